"""Rebuild the embedded default's reference EAGLE-3 drafter for SmolLM2-135M-Instruct (issue 5).

    python scripts/build_reference_drafter.py --stage teacher   # regenerate answers, target features (cached)
    python scripts/build_reference_drafter.py --stage train     # train from scratch (EAGLE layout)
    python scripts/build_reference_drafter.py --stage eval      # tau on mt_bench

Prompts: a fixed mix from ../shared/data/train (never eval/): chat 64 %, code 22 %, math 14 %.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "train"
MIX = {"oasst_prompts.jsonl": None, "vicuna_bench.jsonl": None, "self_instruct_seed.jsonl": None,
       "gpteacher_roleplay.jsonl": 600, "gpteacher_codegen.jsonl": 500, "mbpp.jsonl": 200,
       "gsm8k_train.jsonl": 300, "svamp.jsonl": 150}
WORK = ROOT / "out" / "reference"


def compose_prompts(path: Path) -> Path:
    rng = random.Random(5)
    rows = []
    for name, count in MIX.items():
        data = [json.loads(line) for line in (SHARED / name).read_text().split("\n") if line.strip()]
        rows += data if count is None else rng.sample(data, count)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r["id"], "turns": r["turns"][:1]}) + "\n" for r in rows))
    return path


def main() -> int:
    from slimspec.distill.pipeline import DataOptions, load_target_parts
    from slimspec.distill.scratch import scratch_teacher, train_from_scratch
    from slimspec.distill.train import DistillConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["teacher", "train", "eval"], required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=WORK / "smollm2-135m-eagle3")
    args = parser.parse_args()
    prompts = compose_prompts(WORK / "prompts.jsonl")
    options = DataOptions(data=str(prompts), responses="regenerate", max_new_tokens=128, max_length=768)
    target = "embedded:smollm2-135m"
    if args.stage == "teacher":
        teacher, _ = scratch_teacher(load_target_parts(target), options, progress=True)
        print(json.dumps({"sequences": len(teacher), "tokens": teacher.num_tokens, "cache": str(teacher.folder)}))
    elif args.stage == "train":
        cfg = DistillConfig(steps=args.steps, lr=3e-3, warmup_steps=100, batch_tokens=4096, ttt_steps=3,
                            save_every=250, eval_every_nth=50)
        out, result = train_from_scratch(target, args.out, draft_vocab=8192, data_options=options, config=cfg,
                                         overwrite=True)
        print(json.dumps({"out": str(out), **result.summary()}))
    else:
        from slimspec.evaluate.acceptance import evaluate

        print(json.dumps(evaluate(str(args.out), target, dataset="mt_bench", num_prompts=16, max_new_tokens=128)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
