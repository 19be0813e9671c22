"""scripts/gpu_bench.py must stay runnable for the session that is lent a GPU: that session gets one short device
run, which a script error would waste. ``--cpu-smoke`` runs the same checks, timers and report at tiny shapes on
the CPU under TRITON_INTERPRET=1 (its times mean nothing)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_gpu_bench_cpu_smoke_passes_its_checks(tmp_path):
    """Catches a gpu_bench.py that crashes, whose kernel checks fail, or whose report lacks the table."""
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert "Checks: all passed." in report, report
    assert "[FAIL]" not in proc.stdout
    assert report.count("\n| ") >= 3, report  # header + one row per B at least


def test_gpu_teacher_check_cpu_smoke_passes(tmp_path):
    """Catches a gpu_teacher_check.py (make gpu-bench's teacher-on-GPU check) that crashes or fails its own checks
    when both builds run on the CPU, where they must agree exactly."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_teacher_check.py"), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for dtype in ("float32", "bfloat16"):
        assert f"| {dtype} | 12 / 12 | 0.00e+00 |" in proc.stdout, proc.stdout



def test_gpu_distill_check_cpu_smoke_passes(tmp_path):
    """Catches a gpu_distill_check.py (make gpu-bench's distillation- and eval-on-GPU check) that crashes or fails
    its own checks when both runs of each case (convert with either teacher, from scratch, the reference eval) are on
    the CPU, where they must agree exactly, lower the held-out KL and decode losslessly."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_distill_check.py"), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "e+00 |" in line]
    assert [line.split(" | ")[0] for line in lines] == ["| drafter", "| target", "| from-scratch"], proc.stdout
    assert all(" | 0.00e+00 | " in line for line in lines), proc.stdout
    evals = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| cpu | ")]
    assert len(evals) == 2 and evals[0][1:4] == evals[1][1:4] and evals[0][3] == "True", proc.stdout
