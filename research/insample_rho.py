"""rho_tau of a converted drafter on the calibration prompts it was distilled on, on the held-out ones, and on mt_bench.

A diagnostic of the d/8 rank limit: if a head does not keep rho_tau on the very prompts (and greedy answers) it
was fitted to, no transfer to other prompts can lift it there. The demo's calibration data is the 300 shipped
prompts in file order; its distillation holds out every 10th (``DistillConfig.eval_every_nth``: sequence i with
i % 10 == 9) and fits the rest. This measures 30 of each (the fitted ones spread evenly over the file, which runs
chat, code, math) and the first 30 mt_bench first turns, all with the reference decoder against the original
drafter as baseline at the vLLM tests' settings (64 new tokens, K = 3, temperature 0).

    python research/insample_rho.py out/brief --out out/insample.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

HELD_EVERY = 10  # DistillConfig.eval_every_nth of the demo's recipe


def prompt_sets(rows: list[dict], count: int = 30) -> dict[str, list[dict]]:
    """The fitted and held-out calibration prompts of the demo's split, ``count`` of each."""
    fitted = [r for i, r in enumerate(rows) if i % HELD_EVERY != HELD_EVERY - 1]
    held = [r for i, r in enumerate(rows) if i % HELD_EVERY == HELD_EVERY - 1]
    return {"fitted": fitted[::max(1, len(fitted) // count)][:count], "held_out": held[:count]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("converted", help="a conversion distilled on the shipped calibration prompts")
    parser.add_argument("--original", default="embedded:smollm2-135m-eagle3")
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("out/insample.jsonl"))
    args = parser.parse_args(argv)

    from slimspec.evaluate.acceptance import evaluate
    from slimspec.standin import calibration_prompts

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        datasets = {}
        for name, rows in prompt_sets(calibration_prompts(), args.count).items():
            datasets[name] = str(Path(tmp) / f"{name}.jsonl")
            Path(datasets[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        datasets["mt_bench"] = "mt_bench"
        for name, dataset in datasets.items():
            r = evaluate(args.converted, dataset=dataset, num_prompts=args.count, max_new_tokens=64, draft_tokens=3,
                         baseline=args.original, progress=False)
            row = {"prompts": name, "tau": r["tau"], "tau_original": r["baseline"]["tau"], "rho_tau": r["rho_tau"],
                   "acceptance": r["acceptance_per_position"],
                   "acceptance_original": r["baseline"]["acceptance_per_position"]}
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
