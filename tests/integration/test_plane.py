"""The acceptance-cost plane and --rank auto, end to end on a tiny target (smoke + selection logic)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slimspec.cli import main
from slimspec.convert.rank import parse_rank
from slimspec.evaluate.cost import predicted_speedup
from slimspec.evaluate.plane import PlanePoint, best_rank, plane_table
from slimspec.workflows.recipes import brief_distillation
from tests.layouts import Spec, write_drafter

pytestmark = pytest.mark.slow


def test_best_rank_maximises_predicted_speedup():
    """Catches --rank auto picking by nu or tau alone instead of rho_TPS = rho_tau (1+k)/(1+nu k)."""
    pts = [PlanePoint("a", "slimspec", 0.5, 2.0, 0.99, 1, ""), PlanePoint("b", "slimspec", 0.2, 1.9, 0.95, 1, ""),
           PlanePoint("c", "slimspec", 0.1, 1.5, 0.75, 1, ""), PlanePoint("full", "full", 1.0, 2.0, 1.0, 1, "")]
    assert best_rank(pts, 2.0).name == "b"  # 0.95*3/1.4 = 2.04 > 0.99*3/2 = 1.49, 0.75*3/1.2 = 1.875
    assert best_rank(pts, 0.01).name == "a"
    table = plane_table(pts, (0.5,))
    assert table[2].startswith("| a | 0.500 | 2.000 | 0.990 | ")
    assert f"{predicted_speedup(0.99, 0.5, 0.5):.3f}" in table[2]


def test_plane_and_rank_auto_on_tiny_target(tiny_target, tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=49152, draft_vocab=2048, hidden=32, target_hidden=32))
    common = ["--num-prompts", "1", "--max-new-tokens", "6", "--distill-steps", "2"]
    result = CliRunner().invoke(main, ["bench", "plane", str(tmp_path / "d"), "-t", str(tiny_target), "--ranks",
                                       "d/4,d/8", "--trim-sizes", "512", "-o", str(tmp_path / "plane"), "--json",
                                       "--calibration-prompts", "4", *common])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    kinds = [p["kind"] for p in report["points"]]
    assert kinds == ["full"] + ["slimspec"] * 4 + ["screen", "vocabtrim", "frspec"]  # --screens 16:240 by default
    screen = report["points"][5]
    assert screen["name"] == "Screen r=16 K=240" and screen["share"] == pytest.approx((16 * (2048 + 32) + 240 * 32)
                                                                                      / (2048 * 32))
    names = [p["name"] for p in report["points"]]
    assert names[1:5] == ["SlimSpec r=d/4", "SlimSpec r=d/8", "SlimSpec r=d/4 (draft vocab)",
                          "SlimSpec r=d/8 (draft vocab)"]
    nu = {p["name"]: p["nu"] for p in report["points"]}
    # the draft-vocab pair has 2048 rows instead of the stitched 49152: cheaper at the same rank
    assert nu["SlimSpec r=d/8 (draft vocab)"] < nu["SlimSpec r=d/8"]
    assert (tmp_path / "plane" / "plane.png").stat().st_size > 5000
    base = report["points"][0]["tau"]
    for point in report["points"][1:5]:  # each rank distilled with the demo's recipe, as --help says
        distilled = json.loads((Path(point["folder"]) / "slimspec.json").read_text())["distill"]
        assert distilled["config"]["teacher"] == "drafter" and distilled["config"]["steps"] == 2
        assert distilled["config"]["lr"] == brief_distillation()[1].lr
    assert all(p["rho_tau"] == pytest.approx(p["tau"] / base) for p in report["points"])
    (tmp_path / ".auto.tmp-auto-999999999").mkdir()  # a killed run's candidates (no such process)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tiny_target), "--rank", "auto",
                                       "--kappa", "1.0", "--vocab", "draft", "-o", str(tmp_path / "auto"),
                                       "--distill-steps", "2", "--num-prompts", "4", "--json", "-q",
                                       "--device", "cpu"])  # where the teacher data is computed: honoured
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "auto" / "slimspec.json").read_text())
    points = [p for p in saved["rank_auto"]["points"] if p["kind"] in ("slimspec", "screen")]
    assert [p["kind"] for p in points].count("screen") == 1  # --vocab draft: the screen is a candidate too
    # rho_TPS at kappa 1 = rho_tau * 2 / (1 + nu), recomputed here from the measured points
    best = max(points, key=lambda p: p["rho_tau"] * 2 / (1 + p["nu"]))
    assert saved["rank_auto"]["chosen"] == best["name"] and saved["rho_tau"] == best["rho_tau"]
    rank = 16 if best["kind"] == "screen" else parse_rank(best["name"].split("=")[1], 32)
    assert saved["rank"] == rank == json.loads(result.stdout)["rank"]
    assert saved["vocab_mode"] == "draft" and saved["head_vocab"] == 2048  # --vocab reaches the candidates
    folders = {p["name"]: p["folder"] for p in saved["rank_auto"]["points"]}  # no dangling temporary folders
    assert folders[best["name"]] == str(tmp_path / "auto") and Path(folders["full head"]).resolve() == tmp_path / "d"
    assert all(folder is None for name, folder in folders.items() if name not in (best["name"], "full head"))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # its own and the killed run's


def test_rank_auto_refuses_the_source_folder_as_output(tmp_path):
    """Catches `--rank auto --out SRC --overwrite` deleting the source drafter: it converts into a temporary
    folder and replaces --out with the chosen rank at the end (refused before any work)."""
    source = tmp_path / "d"
    write_drafter(source, "eagle", Spec(vocab=49152, draft_vocab=2048, hidden=32, target_hidden=32))
    files = sorted(p.name for p in source.iterdir())
    result = CliRunner().invoke(main, ["convert", str(source), "-t", "unused", "--rank", "auto", "-o",
                                       str(tmp_path / "." / "d"), "--overwrite"])
    assert result.exit_code != 0 and "drafter's own folder" in result.output
    assert sorted(p.name for p in source.iterdir()) == files
