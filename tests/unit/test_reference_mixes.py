"""The reference drafter's prompt mixes (scripts/build_reference_drafter.py): nested, duplicate-free, never eval/."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not (SHARED / "train").is_dir(), reason="needs ../shared/data (the project's data)")


def _script():
    spec = importlib.util.spec_from_file_location("build_reference_drafter", ROOT / "scripts" /
                                                  "build_reference_drafter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mixes_nest_and_stay_off_eval(tmp_path):
    """Catches a mix that reshuffles its parent (data-scaling steps must add prompts, not swap them: v1 < v2 < v3),
    a prompt drawn twice, counts in the model card that disagree with the file, and an eval/ prompt in training."""
    build = _script()
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


def test_v4_parts_cover_train_once_each_and_stay_off_eval():
    """Catches a ``rest`` part that repeats v3's prompts (the greedy answers would be counted twice), sampled halves
    that overlap or miss train/ prompts (every prompt gets exactly one sampled answer), and eval/ prompts."""
    build = _script()
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
