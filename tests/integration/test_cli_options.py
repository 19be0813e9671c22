"""CLI options that route to the right place: revisions, the target a drafter names, the demo's command line,
and bad values that must end in one clean line (exit code 2) before any work starts."""

import json

import pytest
from click.testing import CliRunner

from slimspec.cli import main
from tests.layouts import Spec, write_drafter, write_target


def _one_line_failure(result, needle: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "needle"), [
    (["convert", "embedded:smollm2-135m-eagle3", "--aux-layers", "2,,3", "--distill-steps", "2"], "--aux-layers"),
    (["convert", "embedded:smollm2-135m-eagle3", "--distill-steps", "0", "--aux-layers", "2,5,8", "--num-prompts", "4"],
     "reads no data (SVD start, --distill-steps 0), so --num-prompts, --aux-layers would be ignored"),
    (["convert", "embedded:smollm2-135m-eagle3", "--distill-steps", "0", "--init", "svd", "--teacher", "drafter"],
     "--teacher would be"),
    (["convert", "embedded:smollm2-135m-eagle3", "--distill-steps", "0", "--init", "whitened", "--lr", "1e-3",
      "--bf16"],
     "--lr, --bf16 only shape distillation steps"),
    (["distill", "embedded:smollm2-135m-eagle3", "--aux-layers", "two"], "--aux-layers"),
    (["convert", "embedded:smollm2-135m-eagle3", "--rank", "auto", "--stitch", "zero", "--lr", "1e-3"],
     "takes no --stitch, --lr"),
    (["convert", "embedded:smollm2-135m-eagle3", "--warmup-steps", "-1", "--distill-steps", "2"],
     "--warmup-steps must be >= 0"),
    (["bench", "--vocab", "100", "--hidden", "16", "--rank", "0"], "--rank"),
    (["bench", "--vocab", "100", "--hidden", "16", "--rank", "-3"], "--rank"),
    (["bench", "--vocab", "100", "--hidden", "16", "--rank", "16"], "0 < r < d"),
    (["bench", "embedded:smollm2-135m-eagle3", "--vocab", "100"], "without CHECKPOINT"),
    (["bench", "--vocab", "100", "--hidden", "16", "--rank", "4", "--rho-tau", "0.9"], "go with --kappa"),
    (["eval", "embedded:smollm2-135m-eagle3", "--temperature", "nan"], "not a finite number"),
    (["eval", "embedded:smollm2-135m-eagle3", "--temperature", "-1"], "--temperature"),
    (["distill", "embedded:smollm2-135m-eagle3", "--steps", "-1"], "--steps"),
    (["convert", "embedded:smollm2-135m-eagle3", "--distill-steps", "-5"], "--distill-steps"),
    (["convert", "embedded:smollm2-135m-eagle3", "--kappa", "0.3"], "--kappa weighs the candidates of --rank auto"),
    (["convert", "embedded:smollm2-135m-eagle3", "--vocab", "draft", "--stitch", "zero"], "--stitch fills"),
    (["convert", "embedded:smollm2-135m-eagle3", "--revision", "v1"], "--revision pins a Hub drafter"),
    (["convert", "embedded:smollm2-135m-eagle3", "--push-to", "bad id"], "not a Hub repo id"),
    (["bench", "plane", "embedded:smollm2-135m-eagle3", "--kappa", "abc"], "--kappa"),
    (["bench", "plane", "embedded:smollm2-135m-eagle3", "--trim-sizes", "x"], "--trim-sizes"),
    (["bench", "plane", "embedded:smollm2-135m-eagle3", "--ranks", "d/8,d/0"], "--ranks"),
    (["inspect", "embedded:smollm2-135m-eagle3", "--plot", "p.txt"], "not a .png path"),
    (["bench", "--vocab", "100", "--hidden", "16", "--rank", "4", "--batch", "0"], "--batch"),
    (["convert"], "Missing argument 'DRAFTER'"),
    (["eval", "embedded:smollm2-135m-eagle3", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["eval", "embedded:smollm2-135m-eagle3", "-k", "0"], "--draft-tokens"),
    (["distill", "embedded:smollm2-135m-eagle3", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["distill", "embedded:smollm2-135m-eagle3", "--batch-tokens", "0"], "--batch-tokens"),
    (["distill", "embedded:smollm2-135m-eagle3", "--draft-vocab", "100", "--layers", "1"],
     "--draft-vocab, --layers go with --from-scratch"),
    (["distill", "embedded:smollm2-135m-eagle3", "--backbone-lr", "1e-3"], "add --train-backbone"),
    (["convert", "embedded:smollm2-135m-eagle3", "--num-prompts", "0", "--distill-steps", "2"], "--num-prompts"),
])
def test_bad_option_values_fail_in_one_line(args, needle, tmp_path, monkeypatch):
    """Catches option values that reached the library as a ValueError/RuntimeError traceback (exit code 1), options
    --rank auto silently ignored, and click's multi-line usage errors (the README promises one line)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    _one_line_failure(result, needle)
    assert list(tmp_path.iterdir()) == []


def test_outputs_that_cannot_be_made_fail_before_any_work(tmp_path, monkeypatch):
    """Catches a FileExistsError / FileNotFoundError traceback after the whole conversion (or inspection) has run,
    when an output's parent is a file; other OS errors (here: a report folder) end in one line too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    _one_line_failure(CliRunner().invoke(main, ["convert", "embedded:smollm2-135m-eagle3", "--vocab", "draft",
                                                "--distill-steps", "0", "-o", "afile/sub"]),
                      "afile is a file, not a folder")
    _one_line_failure(CliRunner().invoke(main, ["inspect", "embedded:smollm2-135m-eagle3", "--plot",
                                                "afile/p.png"]), "is a file")
    (tmp_path / "m.json").write_text(json.dumps([{"drafter": "x"}]))
    (tmp_path / "folder").mkdir()
    _one_line_failure(CliRunner().invoke(main, ["batch", "m.json", "--report", "folder"]), "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder", "m.json"]


def test_an_undistilled_conversion_says_so(tmp_path):
    """Catches a conversion asked not to distil (--distill-steps 0) passing silently for a finished one: the SVD start
    alone kept rho_tau 0.61 on the embedded drafter at d/8 (docs/research.md). One warning line on stderr
    (also with --json, whose stdout stays one JSON object), and a note in the model card."""
    from slimspec.checkpoint.writer import NOT_DISTILLED_NOTE

    write_drafter(tmp_path / "d", "eagle", Spec())
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "--vocab", "draft", "-o",
                                       str(tmp_path / "o"), "--distill-steps", "0", "--json", "-q"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)
    warned = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {tmp_path / 'o'} is not distilled"), warned
    assert "rho_tau 0.61" in warned[0]
    assert warned[0].endswith(f"Without --distill-steps, convert distils with the demo's brief recipe, that is "
                              f"slimspec convert "
                              f"{tmp_path / 'd'} --rank 8 --vocab draft --distill-steps 200 --teacher drafter --lr "
                              "0.005 --warmup-steps 5 --batch-tokens 2048 --max-new-tokens 64 --generation-engine "
                              "static"), warned[0]
    card = (tmp_path / "o" / "README.md").read_text()
    assert NOT_DISTILLED_NOTE in card and "an SVD of the head" in card
    report = json.loads(result.stdout)
    assert f"| energy kept, rows centred (what softmax sees) | {report['energy_kept_centered']:.4f} |" in card


def test_a_distilled_conversion_does_not_warn(tmp_path, monkeypatch):
    """Catches the not-distilled warning on a conversion that did distil (its report holds "distill")."""
    import slimspec.convert.pipeline as pipeline
    import slimspec.workflows.convert as conversion

    monkeypatch.setattr(conversion, "run_conversion", lambda job: pipeline.ConvertResult(
        out=tmp_path / "o", rank=72, report={"distill": {"steps": 2}}))
    result = CliRunner().invoke(main, ["convert", "embedded:smollm2-135m-eagle3", "--distill-steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["distill"] == {"steps": 2} and result.stderr == ""


def test_eval_dataset_that_is_a_folder(tmp_path):
    """Catches an IsADirectoryError traceback for --dataset pointing at a folder."""
    result = CliRunner().invoke(main, ["eval", "embedded:smollm2-135m-eagle3", "--dataset", str(tmp_path)])
    _one_line_failure(result, "no such file")


@pytest.fixture
def pair(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    return tmp_path / "d", tmp_path / "t"


def test_revisions_go_to_their_own_model(pair, tmp_path, monkeypatch):
    """Catches --revision (a drafter branch such as r512) being used to download the target too."""
    import slimspec.hub as hub
    from slimspec.workflows.convert import convert_drafter

    calls = []
    real = hub.resolve_model

    def recording(name, role, revision=None):
        calls.append((str(name), role, revision))
        return real(name, role)

    monkeypatch.setattr("slimspec.workflows.convert.resolve_model", recording)
    monkeypatch.setattr("slimspec.workflows.job._is_local", lambda name: False)  # the folders stand in for Hub repos
    convert_drafter(str(pair[0]), str(pair[1]), 8, out=tmp_path / "o", revision="r1", target_revision="main",
                    distill_steps=0, progress=False)
    assert calls == [(str(pair[0]), "drafter", "r1"), (str(pair[1]), "target", "main")]


def test_convert_takes_the_target_the_drafter_names(tmp_path):
    """Catches `convert DRAFTER` failing with "--vocab full needs --target" when the drafter's config names its
    target (distill, eval and bench plane already default to it), and the named target being fetched for a
    conversion that does not need one."""
    write_target(tmp_path / "t")
    write_drafter(tmp_path / "d", "eagle", Spec(extra_config={"base_model_name_or_path": str(tmp_path / "t")}))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "-o", str(tmp_path / "o"),
                                       "--distill-steps", "0", "--json", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["source"]["target"] == str(tmp_path / "t") and report["rows_from_target"] > 0
    # --vocab draft with the drafter's own head needs no target: a named target that does not exist is not read
    write_drafter(tmp_path / "d2", "eagle", Spec(extra_config={"base_model_name_or_path": str(tmp_path / "gone")}))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d2"), "--rank", "8", "--vocab", "draft", "-o",
                                       str(tmp_path / "o2"), "--distill-steps", "0", "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source"]["target"] is None


def test_demo_command_line_is_the_demo_recipe(monkeypatch, tmp_path):
    """Catches the command the demo prints (and the README copies) drifting from what the demo runs: another
    answer dtype (bf16 on CPUs with native bf16) gives another teacher cache key than the shipped answers',
    another warmup other numbers. Both paths stop at `convert` and must hand it the same options."""
    import shlex

    import slimspec.convert.pipeline as pipeline
    import slimspec.workflows.convert as conversion
    from slimspec.embedded import EMBEDDED_DRAFTER, EMBEDDED_TARGET
    from slimspec.workflows.convert import convert_briefly
    from slimspec.workflows.recipes import brief_command

    seen = []

    def capture(job):
        seen.append({"drafter": job.drafter, "target": job.target, "rank": str(job.rank), "vocab": job.vocab,
                     "steps": job.distill_steps, "options": job.data_options, "config": job.distill_config})
        return pipeline.ConvertResult(out=tmp_path, rank=72, report={})

    monkeypatch.setattr(conversion, "run_conversion", capture)
    convert_briefly(EMBEDDED_DRAFTER, EMBEDDED_TARGET, "d/8", tmp_path / "o")
    command = brief_command(EMBEDDED_DRAFTER)
    assert "--generation-dtype float32" in command
    result = CliRunner().invoke(main, shlex.split(command)[1:] + ["--target", EMBEDDED_TARGET])
    assert result.exit_code != 2, result.output  # the capture returns no report to print; parsing must pass
    assert len(seen) == 2
    ran, printed = seen
    assert printed["options"].teacher_settings([1, 2, 3]) == ran["options"].teacher_settings([1, 2, 3])
    assert printed["options"].num_prompts == ran["options"].num_prompts
    assert printed["config"] == ran["config"]
    assert {k: printed[k] for k in ("drafter", "target", "rank", "vocab", "steps")} == \
        {k: ran[k] for k in ("drafter", "target", "rank", "vocab", "steps")}
    # --recipe brief says the same in two words; an option given beside it overrides the recipe's
    for extra in ([], ["--target", EMBEDDED_TARGET]):
        seen.clear()
        result = CliRunner().invoke(main, ["convert", EMBEDDED_DRAFTER, "--recipe", "brief", *extra])
        assert result.exit_code != 2 and len(seen) == 1, result.output
        recipe = seen[0]
        assert recipe["options"].teacher_settings([1, 2, 3]) == ran["options"].teacher_settings([1, 2, 3])
        assert recipe["options"].num_prompts == ran["options"].num_prompts and recipe["config"] == ran["config"]
        assert (recipe["vocab"], recipe["steps"]) == (ran["vocab"], ran["steps"])
    seen.clear()
    CliRunner().invoke(main, ["convert", EMBEDDED_DRAFTER, "--recipe", "brief", "--distill-steps", "7", "--lr",
                              "1e-3", "--vocab", "full", "--teacher", "target"])
    assert (seen[0]["steps"], seen[0]["config"].lr, seen[0]["vocab"], seen[0]["config"].teacher) == (
        7, 1e-3, "full", "target")
    assert seen[0]["options"].max_new_tokens == 64 and seen[0]["config"].warmup_steps == 5
    result = CliRunner().invoke(main, ["convert", EMBEDDED_DRAFTER, "--recipe", "brief", "--rank", "auto"])
    assert result.exit_code == 2 and "takes no --recipe" in result.stderr


@pytest.mark.parametrize("args", [
    ["--init", "whitened", "--distill-steps", "0", "--num-prompts", "3", "--aux-layers", "1,2,3", "--ttt-steps", "2"],
    ["--init", "svd", "--distill-steps", "2", "--lr", "1e-3", "--aux-layers", "1,2,3"],
    ["--distill-steps", "2", "--bf16", "--teacher-temperature", "0.5"],
])
def test_data_options_a_conversion_reads_are_accepted(args, tmp_path, monkeypatch):
    """Catches the unread-option refusal firing on conversions that do read the data: a whitened start reads the
    prompts, aux layers and TTT unroll without any step, and any --distill-steps reads them all."""
    import slimspec.convert.pipeline as pipeline
    import slimspec.workflows.convert as conversion

    seen = []

    def capture(job):
        seen.append(job)
        raise pipeline.SlimSpecError("stop here")

    monkeypatch.setattr(conversion, "run_conversion", capture)
    result = CliRunner().invoke(main, ["convert", "embedded:smollm2-135m-eagle3", "-o", str(tmp_path / "o"), *args])
    assert "stop here" in result.output and len(seen) == 1, result.output
    assert seen[0].data_options.aux_layers in (None, [1, 2, 3])


def test_bench_kappa_times_the_source_head(tiny_converted, tiny_target):
    """`bench CHECKPOINT --kappa` must time the head the conversion replaced (512 draft rows here, read from
    slimspec.json), not the checkpoint's 49152-row low-rank head: catches kappa ~ nu * kappa in rho_TPS."""
    result = CliRunner().invoke(main, ["bench", str(tiny_converted), "--kappa", "--target", str(tiny_target),
                                       "--batch", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["kappa"]["head_rows"] == 512 and report["head"][0]["source_vocab"] == 512
    assert report["kappa"]["lowrank_head_s"] > 0
    nu, kappa = report["head"][0]["nu"], report["kappa"]["kappa"]
    assert report["predicted_rho_tps"] == pytest.approx((1 + kappa) / (1 + nu * kappa))
    assert report["kappa"]["dtype"] == "float32" and report["kappa"]["device"] == "cpu"
    # the cycle is timed in the dtype it is served in (the first --dtype), not always in float32
    result = CliRunner().invoke(main, ["bench", str(tiny_converted), "--kappa", "--target", str(tiny_target),
                                       "--batch", "1", "--dtype", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kappa"]["dtype"] == "bfloat16"


def test_cli_refuses_a_cuda_device_without_a_gpu(tmp_path):
    """Catches `--device cuda` on a machine without CUDA failing after the conversion's first stages, a model load or
    an hour of plane measurements (or being ignored): it is a one-line usage error before any work."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    for command in (["convert", "embedded:smollm2-135m-eagle3", "-o", str(tmp_path / "o"), "--distill-steps", "1"],
                    ["distill", "embedded:smollm2-135m-eagle3", "-o", str(tmp_path / "d")],
                    ["eval", "embedded:smollm2-135m-eagle3"],
                    ["bench", "head", "--vocab", "64", "--hidden", "8", "--rank", "2"],
                    ["bench", "plane", "embedded:smollm2-135m-eagle3", "-o", str(tmp_path / "p")]):
        result = CliRunner().invoke(main, [*command, "--device", "cuda"])
        assert result.exit_code == 2, (command, result.output)
        assert "no CUDA GPU" in result.output
        assert not any((tmp_path / name).exists() for name in ("o", "d", "p"))


def test_a_broken_report_is_one_line(tmp_path):
    """Catches a malformed slimspec.json (a disk filled mid-write by hand edits, a merge marker) crashing `push`
    and `bench` with a JSONDecodeError traceback."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "--vocab", "draft", "-o",
                                       str(tmp_path / "o"), "--distill-steps", "0", "-q"])
    assert result.exit_code == 0, result.output
    (tmp_path / "o" / "slimspec.json").write_text("garbage{")
    for args in (["push", str(tmp_path / "o"), "someone/x", "--dry-run"], ["bench", str(tmp_path / "o")]):
        result = CliRunner().invoke(main, args)
        _one_line_failure(result, "slimspec.json: not valid JSON")


def test_plot_without_a_head_to_plot_is_refused(tmp_path):
    """Catches `inspect --plot` on a drafter that shares the target's head, without --target, exiting 0 with no
    plot and no energy lines."""
    write_drafter(tmp_path / "d", "eagle", Spec(no_head=True))
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "d"), "--plot", str(tmp_path / "e.png")])
    _one_line_failure(result, "--plot needs --target")
    assert not (tmp_path / "e.png").exists()


def test_a_failed_push_after_convert_says_where_the_conversion_is(tmp_path, monkeypatch):
    """Catches `convert --push-to` failing at the push (offline, no token) without saying the conversion was kept:
    the same command then refuses the existing folder, and nothing says `slimspec push` finishes the job."""
    import slimspec.workflows.publish

    def offline(folder, repo_id, **kwargs):
        raise slimspec.workflows.publish.SlimSpecError(f"push to {repo_id} failed: no network")

    monkeypatch.setattr(slimspec.workflows.publish, "push", offline)
    write_drafter(tmp_path / "d", "eagle", Spec())
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "--vocab", "draft", "-o",
                                       str(out), "--distill-steps", "0", "-q", "--push-to", "me/x"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and errors == [f"error: push to me/x failed: no network (the conversion is kept in "
                                                f"{out}: `slimspec push {out} me/x` pushes it)"], result.stderr
    assert (out / "slimspec.json").exists()


def _captured_jobs(monkeypatch) -> list:
    """Replace ``run_conversion`` by a capture of the job it is handed (the command then stops, "stop here")."""
    import slimspec.workflows.convert as conversion

    seen = []

    def capture(job):
        seen.append(job)
        raise conversion.SlimSpecError("stop here")

    monkeypatch.setattr(conversion, "run_conversion", capture)
    return seen


@pytest.mark.parametrize("extra", [[], ["--target", "embedded:smollm2-135m"], ["--vocab", "full", "--lr", "1e-3"]])
def test_convert_without_distillation_options_runs_the_brief_recipe(extra, monkeypatch):
    """Catches `slimspec convert DRAFTER` writing an undistilled SVD head (0.61 of tau on the embedded drafter) or a
    default distillation that differs in any field from `--recipe brief` (another vocab, lr, answer length or
    answer dtype: another teacher cache), options given beside it not overriding the recipe's, and a default that
    says nothing (one line naming --distill-steps 0)."""
    from dataclasses import replace

    from slimspec.embedded import EMBEDDED_DRAFTER

    seen = _captured_jobs(monkeypatch)
    default = CliRunner().invoke(main, ["convert", EMBEDDED_DRAFTER, *extra])
    recipe = CliRunner().invoke(main, ["convert", EMBEDDED_DRAFTER, "--recipe", "brief", *extra])
    assert "stop here" in default.output and "stop here" in recipe.output and len(seen) == 2, default.output
    by_default, brief = seen
    assert by_default.distils_by_default and not brief.distils_by_default
    assert replace(by_default, given=brief.given) == brief
    assert by_default.distill_steps == 200 and by_default.resolved_init == "whitened" and by_default.reads_data
    assert by_default.vocab == ("full" if "full" in extra else "draft")
    assert by_default.distill_config.lr == (1e-3 if "--lr" in extra else 5e-3)
    said = [line for line in default.stderr.splitlines() if "distilling by default" in line]
    assert len(said) == 1 and "--distill-steps 0 gives the plain SVD head" in said[0], default.stderr
    assert "distilling by default" not in recipe.stderr


def test_distill_steps_0_and_no_distill_give_the_plain_svd_head_reading_no_data(tmp_path, monkeypatch):
    """Catches `--distill-steps 0` / `--no-distill` still distilling or computing teacher data (a whitened start),
    the two giving different jobs, and the two contradicting each other being taken silently."""
    import slimspec.workflows.convert as conversion

    seen = _captured_jobs(monkeypatch)
    for flags in (["--distill-steps", "0"], ["--no-distill"], ["--no-distill", "--distill-steps", "0"]):
        result = CliRunner().invoke(main, ["convert", "embedded:smollm2-135m-eagle3", *flags])
        assert "stop here" in result.output and "distilling by default" not in result.stderr, result.output
    assert seen[0] == seen[1] == seen[2]
    assert (seen[0].distill_steps, seen[0].resolved_init, seen[0].reads_data, seen[0].vocab) == (0, "svd", False,
                                                                                                 "full")
    for flags, needle in ((["--no-distill", "--distill-steps", "3"], "--no-distill and --distill-steps 3"),
                          (["--no-distill", "--recipe", "brief"], "--no-distill and --recipe brief")):
        _one_line_failure(CliRunner().invoke(main, ["convert", "embedded:smollm2-135m-eagle3", *flags]), needle)
    _one_line_failure(CliRunner().invoke(main, ["convert", "embedded:smollm2-135m-eagle3", "--no-distill", "--lr",
                                                "1e-3"]), "so --lr would be ignored")
    # and a real plain conversion reads no teacher data: the target model and the calibration are never reached
    monkeypatch.undo()

    def unreachable(*args, **kwargs):
        raise AssertionError("a plain SVD conversion computed teacher data")

    monkeypatch.setattr(conversion, "load_target_parts", unreachable)
    monkeypatch.setattr(conversion, "init_and_distill", unreachable)
    write_drafter(tmp_path / "d", "eagle", Spec())
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "--vocab", "draft",
                                       "--no-distill", "-o", str(tmp_path / "o"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["init"] == "svd" and "distill" not in report and "init_kl" not in report


def test_the_api_distils_by_default_as_the_cli_does(monkeypatch):
    """Catches `slimspec.convert_drafter(drafter)` keeping the plain SVD head as its default (or distilling otherwise
    than `convert --recipe brief`), keyword options not overriding the recipe, `distill_steps=0` still distilling,
    and data_options given without distill_steps being dropped silently."""
    from dataclasses import replace

    import slimspec
    from slimspec.distill.pipeline import DataOptions
    from slimspec.embedded import EMBEDDED_DRAFTER
    from slimspec.errors import OptionError, SlimSpecError
    from slimspec.workflows.job import conversion_job

    seen = _captured_jobs(monkeypatch)
    for kwargs in ({}, {"vocab": "full"}, {"distill_steps": 0}):
        with pytest.raises(SlimSpecError, match="stop here"):
            slimspec.convert_drafter(EMBEDDED_DRAFTER, progress=False, **kwargs)
    api, full, plain = seen
    brief = conversion_job({"drafter": EMBEDDED_DRAFTER, "recipe": "brief"}, {"recipe"}, progress=False)
    assert api.distils_by_default and replace(api, given=brief.given) == brief
    assert replace(full, vocab="draft", given=brief.given) == brief
    assert (plain.distill_steps, plain.reads_data, plain.vocab) == (0, False, "full")
    with pytest.raises(OptionError, match="give distill_steps with them"):
        slimspec.convert_drafter(EMBEDDED_DRAFTER, data_options=DataOptions(num_prompts=4), progress=False)
