"""The reference drafter's prompt mixes (scripts/build_reference_drafter.py): nested, duplicate-free, never eval/."""

import json
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED / "train").is_dir(), reason="needs ../shared/data (the project's data)")


@needs_shared
def test_mixes_nest_and_stay_off_eval(tmp_path):
    """Catches a mix that reshuffles its parent (data-scaling steps must add prompts, not swap them: v1 < v2 < v3),
    a prompt drawn twice, counts in the model card that disagree with the file, and an eval/ prompt in training."""
    build = load_script("build_reference_drafter")
    texts = {}
    for mix in (m for m in build.MIXES if m not in build.MIX_PARTS):
        rows = [json.loads(line) for line in build.compose_prompts(tmp_path / f"{mix}.jsonl", mix).read_text()
                .splitlines()]
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids))
        counts = build.mix_counts(mix)
        sizes = {name: sum(1 for _ in (SHARED / "train" / name).open()) for name in counts}
        assert len(ids) == sum(sizes[name] if n is None else n for name, n in counts.items())
        texts[mix] = [r["turns"][0] for r in rows]
    order = sorted(texts, key=lambda m: len(texts[m]))
    assert order == ["v1", "v2", "v3"]
    for small, big in zip(order, order[1:], strict=False):
        assert texts[big][: len(texts[small])] == texts[small]
    evaluation = {json.loads(line)["turns"][0] for f in (SHARED / "eval").glob("*.jsonl")
                  for line in f.read_text().splitlines() if line.strip()}
    assert not evaluation & set(texts["v3"])


def _eval_texts() -> set[str]:
    return {json.loads(line)["turns"][0] for f in (SHARED / "eval").glob("*.jsonl")
            for line in f.read_text().splitlines() if line.strip()}


@needs_shared
def test_v4_parts_cover_train_once_each_and_stay_off_eval():
    """Catches a ``rest`` part that repeats v3's prompts (the greedy answers would be counted twice), sampled halves
    that overlap or miss train/ prompts (every prompt gets exactly one sampled answer), and eval/ prompts."""
    build = load_script("build_reference_drafter")
    v3 = {r["id"] for r in build._mix_rows("v3")[0]}
    rest = [r["id"] for r in build.part_rows("rest")]
    a = [r["id"] for r in build.part_rows("sampled-a")]
    b = [r["id"] for r in build.part_rows("sampled-b")]
    train_ids = [json.loads(line)["id"] for f in sorted((SHARED / "train").glob("*.jsonl"))
                 for line in f.read_text().split("\n") if line.strip()]
    assert len(set(rest)) == len(rest) and not v3 & set(rest) and v3 | set(rest) == set(train_ids)
    assert not set(a) & set(b) and sorted(a + b) == sorted(train_ids) and abs(len(a) - len(b)) <= 1
    texts = {r["turns"][0] for part in ("rest", "sampled-a", "sampled-b") for r in build.part_rows(part)}
    assert not _eval_texts() & texts
    assert build.mix_counts("v4") == build.mix_counts("v3")  # the card's base mix


def _record(build, steps, lr, seconds, seed=0, warm=None, parts=None, **extra):
    """A training.json record as warm_train writes it (``warm``: (folder name, the record it continued))."""
    config = {"steps": steps, "lr": lr, "batch_tokens": 2048, "seed": seed, "warmup_steps": 10, "ttt_steps": 3,
              "decay": 0.8, **extra}
    rec = {"distill": {"config": config, "seconds": seconds, "kl_before": 2.0, "kl_after": 1.0,
                       "tokens_per_second": 1000.0},
           "teacher": {"max_new_tokens": 128, "aux_layers": [1, 14, 27], "engine": "static"},
           "teacher_parts": [{"num_sequences": 10, "num_tokens": 100}]}
    if parts is not None:
        rec["parts"] = parts
    if warm:
        rec["warm_start"] = {"from": str(build.ROOT / "out" / "reference" / warm[0]), "from_training": warm[1]}
    return rec


_EVALUATION = {"settings": {"dataset": "mt_bench", "num_prompts": 16, "max_new_tokens": 128, "draft_tokens": 4,
                            "temperature": 0.0},
               "tau": 1.7, "tokens_per_second": 20.0, "reference": {"tau": 1.7, "tokens_per_second": 20.0}}


@needs_shared  # the card counts each mix's prompts
def test_commands_and_card_follow_every_warm_start():
    """Catches a model card of a continued build (v4 continued again) that names only the first warm start: its
    commands must rebuild every run in order, each from the folder the one before wrote, with its own seed and
    precision (``--bf16`` only where the run had it; records from before the field existed have none)."""
    build = load_script("build_reference_drafter")
    v3 = _record(build, 2500, 0.003, 600)
    v4 = _record(build, 3600, 0.002, 1200, warm=("smollm2-135m-eagle3-v3", v3))
    more = _record(build, 3600, 0.001, 2400, seed=1, warm=("smollm2-135m-eagle3-v4", v4), bf16=True)
    out = build.ROOT / "out" / "reference" / "smollm2-135m-eagle3-v4-more"
    lines = build.build_commands("v4", more["distill"]["config"], more, out).splitlines()
    trains = [line for line in lines if "--stage train" in line]
    assert trains[0].endswith("--out out/reference/smollm2-135m-eagle3-v3 \\")
    assert "--init out/reference/smollm2-135m-eagle3-v3 --out out/reference/smollm2-135m-eagle3-v4 " in trains[1]
    assert "--init out/reference/smollm2-135m-eagle3-v4 --out out/reference/smollm2-135m-eagle3-v4-more" in trains[2]
    steps = [line for line in lines if line.strip().startswith("--steps")]
    assert steps == ["    --steps 2500 --batch-tokens 2048 --lr 0.003",
                     "    --steps 3600 --batch-tokens 2048 --lr 0.002",
                     "    --steps 3600 --batch-tokens 2048 --lr 0.001 --seed 1 --bf16"]
    assert lines[-1] == "python scripts/build_reference_drafter.py --stage publish --mix v4 --out " \
                        "out/reference/smollm2-135m-eagle3-v4-more"
    card = build.model_card(more, _EVALUATION, 8192, "v4", out)
    assert ("It continues out/reference/smollm2-135m-eagle3-v4 (3600 steps at lr 0.002, 20 min, on all caches), "
            "which continues out/reference/smollm2-135m-eagle3-v3 (2500 steps from scratch at lr 0.003, 10 min, "
            "on the first cache only).") in " ".join(card.split())


def test_card_reports_every_first_turn():
    """Catches a model card that drops the all-80-first-turns measurement (the issue's measure; the first 16 prompts
    alone read 0.046 low for v3-bf16), or shows a vLLM number an eval without vLLM never made."""
    build = load_script("build_reference_drafter")
    settings = {"dataset": "mt_bench", "num_prompts": 16, "max_new_tokens": 128, "draft_tokens": 4,
                "temperature": 0.0}
    ref80 = {"tau": 1.678, "acceptance_per_position": [0.41, 0.17, 0.07, 0.03]}
    both = {"settings": settings, "tau": 1.63, "reference": {"tau": 1.632, "acceptance_per_position": [0.4] * 4},
            "all_first_turns": {"settings": {**settings, "num_prompts": 80}, "tau": 1.679, "reference": ref80}}
    line = " ".join(build._all_turns_rows(both).split())
    assert line == ("On all 80 first turns (same settings): tau 1.678 (reference decoder), 1.679 (vLLM); "
                    "acceptance per position 0.410, 0.170, 0.070, 0.030.")
    reference_only = {**both, "all_first_turns": {"settings": {**settings, "num_prompts": 80}, **ref80}}
    assert "vLLM" not in build._all_turns_rows(reference_only) and "1.678" in build._all_turns_rows(reference_only)
    assert build._all_turns_rows({"settings": settings, "tau": 1.6}) == ""


def test_gate_measures_all_first_turns_and_passes_at_the_floor(tmp_path, monkeypatch):
    """Catches a chain gate that measures the first 16 turns instead of all 80 (read 0.046 low on v3-bf16), a floor
    compared the wrong way round (tau exactly 1.8 passes, 1.799 does not), and a gate.json without its settings."""
    from slimspec.evaluate import vllm_engine

    build = load_script("build_reference_drafter")
    seen = {}

    def fake_vllm(drafter, target, *, prompts, **settings):
        seen.update(prompts=prompts, settings=settings)
        return {"tau": seen["tau"], "acceptance_per_position": [0.5, 0.2, 0.08, 0.02], "num_prompts": len(prompts)}

    monkeypatch.setattr(vllm_engine, "evaluate_vllm", fake_vllm)
    for tau, passed in ((1.8, True), (1.799, False)):
        seen["tau"] = tau
        report = build.gate(tmp_path, "embedded:smollm2-135m")
        assert report["passed"] is passed
        saved = json.loads((tmp_path / "gate.json").read_text())
        assert saved["passed"] is passed and saved["settings"]["num_prompts"] == 80
    assert len(seen["prompts"]) == 80 and len(set(seen["prompts"])) == 80
    assert seen["settings"] == {"max_new_tokens": 128, "draft_tokens": 4, "temperature": 0.0}


@needs_shared
def test_parts_choose_caches_and_the_card_names_them(monkeypatch):
    """Catches ``--parts`` that builds or trains on caches it was not given (a run on a fresh machine has time for
    only some), an unknown or misspelt part accepted silently, and a card whose commands omit ``--parts`` (they
    would rebuild a run on data it never saw)."""
    from types import SimpleNamespace

    from slimspec.distill import scratch
    from slimspec.distill.pipeline import DataOptions
    from slimspec.errors import SlimSpecError

    build = load_script("build_reference_drafter")
    assert build._parts(SimpleNamespace(mix="v4", parts="rest, v3")) == ["rest", "v3"]
    assert build._parts(SimpleNamespace(mix="v4", parts=None)) is None
    for bad in (SimpleNamespace(mix="v4", parts="rest,sampled-c"), SimpleNamespace(mix="v3", parts="rest"),
                SimpleNamespace(mix="v4", parts=",")):
        with pytest.raises(SlimSpecError, match="--parts"):
            build._parts(bad)
    built, saved = [], []
    monkeypatch.setattr(scratch, "scratch_teacher",
                        lambda target, options, progress: (built.append((options.temperature, options.seed)),
                                                           None))
    monkeypatch.setattr(build, "save_teacher_answers", lambda target, options: saved.append(options.answers))
    assert len(build.mix_teachers("v4", DataOptions(), "target", ["sampled-a"])) == 1
    assert built == [(0.7, 1)]
    assert saved == [str(build.ANSWERS / "v4-sampled-a.jsonl.gz")]  # each cache saves its answers to its own file
    built.clear()
    saved.clear()
    base = DataOptions(answers=str(build.answers_file("v3")))
    assert len(build.mix_teachers("v4", base, "target", ["v3", "rest"])) == 2
    assert built == [(0.0, 0), (0.0, 0)]  # rest (greedy, seed 0), then the base mix's own options
    assert saved == [str(build.ANSWERS / "v4-rest.jsonl.gz"), str(build.ANSWERS / "v3.jsonl.gz")]

    v3 = _record(build, 2500, 0.001, 600, seed=1, bf16=True)
    run = _record(build, 2600, 0.001, 600, seed=1, parts=["rest", "sampled-a"], warm=("smollm2-135m-eagle3-v3", v3),
                  bf16=True)
    out = build.ROOT / "out" / "reference" / "smollm2-135m-eagle3-v5"
    lines = build.build_commands("v4", run["distill"]["config"], run, out).splitlines()
    assert "python scripts/build_reference_drafter.py --stage teacher --mix v4 --parts rest,sampled-a" in lines
    assert not any(line.endswith("--stage teacher --mix v4") for line in lines)
    assert any("--out out/reference/smollm2-135m-eagle3-v5 --parts rest,sampled-a \\" in line for line in lines)
    card = " ".join(build.model_card(run, _EVALUATION, 8192, "v4", out).split())
    assert "This run trained on rest, sampled-a, in order" in card


def test_commands_rebuild_a_chain_begun_from_the_packaged_drafter():
    """Catches a card whose first commands name the parted mix's base (v3) for a chain that began from the shipped
    v2 build, and that rebuild that first drafter over the package: the from-scratch run's recorded mix and an
    out/ folder must be named instead, and the next run must continue that folder."""
    build = load_script("build_reference_drafter")
    v2 = {**_record(build, 1400, 0.003, 600), "mix": "v2"}
    w1 = _record(build, 1500, 0.002, 600, seed=1, parts=["sampled-a"], bf16=True)
    w1["warm_start"] = {"from": "src/slimspec/data/smollm2-135m-eagle3", "from_training": v2}
    out = build.ROOT / "out" / "reference" / "smollm2-135m-eagle3-w1"
    lines = build.build_commands("v4", w1["distill"]["config"], w1, out).splitlines()
    assert lines[0] == "python scripts/build_reference_drafter.py --stage teacher --mix v2"
    assert lines[1].endswith("--stage train --mix v2 --out out/reference/smollm2-135m-eagle3-v2 \\")
    assert "--init out/reference/smollm2-135m-eagle3-v2 --out out/reference/smollm2-135m-eagle3-w1" in " ".join(lines)
    assert "src/slimspec" not in "\n".join(lines)
