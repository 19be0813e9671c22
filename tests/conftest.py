import fnmatch
import os
import shutil
from types import SimpleNamespace

# Triton kernels run in Triton's interpreter on these CPU-only machines. Set before anything imports triton
# (speculators' flex-attention import does): triton reads the flag once, and kernels decorated without it
# cannot run in the interpreter later.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Teacher data is built on the CPU in every test, also on a machine with a GPU (`--device auto` would pick it, and
# the static engine and what the tests count are CPU-only); tests of the device choice set or clear it themselves.
os.environ["SLIMSPEC_DEVICE"] = "cpu"

import pytest

from slimspec.vllm_env import vllm_python
from tests.layouts import Spec, write_drafter, write_target


@pytest.fixture(scope="module")
def vllm_venv():
    """vLLM's interpreter for a module's tests (`pytestmark = pytest.mark.usefixtures("vllm_venv")`): the module is
    skipped without `.venv-vllm`, and fails instead under SLIMSPEC_REQUIRE_VLLM=1 (`make test`), so a broken vLLM
    environment cannot pass as skipped tests."""
    try:
        return vllm_python()
    except Exception as exc:
        if os.environ.get("SLIMSPEC_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"{exc}")


@pytest.fixture
def pretend_gpus(monkeypatch):
    """``pretend_gpus(n)``: torch.cuda says n GPUs are there (these machines have none), each with 80 GB free, and
    $SLIMSPEC_DEVICE is cleared (it pins the CPU above), so `auto` choices see the pretended GPUs. Nothing can run on
    them."""
    import torch

    def pretend(count: int = 1) -> None:
        monkeypatch.delenv("SLIMSPEC_DEVICE", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 10**9, 80 * 10**9))

    return pretend


@pytest.fixture(autouse=True, scope="session")
def _teacher_cache_in_tmp(tmp_path_factory):
    """Keep the tests' teacher data out of the user's cache (the embedded target itself is shared)."""
    import os

    old = os.environ.get("SLIMSPEC_TEACHER_CACHE")
    os.environ["SLIMSPEC_TEACHER_CACHE"] = str(tmp_path_factory.mktemp("teacher-cache"))
    yield
    if old is None:
        os.environ.pop("SLIMSPEC_TEACHER_CACHE", None)
    else:
        os.environ["SLIMSPEC_TEACHER_CACHE"] = old



@pytest.fixture
def tiny_pair(tmp_path):
    """An EAGLE-layout drafter and a matching tied target, as folders."""
    drafter, target = tmp_path / "drafter", tmp_path / "target"
    tensors = write_drafter(drafter, "eagle", Spec())
    head = write_target(target)
    return drafter, target, tensors, head


__all__ = ["Spec", "write_drafter", "write_target"]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Llama target (hidden 32, 4 layers) with SmolLM2's real tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slimspec.embedded import embedded_target_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_target_path(progress=False))
    folder = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_converted(tiny_target, tmp_path):
    """An EAGLE-layout drafter for the tiny target, converted at rank 8 over the full vocabulary."""
    import slimspec

    write_drafter(tmp_path / "drafter", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32))
    return slimspec.convert_drafter(str(tmp_path / "drafter"), str(tiny_target), 8, out=tmp_path / "converted",
                            distill_steps=0, progress=False).out


def hub_error(kind: str, message: str) -> Exception:
    """One of huggingface_hub's HTTP errors, as snapshot_download raises it (they need the response)."""
    import huggingface_hub

    response = SimpleNamespace(headers={}, request=None, status_code=404)
    return getattr(huggingface_hub.errors, kind)(message, response=response)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """Repos under tmp/hub/<owner>/<name>; snapshot_download copies the files matching allow_patterns, records
    (repo id, patterns, revision), and raises the Hub's not-found error for a repo that is not there."""
    import huggingface_hub

    hub, cache = tmp_path / "hub", tmp_path / "cache"
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, revision=None, **kwargs):
        calls.append((repo_id, list(allow_patterns or []), revision))
        src = hub / repo_id
        if not src.exists():
            raise hub_error("RepositoryNotFoundError", f"404 Client Error: {repo_id} not found")
        dst = cache / repo_id.replace("/", "--")
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if allow_patterns is None or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, dst / f.name)
        return str(dst)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return hub, calls
