"""`slimspec batch`: many conversions from one manifest; idempotent, resumable, one report line per job."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimspec import choices
from slimspec.convert.pipeline import model_name
from slimspec.errors import OptionError, SlimSpecError, SlimSpecWarning, first_line
from slimspec.evaluate.acceptance import evaluate, record_tau
from slimspec.workflows import convert as conversion
from slimspec.workflows.job import conversion_job
from slimspec.workflows.plan import conversion_plan
from slimspec.workflows.publish import push
from slimspec.workflows.recipes import DEFAULT_RECIPE, UNDISTILLED_EXAMPLE, brief_keys, default_note

DISTILL_DEFAULTS: dict[str, Any] = {"teacher": "target", "lr": 2e-3, "warmup_steps": 10, "batch_tokens": 2048,
                                    "ttt_steps": 3, "seed": 0, "bf16": False, "teacher_temperature": 1.0,
                                    "screen_train_share": 0.5,
                                    "temperature": 0.0, "aux_layers": None, "aux_convention": None}
"""Distillation keys of a job and their values when absent (those of ``slimspec convert``'s options)."""
JOB_KEYS = {"drafter", "target", "rank", "vocab", "out", "dtype", "stitch", "init", "distill_steps", "data",
            "num_prompts", "responses", "max_new_tokens", "overwrite", "push_to", "eval_prompts", "revision",
            "generation_engine", "generation_dtype", "target_revision", "device", "recipe", "feature_dtype",
            "max_memory", "offload_folder", "shortlist", "hot_rows", "head_budget", "serve_batch",
            *DISTILL_DEFAULTS}
INT_KEYS = {"distill_steps": 0, "num_prompts": 0, "max_new_tokens": 1, "eval_prompts": 0,  # smallest value each
            "warmup_steps": 0, "batch_tokens": 1, "ttt_steps": 1, "shortlist": 0, "hot_rows": 0,
            "serve_batch": 1}
FLOAT_KEYS = {"lr": False, "teacher_temperature": False, "temperature": True,  # True: 0 allowed, else > 0
              "screen_train_share": False}
CHOICES = {"vocab": choices.VOCABS, "stitch": choices.STITCHES, "init": choices.INITS,
           "dtype": (*choices.OUTPUT_DTYPES, None), "responses": choices.RESPONSES,
           "generation_engine": choices.GENERATION_ENGINES, "generation_dtype": choices.GENERATION_DTYPES,
           "feature_dtype": choices.FEATURE_DTYPES,
           "teacher": choices.TEACHERS, "aux_convention": ("input", "output", None), "recipe": choices.RECIPES}
NULLABLE_KEYS = {"target", "dtype", "data", "num_prompts", "revision", "target_revision", "out", "push_to", "device",
                 "aux_layers", "aux_convention", "eval_prompts", "recipe", "max_memory", "offload_folder",
                 "head_budget"}
"""Keys whose null means "not given"; any other null fails the manifest (a blank YAML value is null)."""
BY_DEFAULT = "distils_by_default"
"""Set (True) on a read job that gives neither ``recipe`` nor ``distill_steps``: the default recipe set its keys."""
SETTING_DEFAULTS = {"rank": "d/8", "vocab": "full", "stitch": "target", "init": "auto", "distill_steps": 0,
                    "responses": "regenerate", "max_new_tokens": 128}
"""Values of SETTINGS a job may write out or leave out, alike."""
SETTINGS = ("drafter", "target", "rank", "vocab", "dtype", "stitch", "init", "distill_steps", "data", "num_prompts",
            "responses", "max_new_tokens", "revision")


@dataclass
class JobResult:
    job: str
    status: str  # done | skipped | failed | not run
    out: str | None = None
    rank: int | None = None
    error: str | None = None
    seconds: float = 0.0
    tau: float | None = None
    pushed_to: str | None = None
    distilled: bool | None = None  # False: the pair is only a start (a job without distill_steps)

    def line(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items()})


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """Jobs with defaults applied, from YAML, JSON (``{defaults, jobs}`` or a list) or JSON lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SlimSpecError(f"{path}: cannot read manifest ({exc.strerror})") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif path.suffix == ".jsonl":
            rows = []
            for number, line in enumerate(text.split("\n"), start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:  # its own "line 1": name the file's line instead
                        raise ValueError(f"line {number}: {exc.msg} at column {exc.colno}") from None
            header = bool(rows) and isinstance(rows[0], dict) and set(rows[0]) == {"defaults"}
            data = {"defaults": rows[0]["defaults"] if header else {}, "jobs": rows[1:] if header else rows}
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml or json syntax: one line
        first = first_line(exc)
        raise SlimSpecError(f"{path}: cannot parse manifest ({first})") from None
    if isinstance(data, list):
        data = {"jobs": data}
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise SlimSpecError(f"{path}: expected a list of jobs, or {{defaults: ..., jobs: [...]}}")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise SlimSpecError(f"{path}: defaults must be a mapping of job options")
    jobs = []
    for i, job in enumerate(data["jobs"]):
        if not isinstance(job, dict):
            raise SlimSpecError(f"{path}: job {i + 1} is not a mapping")
        where = f"{path}: job {i + 1}"
        merged = {key: _expand_home(key, value) for key, value in {**defaults, **job}.items()}
        by_default = merged.get("recipe") is None and "distill_steps" not in merged
        if by_default:  # neither a recipe nor steps: the default recipe, as `slimspec convert` runs it
            merged = {**merged, "recipe": DEFAULT_RECIPE}
        if merged.get("recipe") is not None:
            _check_values({"recipe": merged["recipe"]}, where)
            merged = {**recipe_keys(merged), **merged}  # what the job or the defaults give overrides the recipe
        unknown = set(merged) - JOB_KEYS - {"name"}
        if unknown:
            raise SlimSpecError(f"{where} has unknown option(s) {', '.join(sorted(unknown))}")
        if "drafter" not in merged:
            raise SlimSpecError(f"{where} has no drafter")
        _check_values(merged, where)
        _check_job_reads(merged, set(job), where)
        merged.setdefault("name", merged.get("out") or f"job{i + 1}")
        jobs.append({**merged, BY_DEFAULT: by_default})
    outs = [Path(str(job["out"])).resolve() for job in jobs if job.get("out")]
    shared = sorted({str(out) for out in outs if outs.count(out) > 1})
    if shared:  # each would replace the other's output, on every run
        raise SlimSpecError(f"{path}: several jobs write to {', '.join(shared)}; give each job its own out")
    return jobs


def _expand_home(key: str, value: Any) -> Any:
    """``~`` in a path a job names (drafter, target, out, data) is the home folder, as in a shell."""
    if key in ("drafter", "target", "out", "offload_folder") and isinstance(value, str):
        return os.path.expanduser(value)
    if key == "data":
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) \
            else os.path.expanduser(value) if isinstance(value, str) else value
    return value


def _check_values(job: dict[str, Any], where: str) -> None:
    """Option values of the wrong type or out of range fail the whole manifest before any job runs."""
    for key, value in job.items():
        if value is None and key not in NULLABLE_KEYS:
            raise SlimSpecError(f"{where}: {key} is null; leave it out for its default")
    if "drafter" in job and (not isinstance(job["drafter"], str) or not job["drafter"].strip()):
        raise SlimSpecError(f"{where}: drafter must be a Hub id or a folder, got {job['drafter']!r}")
    for key, least in INT_KEYS.items():
        value = job.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise SlimSpecError(f"{where}: {key} must be an integer >= {least}, got {value!r}")
    for key, allowed in CHOICES.items():
        if key in job and job[key] not in allowed:
            shown = ", ".join(str(a) for a in allowed if a is not None)
            raise SlimSpecError(f"{where}: {key} must be one of {shown}, got {job[key]!r}")
    for key, zero_allowed in FLOAT_KEYS.items():
        value = job.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0 or value == 0 and not zero_allowed):
            raise SlimSpecError(f"{where}: {key} must be a number {'>=' if zero_allowed else '>'} 0, got {value!r}")
    for key in ("overwrite", "bf16"):
        if key in job and not isinstance(job[key], bool):
            raise SlimSpecError(f"{where}: {key} must be true or false, got {job[key]!r}")
    if "seed" in job and (isinstance(job["seed"], bool) or not isinstance(job["seed"], int)):
        raise SlimSpecError(f"{where}: seed must be an integer, got {job['seed']!r}")
    layers = job.get("aux_layers")
    if layers is not None and not (isinstance(layers, list) and layers and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
        raise SlimSpecError(f"{where}: aux_layers must be a list of layer indices >= 0, e.g. [2, 15, 27], "
                            f"got {layers!r}")
    if "rank" in job and (isinstance(job["rank"], bool) or not isinstance(job["rank"], (int, str))):
        raise SlimSpecError(f"{where}: rank must be d/N, an integer or energy:F, got {job['rank']!r}")


def _check_job_reads(job: dict[str, Any], own: set[str], where: str) -> None:
    """What ``slimspec convert`` refuses, a job refuses before any job runs (``own``: the keys the job itself
    gives; a default may serve only the jobs that read it): the conversion job's one ``validate()``."""
    try:
        conversion_job({**job, "recipe": None}, own).validate()  # the recipe is merged already
    except OptionError as exc:
        raise SlimSpecError(f"{where}: {exc.render(str)}") from None
    except SlimSpecError as exc:
        raise SlimSpecError(f"{where}: {exc}") from None


def recipe_keys(job: dict[str, Any]) -> dict[str, Any]:
    """The job keys of ``recipe: brief``: the demo's brief distillation (``convert --recipe brief``)."""
    return brief_keys(str(job.get("drafter")), job.get("target"))


def job_fingerprint(job: dict[str, Any]) -> str:
    """Hash of the settings that decide a job's output (not its name, out, overwrite or push). A key at its default
    counts as absent: writing ``rank: d/8`` out does not make a finished job run again."""
    payload = {k: None if job.get(k) == SETTING_DEFAULTS.get(k) else job.get(k) for k in SETTINGS}
    for key, default in DISTILL_DEFAULTS.items():  # absent or at their default: the fingerprints jobs always had
        if job.get(key, default) != default:
            payload[key] = job[key]
    if job.get("generation_engine", "transformers") != "transformers":  # absent: the fingerprints jobs always had
        payload["generation_engine"] = job["generation_engine"]
    if job.get("generation_dtype", "auto") != "auto":
        payload["generation_dtype"] = job["generation_dtype"]
    if job.get("feature_dtype", "auto") != "auto":
        payload["feature_dtype"] = job["feature_dtype"]
    if job.get("target_revision"):
        payload["target_revision"] = job["target_revision"]
    for key in ("shortlist", "hot_rows", "head_budget"):  # absent, 0 or null: a plain pair, as jobs always had
        if job.get(key):
            payload[key] = job[key]
    if job.get("serve_batch", 1) != 1:
        payload["serve_batch"] = job["serve_batch"]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def inputs_identity(job: dict[str, Any]) -> str | None:
    """Size and modification time of the job's local inputs (drafter, target, data files): a folder retrained or
    replaced in place makes an earlier output stale although the job's options are the same. None if all its
    inputs are Hub ids (their revision is part of the fingerprint when pinned)."""
    stamps = []
    for key in ("drafter", "target", "data"):
        for value in job.get(key) if isinstance(job.get(key), list) else [job.get(key)]:
            text = str(value) if value else ""
            matches = sorted(glob.glob(text)) if key == "data" and any(c in text for c in "*?[") else [text]
            for path in (Path(m) for m in matches if m and Path(m).exists()):
                files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
                stamps += [(key, str(p), st.st_size, st.st_mtime_ns) for p in files if (st := p.stat())]
    return hashlib.sha256(json.dumps(stamps).encode()).hexdigest()[:16] if stamps else None


def _batch_record(out: Path) -> dict[str, Any]:
    """The slimspec.json of a complete conversion in ``out`` ({} if there is none)."""
    try:
        return json.loads((out / "slimspec.json").read_text())
    except (json.JSONDecodeError, OSError):
        return {}


def finished(out: Path, fingerprint: str, inputs: str | None = None) -> bool:
    """True if ``out`` holds a complete conversion of exactly this job, from inputs as they are now (``inputs``:
    :func:`inputs_identity`; outputs written before it was recorded count as current)."""
    record = _batch_record(out)
    return record.get("batch_job") == fingerprint and record.get("batch_inputs", inputs) == inputs


def written_by_batch(out: Path) -> bool:
    """True if ``out`` holds a conversion an earlier batch job wrote (a batch may replace those without asking)."""
    return _batch_record(out).get("batch_job") is not None


def run_job(job: dict[str, Any]) -> JobResult:
    start = time.perf_counter()
    fingerprint = job_fingerprint(job)
    out = Path(job.get("out") or f"{model_name(str(job['drafter']))}-slimspec-{fingerprint[:8]}")
    inputs = inputs_identity(job)
    if finished(out, fingerprint, inputs) and not job.get("push_to") and not job.get("eval_prompts"):
        report = json.loads((out / "slimspec.json").read_text())
        return JobResult(job=job["name"], status="skipped", out=str(out), rank=report.get("rank"),
                         tau=report.get("tau"), distilled="distill" in report)
    tau = None
    if finished(out, fingerprint, inputs):
        report = json.loads((out / "slimspec.json").read_text())
        status = "skipped"
    else:
        overwrite = bool(job.get("overwrite")) or written_by_batch(out)
        result = conversion.run_conversion(conversion_job(
            {**job, "out": out, "push_to": None, "recipe": None}, (), overwrite=overwrite, progress=False,
            extra_report={"batch_job": fingerprint, "batch_inputs": inputs}))
        report, status = result.report, "done"
    if job.get("eval_prompts"):
        measured = evaluate(str(out), job.get("target"), num_prompts=int(job["eval_prompts"]), progress=False,
                            device=job.get("device"))
        record_tau(out, measured)  # in slimspec.json: later skips report it, the pushed card shows it
        tau = measured["tau"]
    pushed = None
    if job.get("push_to"):
        plan = push(out, job["push_to"])
        pushed = plan.url or job["push_to"]
    return JobResult(job=job["name"], status=status, out=str(out), rank=report.get("rank"),
                     seconds=round(time.perf_counter() - start, 3), tau=tau, pushed_to=pushed,
                     distilled="distill" in report)


def say_default(jobs: list[dict[str, Any]]) -> None:
    """One line on stderr naming the jobs that distil by default (neither ``recipe`` nor ``distill_steps``)."""
    names = [str(job["name"]) for job in jobs if job.get(BY_DEFAULT)]
    if names:
        print(f"{len(names)} job(s) without recipe or distill_steps ({', '.join(names)}): "
              f"{default_note('distill_steps: 0', 'recipe: brief')}", file=sys.stderr, flush=True)


def run_batch(manifest: Path, *, continue_on_error: bool = False, report_path: Path | None = None) -> list[JobResult]:
    """Run every job; a JSON line per job to ``report_path`` (or stdout), a progress line per job on stderr."""
    jobs = read_manifest(manifest)
    results: list[JobResult] = []
    sink = report_path.open("w") if report_path else sys.stdout
    say_default(jobs)
    try:
        for i, job in enumerate(jobs):
            label = f"[{i + 1}/{len(jobs)}] {job['name']}"
            if any(r.status == "failed" for r in results) and not continue_on_error:
                result = JobResult(job=job["name"], status="not run")
            else:
                print(f"{label}: converting {job['drafter']} ...", file=sys.stderr, flush=True)
                start = time.perf_counter()
                try:
                    result = run_job(job)
                except SlimSpecError as exc:  # the library's advice, in a manifest's words
                    message = str(exc).replace("use --overwrite", "set overwrite: true in the job")
                    result = JobResult(job=job["name"], status="failed", error=message)
                except Exception as exc:  # a job must never take the batch down with a traceback
                    first = first_line(exc, default="")
                    result = JobResult(job=job["name"], status="failed", error=f"{type(exc).__name__}: {first}")
                result.seconds = round(time.perf_counter() - start, 3)
            results.append(result)
            detail = result.error if result.status == "failed" else (
                f"rank {result.rank} -> {result.out}" if result.out else "")
            if result.distilled is False:
                detail += " (not distilled)"
            print(f"{label}: {result.status} {detail} ({result.seconds:.1f}s)", file=sys.stderr, flush=True)
            print(result.line(), file=sink, flush=True)
    finally:
        if report_path:
            sink.close()
    undistilled = [r.job for r in results if r.distilled is False]
    if undistilled:
        warnings.warn(f"{len(undistilled)} job(s) not distilled ({', '.join(undistilled)}): a conversion without "
                      f"distillation can lose most of the drafter's acceptance ({UNDISTILLED_EXAMPLE}); without "
                      "distill_steps: 0 a job runs recipe: brief (the demo's brief distillation)", SlimSpecWarning,
                      stacklevel=2)
    return results


def plan_batch(manifest: Path, *, report_path: Path | None = None) -> list[dict[str, Any]]:
    """``batch --dry-run``: each job planned as ``convert --dry-run`` plans it, none run. One JSON line per job to
    ``report_path`` (or stdout): ``status`` is ``planned``, ``already done`` (its output holds this very conversion),
    ``refused`` (the plan does not fit the free memory: ``error`` says by how much) or ``failed`` (its inputs or
    options are refused), with the plan; a progress line per job on stderr."""
    jobs = read_manifest(manifest)
    lines: list[dict[str, Any]] = []
    sink = report_path.open("w") if report_path else sys.stdout
    say_default(jobs)
    try:
        for i, job in enumerate(jobs):
            fingerprint = job_fingerprint(job)
            out = Path(job.get("out") or f"{model_name(str(job['drafter']))}-slimspec-{fingerprint[:8]}")
            line: dict[str, Any] = {"job": job["name"], "status": "planned", "out": str(out), "error": None,
                                    "plan": None}
            if finished(out, fingerprint, inputs_identity(job)):
                line["status"] = "already done"
            else:
                overwrite = bool(job.get("overwrite")) or written_by_batch(out)
                try:
                    plan = conversion_plan(conversion_job({**job, "out": out, "push_to": None, "recipe": None}, (),
                                                          overwrite=overwrite, progress=False), out)
                except SlimSpecError as exc:
                    line.update(status="failed", error=str(exc).replace("use --overwrite",
                                                                        "set overwrite: true in the job"))
                else:
                    line.update(status="refused" if plan.refusal else "planned", error=plan.refusal,
                                plan=plan.report)
            lines.append(line)
            peak = ", ".join(f"{device} {need / 1e9:.2f} GB" for device, need in (line["plan"] or {}).get(
                "peak", {}).items())
            detail = line["error"] or (f"rank {line['plan']['rank']}, peak {peak}" if line["plan"] else "")
            print(f"[{i + 1}/{len(jobs)}] {job['name']}: {line['status']} {detail}".rstrip(), file=sys.stderr,
                  flush=True)
            print(json.dumps(line), file=sink, flush=True)
    finally:
        if report_path:
            sink.close()
    return lines
