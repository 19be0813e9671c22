"""DataOptions reach the teacher's settings (and so its cache key) on both paths that build teacher data."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimspec.distill import pipeline, scratch
from slimspec.distill.pipeline import DataOptions
from slimspec.distill.prompts import Prompt
from slimspec.distill.teacher import TeacherSettings, cache_key
from slimspec.errors import SlimSpecError


def _prompts(tmp_path: Path) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "turns": ["hello"]}) + "\n")
    return str(path)


def test_generation_batch_and_answers_reach_the_teacher(tmp_path, monkeypatch):
    """Catches ``DataOptions.generation_batch`` dropped on the way (the reference build's v4 parts decode 256 prompts
    at a time: dropped, they would silently decode 64 and miss the caches a resumed build already wrote), and
    ``DataOptions.answers`` dropped (a new machine would decode again what its saved answers hold)."""
    seen = []

    def record(path, prompts, settings, progress, answers=None):
        seen.append((settings, answers))

    monkeypatch.setattr(scratch, "build_teacher_data", record)
    monkeypatch.setattr(pipeline, "build_teacher_data", record)
    options = DataOptions(data=_prompts(tmp_path), generation_batch=256, engine="static", answers="a.jsonl.gz")
    scratch.scratch_teacher(SimpleNamespace(path=tmp_path, num_layers=30), options, progress=False)
    ckpt = SimpleNamespace(config=SimpleNamespace(aux_layer_ids=[1, 14, 27]), layout="eagle", aux_convention="input")
    pipeline.teacher_for(ckpt, SimpleNamespace(path=tmp_path, num_layers=30), options, progress=False)
    assert [s.generation_batch for s, _ in seen] == [256, 256]
    assert all(s.engine == "static" for s, _ in seen)
    assert [a for _, a in seen] == [Path("a.jsonl.gz")] * 2


def test_generation_batch_is_part_of_the_cache_key(tmp_path):
    """Catches two batch sizes sharing one cache (sampled answers depend on which prompts decode together)."""
    (tmp_path / "config.json").write_text("{}")
    prompts = [Prompt(id="a", text="hello")]
    keys = {cache_key(tmp_path, prompts, TeacherSettings(engine="static", generation_batch=b)) for b in (64, 256)}
    assert len(keys) == 2


def test_aux_layer_options_may_not_retarget_an_existing_drafter(tmp_path, monkeypatch):
    """Catches `distill DRAFTER --aux-layers a,b,c` training the head on other target states than the drafter's
    config names (eval and vLLM then feed it the config's: a silent tau drop); confirming them is fine."""
    monkeypatch.setattr(pipeline, "build_teacher_data", lambda *a, **k: "built")
    ckpt = SimpleNamespace(config=SimpleNamespace(aux_layer_ids=[1, 14, 27]), layout="eagle", aux_convention="input")
    parts = SimpleNamespace(path=tmp_path, num_layers=30)
    options = DataOptions(data=_prompts(tmp_path))
    assert pipeline.teacher_for(ckpt, parts, replace(options, aux_layers=[1, 14, 27]), progress=False) == "built"
    with pytest.raises(SlimSpecError, match=r"reads \(1, 14, 27\)"):
        pipeline.teacher_for(ckpt, parts, replace(options, aux_layers=[2, 15, 27]), progress=False)
    with pytest.raises(SlimSpecError, match="fix the drafter"):
        pipeline.teacher_for(ckpt, parts, replace(options, aux_convention="output"), progress=False)
