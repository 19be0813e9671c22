"""A sliding-window drafter (speculators layout: ``layer_types`` + ``sliding_window`` in its layer config) converts,
distils with its window and keeps it in the output config, where vLLM reads it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

import slimspec
from slimspec.checkpoint import load_drafter
from slimspec.cli import main
from slimspec.distill.train import DistillConfig
from tests.integration.test_distill import FEW
from tests.layouts import Spec, assert_same_ttt_forward, write_drafter

pytestmark = pytest.mark.slow

WINDOWED = Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32, layers=2, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                extra_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})


def _kept(out) -> dict:
    written = json.loads((out / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"] and written["sliding_window"] == 8
    cfg = load_drafter(out).config
    assert (cfg.layer_types, cfg.sliding_window) == (written["layer_types"], 8)
    return written


def test_sliding_window_drafter_converts_without_distillation(tmp_path):
    """Catches ``convert --distill-steps 0`` refusing a sliding-window drafter or writing a config without its window
    (vLLM would serve the converted drafter with full attention)."""
    write_drafter(tmp_path / "d", "speculators", dataclasses.replace(WINDOWED, vocab=301, draft_vocab=97))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "--vocab", "draft", "-o",
                                       str(tmp_path / "o"), "--distill-steps", "0", "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert _kept(tmp_path / "o")["num_hidden_layers"] == 2


def test_sliding_window_drafter_distils_with_its_window(tiny_target, tmp_path):
    """Catches distillation (or its held-out measure) running the drafter without its window: the same weights
    converted with and without ``layer_types`` start from different held-out KLs (the teacher sequences are longer
    than the window of 8), the windowed one's output keeps the window, and its backbone computes the source's
    states."""
    runs = {}
    for name, spec in (("windowed", WINDOWED), ("full", dataclasses.replace(WINDOWED, sliding_window=None))):
        write_drafter(tmp_path / name, "speculators", spec)
        runs[name] = slimspec.convert_drafter(
            str(tmp_path / name), str(tiny_target), 8, vocab="draft", out=tmp_path / f"{name}-o", init="svd",
            distill_steps=4, data_options=FEW, progress=False,
            distill_config=DistillConfig(lr=1e-2, warmup_steps=1, batch_tokens=256)).report["distill"]
    assert abs(runs["windowed"]["kl_before"] - runs["full"]["kl_before"]) > 1e-4, runs
    _kept(tmp_path / "windowed-o")
    assert "layer_types" not in json.loads((tmp_path / "full-o" / "config.json").read_text())
    src, out = load_drafter(tmp_path / "windowed"), load_drafter(tmp_path / "windowed-o")
    assert_same_ttt_forward(src, out, tokens=12)
