"""The embedded default's reference EAGLE-3 drafter: shipped, loadable, lossless, really trained."""

import json
import subprocess
import sys

import pytest
import torch

from slimspec import embedded
from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.target_model import chat_ids, load_target_model
from slimspec.evaluate.acceptance import load_for_eval, target_greedy
from slimspec.evaluate.spec_decode import SpeculativeDecoder
from slimspec.prompts import eval_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAME = embedded.EMBEDDED_DRAFTER


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slimspec", *args], capture_output=True, text=True, timeout=900)


def test_shipped_in_the_eagle_layout() -> None:
    """Catches a drafter that is not what a published EAGLE-3 checkpoint looks like, or too big to ship."""
    folder = embedded.resolve_embedded(NAME)
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 25 * 2**20, size
    ckpt = load_drafter(folder)
    assert ckpt.layout == "eagle"
    raw = json.loads((folder / "config.json").read_text())
    assert raw["draft_vocab_size"] == 8192 and raw["vocab_size"] == 49152
    d2t = ckpt.d2t
    ids = ckpt.draft_to_target_ids()
    assert d2t is not None and ids.unique().numel() == 8192 and bool((ids[1:] > ids[:-1]).all())
    card = (folder / "README.md").read_text()
    assert "build_reference_drafter.py --stage train" in card and "| vLLM" in card


def test_greedy_spec_decoding_reproduces_the_target() -> None:
    """Catches a drafter/decoder pair that changes the output, and a drafter that never gets accepted:
    greedy speculative decoding with K=4 must equal the target's own greedy output, with tau well above 1."""
    drafter, layers, parts, _ = load_for_eval(NAME, None)
    assert parts.path == embedded.embedded_target_path(progress=False)  # --target defaults to the embedded one
    target, tokenizer = load_target_model(parts.path)
    decoder = SpeculativeDecoder(target, drafter, layers, draft_tokens=4, eos_token_id=tokenizer.eos_token_id)
    accepted, rounds = 0, 0
    for prompt in eval_prompts("mt_bench", 3):
        ids, _ = chat_ids(tokenizer, prompt)
        out, stats = decoder.generate(ids, 48)
        assert out == target_greedy(target, ids, 48, tokenizer.eos_token_id)
        accepted += stats.accepted
        rounds += stats.rounds
    assert 1 + accepted / rounds > 1.3, accepted / rounds


def test_name_works_as_a_drafter_id_without_target(tmp_path) -> None:
    """Catches the embedded name not resolving on the CLI, or --target not defaulting to the embedded target."""
    proc = _cli("convert", NAME, "--distill-steps", "0", "--rank", "d/8", "--vocab", "draft", "--out",
                str(tmp_path / "o"), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["rank"] == 72 and report["head_vocab"] == 8192
    from safetensors.torch import load_file

    d2t = load_file(embedded.resolve_embedded(NAME) / "model.safetensors")["d2t"]
    assert d2t.dtype == torch.int64 and d2t.numel() == 8192
