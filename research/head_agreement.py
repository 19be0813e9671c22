"""Does a converted head pick the source head's token on the same hidden states? (d/8 rho_tau)

Teacher-forced, per TTT step, on the answer positions of some teacher data (target answers to prompts): the
source drafter's argmax accuracy on the target's next token, each converted head's accuracy on the *same* hidden
states (the backbone is the source's), how often the two argmaxes agree, and that agreement where the source is
sure (top probability > 0.5) or unsure. Comparing the data a head was calibrated on with other prompts measures
how far the low-rank head's fit carries (docs/research.md). Measuring on eval/
prompts is allowed; never train on that teacher data.

    python research/head_agreement.py out/conv/brief,out/conv/chat300 --data src/slimspec/data/eval/mt_bench.jsonl
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", help="comma-separated converted drafters (same backbone as --source)")
    parser.add_argument("--source", default="embedded:smollm2-135m-eagle3")
    parser.add_argument("--data", default=None, help="prompts (default: the shipped calibration set)")
    parser.add_argument("--temperature", type=float, default=0.0, help="answers sampled at this temperature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=300, help="first N teacher sequences")
    args = parser.parse_args(argv)

    import torch

    from slimspec.checkpoint import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts, target_of
    from slimspec.distill.pipeline import DataOptions, teacher_for
    from slimspec.distill.train import student_features
    from slimspec.hub import resolve_model
    from slimspec.model import drafter_model

    def model_of(drafter: str):
        return drafter_model(load_drafter(resolve_model(drafter, "drafter")), parts)

    torch.set_grad_enabled(False)
    ckpt = load_drafter(resolve_model(args.source, "drafter"))
    parts = load_target_parts(target_of(args.source, ckpt))  # read once, shared by every head
    source = drafter_model(ckpt, parts)
    options = DataOptions(data=args.data, max_new_tokens=args.max_new_tokens, engine="static",
                          temperature=args.temperature, seed=args.seed)
    data = teacher_for(ckpt, parts, options, progress=True, training=False)  # measured on, never trained on
    feats = student_features(source, data, list(range(min(len(data), args.sequences))), 3)
    nxt = (feats.teacher_index + 1).clamp(max=data.num_tokens - 1)
    truth = data.input_ids[nxt]
    rows = (feats.weight > 0) & data.loss_mask[nxt]
    source_logits = source.lm_head(feats.hidden).float()
    picked = source.draft_to_target(source_logits.argmax(-1))
    sure = torch.softmax(source_logits, -1).amax(-1) > 0.5
    print("| head | TTT step | positions | source acc | head acc | agreement | agreement, source sure (share) "
          "| agreement, source unsure |\n|---|---|---|---|---|---|---|---|")
    for folder in args.heads.split(","):
        head = model_of(folder)
        ours = head.draft_to_target(head.lm_head(feats.hidden).argmax(-1))
        for i in range(feats.hidden.shape[1]):
            m, s = rows[:, i], rows[:, i] & sure[:, i]
            src_ok, ours_ok, agree = (picked == truth)[:, i], (ours == truth)[:, i], (picked == ours)[:, i]
            print(f"| {folder} | {i + 1} | {int(m.sum())} | {_mean(src_ok, m)} | {_mean(ours_ok, m)} "
                  f"| {_mean(agree, m)} | {_mean(agree, s)} ({float(s.sum() / m.sum()):.2f}) "
                  f"| {_mean(agree, m & ~s)} |", flush=True)
    return 0


def _mean(hit, mask) -> str:
    return f"{float(hit[mask].float().mean()):.3f}"


if __name__ == "__main__":
    sys.exit(main())
