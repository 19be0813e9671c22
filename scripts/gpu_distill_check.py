"""Distillation and the reference eval on a CUDA GPU against the same runs on the CPU (``--device``; run by
``make gpu-bench``).

    python scripts/gpu_distill_check.py              # needs a CUDA GPU
    python scripts/gpu_distill_check.py --cpu-smoke  # the same code, both runs on the CPU (tests this script)

Builds the tiny random Llama target of ``gpu_teacher_check.py`` (no download) and a stand-in EAGLE-3 drafter for it
(``slimspec.standin``), then runs each case of ``CASES`` twice through the CLI, with ``--device <gpu>`` and with
``--device cpu``: ``convert --rank d/8 --vocab draft --distill-steps 40`` with the drafter teacher (the demo's, with
its teacher table) and with the target teacher (no table: the target's states read from the CPU cache each step),
and ``distill --from-scratch`` (the whole drafter trains). Both runs of a case read one teacher cache (float32
answers, so its key is the same on both devices): they differ only in where the drafter's features, the whitened
start, the teacher table and the steps are computed. Checks: the loss saw rows, head (and table) on the asked
device, the written heads agree within 5e-2 relative and the held-out KLs after training within 2e-2 relative
(float32 on both; Adam turns rounding-level gradient differences into lr-sized steps, so not bit for bit), and
the CPU run lowered its held-out KL. Then ``evaluate`` (the reference decoder, greedy) of the drafter-teacher
conversion with the stand-in as baseline on both devices: every output identical to the baseline's (both are the
target's own greedy output) and tau within 0.05. Prints two tables; exit 1 on a failure.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 40
COMMON = ["--num-prompts", "24", "--max-new-tokens", "16", "--generation-dtype", "float32", "--lr", "5e-3",
          "--warmup-steps", "5", "-q"]


def case_args(case: str, drafter: Path, target: Path) -> tuple[list[str], str | None]:
    """CLI arguments of a case (without --device/--out) and its $SLIMSPEC_TEACHER_TABLE_BYTES (None: default)."""
    if case == "from-scratch":
        return ["distill", "--from-scratch", "--target", str(target), "--draft-vocab", "32", "--steps", "20",
                *COMMON], None
    convert = ["convert", str(drafter), "--target", str(target), "--rank", "d/8", "--vocab", "draft",
               "--distill-steps", str(STEPS), *COMMON]
    return (convert + ["--teacher", "drafter"], None) if case == "drafter" else (convert + ["--teacher", "target"], "0")


CASES = ("drafter", "target", "from-scratch")


def run_on(where: str, args: list[str], out: Path) -> tuple[dict, float]:
    """One CLI run with ``--device where``: (the distillation summary it wrote, seconds)."""
    from click.testing import CliRunner

    from slimspec.cli import main

    start = time.perf_counter()
    result = CliRunner().invoke(main, [*args, "--device", where, "--out", str(out)], catch_exceptions=False)
    seconds = time.perf_counter() - start
    if result.exit_code != 0:
        raise RuntimeError(f"{args[0]} on {where} failed ({result.exit_code}): {result.output[-2000:]}")
    if (out / "training.json").exists():  # from scratch
        return json.loads((out / "training.json").read_text())["distill"], seconds
    return json.loads((out / "slimspec.json").read_text())["distill"], seconds


def written_head(folder: Path):
    """The written head as one [V, d] float64 matrix: ``W_up @ W_down`` of a SlimSpec checkpoint, else lm_head."""
    import torch
    from safetensors.torch import load_file

    if (folder / "model.safetensors").exists():
        tensors = load_file(str(folder / "model.safetensors"))
    else:
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if "lm_head_down.weight" in tensors:
        return tensors["lm_head.weight"].double() @ tensors["lm_head_down.weight"].double()
    return tensors["lm_head.weight"].double()


EVAL_PROMPTS, EVAL_TOKENS = 4, 24


def eval_on(where: str, drafter: Path, baseline: Path, target: Path) -> tuple[dict, float]:
    """``evaluate`` (the reference decoder) of ``drafter`` with ``baseline`` on ``where``: (report, seconds)."""
    from slimspec.evaluate.acceptance import evaluate

    start = time.perf_counter()
    report = evaluate(str(drafter), str(target), num_prompts=EVAL_PROMPTS, max_new_tokens=EVAL_TOKENS,
                      baseline=str(baseline), progress=False, device=where)
    return report, time.perf_counter() - start


def main() -> int:
    from gpu_teacher_check import device_from_args, tiny_target

    device = device_from_args(__doc__, "gpu_distill_check.py")

    import torch

    import slimspec.distill.train as train
    from slimspec.standin import build_standin_drafter
    seen: set[str] = set()  # devices of the rows, head and teacher table the loss saw in one run
    terms = train.kl_terms

    def recording_terms(drafter, hidden, *rest, **kwargs):
        seen.add(f"rows@{hidden.device}")
        if kwargs.get("teacher_logits") is not None:
            seen.add(f"table@{kwargs['teacher_logits'].device}")
        seen.add(f"head@{drafter.lm_head.weight_up.device}")
        return terms(drafter, hidden, *rest, **kwargs)

    train.kl_terms = recording_terms
    failures: list[str] = []
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["SLIMSPEC_CACHE"] = str(root / "cache")  # one teacher cache for both runs of a case
        target = tiny_target(root / "target")
        drafter = build_standin_drafter(target, root / "drafter", draft_vocab=32)
        for case in CASES:
            case_cli, table_bytes = case_args(case, drafter, target)
            if table_bytes is None:
                os.environ.pop("SLIMSPEC_TEACHER_TABLE_BYTES", None)
            else:
                os.environ["SLIMSPEC_TEACHER_TABLE_BYTES"] = table_bytes
            summaries, heads, timings = [], [], []
            for n, where in enumerate((device, "cpu")):
                seen.clear()
                out = root / f"out-{case}-{n}"
                summary, seconds = run_on(where, case_cli, out)
                summaries.append(summary)
                heads.append(written_head(out))
                timings.append(seconds)
                want = torch.device(where)
                want = f"cuda:{want.index or 0}" if want.type == "cuda" else "cpu"
                expected = {f"rows@{want}", f"head@{want}"} | ({f"table@{want}"} if case == "drafter" else set())
                if seen != expected:
                    failures.append(f"{case} on {where}: the loss saw {sorted(seen)}, not {sorted(expected)}")
            a, b = heads
            head_diff = float((a - b).norm() / b.norm().clamp_min(1e-300))
            before = [s["kl_before"] for s in summaries]
            after = [s["kl_after"] for s in summaries]
            kl_diff = abs(after[0] - after[1]) / max(abs(after[1]), 1e-12)
            if head_diff > 5e-2:
                failures.append(f"{case}: written heads differ by {head_diff:.2e} (relative) > 5e-2")
            if kl_diff > 2e-2:
                failures.append(f"{case}: held-out KL after training differs by {kl_diff:.2e} (relative) > 2e-2")
            if not after[1] < before[1]:
                failures.append(f"{case}: the CPU run did not lower the held-out KL ({before[1]:.4f} -> "
                                f"{after[1]:.4f})")
            rows.append(f"| {case} | {before[0]:.4f} -> {after[0]:.4f} | {before[1]:.4f} -> {after[1]:.4f} | "
                        f"{head_diff:.2e} | {timings[0]:.2f} / {timings[1]:.2f} |")
        evals = [eval_on(where, root / "out-drafter-1", drafter, target) for where in (device, "cpu")]
    print(f"distillation on {device} vs cpu (tiny Llama target, stand-in drafter; one teacher cache per case)")
    print(f"| case | held-out KL on {device} | on cpu | relative head difference | seconds ({device} / cpu) |\n"
          "|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nreference eval (greedy, {EVAL_PROMPTS} mt_bench prompts x {EVAL_TOKENS} tokens, K=4) of the converted "
          "drafter, the stand-in as baseline")
    print("| device | tau | baseline tau | outputs identical to the baseline's | seconds |\n|---|---|---|---|---|")
    for where, (report, seconds) in zip((device, "cpu"), evals, strict=True):
        print(f"| {where} | {report['tau']:.4f} | {report['baseline']['tau']:.4f} | "
              f"{report['outputs_identical_to_baseline']} | {seconds:.2f} |")
        if not report["outputs_identical_to_baseline"]:
            failures.append(f"eval on {where}: greedy outputs differ between drafters (not the target's own)")
        if report["device"] != str(torch.device(where)):
            failures.append(f"eval on {where} ran on {report['device']}")
    taus = [report["tau"] for report, _ in evals]
    if abs(taus[0] - taus[1]) > 0.05:
        failures.append(f"eval: tau {taus[0]:.4f} on {device} vs {taus[1]:.4f} on the CPU")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
