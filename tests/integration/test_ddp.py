"""torchrun (gloo) data parallelism: 2 processes give the same loss curve as 1 with the same global batch."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> str:
    """A port nothing listens on now (a fixed one collides with another run on the machine)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _run(args, env, timeout: int = 900):
    """The one JSON summary the run printed (only rank 0 prints under torchrun)."""
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, proc.stdout  # two: each worker trained alone (no process group)
    return json.loads(summaries[0])


def test_two_processes_match_one(tiny_converted, tiny_target, tmp_path):
    """Catches per-rank loss normalisation or unsynchronised gradients (the curves would drift apart), and
    workers that never joined a process group (each would train alone on the whole batch: the same curve, but
    two summaries)."""
    env = {**os.environ, "SLIMSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    common = ["distill", str(tiny_converted), "-t", str(tiny_target), "--steps", "6", "--num-prompts", "6",
              "--max-new-tokens", "10", "--batch-tokens", "256", "--json", "-q"]
    one = _run([sys.executable, "-m", "slimspec", *common, "-o", str(tmp_path / "one")], env)
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                "-m", "slimspec", *common, "-o", str(tmp_path / "two")], env)
    assert len(one["losses"]) == len(two["losses"]) == 6
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (one["losses"], two["losses"])
    assert abs(one["kl_after"] - two["kl_after"]) <= 1e-4 * one["kl_after"]


def test_backbone_training_with_a_rank_that_draws_no_sequence(tiny_converted, tiny_target, tmp_path):
    """--train-backbone splits whole sequences over ranks: with one sequence per step, rank 1 has none, so its
    backbone gradients are None. Catches all-reduces that then pair up wrongly (gloo fails or hangs) and a
    batch lost or counted twice: the curve must equal one process's on the same sequences."""
    env = {**os.environ, "SLIMSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    common = ["distill", str(tiny_converted), "-t", str(tiny_target), "--steps", "3", "--num-prompts", "6",
              "--max-new-tokens", "10", "--batch-tokens", "1", "--train-backbone", "--json", "-q"]
    one = _run([sys.executable, "-m", "slimspec", *common, "-o", str(tmp_path / "one")], env)
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                "-m", "slimspec", *common, "-o", str(tmp_path / "two")], env, timeout=300)
    assert len(two["losses"]) == 3
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (one["losses"], two["losses"])


def test_from_scratch_under_torchrun_writes_once(tiny_target, tmp_path):
    """Catches every rank of `distill --from-scratch` under torchrun building the teacher cache and writing the
    output folder: the slower rank found the folder the other had written and failed ("already exists")."""
    env = {**os.environ, "SLIMSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "scratch"
    summary = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    _free_port(), "-m", "slimspec", "distill", "--from-scratch", "-t", str(tiny_target),
                    "--draft-vocab", "300", "--steps", "2", "--num-prompts", "4", "--max-new-tokens", "8",
                    "--batch-tokens", "64", "-o", str(out), "--json", "-q"], env, timeout=300)
    assert len(summary["losses"]) == 2 and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".scratch")) == []
