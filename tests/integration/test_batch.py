"""slimspec batch: idempotent, resumable, reports every job, survives bad jobs; the Python API surface."""

import json
import subprocess
import sys

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
    doc = {"defaults": {"target": str(tmp_path / "t"), "rank": "d/8"},
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
                                     "out": str(tmp_path / "o1")}]))
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
    lines = [{"defaults": {"target": str(tmp_path / "t")}},
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
    from slimspec.batch import read_manifest

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
        {"drafter": str(tmp_path / "d1"), "target": str(tmp_path / "t"), "out": str(tmp_path / "taken")}]}))
    result, rows = _run(tmp_path / "m.yaml")
    error = rows[str(tmp_path / "taken")]["error"]
    assert result.exit_code == 1 and "set overwrite: true in the job" in error and "--overwrite" not in error


def test_rerun_with_eval_prompts_measures_and_records_tau(tiny_target, tmp_path):
    """Catches a finished job that returned before `eval_prompts` (tau null on every rerun) and a measured tau that
    was never kept in slimspec.json (later skips and the pushed card would not show it)."""
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32))
    job = {"drafter": str(tmp_path / "d"), "target": str(tiny_target), "rank": 8, "out": str(tmp_path / "o")}
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
    """`import slimspec` must not import vLLM, Triton or transformers; the documented API resolves."""
    code = ("import sys, slimspec; heavy = [m for m in ('vllm', 'triton', 'transformers') if m in sys.modules];"
            "print(heavy); print(all(callable(getattr(slimspec, n)) for n in "
            "('convert', 'distill', 'evaluate', 'push', 'factorize')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "True"]


def test_device_is_a_job_option_outside_the_fingerprint(tmp_path, monkeypatch):
    """Catches `device` refused in a manifest, dropped on its way to the teacher, or making a job that ran on a GPU
    run again on a CPU machine (the device does not change what a job writes)."""
    from slimspec.batch import job_fingerprint, read_manifest

    (tmp_path / "m.json").write_text(json.dumps({"defaults": {"device": "cpu"}, "jobs": [{"drafter": "x"}]}))
    job = read_manifest(tmp_path / "m.json")[0]
    assert job["device"] == "cpu"
    assert job_fingerprint(job) == job_fingerprint({k: v for k, v in job.items() if k != "device"})
    seen = {}

    def fake_convert(*args, data_options=None, **kwargs):
        seen["device"] = data_options.device
        raise RuntimeError("stop here")

    monkeypatch.setattr("slimspec.convert.pipeline.convert", fake_convert)
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "m.json")])
    assert seen == {"device": "cpu"}, result.output
