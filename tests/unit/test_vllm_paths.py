"""run_vllm_check starts vLLM from an empty temporary folder, so it must hand vLLM absolute paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slimspec.evaluate import vllm_engine


def test_relative_local_paths_reach_vllm_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches `slimspec eval out/my-drafter --engine vllm` failing with 'Invalid repository ID' (the relative path
    was resolved against vLLM's neutral working folder and read as a Hub id); Hub ids must pass through unchanged."""
    (tmp_path / "drafter").mkdir()
    (tmp_path / "target").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, sys.executable)
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
    import os
    from types import SimpleNamespace
    from unittest import mock

    from tests.scripts import load_script

    with mock.patch.dict(os.environ):  # the script sets vLLM's environment when loaded: keep ours
        check = load_script("vllm_check")
    v1_model, gpu_model = object(), object()
    v1 = SimpleNamespace(model_runner=SimpleNamespace(drafter=SimpleNamespace(model=v1_model)))
    gpu = SimpleNamespace(model_runner=SimpleNamespace(speculator=SimpleNamespace(model=gpu_model)))
    assert check.draft_model(v1) is v1_model
    assert check.draft_model(gpu) is gpu_model
    assert check.draft_model(SimpleNamespace(model_runner=SimpleNamespace(drafter=None))) is None
