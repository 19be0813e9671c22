"""Rehearse one conversion on stand-ins of real shapes: wall time and peak resident memory of every stage, beside
the peak ``convert --dry-run`` predicts for the same job.

    .venv/bin/python scripts/build_standins.py --family llama3-8b --out out/standins/llama3-8b
    .venv/bin/python scripts/rehearse.py --family llama3-8b --job brief --prompts 8 --new-tokens 32 --steps 10
    .venv/bin/python scripts/rehearse.py --table          # out/rehearsal/*.json -> out/rehearsal/rehearsal.md

Runs the real CLI path in this process (``slimspec convert``: ``run_conversion``) with stage markers around the
package's functions, and a thread reading ``VmRSS`` from ``/proc/self/status`` every 10 ms. A stage lasts from its
marker until the next one, so its peak is the most memory resident while it ran (what it holds and what earlier
stages left). Jobs: ``brief`` (``--vocab draft``, drafter teacher, static engine) and ``full`` (``--vocab full``,
target teacher), ``head`` (``--vocab full`` without teacher data: factorise and write only, for the 70B head).
The teacher cache goes to a fresh folder per run, so the teacher data is always made.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "rehearsal"
PAGE = 1 << 30
PLAN_OF = {"head read": "head read", "gram + eigenvalues": "gram + eigenvalues", "factorisation": "factorisation",
           "target head + embedding": "teacher data",
           "factorisation + target head and embedding": "teacher data", "teacher answers": "teacher data",
           "teacher features": "teacher data", "student features": "whitened covariance",
           "whitened covariance": "whitened covariance", "held-out KL": "whitened covariance",
           "teacher table": "teacher table", "steps": "distillation", "output tensors": "write", "write": "write",
           "verify": "verify"}
"""Measured stage -> the planned stage that bounds it."""


def rss_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class StageMeter:
    """Per-stage wall time and peak RSS. ``mark(name)`` ends the current stage and starts ``name``."""

    def __init__(self, interval: float = 0.01) -> None:
        self.stages: dict[str, dict] = {}
        self.current: str | None = None
        self.started = time.perf_counter()
        self.lock = threading.Lock()
        self.interval = interval
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            rss = rss_bytes()
            with self.lock:
                if self.current is not None:
                    entry = self.stages[self.current]
                    entry["peak"] = max(entry["peak"], rss)
            time.sleep(self.interval)

    def mark(self, name: str) -> None:
        now, rss = time.perf_counter(), rss_bytes()
        with self.lock:
            if self.current is not None:
                entry = self.stages[self.current]
                entry["seconds"] += now - self.started
                entry["peak"] = max(entry["peak"], rss)
            entry = self.stages.setdefault(name, {"seconds": 0.0, "peak": 0, "start_rss": rss})
            entry["peak"] = max(entry["peak"], rss)
            self.current, self.started = name, now

    def stop(self) -> dict[str, dict]:
        self.mark("end")
        self.running = False
        self.thread.join()
        self.stages.pop("end", None)
        return self.stages


STAGE_MARKS = {"load_drafter": "head read", "gram": "gram + eigenvalues", "factorize": "factorisation",
               "write": "write", "verify": "verify"}
"""``Stages.stage`` names of ``run_conversion`` -> the stage they begin."""


def install_markers(meter: StageMeter) -> None:
    """Mark stages where the package's functions begin (wrapping them where they are looked up)."""
    import slimspec.distill.pipeline as pipeline
    import slimspec.distill.teacher as teacher
    import slimspec.distill.train as train
    import slimspec.progress as progress
    import slimspec.workflows.convert as convert

    original_stage = progress.Stages.stage

    @contextlib.contextmanager
    def stage(self, name, message):
        if name in STAGE_MARKS:
            meter.mark(STAGE_MARKS[name])
        with original_stage(self, name, message):
            yield

    progress.Stages.stage = stage

    def wrap(module, attr: str, before: str, after: str | None = None) -> None:
        function = getattr(module, attr)

        @functools.wraps(function)
        def marked(*args, **kwargs):
            meter.mark(before)
            result = function(*args, **kwargs)
            if after is not None:
                meter.mark(after)
            return result

        setattr(module, attr, marked)

    wrap(convert, "load_target_parts", "target head + embedding")
    wrap(pipeline, "teacher_for", "teacher answers", "student features")
    wrap(teacher, "_write_teacher_folder", "teacher features")
    wrap(pipeline, "activation_covariance", "whitened covariance")
    wrap(pipeline, "evaluate_kl", "held-out KL")
    wrap(train, "frozen_teacher_table", "teacher table")
    wrap(train, "_train", "steps", "held-out KL")
    wrap(convert, "lowrank_tensors", "output tensors")


def job_args(args: argparse.Namespace, out: Path) -> list[str]:
    """The ``slimspec convert`` command line of the rehearsed job (every option explicit)."""
    folder = Path(args.standins) / args.family
    base = ["convert", str(folder / "drafter"), "--target", str(folder / "target"), "--rank", args.rank,
            "--out", str(out), "--overwrite"]
    if args.job == "head":
        return base + ["--vocab", "full", "--distill-steps", "0", "--init", "svd"]
    data = ["--num-prompts", str(args.prompts), "--max-new-tokens", str(args.new_tokens),
            "--distill-steps", str(args.steps), "--batch-tokens", str(args.batch_tokens)]
    if args.job == "brief":
        return base + ["--recipe", "brief", "--vocab", "draft", "--teacher", "drafter", "--generation-engine",
                       "static"] + data
    return base + ["--vocab", "full", "--teacher", "target"] + data


def run_cli(argv: list[str]) -> str:
    """``slimspec`` with ``argv`` in this process; its stdout."""
    from slimspec.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            main(argv, standalone_mode=False)
        except SystemExit as exc:
            if exc.code:
                raise
    return buffer.getvalue()


def planned_bytes(argv: list[str]) -> tuple[dict, dict[str, int]]:
    """The dry run's plan of ``argv`` (also one over the free memory) and its bytes per planned stage."""
    from slimspec.workflows import plan as planning

    check, planning.Plan.check = planning.Plan.check, lambda self: None  # a plan over the free memory: still run it
    try:
        plan = json.loads(run_cli(argv + ["--dry-run", "--json"]))
    finally:
        planning.Plan.check = check
    return plan, {s["stage"]: s["bytes"] for s in plan["stages"]}


def compare(stages: dict[str, dict], planned: dict[str, int]) -> list[dict]:
    """One row per measured stage: time, peak RSS, the planned stage that bounds it and the ratio."""
    rows = []
    for stage, m in stages.items():
        bound = planned.get(PLAN_OF.get(stage, ""))
        rows.append({"stage": stage, "seconds": round(m["seconds"], 2), "peak_rss": m["peak"],
                     "planned_stage": PLAN_OF.get(stage), "predicted": bound,
                     "ratio": round(m["peak"] / bound, 3) if bound else None})
    return rows


def replan(path: Path) -> dict:
    """A record's predictions again from the current formulas (its measurements kept)."""
    record = json.loads(path.read_text())
    plan, planned = planned_bytes(record["command"].split()[1:])
    measured = {r["stage"]: {"seconds": r["seconds"], "peak": r["peak_rss"]} for r in record["stages"]}
    record.update(plan=plan, stages=compare(measured, planned))
    path.write_text(json.dumps(record, indent=2))
    return record


def stopped(signum, frame) -> None:
    """SIGTERM (a memory watchdog): stop the conversion as Ctrl-C would, so the stages so far are recorded."""
    raise KeyboardInterrupt(f"signal {signum}")


def rehearse(args: argparse.Namespace) -> dict:
    """Plan, then run and measure one job; the record written to ``out/rehearsal/<name>.json``."""
    name = f"{args.family}-{args.job}"
    out = OUT / "outputs" / name
    cache = OUT / "teacher-cache" / name
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["SLIMSPEC_TEACHER_CACHE"] = str(cache)
    argv = job_args(args, out)
    plan, planned = planned_bytes(argv)
    baseline = rss_bytes()
    meter = StageMeter()
    install_markers(meter)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, stopped)
    failure = None
    try:
        run_cli(argv + ["--json"])
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # a stopped or failed run records its stages so far
        failure = f"{type(exc).__name__}: {exc}"
    total = time.perf_counter() - started
    stages = meter.stop()
    report = json.loads((out / "slimspec.json").read_text()) if failure is None else {}
    rows = compare(stages, planned)
    record = {"name": name, "family": args.family, "job": args.job, "command": "slimspec " + " ".join(argv),
              "prompts": args.prompts, "new_tokens": args.new_tokens, "steps": args.steps,
              "baseline_rss": baseline, "total_seconds": round(total, 1), "stages": rows, "plan": plan,
              "report": {k: report.get(k) for k in ("rank", "head_vocab", "energy_kept", "relative_frobenius_error",
                                                    "timings", "init_kl", "teacher")},
              "load": os.getloadavg(), "cpus": os.cpu_count(), "failure": failure}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=2))
    shutil.rmtree(cache, ignore_errors=True)
    return record


def table(records: list[dict]) -> str:
    """The markdown table of rehearsed jobs: one row per planned stage, its measured peak the largest of the
    measured stages it bounds (listed with their times)."""
    lines = ["| job | planned stage | measured stages (s) | peak RSS (GiB) | predicted (GiB) | measured / predicted |",
             "|---|---|---|---:|---:|---:|"]
    for rec in records:
        name = rec["name"] + (" (stopped)" if rec.get("failure") else "")
        groups: dict[str, list[dict]] = {}
        for row in rec["stages"]:
            groups.setdefault(row["planned_stage"] or row["stage"], []).append(row)
        for planned, rows in groups.items():
            peak = max(r["peak_rss"] for r in rows)
            predicted = rows[0]["predicted"]
            parts = ", ".join(f"{r['stage']} {r['seconds']:.1f}" for r in rows)
            cells = f"{predicted / PAGE:.2f} | {peak / predicted:.2f}" if predicted else "- | -"
            lines.append(f"| {name} | {planned} | {parts} | {peak / PAGE:.2f} | {cells} |")
    return "\n".join(lines) + "\n"


GPUS = {"H100": {"bf16": 989e12, "fp32": 67e12, "hbm": 3.35e12}, "H200": {"bf16": 989e12, "fp32": 67e12,
                                                                         "hbm": 4.8e12}}
"""Dense peaks: bf16 tensor-core FLOP/s, FP32 (no TF32) FLOP/s, HBM bytes/s (SXM parts)."""
EFFICIENCY = 0.5
"""Share of the peak FLOP/s a stage reaches (its byte traffic is counted at the full HBM bandwidth)."""


def full_size_job(prompts: int = 300, prompt_tokens: int = 84, answer_tokens: int = 64, steps: int = 200,
                  batch_tokens: int = 2048, ttt: int = 3) -> dict:
    """The default brief job on the real Llama-3.1-8B (32 layers) and EAGLE3-LLaMA3.1-Instruct-8B: the counts
    a projection needs. Prompt tokens: the shipped calibration prompts' mean characters / 4 + 32 template tokens."""
    from slimspec.workflows import memory

    t = {"P": memory.dense_params(128256, 4096, 32, 32, 8, 128, 14336, tied=False), "Ht": 4096, "Vt": 128256,
         "d": 4096, "V": 32000, "r": 512, "N": prompts, "p": prompt_tokens, "a": answer_tokens, "S": steps,
         "B": batch_tokens, "k": ttt}
    t["T"] = prompts * (prompt_tokens + answer_tokens)
    t["M"] = t["T"]  # the drafter teacher: every position teaches
    h, i = 4096, 14336
    t["Pd"] = h * 3 * h + 4096 * 2 * h + 2 * 1024 * 2 * h + h * 4096 + 3 * h * i  # drafter without its head
    return t


def projection() -> str:
    """The full-size default brief job's device stages on one H100 / H200, from FLOP and byte counts."""
    j = full_size_job()
    pair = j["r"] * (j["V"] + j["d"])
    batches = -(-j["N"] // 64)
    stages = [  # (stage, FLOPs, precision, bytes through HBM, what)
        ("teacher answers (bf16 generate)", 2 * j["P"] * j["T"], "bf16",
         batches * j["a"] * 2 * j["P"], "2*P*T FLOPs; each of N/64 batches x a decode steps reads the bf16 weights"),
        ("teacher features (fp32 forwards)", 2 * j["P"] * j["T"], "fp32", j["N"] * 4 * j["P"],
         "2*P*T FLOPs; one forward per sequence reads the fp32 weights"),
        ("student features", 2 * j["Pd"] * j["M"] * j["k"], "fp32", j["M"] * j["k"] * j["d"] * 4,
         "2*P_drafter*M*k"),
        ("teacher table", 2 * j["M"] * j["k"] * j["V"] * (j["d"] + 1), "fp32", j["M"] * j["k"] * j["V"] * 4,
         "2*M*k*V*(d+1); writes M*k*V*4 bytes"),
        ("steps", j["S"] * 6 * j["B"] * j["k"] * pair, "fp32", j["S"] * 6 * j["B"] * j["k"] * j["V"] * 4,
         "S*6*B*k*r*(V+d) (forward + backward); ~6 passes over B*k*V float32 logits a step"),
    ]
    lines = ["| stage | TFLOP | GB through HBM | H100 (s) | H200 (s) | counted as |", "|---|---:|---:|---:|---:|---|"]
    total = {"H100": 0.0, "H200": 0.0}
    for name, flops, precision, moved, what in stages:
        cells = []
        for gpu, spec in GPUS.items():
            seconds = max(flops / (EFFICIENCY * spec[precision]), moved / spec["hbm"])
            total[gpu] += seconds
            cells.append(f"{seconds:.1f}")
        lines.append(f"| {name} | {flops / 1e12:.1f} | {moved / 1e9:.0f} | {cells[0]} | {cells[1]} | {what} |")
    lines.append(f"| **device stages** | | | **{total['H100']:.0f}** | **{total['H200']:.0f}** | |")
    counts = ", ".join(f"{k} = {v:,}" for k, v in j.items())
    return "\n".join(lines) + f"\n\nCounts: {counts}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="llama3-8b")
    parser.add_argument("--job", choices=("brief", "full", "head"), default="brief")
    parser.add_argument("--standins", default=str(ROOT / "out" / "standins"), help="where build_standins wrote")
    parser.add_argument("--rank", default="d/8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--table", action="store_true", help="only write out/rehearsal/rehearsal.md from the JSONs")
    parser.add_argument("--replan", action="store_true",
                        help="recompute the predictions of out/rehearsal/*.json from the current formulas")
    parser.add_argument("--project", action="store_true",
                        help="print the full-size job's projection to one H100 / H200 and exit")
    args = parser.parse_args()
    if args.project:
        print(projection())
        return
    if args.replan:
        for path in sorted(OUT.glob("*.json")):
            replan(path)
    elif not args.table:
        record = rehearse(args)
        print(table([record]), file=sys.stderr)
    records = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    (OUT / "rehearsal.md").write_text(table(records))
    print(f"wrote {OUT / 'rehearsal.md'}")


if __name__ == "__main__":
    main()
