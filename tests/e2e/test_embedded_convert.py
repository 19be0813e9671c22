"""The real embedded target (SmolLM2-135M-Instruct from its GGUF) through the CLI, as a user runs it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from slimspec import embedded
from slimspec.checkpoint import load_drafter, load_target_head
from slimspec.standin import build_standin_drafter

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    target = embedded.embedded_target_path(progress=False)
    return build_standin_drafter(target, tmp_path_factory.mktemp("standin") / "smollm2-eagle3", draft_vocab=4096)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "slimspec", *args], capture_output=True, text=True, timeout=600)


def test_convert_embedded_target_d8(standin, tmp_path):
    """Catches a wrong stitched head on the real model: the factors must reproduce target rows outside
    the draft vocab and the drafter's rows inside it, to the accuracy the energy kept implies; and an energy kept
    with the rows centred that is not the float64 centred spectrum's."""
    out = tmp_path / "out"
    proc = _cli("convert", str(standin), "--target", "embedded:smollm2-135m", "--rank", "d/8", "--out", str(out),
                "--distill-steps", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["rank"] == 72 and report["head_vocab"] == 49152 and report["rows_from_drafter"] == 4096
    target = load_target_head(embedded.embedded_target_path(progress=False))
    drafter = load_drafter(standin)
    full = target.weight.float().clone()
    full[drafter.draft_to_target_ids()] = drafter.tensors["lm_head.weight"].float()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        approx = f.get_tensor("lm_head.weight").float() @ f.get_tensor("lm_head_down.weight").float()
    err = float(torch.linalg.norm(full - approx) / torch.linalg.norm(full))
    assert abs(err - report["relative_frobenius_error"]) < 2e-3  # fp16 output rounding
    assert abs(err ** 2 - (1 - report["energy_kept"])) < 5e-3
    s = torch.linalg.svdvals(full.double())
    assert abs(report["energy_kept"] - float((s[:72] ** 2).sum() / (s ** 2).sum())) < 1e-6
    s = torch.linalg.svdvals(full.double() - full.double().mean(0))  # the part softmax sees
    assert abs(report["energy_kept_centered"] - float((s[:72] ** 2).sum() / (s ** 2).sum())) < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3SlimSpecLlamaForCausalLM"] and config["torch_dtype"] == "float16"


def test_inspect_embedded(standin, tmp_path):
    proc = _cli("inspect", str(standin), "--target", "embedded:smollm2-135m", "--plot", str(tmp_path / "e.png"))
    assert proc.returncode == 0, proc.stderr
    assert "8.3% of the target vocabulary" in proc.stdout and "full vocab head" in proc.stdout
    assert (tmp_path / "e.png").stat().st_size > 10_000
