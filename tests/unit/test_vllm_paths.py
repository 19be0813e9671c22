"""run_vllm_check starts vLLM from an empty temporary folder, so it must hand vLLM absolute paths."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from slimspec import vllm_env
from slimspec.evaluate import vllm_engine


def test_relative_local_paths_reach_vllm_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches `slimspec eval out/my-drafter --engine vllm` failing with 'Invalid repository ID' (the relative path
    was resolved against vLLM's neutral working folder and read as a Hub id); Hub ids must pass through unchanged."""
    (tmp_path / "drafter").mkdir()
    (tmp_path / "target").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(vllm_env.PYTHON_ENV, sys.executable)
    monkeypatch.setenv(vllm_engine.SCRIPT_ENV, __file__)
    seen: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"ok": true}\n', stderr="")

    monkeypatch.setattr(vllm_engine.subprocess, "run", fake_run)
    assert vllm_engine.run_vllm_check("target", ["hi"], drafter="drafter")["ok"]
    cmd = seen[-1]
    assert cmd[cmd.index("--target") + 1] == str(tmp_path / "target")
    assert cmd[cmd.index("--drafter") + 1] == str(tmp_path / "drafter")
    vllm_engine.run_vllm_check("org/target-on-the-hub", ["hi"], drafter="org/drafter-on-the-hub")
    assert seen[-1][seen[-1].index("--target") + 1] == "org/target-on-the-hub"
    assert seen[-1][seen[-1].index("--drafter") + 1] == "org/drafter-on-the-hub"


def test_draft_model_is_found_in_both_vllm_runners() -> None:
    """Catches the head check and drafter report going blind on vLLM's GPU model runner (0.33-0.34), which
    holds the drafter at ``model_runner.speculator.model`` instead of the v1 runner's ``model_runner.drafter``."""
    import importlib
    import os
    from types import SimpleNamespace
    from unittest import mock

    with mock.patch.dict(os.environ):  # the module sets vLLM's environment when loaded: keep ours
        check = importlib.import_module("slimspec.evaluate.vllm_check")
    v1_model, gpu_model = object(), object()
    v1 = SimpleNamespace(model_runner=SimpleNamespace(drafter=SimpleNamespace(model=v1_model)))
    gpu = SimpleNamespace(model_runner=SimpleNamespace(speculator=SimpleNamespace(model=gpu_model)))
    assert check.draft_model(v1) is v1_model
    assert check.draft_model(gpu) is gpu_model
    assert check.draft_model(SimpleNamespace(model_runner=SimpleNamespace(drafter=None))) is None


def test_engine_python_and_command_without_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches `slimspec eval --engine vllm` failing for a pip install (no repository, no .venv-vllm, no scripts/):
    with vLLM importable here it must run this python with the module shipped in the package; without vLLM
    anywhere it must say how to get it; an explicit SLIMSPEC_VLLM_PYTHON or check script wins."""
    monkeypatch.setattr(vllm_engine, "REPO", tmp_path)  # a site-packages install: no .venv-vllm beside it
    monkeypatch.delenv(vllm_env.PYTHON_ENV, raising=False)
    monkeypatch.delenv(vllm_engine.SCRIPT_ENV, raising=False)
    found = {"vllm": True}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" and found["vllm"] else real_find_spec(name, *a))
    python = vllm_engine.vllm_python()
    assert python == Path(sys.executable)
    assert vllm_engine.check_command(python) == [sys.executable, "-m", "slimspec.evaluate.vllm_check"]
    found["vllm"] = False
    with pytest.raises(vllm_engine.SlimSpecError, match="slimspec\\[vllm\\]"):
        vllm_engine.vllm_python()
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").touch()
    assert vllm_engine.vllm_python() == tmp_path / ".venv-vllm" / "bin" / "python"
    monkeypatch.setenv(vllm_env.PYTHON_ENV, sys.executable)
    monkeypatch.setenv(vllm_engine.SCRIPT_ENV, __file__)
    assert vllm_engine.vllm_python() == Path(sys.executable)
    assert vllm_engine.check_command(Path(sys.executable)) == [sys.executable, __file__]


def test_check_module_runs_as_a_module() -> None:
    """Catches the shipped check module not running as ``python -m`` (how the engine is started): its --help
    must come back without importing vLLM (absent from this environment)."""
    proc = subprocess.run([sys.executable, "-m", "slimspec.evaluate.vllm_check", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--prompts-json" in proc.stdout


def test_engine_failures_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a vLLM check that times out, or whose last JSON-looking line is not JSON, surfacing as a
    TimeoutExpired / JSONDecodeError traceback instead of one SlimSpecError line; and a run with no draft round
    reporting tau NaN (invalid JSON under --json)."""
    from slimspec.errors import SlimSpecError

    monkeypatch.setenv(vllm_env.PYTHON_ENV, sys.executable)
    monkeypatch.setenv(vllm_engine.SCRIPT_ENV, __file__)

    def timed_out(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(vllm_engine.subprocess, "run", timed_out)
    with pytest.raises(SlimSpecError, match="did not finish within 5 s"):
        vllm_engine.run_vllm_check("t", ["hi"], timeout=5)
    monkeypatch.setattr(vllm_engine.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="{truncated\n", stderr=""))
    with pytest.raises(SlimSpecError, match="report is not JSON"):
        vllm_engine.run_vllm_check("t", ["hi"])
    report = {"ok": True, "spec_decode": {"num_drafts": 0}, "tau": float("nan")}
    monkeypatch.setattr(vllm_engine, "run_vllm_check", lambda *a, **k: report)
    monkeypatch.setattr(vllm_engine, "is_parallel_drafter", lambda folder: False)
    with pytest.raises(SlimSpecError, match="no speculation round ran"):
        vllm_engine.evaluate_vllm("d", "t", prompts=["hi"], max_new_tokens=1, draft_tokens=3, temperature=0.0)
