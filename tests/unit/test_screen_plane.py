"""The plane by multiply-add share and its screen points' specs."""

from __future__ import annotations

import pytest

from slimspec.errors import OptionError
from slimspec.evaluate.cost import predicted_speedup
from slimspec.evaluate.plane import PlanePoint, best_rank, share_table
from slimspec.workflows.plane import parse_screen


def test_share_table_predicts_from_the_share_and_rank_auto_may_pick_a_screen():
    """Catches the share table predicting from the timed nu (or listing points without a share), and --rank auto
    ignoring screen points."""
    points = [PlanePoint("full head", "full", 1.0, 2.0, 1.0, 1, "", 1.0),
              PlanePoint("SlimSpec r=d/8", "slimspec", 0.3, 1.8, 0.9, 1, "", 0.134),
              PlanePoint("Screen r=16 K=240", "screen", 0.5, 1.98, 0.99, 1, "", 0.059),
              PlanePoint("no share", "vocabtrim", 0.2, 1.9, 0.95, 1, "")]
    table = share_table(points, (0.5,))
    assert [line.split(" | ")[0] for line in table[2:]] == ["| Screen r=16 K=240", "| SlimSpec r=d/8", "| full head"]
    assert table[2].endswith(f"| {predicted_speedup(0.99, 0.059, 0.5):.3f} |")
    assert best_rank(points, 10).name == "SlimSpec r=d/8"  # by the timed nu: 0.9*11/4 > 0.99*11/6
    assert best_rank(points, 0.5).name == "Screen r=16 K=240"  # 0.99*1.5/1.25 > 0.9*1.5/1.15


@pytest.mark.parametrize("spec", ["16", "16:x", "16:0", "16:8:-1", "1:2:3:4"])
def test_bad_screen_specs_are_refused(spec):
    """Catches a malformed --screens point accepted and failing an hour into the plane."""
    with pytest.raises(OptionError):
        parse_screen(spec)
    assert parse_screen("d/36:240:8") == ("d/36", 240, 8)
