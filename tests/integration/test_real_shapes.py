"""The brief conversion at the real widths and vocabularies of Llama-3.1-8B and its EAGLE-3 drafter (hidden 4096,
vocab 128,256, draft vocab 32,000, GQA 32/8, llama3 RoPE scaling), on a 1-layer stand-in target with random weights
(``scripts/build_standins.py``), through the CLI."""

import json
import math

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from slimspec.cli import main
from tests.scripts import load_script


@pytest.mark.slow
def test_brief_conversion_at_llama_8b_widths(tmp_path, monkeypatch):
    """Catches what only the real shapes show: a 128,256-token tokenizer and head, a 32,000-row draft head with its
    d2t, a 4096-wide Gram and eigendecomposition, bf16 sharded targets with the head in its own shard, teacher data
    and steps at 4096 x 128,256. The output must load back with a rank-512 head (d/8) and finite numbers in its
    report (KL before and after, energy, errors); the dry run's plan must cover every stage it ran."""
    build = load_script("build_standins")
    standins = build.build("llama3-8b", tmp_path / "standins", target_layers=1, seed=0, intermediate=None)
    monkeypatch.setenv("SLIMSPEC_TEACHER_CACHE", str(tmp_path / "teacher"))
    out = tmp_path / "converted"
    args = ["convert", standins["drafter"], "--target", standins["target"], "--rank", "d/8", "--recipe", "brief",
            "--vocab", "draft", "--teacher", "drafter", "--num-prompts", "2", "--max-new-tokens", "8",
            "--distill-steps", "2", "--out", str(out), "--json"]
    plan = CliRunner().invoke(main, [*args, "--dry-run"])
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.output)
    assert planned["rank"] == 512 and planned["head_vocab"] == 32000
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "slimspec.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        up, down = f.get_slice("lm_head.weight").get_shape(), f.get_slice("lm_head_down.weight").get_shape()
        d2t = f.get_slice("d2t").get_shape()
    assert up == [32000, 512] and down == [512, 4096] and d2t == [32000]
    assert report["rank"] == 512 and report["head_vocab"] == 32000 and report["hidden_size"] == 4096
    numbers = [report["energy_kept"], report["relative_frobenius_error"], report["distill"]["kl_before"],
               report["distill"]["kl_after"]] + [v["step0_kl"] for v in report["init_kl"].values()]
    assert all(v is not None and math.isfinite(v) for v in numbers), numbers
    assert {s["stage"] for s in planned["stages"]} >= {"head read", "teacher data", "distillation", "write"}
