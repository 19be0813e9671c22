"""A teacher build on a (pretended) CUDA device, on this GPU-less machine: `torch.cuda` says one GPU is there and
the target loader records what it was asked for, then hands back the real tiny target on the CPU. Checks the path a
GPU run takes: the device reaches every load, the static engine (CPU-only) is not used, one copy of the target at a
time, and saved answers are used instead of decoding. scripts/gpu_teacher_check.py checks the numbers on a GPU."""

import pytest
import torch

import slimspec.distill.teacher as teacher
from slimspec.distill.answers import save_answers
from slimspec.distill.teacher import TeacherSettings, build_teacher_data, teacher_location
from slimspec.prompts import Prompt

PROMPTS = [Prompt(id=str(i), text=f"Say {word} twice.") for i, word in enumerate(["red", "blue", "green"])]


@pytest.fixture
def pretend_gpu(monkeypatch, pretend_gpus):
    """One visible 'GPU'; returns the list of (dtype, device) loads and the decoders' calls."""
    pretend_gpus(1)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    record = {"loads": [], "generate": 0, "static": 0}
    load = teacher.load_target_model

    def loading(path, dtype=torch.float32, device=None):
        record["loads"].append((dtype, None if device is None else str(device)))
        model, tokenizer = load(path, dtype)  # the real target, on the CPU
        generate = model.generate

        def counting(*args, **kwargs):
            record["generate"] += 1
            return generate(*args, **kwargs)

        model.generate = counting
        return model, tokenizer

    def static(*args, **kwargs):
        record["static"] += 1
        raise AssertionError("the static engine ran on a GPU build")

    monkeypatch.setattr(teacher, "load_target_model", loading)
    monkeypatch.setattr(teacher, "_static_generate", static)
    return record


def test_gpu_build_loads_on_the_device_one_copy_at_a_time(tiny_target, tmp_path, pretend_gpu):
    """Catches the device dropped on the way to a load (an 8B target on CPU cores), the CPU-only static engine
    run on a GPU, and the float32 copy loaded before the answering copy is freed (two copies on the GPU)."""
    settings = TeacherSettings(engine="static", generation_dtype="bfloat16", max_new_tokens=4, aux_layers=(1, 2, 3))
    data = build_teacher_data(tiny_target, PROMPTS, settings, cache_root=tmp_path, progress=False, device="cuda")
    assert pretend_gpu["loads"] == [(torch.bfloat16, "cuda"), (torch.float32, "cuda")]
    assert pretend_gpu["static"] == 0 and pretend_gpu["generate"] >= 1
    assert len(data) == 3 and data.aux.shape[1] == 3 * 32


def test_gpu_build_uses_saved_answers(tiny_target, tmp_path, pretend_gpu):
    """Catches saved (or shipped) answers ignored off the static engine: a GPU build decoded the demo's 300 prompts
    again instead of reading the answers that ship for its cache key."""
    settings = TeacherSettings(engine="static", generation_dtype="float32", max_new_tokens=4, aux_layers=(1, 2, 3))
    key = teacher_location(tiny_target, PROMPTS, settings, tmp_path).key
    answers = {0: [28, 29, 2], 1: [30, 2], 2: [31, 32, 33, 34]}
    save_answers(tmp_path / "answers.jsonl.gz", key, len(PROMPTS), answers)
    data = build_teacher_data(tiny_target, PROMPTS, settings, cache_root=tmp_path / "cache", progress=False,
                              answers=tmp_path / "answers.jsonl.gz", device="cuda")
    assert pretend_gpu["generate"] == 0 and pretend_gpu["loads"] == [(torch.float32, "cuda")]
    for i, answer in answers.items():
        assert data.sequence(i)["input_ids"][-len(answer):].tolist() == answer
