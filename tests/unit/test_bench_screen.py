"""`slimspec bench head --shortlist`: the screen-and-rescore head timed beside the full head, the pair and a trimmed
head, and where it stops paying."""

from __future__ import annotations

import functools
import json
import time

import pytest
from click.testing import CliRunner

from slimspec.cli import main
from slimspec.evaluate import cost
from slimspec.evaluate.cost import side_by_side
from slimspec.kernels.screen import screen_share
from slimspec.workflows import bench
from slimspec.workflows.bench import stops_paying


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds  # CPU time: other jobs on the machine do not stretch it
    while time.thread_time() < end:
        pass


def test_side_by_side_gives_shares_of_the_first():
    """Catches shares taken against the wrong function or inverted: a call doing 3x the work of the first reads
    ~3 (and the first exactly 1)."""
    timed = side_by_side({"one": lambda: _spin(0.002), "three": lambda: _spin(0.006)}, rounds=3, sample_seconds=0.01,
                         clock=time.thread_time)
    assert timed["one"]["share"] == 1.0
    assert 2.5 < timed["three"]["share"] < 3.6


def test_stops_paying_is_the_batch_from_which_on_it_never_pays():
    """Catches the batch size reported as the first failure even when a larger batch pays again, or reported
    across dtypes."""
    rows = [{"dtype": "float32", "batch": b, "screen_pays": p} for b, p in [(1, True), (8, False), (64, False)]]
    rows += [{"dtype": "bfloat16", "batch": b, "screen_pays": p} for b, p in [(1, False), (8, True), (64, True)]]
    assert stops_paying(rows) == {"float32": 8, "bfloat16": None}


@pytest.mark.slow
def test_bench_head_shortlist_reports_each_head(monkeypatch):
    """Catches the screen's row missing a head, a multiply-add share other than (r(V+d) + (K+N)d)/(Vd), a trimmed
    head not sized at that share by default, or a CLI that refuses a plain shape with --shortlist."""
    monkeypatch.setattr(bench, "screen_head_latency", functools.partial(cost.screen_head_latency, rounds=1))
    args = ["bench", "head", "--vocab", "3000", "--hidden", "64", "--rank", "8", "--shortlist", "32",
            "--hot-rows", "4", "--batch", "1", "--batch", "3", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [r["batch"] for r in out["head"]] == [1, 3]
    row = out["head"][0]
    assert row["screen_share"] == screen_share(3000, 64, 8, 32, 4) == (8 * 3064 + 36 * 64) / (3000 * 64)
    assert row["trim_rows"] == round(row["screen_share"] * 3000)
    for key in ("nu", "screen_nu", "trim_nu"):
        assert row[key] > 0
    assert set(out["stops_paying_at_batch"]) == {"float32"}
    refused = CliRunner().invoke(main, ["bench", "head", "--vocab", "3000", "--hidden", "64", "--rank", "8",
                                        "--hot-rows", "4"])
    assert refused.exit_code == 2 and "--shortlist" in refused.output
