"""slimspec batch: idempotent, resumable, reports every job, survives bad jobs; the Python API surface."""

import json
import subprocess
import sys
import warnings

import pytest
import yaml
from click.testing import CliRunner

from slimspec.cli import main
from tests.layouts import Spec, write_drafter, write_target


def _setup(tmp_path):
    write_drafter(tmp_path / "d1", "eagle", Spec())
    write_drafter(tmp_path / "d2", "speculators", Spec(seed=4))
    write_target(tmp_path / "t")


def _run(manifest, *extra):
    result = CliRunner().invoke(main, ["batch", str(manifest), *extra])
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result, {r["job"]: r for r in lines}


def test_batch_is_idempotent_and_reruns_changed_jobs(tmp_path):
    """Catches a batch that redoes finished work, or skips a job whose settings changed."""
    _setup(tmp_path)
    manifest = tmp_path / "jobs.yaml"
    doc = {"defaults": {"target": str(tmp_path / "t"), "rank": "d/8", "distill_steps": 0},
           "jobs": [{"drafter": str(tmp_path / "d1"), "out": str(tmp_path / "o1")},
                    {"drafter": str(tmp_path / "d2"), "out": str(tmp_path / "o2"), "rank": 6}]}
    manifest.write_text(yaml.safe_dump(doc))
    result, rows = _run(manifest)
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in rows.values()] == ["done", "done"] and rows[str(tmp_path / "o2")]["rank"] == 6
    assert result.stderr.count("[1/2]") == 2 and result.stderr.count("[2/2]") == 2  # start + end line per job
    _, rows = _run(manifest)
    assert [r["status"] for r in rows.values()] == ["skipped", "skipped"]
    doc["jobs"][1]["rank"] = 5
    manifest.write_text(yaml.safe_dump(doc))
    _, rows = _run(manifest)
    assert [r["status"] for r in rows.values()] == ["skipped", "done"] and rows[str(tmp_path / "o2")]["rank"] == 5
    # a drafter retrained in place (same options, other weights) makes its output stale
    write_drafter(tmp_path / "d1", "eagle", Spec(seed=9))
    _, rows = _run(manifest)
    assert [r["status"] for r in rows.values()] == ["done", "skipped"]


def test_killed_job_leaves_nothing_that_looks_finished(tmp_path):
    """A job killed mid-write leaves only a hidden temp folder (dead pid); the rerun cleans it and converts."""
    _setup(tmp_path)
    stale = tmp_path / ".o1.tmp-999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    manifest = tmp_path / "jobs.json"
    manifest.write_text(json.dumps([{"drafter": str(tmp_path / "d1"), "target": str(tmp_path / "t"),
                                     "out": str(tmp_path / "o1"), "distill_steps": 0}]))
    assert not (tmp_path / "o1").exists()
    result, rows = _run(manifest)
    assert result.exit_code == 0 and rows[str(tmp_path / "o1")]["status"] == "done"
    assert not stale.exists()


def test_bad_jobs_are_reported_and_good_ones_finish(tmp_path):
    """A corrupt drafter, a missing target and an out-of-range rank: one clear line each, exit non-zero."""
    _setup(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x00" * 10)
    manifest = tmp_path / "jobs.jsonl"
    lines = [{"defaults": {"target": str(tmp_path / "t"), "distill_steps": 0}},
             {"drafter": str(tmp_path / "d1"), "out": str(tmp_path / "good1"), "name": "good1"},
             {"drafter": str(tmp_path / "bad"), "out": str(tmp_path / "o-bad"), "name": "corrupt"},
             {"drafter": str(tmp_path / "d1"), "target": str(tmp_path / "nowhere"), "out": str(tmp_path / "o-nt"),
              "name": "no-target"},
             {"drafter": str(tmp_path / "d1"), "rank": 999, "out": str(tmp_path / "o-rank"), "name": "rank"},
             {"drafter": str(tmp_path / "d2"), "out": str(tmp_path / "good2"), "name": "good2"}]
    manifest.write_text("\n".join(json.dumps(x) for x in lines))
    report = tmp_path / "report.jsonl"
    result = CliRunner().invoke(main, ["batch", str(manifest), "--continue-on-error", "--report", str(report)])
    assert result.exit_code == 1
    rows = {r["job"]: r for r in map(json.loads, report.read_text().splitlines())}
    assert rows["good1"]["status"] == rows["good2"]["status"] == "done"
    assert "truncated" in rows["corrupt"]["error"] or "corrupt" in rows["corrupt"]["error"]
    assert "no such folder" in rows["no-target"]["error"]
    assert "0 < r < d" in rows["rank"]["error"]
    for name, out in (("corrupt", "o-bad"), ("no-target", "o-nt"), ("rank", "o-rank")):
        assert "\n" not in rows[name]["error"] and not (tmp_path / out).exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".o-")]  # no half-written sibling either
    assert "Traceback" not in result.output
    # without --continue-on-error the batch stops at the first failure
    result = CliRunner().invoke(main, ["batch", str(manifest), "--report", str(report)])
    statuses = [json.loads(line)["status"] for line in report.read_text().splitlines()]
    assert result.exit_code == 1 and statuses == ["skipped", "failed", "not run", "not run", "not run"]


def test_bad_manifest_is_one_line(tmp_path):
    (tmp_path / "m.yaml").write_text("jobs: [unclosed")
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.yaml")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    (tmp_path / "m.json").write_text(json.dumps({"jobs": [{"drafter": "x", "rnak": 3}]}))
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    assert result.exit_code == 2 and "unknown option(s) rnak" in result.stderr
    # an empty defaults header is a header, not a job; defaults that are not a mapping; two jobs sharing an out
    (tmp_path / "m.jsonl").write_text('{"defaults": {}}\n{"drafter": "x", "rank": 3}\n')
    from slimspec.workflows.batch import read_manifest

    assert [job["drafter"] for job in read_manifest(tmp_path / "m.jsonl")] == ["x"]
    for name, text, needle in (
            ("d.yaml", "defaults: [1]\njobs: [{drafter: x}]", "defaults must be a mapping"),
            ("o.yaml", "jobs: [{drafter: a, out: same}, {drafter: b, out: ./same}]", "several jobs write to"),
            # values are checked before the first job runs, not when their own job comes
            ("t.yaml", "jobs: [{drafter: a}, {drafter: b, distill_steps: many}]",
             "job 2: distill_steps must be an integer >= 0, got 'many'"),
            ("v.yaml", "jobs: [{drafter: a, vocab: draftt}]", "vocab must be one of full, draft"),
            ("w.yaml", "jobs: [{drafter: a, overwrite: 'yes'}]", "overwrite must be true or false"),
            # JSON lines: the file's line, not the line inside the one row json saw
            ("l.jsonl", '{"drafter": "a"}\n{"drafter": b}\n', "line 2: Expecting value at column 13")):
        (tmp_path / name).write_text(text)
        result = CliRunner().invoke(main, ["batch", str(tmp_path / name)])
        assert result.exit_code == 2 and needle in result.stderr and result.stderr.count("\n") == 1, result.output


def test_existing_output_failure_names_the_manifest_option(tmp_path):
    """Catches a batch failure advising `--overwrite`, a CLI flag that a manifest cannot take."""
    _setup(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"jobs": [
        {"drafter": str(tmp_path / "d1"), "target": str(tmp_path / "t"), "out": str(tmp_path / "taken"),
         "distill_steps": 0}]}))
    result, rows = _run(tmp_path / "m.yaml")
    error = rows[str(tmp_path / "taken")]["error"]
    assert result.exit_code == 1 and "set overwrite: true in the job" in error and "--overwrite" not in error


def test_rerun_with_eval_prompts_measures_and_records_tau(tiny_target, tmp_path):
    """Catches a finished job that returned before `eval_prompts` (tau null on every rerun) and a measured tau that
    was never kept in slimspec.json (later skips and the pushed card would not show it)."""
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32))
    job = {"drafter": str(tmp_path / "d"), "target": str(tiny_target), "rank": 8, "out": str(tmp_path / "o"),
           "distill_steps": 0}
    manifest = tmp_path / "jobs.json"
    manifest.write_text(json.dumps([job]))
    _, rows = _run(manifest)
    assert rows[str(tmp_path / "o")]["status"] == "done" and rows[str(tmp_path / "o")]["tau"] is None
    manifest.write_text(json.dumps([{**job, "eval_prompts": 1}]))
    _, rows = _run(manifest)
    row = rows[str(tmp_path / "o")]
    assert row["status"] == "skipped" and row["tau"] >= 1.0
    saved = json.loads((tmp_path / "o" / "slimspec.json").read_text())
    assert saved["tau"] == row["tau"] and saved["tau_settings"]["num_prompts"] == 1
    # a ratio recorded at other settings (e.g. by --rank auto) does not survive beside a tau measured without a baseline
    from slimspec.evaluate.acceptance import record_tau

    (tmp_path / "o" / "slimspec.json").write_text(json.dumps({**saved, "rho_tau": 0.5, "tau_source": 3.0}))
    record_tau(tmp_path / "o", {"tau": 1.5, "dataset": "mt_bench", "num_prompts": 2, "draft_tokens": 4,
                                "temperature": 0.0, "max_new_tokens": 8})
    again = json.loads((tmp_path / "o" / "slimspec.json").read_text())
    assert again["tau"] == 1.5 and "rho_tau" not in again and "tau_source" not in again


def test_import_is_light_and_api_is_complete():
    """`import slimspec` must not import torch, vLLM, Triton or transformers; the documented API resolves."""
    code = ("import sys, slimspec; heavy = [m for m in ('torch', 'vllm', 'triton', 'transformers') "
            "if m in sys.modules];"
            "print(heavy); print(all(callable(getattr(slimspec, n)) for n in "
            "('convert_drafter', 'convert_briefly', 'distill_drafter', 'evaluate_drafter', 'push', 'factorize')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "True"]


def test_api_functions_stay_callable_after_their_packages_load():
    """Catches an API function that a subpackage of the same name replaces once it is imported (importing
    `slimspec.evaluate.acceptance` binds the package `slimspec.evaluate`): the README's pipeline loop would fail on
    its second drafter with "'module' object is not callable"."""
    code = ("import slimspec, slimspec.evaluate.acceptance as a, slimspec.distill.pipeline as d\n"
            "import slimspec.convert.pipeline, slimspec.workflows.convert\n"
            "a.evaluate = lambda *x, **k: ('evaluate', x, k)\n"
            "d.distill = lambda *x, **k: ('distill', x, k)\n"
            "print([slimspec.evaluate_drafter('o', num_prompts=2), slimspec.evaluate_drafter('p'), "
            "slimspec.distill_drafter('q'), slimspec.distill_drafter('r'), callable(slimspec.convert_drafter), "
            "slimspec.convert_briefly.__name__])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("[('evaluate', ('o',), {'num_prompts': 2}), ('evaluate', ('p',), {}), ('distill', ('q',), {}), "
                   "('distill', ('r',), {}), True, 'convert_briefly']")


def test_device_is_a_job_option_outside_the_fingerprint(tmp_path, monkeypatch):
    """Catches `device` refused in a manifest, dropped on its way to the teacher, or making a job that ran on a GPU
    run again on a CPU machine (the device does not change what a job writes)."""
    from slimspec.workflows.batch import job_fingerprint, read_manifest

    (tmp_path / "m.json").write_text(json.dumps({"defaults": {"device": "cpu"}, "jobs": [{"drafter": "x"}]}))
    job = read_manifest(tmp_path / "m.json")[0]
    assert job["device"] == "cpu"
    assert job_fingerprint(job) == job_fingerprint({k: v for k, v in job.items() if k != "device"})
    seen = {}

    def fake_convert(job):
        seen["device"] = job.data_options.device
        raise RuntimeError("stop here")

    monkeypatch.setattr("slimspec.workflows.convert.run_conversion", fake_convert)
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    assert seen == {"device": "cpu"}, result.output


def _captured_convert(monkeypatch):
    """Replace ``run_conversion`` by a capture of the options a batch job hands it (the job then fails, "stop here")."""
    seen = []

    def capture(job):
        seen.append({"drafter": job.drafter, "target": job.target, "rank": str(job.rank), "vocab": job.vocab,
                     "steps": job.distill_steps, "options": job.data_options, "config": job.distill_config})
        raise RuntimeError("stop here")

    monkeypatch.setattr("slimspec.workflows.convert.run_conversion", capture)
    return seen


def test_recipe_brief_runs_the_demos_distillation(tmp_path, monkeypatch):
    """Catches a manifest that cannot say the demo's recipe: without it a job's distillation ran against the
    target, at lr 2e-3, on 128-token answers (0.87 of the drafter teacher's result, BENCHMARKS.md), whatever the
    README recommended. `recipe: brief` must hand `convert` exactly what `convert_briefly` does, and a key the job
    or the defaults give must override the recipe's."""
    from slimspec.embedded import EMBEDDED_DRAFTER, EMBEDDED_TARGET
    from slimspec.workflows.convert import convert_briefly

    seen = _captured_convert(monkeypatch)
    with pytest.raises(RuntimeError, match="stop here"):
        convert_briefly(EMBEDDED_DRAFTER, EMBEDDED_TARGET, "d/8", tmp_path / "o")
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"defaults": {"recipe": "brief"}, "jobs": [
        {"drafter": EMBEDDED_DRAFTER, "target": EMBEDDED_TARGET, "out": str(tmp_path / "o")},
        {"drafter": EMBEDDED_DRAFTER, "out": str(tmp_path / "o2"), "distill_steps": 7, "lr": 1e-3, "vocab": "full"}]}))
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.yaml"), "--continue-on-error"])
    assert result.exit_code == 1 and len(seen) == 3, result.output
    ran, job, overridden = seen
    assert job["options"].teacher_settings([1, 2, 3]) == ran["options"].teacher_settings([1, 2, 3])
    assert job["options"].num_prompts == ran["options"].num_prompts
    assert job["config"] == ran["config"] and ran["config"].teacher == "drafter"
    assert {k: job[k] for k in ("drafter", "target", "rank", "vocab", "steps")} == \
        {k: ran[k] for k in ("drafter", "target", "rank", "vocab", "steps")}
    assert (overridden["steps"], overridden["config"].lr, overridden["vocab"]) == (7, 1e-3, "full")
    assert overridden["config"].teacher == "drafter" and overridden["options"].max_new_tokens == 64


def test_distillation_keys_reach_the_loop_and_the_fingerprint(tmp_path, monkeypatch):
    """Catches distillation knobs a manifest could not set (teacher, lr, TTT unroll, ...), or set without effect,
    and a key at its default changing the fingerprint (finished jobs would all run again)."""
    from slimspec.workflows.batch import job_fingerprint

    seen = _captured_convert(monkeypatch)
    keys = {"teacher": "drafter", "lr": 1e-3, "warmup_steps": 3, "batch_tokens": 512, "ttt_steps": 2, "seed": 5,
            "bf16": True, "teacher_temperature": 0.5, "temperature": 0.7, "aux_layers": [1, 2, 3],
            "aux_convention": "output"}
    job = {"drafter": "x", "distill_steps": 4, **keys}
    (tmp_path / "m.json").write_text(json.dumps([job]))
    CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    config, options = seen[0]["config"], seen[0]["options"]
    assert (config.teacher, config.lr, config.warmup_steps, config.batch_tokens, config.ttt_steps, config.seed,
            config.bf16, config.teacher_temperature) == (
        "drafter", 1e-3, 3, 512, 2, 5, True, 0.5)
    assert (options.temperature, options.seed, options.aux_layers, options.aux_convention) == (
        0.7, 5, [1, 2, 3], "output")
    plain = {"drafter": "x", "distill_steps": 4}
    assert job_fingerprint({**plain, "teacher": "target", "lr": 2e-3, "bf16": False}) == job_fingerprint(plain)
    assert job_fingerprint(plain) == "4066b6d7ab72d2af"  # the fingerprint such a job had before these keys
    for key, value in keys.items():
        assert job_fingerprint({**plain, key: value}) != job_fingerprint(plain), key


@pytest.mark.parametrize("job, needle", [
    ({"lr": 0}, "lr must be a number > 0, got 0"),
    ({"temperature": -1}, "temperature must be a number >= 0"),
    ({"teacher": "student"}, "teacher must be one of target, drafter"),
    ({"aux_layers": "2,5,8"}, "aux_layers must be a list of layer indices"),
    ({"bf16": "yes"}, "bf16 must be true or false"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"ttt_steps": 0}, "ttt_steps must be an integer >= 1"),
    ({"recipe": "fast"}, "recipe must be one of brief"),
    # a blank YAML value is null: it must be refused by the check, not crash its job with int(None)
    ({"max_new_tokens": None}, "max_new_tokens is null; leave it out"),
    ({"lr": None, "distill_steps": 2}, "lr is null"),
    # what convert refuses, a job refuses before any job runs (an SVD start without steps reads no data)
    ({"lr": 0.5, "teacher": "drafter", "distill_steps": 0},
     "this conversion reads no data (SVD start, distill_steps 0), so teacher, lr would be ignored"),
    ({"init": "whitened", "lr": 0.5, "num_prompts": 3, "distill_steps": 0},
     "lr only shape distillation steps: give distill_steps N"),
    ({"vocab": "draft", "stitch": "zero"}, "stitch fills the rows a vocab full head adds"),
    ({"drafter": "embedded:smollm2-135m-eagle3", "revision": "v9"}, "revision pins a Hub drafter"),
    ({"rank": "auto"}, "rank auto measures several conversions: run it with `slimspec convert --rank auto`"),
    ({"rank": "d/0"}, "rank 'd/0': divisor must be positive"),
    ({"rank": "foo"}, "cannot parse rank 'foo'"),
    ({"push_to": "not a repo"}, "push_to 'not a repo' is not a Hub repo id"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
])
def test_bad_job_keys_fail_before_any_job(job, needle, tmp_path):
    """Catches values (and combinations convert refuses) that passed the manifest check and then failed, or were
    silently ignored, only when their job came: hours into a batch, after the jobs before it."""
    (tmp_path / "m.json").write_text(json.dumps([{"drafter": "x"}, {"drafter": "y", **job}]))
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    assert result.exit_code == 2 and f"job 2: {needle}" in result.stderr, result.output
    assert result.stderr.count("\n") == 1


def test_defaults_serve_only_the_jobs_that_read_them(tmp_path):
    """Catches the unread-key refusal firing on a default: defaults are shared by jobs with and without steps."""
    from slimspec.workflows.batch import read_manifest

    (tmp_path / "m.json").write_text(json.dumps({"defaults": {"teacher": "drafter", "lr": 1e-3}, "jobs": [
        {"drafter": "x", "distill_steps": 3}, {"drafter": "y"}, {"drafter": "z", "init": "whitened", "ttt_steps": 2}]}))
    assert [job["drafter"] for job in read_manifest(tmp_path / "m.json")] == ["x", "y", "z"]


def test_written_out_defaults_and_home_paths(tmp_path, monkeypatch):
    """Catches a finished job redone because the manifest now writes a default out (`rank: d/8`: hours for a
    distilled job), `~` taken as a folder named "~", and a glob of prompt files never checked for changes (a
    job over `data: dir/*.jsonl` was skipped after the prompts were replaced)."""
    from slimspec.workflows.batch import inputs_identity, job_fingerprint, read_manifest

    plain = {"drafter": "x", "distill_steps": 0}
    written = {"drafter": "x", "rank": "d/8", "vocab": "full", "stitch": "target", "init": "auto",
               "distill_steps": 0, "responses": "regenerate", "max_new_tokens": 128}
    assert job_fingerprint(written) == job_fingerprint(plain) == "1ad7821f823ddf22"  # as before this change
    assert job_fingerprint({**plain, "rank": "d/16"}) != job_fingerprint(plain)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"turns": ["hi"]}\n')
    (tmp_path / "m.json").write_text(json.dumps([{"drafter": "~/d", "out": "~/o", "data": "~/data/*.jsonl",
                                                  "distill_steps": 1}]))
    job = read_manifest(tmp_path / "m.json")[0]
    assert (job["drafter"], job["out"], job["data"]) == (
        str(tmp_path / "d"), str(tmp_path / "o"), str(tmp_path / "data" / "*.jsonl"))
    before = inputs_identity(job)
    assert before is not None
    (tmp_path / "data" / "a.jsonl").write_text('{"turns": ["hello, a longer prompt"]}\n')
    assert inputs_identity(job) != before


def test_interrupted_batch_says_what_is_kept(tmp_path, monkeypatch):
    """Catches Ctrl-C in a batch saying "nothing was written" while the finished jobs' folders stay."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("slimspec.cli.run_batch", interrupted)
    (tmp_path / "m.json").write_text("[]")
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    assert result.exit_code == 2 and "finished jobs are kept" in result.stderr
    assert "nothing was written" not in result.stderr


def test_undistilled_jobs_are_named(tmp_path):
    """Catches a batch of undistilled conversions passing for finished ones (the SVD start alone kept rho_tau 0.61
    on the embedded drafter at d/8): the report says distilled false, the job's line says so, and one warning
    names the jobs and the recipe that fixes them."""
    _setup(tmp_path)
    (tmp_path / "m.json").write_text(json.dumps({"defaults": {"target": str(tmp_path / "t"), "rank": 6,
                                                              "distill_steps": 0}, "jobs": [
        {"drafter": str(tmp_path / "d1"), "out": str(tmp_path / "o1"), "name": "one"},
        {"drafter": str(tmp_path / "d2"), "out": str(tmp_path / "o2"), "name": "two"}]}))
    for _ in range(2):  # done, then skipped: both say it
        with warnings.catch_warnings():  # one process, same warning twice: Python would show it once
            warnings.simplefilter("always")
            result, rows = _run(tmp_path / "m.json")
        assert result.exit_code == 0, result.output
        assert [rows[name]["distilled"] for name in ("one", "two")] == [False, False]
        assert result.stderr.count("(not distilled)") == 2
        warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
        assert len(warned) == 1 and "2 job(s) not distilled (one, two)" in warned[0] and "recipe: brief" in warned[0], \
            result.stderr


def test_a_job_without_distillation_keys_runs_the_default_recipe(tmp_path, monkeypatch):
    """Catches a manifest job without `recipe` or `distill_steps` writing the plain SVD head (`slimspec convert`
    distils by default), running another distillation than `recipe: brief` or another fingerprint (the same output
    made twice), `distill_steps: 0` still distilling, and a batch that does not say which jobs distil by default."""
    from slimspec.embedded import EMBEDDED_DRAFTER
    from slimspec.workflows.batch import job_fingerprint, read_manifest

    seen = _captured_convert(monkeypatch)
    (tmp_path / "m.json").write_text(json.dumps([
        {"drafter": EMBEDDED_DRAFTER, "out": str(tmp_path / "o1"), "name": "default"},
        {"drafter": EMBEDDED_DRAFTER, "out": str(tmp_path / "o2"), "name": "brief", "recipe": "brief"},
        {"drafter": EMBEDDED_DRAFTER, "out": str(tmp_path / "o3"), "name": "plain", "distill_steps": 0}]))
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.json"), "--continue-on-error"])
    assert result.exit_code == 1 and len(seen) == 3, result.output
    default, brief, plain = seen
    assert default == brief and default["steps"] == 200 and default["vocab"] == "draft"
    assert (plain["steps"], plain["vocab"]) == (0, "full")
    said = [line for line in result.stderr.splitlines() if "distilling by default" in line]
    assert len(said) == 1 and "(default)" in said[0] and "distill_steps: 0 gives the plain SVD head" in said[0]
    jobs = read_manifest(tmp_path / "m.json")
    assert job_fingerprint(jobs[0]) == job_fingerprint(jobs[1]) != job_fingerprint(jobs[2])
    assert job_fingerprint(jobs[2]) == job_fingerprint({"drafter": EMBEDDED_DRAFTER})  # the plain head's, as ever


def test_screen_keys_reach_the_job_and_the_fingerprint(tmp_path, monkeypatch):
    """Catches a job that differs only in its screen (shortlist, hot rows, head budget, serving batch) fingerprinted
    like the plain pair, so a finished plain job made it skip, and screen keys a manifest could not set."""
    from slimspec.workflows.batch import job_fingerprint

    plain = {"drafter": "x", "distill_steps": 4}
    assert job_fingerprint({**plain, "shortlist": 0, "hot_rows": 0, "head_budget": None}) == job_fingerprint(plain)
    prints = {job_fingerprint({**plain, **extra}) for extra in (
        {}, {"shortlist": 240}, {"shortlist": 240, "hot_rows": 16}, {"head_budget": "d/8"}, {"head_budget": 0.06},
        {"head_budget": 0.06, "serve_batch": 8})}
    assert len(prints) == 6
    assert job_fingerprint({**plain, "head_budget": 0.06, "serve_batch": 1}) == job_fingerprint(
        {**plain, "head_budget": 0.06})
    seen = []

    def capture(job):
        seen.append((job.head_budget, job.vocab, job.shortlist, job.serve_batch))
        raise RuntimeError("stop here")

    monkeypatch.setattr("slimspec.workflows.convert.run_conversion", capture)
    (tmp_path / "m.json").write_text(json.dumps([{"drafter": "embedded:smollm2-135m-eagle3", "head_budget": "0.06",
                                                  "serve_batch": 8}]))
    CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    assert seen == [("0.06", "draft", 0, 8)]
