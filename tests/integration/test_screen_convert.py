"""`slimspec convert --shortlist` on a tiny drafter: the written screen-and-rescore checkpoint and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from slimspec.checkpoint.drafter import load_drafter
from slimspec.cli import main
from slimspec.model import Eagle3Drafter, ScreenRescoreHead
from tests.layouts import Spec, write_drafter, write_target


def _convert(tmp_path, *extra):
    return CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tmp_path / "t"), "--vocab", "draft",
                                     "--distill-steps", "0", "-r", "4", "-o", str(tmp_path / "o"), "--json", "-q",
                                     *extra])


def test_convert_writes_a_screen_head_that_reads_back(tmp_path):
    """Catches the exact rows, the shortlist or the config keys lost on the way to the folder (a plain pair served),
    exact rows in the wrong (target instead of draft) order, and a report without the head's cost and bytes."""
    written = write_drafter(tmp_path / "d", "modelopt", Spec())  # frequency-ordered draft vocab with d2t
    write_target(tmp_path / "t")
    result = _convert(tmp_path, "--shortlist", "9")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    v, d, r = 97, 32, 4
    assert report["screen"]["multiply_add_share"] == pytest.approx((r * (v + d) + 9 * d) / (v * d))
    assert report["screen"]["bytes_read_per_step"]["1"] == (r * (v + d) + 9 * d) * 4
    assert report["screen"]["bytes_read_per_step"]["64"] == (r * (v + d) + v * d) * 4
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["slimspec"] | {"head": "screen_rescore", "shortlist": 9, "hot_rows": 0} == config["slimspec"]
    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head_exact.weight"), written["lm_head.weight"])
        assert "lm_head_hot_ids" not in f.keys()
    ckpt = load_drafter(tmp_path / "o")
    assert ckpt.is_screen and ckpt.shortlist == 9 and ckpt.rank == r
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=torch.randn(301, d))
    assert isinstance(model.lm_head, ScreenRescoreHead) and model.lm_head.shortlist == 9
    h = torch.randn(5, d)
    exact = model.lm_head.greedy(h)
    full = (h @ written["lm_head.weight"].float().T)
    shortlist = model.lm_head.shortlist_ids(model.lm_head.screen(h))
    assert torch.equal(exact, shortlist.gather(1, full.gather(1, shortlist).argmax(1, keepdim=True))[:, 0])
    assert torch.equal(model.canonical_state_dict()["lm_head_exact.weight"], written["lm_head.weight"])
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "o")])
    assert shown.exit_code == 0, shown.output
    assert "head: screen and rescore" in shown.stdout and "exact rows rescore its top 9" in shown.stdout
    info = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "o"), "--json"]).stdout)
    assert info["screen"] == report["screen"] and info["screen"]["head_bytes"] == (r * (v + d) + v * d) * 4


@pytest.mark.parametrize("args, message", [
    (("--shortlist", "98"), "exceed the head's 97 tokens"),
    (("--hot-rows", "3"), "give --shortlist K too"),
    (("--shortlist", "5", "--vocab", "full"), "use --vocab draft"),
    (("--shortlist", "5", "--hot-rows", "2"), "--hot-rows are the tokens most frequent"),
])
def test_screen_options_refused(tmp_path, args, message):
    """Catches a shortlist larger than the vocabulary, hot rows without a shortlist or without data to rank them,
    and a screen over the target's whole vocabulary, accepted (and failing late or silently)."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    result = _convert(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_shortlist_alone_converts_over_the_draft_vocabulary(tmp_path):
    """Catches `--shortlist` with distillation options but no `--vocab` refused for the default full vocabulary:
    the exact rows are the drafter's own, so the shortlist means the draft vocabulary."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tmp_path / "t"), "--shortlist", "9",
                                       "--distill-steps", "0", "-r", "4", "-o", str(tmp_path / "o"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["vocab_mode"] == "draft" and report["head_vocab"] == 97 and report["screen"]["shortlist"] == 9


def test_a_screen_checkpoint_without_its_config_keys_is_refused(tmp_path):
    """Catches a folder whose exact rows lack the shortlist in config.json being read as a plain pair."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    assert _convert(tmp_path, "--shortlist", "9").exit_code == 0
    config_path = tmp_path / "o" / "config.json"
    config = json.loads(config_path.read_text())
    del config["slimspec"]["shortlist"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(Exception, match="shortlist"):
        load_drafter(tmp_path / "o")


@pytest.mark.slow
def test_distilled_screen_decodes_losslessly_and_distils_again(tiny_target, tmp_path):
    """Catches the two-level distillation, the hot rows from the teacher's answers, the decoder's exact greedy token
    or `distill` of a screen checkpoint breaking: the conversion trains and records its hot ids, greedy speculative
    output stays the target's own, and a further `distill` keeps the exact rows, K and N."""
    from slimspec.checkpoint.target_model import load_target_model

    vocab = load_target_model(tiny_target)[0].config.vocab_size
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=vocab, draft_vocab=512, hidden=32, target_hidden=32))
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tiny_target), "--vocab", "draft",
                                  "-r", "4", "--shortlist", "20", "--hot-rows", "3", "--distill-steps", "2",
                                  "--num-prompts", "3", "--max-new-tokens", "8", "-o", str(tmp_path / "o"), "--json",
                                  "-q", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["distill"]["config"]["screen_loss"] == "two_level" and report["screen"]["hot_rows"] == 3
    ckpt = load_drafter(tmp_path / "o")
    assert ckpt.hot_rows == 3 and ckpt.shortlist == 20
    result = runner.invoke(main, ["eval", str(tmp_path / "o"), "-t", str(tiny_target), "--num-prompts", "1",
                                  "--max-new-tokens", "10", "--baseline", str(tmp_path / "d"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outputs_identical_to_baseline"] is True
    result = runner.invoke(main, ["distill", str(tmp_path / "o"), "-t", str(tiny_target), "--steps", "1",
                                  "--num-prompts", "3", "--max-new-tokens", "8", "-o", str(tmp_path / "again"), "-q"])
    assert result.exit_code == 0, result.output
    again = load_drafter(tmp_path / "again")
    assert again.is_screen and again.shortlist == 20 and again.hot_rows == 3
    assert torch.equal(again.tensors["lm_head_exact.weight"], ckpt.tensors["lm_head_exact.weight"])
    assert torch.equal(again.tensors["lm_head_hot_ids"], ckpt.tensors["lm_head_hot_ids"])


def test_head_budget_picks_a_screen_and_writes_what_it_picked(tiny_target, tmp_path):
    """Catches `--head-budget` writing other sizes than it reports, a pick that is not the best measured candidate,
    or one over the budget: the folder's rank, K and N are the report's choice, the most agreeing screen."""
    from slimspec.checkpoint.target_model import load_target_model

    vocab = load_target_model(tiny_target)[0].config.vocab_size
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=vocab, draft_vocab=512, hidden=32, target_hidden=32))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tiny_target), "--head-budget",
                                       "d/4", "--init", "whitened", "--distill-steps", "0", "--num-prompts", "6",
                                       "--max-new-tokens", "8", "-o", str(tmp_path / "o"), "--json", "--device",
                                       "cpu"])
    assert result.exit_code == 0, result.output
    assert "head budget 0.266 of the full head's multiply-adds: screen r=" in result.stderr
    report = json.loads(result.stdout)
    picked, points = report["head_budget"]["chosen"], report["head_budget"]["points"]
    assert report["head_budget"]["budget"] == pytest.approx(8 * (512 + 32) / (512 * 32))
    assert picked["agreement"] == max(p["agreement"] for p in points if p["shortlist"])
    assert all(p["share"] <= report["head_budget"]["budget"] for p in points)
    ckpt = load_drafter(tmp_path / "o")
    assert (ckpt.rank, ckpt.shortlist, ckpt.hot_rows) == (picked["rank"], picked["shortlist"], picked["hot_rows"])
    assert report["screen"]["multiply_add_share"] == pytest.approx(picked["share"])


def test_head_budget_at_a_large_serving_batch_writes_the_plain_pair(tiny_target, tmp_path):
    """Catches `--serve-batch` ignored: at batch 64 no shortlist of 32 rows per sequence fits a d/4 budget on a
    512-token head, so the budget must write the plain pair at the largest rank it affords, and say so."""
    from slimspec.checkpoint.target_model import load_target_model

    vocab = load_target_model(tiny_target)[0].config.vocab_size
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=vocab, draft_vocab=512, hidden=32, target_hidden=32))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tiny_target), "--head-budget",
                                       "d/4", "--serve-batch", "64", "--init", "whitened", "--distill-steps", "0",
                                       "--num-prompts", "6", "--max-new-tokens", "8", "-o", str(tmp_path / "o"),
                                       "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "at batch 64 (multiply-adds and rows read): plain pair r=8" in result.stderr
    report = json.loads(result.stdout)
    assert report["head_budget"]["batch"] == 64 and [p["shortlist"] for p in report["head_budget"]["points"]] == [0]
    ckpt = load_drafter(tmp_path / "o")
    assert ckpt.rank == 8 and not ckpt.is_screen and "screen" not in report


@pytest.mark.slow
def test_distill_gives_a_plain_pair_a_screen_and_resizes_one(tiny_target, tmp_path):
    """Catches `distill --shortlist` ignored (the plain pair written back), exact rows taken from anywhere but the
    source drafter's head in draft order, hot rows not the answers' most frequent tokens, or a screen's K not
    changed; and a full head or hot rows without a shortlist accepted."""
    from slimspec.checkpoint.target_model import load_target_model, load_target_parts
    from slimspec.distill.pipeline import DataOptions, hot_rows_of, teacher_for

    vocab = load_target_model(tiny_target)[0].config.vocab_size
    written = write_drafter(tmp_path / "d", "modelopt", Spec(vocab=vocab, draft_vocab=512, hidden=32,
                                                             target_hidden=32, target_layers=4))
    runner = CliRunner()
    data = ["--num-prompts", "3", "--max-new-tokens", "8", "-q", "--device", "cpu"]
    result = runner.invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tiny_target), "--vocab", "draft", "-r",
                                  "4", "--distill-steps", "0", "-o", str(tmp_path / "pair"), "-q"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["distill", str(tmp_path / "pair"), "-t", str(tiny_target), "--steps", "1",
                                  "--shortlist", "20", "--hot-rows", "3", "-o", str(tmp_path / "screen"), *data])
    assert result.exit_code == 0, result.output
    screen = load_drafter(tmp_path / "screen")
    assert screen.is_screen and (screen.shortlist, screen.hot_rows) == (20, 3)
    assert torch.equal(screen.tensors["lm_head_exact.weight"], written["lm_head.weight"])
    teacher = teacher_for(screen, load_target_parts(str(tiny_target)), DataOptions(num_prompts=3, max_new_tokens=8,
                                                                                    device="cpu"), progress=False)
    counts = torch.bincount(teacher.response_ids().long(), minlength=vocab)[screen.draft_to_target_ids()]
    assert torch.equal(screen.tensors["lm_head_hot_ids"], hot_rows_of(screen, teacher, 512, 3))
    assert counts[screen.tensors["lm_head_hot_ids"]].min() >= counts.sort(descending=True).values[2]
    result = runner.invoke(main, ["distill", str(tmp_path / "screen"), "-t", str(tiny_target), "--steps", "1",
                                  "--shortlist", "9", "-o", str(tmp_path / "again"), *data])
    assert result.exit_code == 0, result.output
    again = load_drafter(tmp_path / "again")
    assert (again.shortlist, again.hot_rows) == (9, 3)
    assert torch.equal(again.tensors["lm_head_hot_ids"], screen.tensors["lm_head_hot_ids"])
    for args, message in (([str(tmp_path / "d"), "--shortlist", "9"], "has a full head"),
                          ([str(tmp_path / "pair"), "--hot-rows", "2"], "give --shortlist K too")):
        result = runner.invoke(main, ["distill", *args, "-t", str(tiny_target), "--steps", "1", "-o",
                                      str(tmp_path / "no"), *data])
        assert result.exit_code == 2 and message in result.output, result.output


def test_a_plain_draft_vocabulary_pair_names_the_screen_within_its_cost(tmp_path):
    """Catches the screen left unmentioned where it could replace a plain pair over the draft vocabulary, a command
    whose budget is not the pair's own cost (d/N kept as given, an integer rank as its multiply-add share), and the
    line printed for a screen or under -q."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    base = ["convert", str(tmp_path / "d"), "-t", str(tmp_path / "t"), "--vocab", "draft", "--distill-steps", "0",
            "--overwrite", "-o", str(tmp_path / "o")]
    for rank, budget in (("d/8", "d/8"), ("4", f"{4 * (97 + 32) / (97 * 32):.3f}")):
        result = CliRunner().invoke(main, [*base, "-r", rank])
        assert result.exit_code == 0, result.output
        assert f"slimspec convert {tmp_path / 'd'} --head-budget {budget}" in result.stderr
    for extra in (["-r", "4", "--shortlist", "9"], ["-r", "4", "-q"]):
        result = CliRunner().invoke(main, [*base, *extra])
        assert result.exit_code == 0, result.output
        assert "--head-budget" not in result.stderr
