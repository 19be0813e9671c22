"""Screen and rescore on the embedded drafter: greedy agreement with the source head per (rank, shortlist, hot rows).

The pair starts from the whitened factorisation of the drafter's head (covariance of the calibration states, all
three TTT steps); ``--steps`` > 0 then distils it with the brief recipe's settings against the source head, under the
two-level KL (or ``--loss pair``: the pair's own KL; ``--loss margin``: the teacher's token above the shortlist's
boundary) at each point's shortlist. Agreement = share of mt_bench answer states (all TTT steps; the source
backbone) where the head's greedy token is the source head's; cost = multiply-adds
as a share of the full head, ``(r (V + d) + (K + N) d) / (V d)``. Hot rows: the draft tokens most frequent in the
target's answers to the calibration prompts. Measures on eval/ prompts; trains on the calibration prompts only.

    python research/screen_sweep.py --points 16:240,8:360 --steps 400 --save out/screen/heads
    python research/screen_sweep.py --points 16:240 --steps 400 --train-shortlist 0.5   # trained at K = 120
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="16:240", help="comma-separated rank:shortlist[:hot] points")
    parser.add_argument("--steps", type=int, default=0, help="distillation steps per point (0: the whitened start)")
    parser.add_argument("--loss", default="two_level", choices=("two_level", "pair", "margin"))
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--train-shortlist", type=float, default=1.0,
                        help="train at this multiple of each point's shortlist (< 1: a tighter list than served)")
    parser.add_argument("--eval-data", default="src/slimspec/data/eval/mt_bench.jsonl")
    parser.add_argument("--save", default=None, help="folder to save each point's head tensors (pt) in")
    parser.add_argument("--json", default=None, help="append one JSON line per point to this file")
    parser.add_argument("--heads", default=None, help="comma-separated converted screen drafters to measure as well")
    args = parser.parse_args(argv)

    import torch

    from slimspec.checkpoint import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts, target_of
    from slimspec.convert.factorize import factorize_whitened
    from slimspec.distill.pipeline import DataOptions, activation_covariance, self_teacher_head, teacher_for
    from slimspec.distill.train import DistillConfig, student_features, train_drafter
    from slimspec.evaluate.trim import token_counts
    from slimspec.hub import resolve_model
    from slimspec.model import ScreenRescoreHead, drafter_model, screen_cost
    from slimspec.workflows.recipes import brief_distillation

    torch.manual_seed(0)
    source_name = "embedded:smollm2-135m-eagle3"
    ckpt = load_drafter(resolve_model(source_name, "drafter"))
    parts = load_target_parts(target_of(source_name, ckpt))
    drafter = drafter_model(ckpt, parts)
    weight = ckpt.head_weight().float()
    vocab, hidden = weight.shape
    options, recipe = brief_distillation()
    options.generation_dtype = "float32"  # the shipped answers' key (convert_briefly)
    cal = teacher_for(ckpt, parts, options, progress=True)
    with torch.no_grad():
        cal_feats = student_features(drafter, cal, list(range(len(cal))), 3)
        cov = activation_covariance(cal_feats)
        evaluation = DataOptions(data=args.eval_data, max_new_tokens=64, engine="static", generation_dtype="float32")
        ev = teacher_for(ckpt, parts, evaluation, progress=True, training=False)
        ev_feats = student_features(drafter, ev, list(range(len(ev))), 3)
        states = ev_feats.hidden[ev_feats.weight > 0]
        reference = (states @ weight.T).argmax(-1)
    counts = token_counts(cal.response_ids(), ckpt.config.vocab_size)[ckpt.draft_to_target_ids()]
    hot_order = torch.argsort(-(counts - torch.arange(vocab, dtype=torch.float64) * 1e-9))
    print(f"calibration states {int((cal_feats.weight > 0).sum())}, eval states {states.shape[0]}", flush=True)
    teacher_head = self_teacher_head(ckpt, parts, vocab)
    for folder in (args.heads or "").split(",") if args.heads else []:
        head = drafter_model(load_drafter(folder), parts).lm_head
        with torch.no_grad():
            agree = float((head.greedy(states) == reference).float().mean())
        row = {"folder": folder, "rank": head.rank, "shortlist": head.shortlist, "hot_rows": head.hot_rows,
               "cost": head.multiply_add_share(), "agreement": agree}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    for point in (args.points.split(",") if args.points else []):
        r, k, *rest = (int(x) for x in point.split(":"))
        n = rest[0] if rest else 0
        hot = torch.sort(hot_order[:n]).values if n else None
        up, down = (t.float() for t in factorize_whitened(weight, r, cov))
        drafter.lm_head = ScreenRescoreHead(up, down, weight, max(1, round(k * args.train_shortlist)), hot)
        started = time.perf_counter()
        summary = {}
        if args.steps > 0:
            cfg = DistillConfig(steps=args.steps, lr=args.lr, batch_tokens=recipe.batch_tokens,
                                warmup_steps=recipe.warmup_steps, teacher="drafter", screen_loss=args.loss)
            result = train_drafter(drafter, cal, teacher_head, cfg, progress=False)
            summary = {k2: result.summary()[k2] for k2 in ("kl_before", "kl_after", "top1_before", "top1_after")}
        head = drafter.lm_head
        head.shortlist = k  # served at the point's shortlist, whatever it trained at
        with torch.no_grad():
            agree = float((head.greedy(states) == reference).float().mean())
            pair = float(((states @ head.down.T @ head.up.T).argmax(-1) == reference).float().mean())
            recall = float((head.shortlist_ids(head.screen(states)) == reference[:, None]).any(-1).float().mean())
        row = {"rank": r, "shortlist": k, "hot_rows": n, "cost": screen_cost(vocab, hidden, r, k, n),
               "steps": args.steps, "loss": args.loss, "train_shortlist": round(k * args.train_shortlist),
               "agreement": agree, "pair_agreement": pair,
               "recall": recall, "seconds": round(time.perf_counter() - started, 1), **summary}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if args.save:
            folder = Path(args.save)
            folder.mkdir(parents=True, exist_ok=True)
            tag = f"-t{round(k * args.train_shortlist)}" if args.train_shortlist != 1.0 else ""
            torch.save({"up": head.up.detach(), "down": head.down.detach(), "shortlist": k,
                        "hot_ids": head.hot_ids}, folder / f"r{r}-k{k}-n{n}-{args.loss}-{args.steps}{tag}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
