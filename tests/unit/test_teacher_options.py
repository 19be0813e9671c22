"""DataOptions reach the teacher's settings (and so its cache key) on both paths that build teacher data."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimspec.distill import pipeline, scratch
from slimspec.distill.pipeline import DataOptions
from slimspec.distill.teacher import TeacherSettings, cache_key
from slimspec.errors import SlimSpecError
from slimspec.prompts import Prompt


def _prompts(tmp_path: Path) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "turns": ["hello"]}) + "\n")
    return str(path)


def test_generation_batch_and_answers_reach_the_teacher(tmp_path, monkeypatch):
    """Catches ``DataOptions.generation_batch`` dropped on the way (the reference build's v4 parts decode 256 prompts
    at a time: dropped, they would silently decode 64 and miss the caches a resumed build already wrote), and
    ``DataOptions.answers`` dropped (a new machine would decode again what its saved answers hold), and
    ``DataOptions.device`` dropped (`--device cuda` would build on the CPU)."""
    seen = []

    def record(path, prompts, settings, progress, answers=None, placement=None):
        seen.append((settings, answers))
        assert placement.device == "cpu"

    monkeypatch.setattr(scratch, "build_teacher_data", record)
    monkeypatch.setattr(pipeline, "build_teacher_data", record)
    options = DataOptions(data=_prompts(tmp_path), generation_batch=256, engine="static", answers="a.jsonl.gz",
                          device="cpu")
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


def test_prompt_formats_and_the_eval_guard(tmp_path):
    """Catches prompt rows read wrongly (OpenAI content lists became a list, Alpaca inputs were dropped, a
    non-object row crashed with a traceback), a mistyped path reported as an unknown Hub dataset, and training
    prompts that are slimspec's own eval prompts (tau would be measured on the data the head was fitted to)."""
    from slimspec.prompts import eval_prompts, load_prompts

    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                       {"type": "image_url", "image_url": "x"}]}]},
            {"instruction": "Summarize the text below.", "input": "The sky is blue."}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.text for p in load_prompts(str(path))] == ["hi", "Summarize the text below.\n\nThe sky is blue."]
    path.write_text('"just a string"\n')
    with pytest.raises(SlimSpecError, match="must be an object"):
        load_prompts(str(path))
    for spec, needle in ((str(tmp_path / "typo.jsonl"), "no such file"), ("data/typo.jsonl", "no such file"),
                         (str(tmp_path / "*.parquet"), "matches no file")):
        with pytest.raises(SlimSpecError, match=needle) as info:
            load_prompts(spec)
        assert "dataset" not in str(info.value)
    leak = tmp_path / "leak.jsonl"
    leak.write_text(json.dumps({"turns": [eval_prompts("gsm8k", 1)[0]]}) + "\n")
    assert len(load_prompts(str(leak))) == 1  # measuring on it is fine
    with pytest.raises(SlimSpecError, match="never train on eval"):
        load_prompts(str(leak), training=True)
    load_prompts(None, training=True)  # the shipped calibration set is disjoint from the eval sets


def test_equivalent_greedy_settings_share_a_cache_key(tmp_path):
    """Catches a needless rebuild (and shipped answers missed) when the temperature is given as 0 instead of 0.0 or a
    seed is set for greedy answers; sampled answers keep their seed in the key."""
    (tmp_path / "config.json").write_text("{}")
    prompts = [Prompt(id="a", text="hello")]
    base = cache_key(tmp_path, prompts, TeacherSettings())
    assert cache_key(tmp_path, prompts, TeacherSettings(temperature=0)) == base
    assert cache_key(tmp_path, prompts, TeacherSettings(seed=7)) == base
    sampled = [cache_key(tmp_path, prompts, TeacherSettings(temperature=1, seed=s)) for s in (1, 2)]
    assert sampled[0] != sampled[1] and base not in sampled


def test_targets_with_several_eos_ids_get_new_cache_keys(tmp_path):
    """Catches reuse of a teacher cache built before answers stopped at every generation-config eos: a Llama 3.x
    style target (eos list) must key differently from the same folder with one eos, whose key (the shipped
    answers' case) must not change."""
    from slimspec.checkpoint.target_model import generation_stop_ids

    (tmp_path / "config.json").write_text("{}")
    prompts = [Prompt(id="a", text="hello")]
    bare = cache_key(tmp_path, prompts, TeacherSettings())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_stop_ids(tmp_path) == [2]
    assert cache_key(tmp_path, prompts, TeacherSettings()) == bare
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 2]}))
    assert cache_key(tmp_path, prompts, TeacherSettings()) == bare
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128009, 128001, 128008]}))
    assert generation_stop_ids(tmp_path) == [128001, 128008, 128009]
    several = cache_key(tmp_path, prompts, TeacherSettings())
    assert several != bare
    reference = TeacherSettings(responses="reference")  # answers read from the data, not generated: key unchanged
    (tmp_path / "generation_config.json").unlink()
    before = cache_key(tmp_path, prompts, reference)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128009, 128001]}))
    assert cache_key(tmp_path, prompts, reference) == before
