"""How much tau does the demo's conversion keep, by rank?

Converts a drafter for the embedded SmolLM2-135M target at each rank with the demo's recipe (draft vocabulary,
brief distillation against the drafter's own head) and measures tau, original and converted, side by side:

- ``--engine reference``: SlimSpec's reference decoder, 16 mt_bench first turns x 128 new tokens, 4 draft tokens
  (the settings of the reference drafter's model card and of BENCHMARKS.md "Reference drafter");
- ``--engine vllm``: vLLM (the .venv-vllm engine), 8 prompts x 64 tokens, 3 draft tokens, float32: the settings
  of tests/e2e/test_vllm.py, whose assertions (0.97 at its served rank, the d/8 floor) come from these numbers.

    python research/rank_sweep.py out/reference/smollm2-135m-eagle3-v4 --out ranks.json d/8 d/4
    python research/rank_sweep.py embedded:smollm2-135m-eagle3 --engine vllm --out ranks-vllm.json d/2 d/4 d/8

Writes the JSON after each rank (original tau, and per rank tau, rho = tau / original, acceptance per position).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TARGET = "embedded:smollm2-135m"
SETTINGS = {"reference": {"num_prompts": 16, "max_new_tokens": 128, "draft_tokens": 4},
            "vllm": {"num_prompts": 8, "max_new_tokens": 64, "draft_tokens": 3}}


class ReferenceTau:
    """tau in SlimSpec's reference decoder (greedy, mt_bench)."""

    def __init__(self) -> None:
        self.settings = SETTINGS["reference"]

    def __call__(self, drafter: str) -> dict:
        from slimspec.evaluate.acceptance import evaluate

        s = self.settings
        report = evaluate(drafter, TARGET, dataset="mt_bench", num_prompts=s["num_prompts"],
                          max_new_tokens=s["max_new_tokens"], draft_tokens=s["draft_tokens"], engine="reference",
                          progress=False)
        return {"tau": report["tau"], "acc": report.get("acceptance_per_position")}


class VllmTau:
    """tau in vLLM at the e2e test's settings; also checks that speculation keeps the greedy output."""

    def __init__(self) -> None:
        from slimspec import embedded
        from slimspec.prompts import eval_prompts

        s = self.settings = SETTINGS["vllm"]
        self.target = embedded.embedded_target_path(progress=False)
        self.prompts = eval_prompts("mt_bench", s["num_prompts"])
        self.args = ["--max-new-tokens", str(s["max_new_tokens"]), "--draft-tokens", str(s["draft_tokens"]),
                     "--dtype", "float32", "--enforce-eager"]
        self.baseline = self._run(None)["outputs"]

    def _run(self, drafter: str | None) -> dict:
        from slimspec.evaluate.vllm_engine import run_vllm_check

        report = run_vllm_check(self.target, self.prompts, drafter=drafter, extra_args=self.args)
        if not report.get("ok"):
            raise RuntimeError(f"vLLM run failed for {drafter}: {report.get('error')}")
        return report

    def __call__(self, drafter: str) -> dict:
        report = self._run(drafter)
        return {"tau": report["tau"], "acc": report["acceptance_per_position"],
                "lossless": report["outputs"] == self.baseline}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="drafter: a folder, a Hub id or embedded:smollm2-135m-eagle3")
    parser.add_argument("ranks", nargs="+", help="ranks as convert takes them: d/8, d/4, 72, ...")
    parser.add_argument("--engine", choices=sorted(SETTINGS), default="reference")
    parser.add_argument("--out", type=Path, required=True, help="JSON written after each rank")
    args = parser.parse_args(argv)

    from slimspec.errors import SlimSpecError
    from slimspec.hub import resolve_model
    from slimspec.workflows.convert import convert_briefly

    try:
        source = str(resolve_model(args.source, "drafter").resolve())  # vLLM runs from another folder
    except SlimSpecError as exc:
        print(f"rank_sweep: {exc}", file=sys.stderr)
        return 2
    measure = VllmTau() if args.engine == "vllm" else ReferenceTau()
    original = measure(source)
    result = {"source": source, "engine": args.engine, "settings": measure.settings, "original": original}
    print(json.dumps(result), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.ranks:
            converted = convert_briefly(source, TARGET, rank, Path(tmp) / rank.replace("/", "_")).out  # the demo's
            row = measure(str(converted))
            row["rho"] = row["tau"] / original["tau"]
            result[rank] = row
            print(json.dumps({rank: row}), flush=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
