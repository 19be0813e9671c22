"""How much of a head's logits a rank-r head can keep on the drafter's real states (the d/8 rank limit).

For each rank r, the share of ``||W X||_F^2`` (logit variance) and of ``||C W X||_F^2`` (C centres over tokens:
the variation between the tokens' logits, all that softmax sees) that the best rank-r head keeps; ``X`` is the
drafter's normed states on the demo's calibration prompts (every TTT step), read from the demo's teacher cache.
It is the whitened spectrum of the (centred) head: no distillation can keep more at that rank.

    python research/logit_energy.py                    # the embedded drafter, ranks d/16 ... d/2
"""

from __future__ import annotations

import argparse

import torch


def kept_shares(weight: torch.Tensor, covariance: torch.Tensor, ranks: list[int]) -> dict[str, dict[int, float]]:
    """Per rank, the share of the plain and of the centred logits' squared norm the best rank-r head keeps."""
    from slimspec.convert.factorize import centered_gram, gram_matrix, squared_singular_values
    from slimspec.convert.rank import energy_curve

    values, vectors = torch.linalg.eigh(covariance.double())
    root = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
    gram = gram_matrix(weight)
    out = {}
    for name, g in (("plain", gram), ("centred", centered_gram(weight, gram))):
        curve = energy_curve(squared_singular_values(root @ g @ root))
        out[name] = {r: float(curve[r - 1]) for r in ranks}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="embedded:smollm2-135m-eagle3")
    parser.add_argument("--divisors", default="16,8,4,2", help="ranks d/N")
    args = parser.parse_args(argv)

    from dataclasses import replace

    from slimspec.checkpoint import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts, target_of
    from slimspec.convert.factorize import factorize
    from slimspec.distill.pipeline import activation_covariance, lowrank_checkpoint, teacher_for
    from slimspec.distill.train import split_sequences, student_features
    from slimspec.hub import resolve_model
    from slimspec.model import drafter_model
    from slimspec.workflows.recipes import brief_distillation

    ckpt = load_drafter(resolve_model(args.drafter, "drafter"))
    target = load_target_parts(target_of(args.drafter))
    options, cfg = brief_distillation()
    options = replace(options, generation_dtype="float32")  # the key of the demo's (shipped) answers
    weight = ckpt.head_weight().float()
    d = weight.shape[1]
    ranks = [d // int(n) for n in args.divisors.split(",")]
    drafter = drafter_model(lowrank_checkpoint(ckpt, *factorize(weight, ranks[0]), None), target)  # the backbone
    teacher = teacher_for(ckpt, target, options, True)
    fitted, _ = split_sequences(teacher, cfg.eval_every_nth)
    covariance = activation_covariance(student_features(drafter, teacher, fitted, cfg.ttt_steps))
    shares = kept_shares(weight, covariance, ranks)
    print("| rank | " + " | ".join(f"d/{n}" for n in args.divisors.split(",")) + " |")
    print("|---|" + "---|" * len(ranks))
    for name, label in (("plain", "logit variance kept"), ("centred", "centred logit variance kept")):
        print(f"| {label} | " + " | ".join(f"{shares[name][r]:.3f}" for r in ranks) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
