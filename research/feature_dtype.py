"""What reading the teacher features in bf16 instead of float32 costs (``--feature-dtype``, docs/distillation.md,
"Targets beyond one device").

On the embedded target, the same sequences (the shipped calibration prompts with the brief recipe's answers) get
their features from a float32 copy and from a bf16 copy of the target. Measured: the relative error of the aux
hidden states and of the final normed state against float32 (Frobenius over all tokens, and the worst token),
beside the error the cache's own bf16 rows already bring; the top-1 agreement and the KL of the teacher's next-token
distributions (final state @ the target's head) on the answer positions; then the same short distillation of the
embedded drafter's d/8 head (SVD start) on each feature set, both measured on the float32 set's held-out tokens.

    python research/feature_dtype.py --num-prompts 300 --steps 100 --out feature-dtype.json

``--num-prompts N`` keeps the first N of the 300 sequences.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from slimspec.checkpoint.drafter import load_drafter
from slimspec.checkpoint.target_model import load_target_model, load_target_parts
from slimspec.convert.factorize import factorize
from slimspec.convert.pipeline import stitched_head
from slimspec.distill.pipeline import DataOptions, distill_teacher_head, lowrank_checkpoint, teacher_for
from slimspec.distill.teacher import TeacherData, _features
from slimspec.distill.train import DistillConfig, evaluate_kl, split_sequences, student_features, train_drafter
from slimspec.embedded import EMBEDDED_DRAFTER, EMBEDDED_TARGET
from slimspec.hub import resolve_model
from slimspec.model import drafter_model


def relative(error: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """||error|| / ||reference|| over all rows, and the largest such ratio of one row (token)."""
    rows = error.norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)
    return {"frobenius": float(error.norm() / reference.norm()), "worst_token": float(rows.max())}


def features_of(teacher: TeacherData, target_path, dtype: torch.dtype, aux_layers) -> tuple[torch.Tensor, ...]:
    """Aux and final states of every teacher sequence, unrounded, from the target loaded in ``dtype``."""
    model, _ = load_target_model(target_path, dtype)
    aux, final = [], []
    for i in range(len(teacher)):
        a, f = _features(model, teacher.sequence(i)["input_ids"].tolist(), aux_layers)
        aux.append(a.float())
        final.append(f.float())
    return torch.cat(aux), torch.cat(final)


def teacher_agreement(final_a: torch.Tensor, final_b: torch.Tensor, head: torch.Tensor, mask: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(a || b) of the next-token distributions of two final states at ``mask``."""
    agree, kl, count = 0, 0.0, 0
    rows = mask.nonzero().flatten()
    for chunk in rows.split(1024):
        la, lb = final_a[chunk] @ head.T, final_b[chunk] @ head.T
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        pa = la.log_softmax(-1)
        kl += float((pa.exp() * (pa - lb.log_softmax(-1))).sum())
        count += len(chunk)
    return {"top1_agreement": agree / count, "kl": kl / count, "positions": count}


def distil_on(teacher: TeacherData, reference: TeacherData, ckpt, parts, rank: int, cfg: DistillConfig) -> dict:
    """The d/8 SVD start distilled ``cfg.steps`` on ``teacher``, its held-out KL measured on ``reference``."""
    weight, _ = stitched_head(ckpt, None, "draft")
    w_up, w_down = factorize(weight, rank)
    d2t = (ckpt.draft_to_target_ids() - torch.arange(weight.shape[0])).long()
    drafter = drafter_model(lowrank_checkpoint(ckpt, w_up, w_down, d2t), parts)
    head = distill_teacher_head(ckpt, drafter, parts, cfg.teacher)
    result = train_drafter(drafter, teacher, head, cfg, progress=False)
    _, held_out = split_sequences(reference, cfg.eval_every_nth)
    features = student_features(drafter, reference, held_out, cfg.ttt_steps)
    _, per_step = evaluate_kl(drafter, features, reference, head, cfg.decay, kind=cfg.teacher)
    return {"kl_before": result.kl_before, "kl_after_own_held_out": result.kl_after,
            "kl_after_float32_held_out": per_step[0], "per_step": per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--teacher", choices=("target", "drafter"), default="target")
    parser.add_argument("--out", help="write the numbers here as JSON")
    args = parser.parse_args()
    start = time.time()
    ckpt = load_drafter(resolve_model(EMBEDDED_DRAFTER, "drafter"))
    parts = load_target_parts(EMBEDDED_TARGET)
    # the brief recipe's teacher data: its answers ship with slimspec (no decoding), float32 features
    options = DataOptions(max_new_tokens=64, engine="static", generation_dtype="float32", feature_dtype="float32",
                          device="cpu")
    base = teacher_for(ckpt, parts, options, progress=True)
    if args.num_prompts < len(base):
        base = base.subset(list(range(args.num_prompts)))
    layers = tuple(base.manifest["settings"]["aux_layers"])
    aux32, final32 = features_of(base, parts.path, torch.float32, layers)
    aux16, final16 = features_of(base, parts.path, torch.bfloat16, layers)
    report = {
        "prompts": len(base), "tokens": base.num_tokens, "aux_layers": list(layers),
        "aux_bf16_features": relative(aux16 - aux32, aux32),
        "final_bf16_features": relative(final16 - final32, final32),
        "aux_bf16_rows_of_float32": relative(aux32.bfloat16().float() - aux32, aux32),
        "final_bf16_rows_of_float32": relative(final32.bfloat16().float() - final32, final32),
        "teacher_bf16_vs_float32": teacher_agreement(final32, final16, parts.head, base.loss_mask),
    }
    _write(report, args.out)
    stored = base.aux.dtype  # the cache's rows (bf16): both sets stored as the cache stores them
    float32_set = replace(base, aux=aux32.to(stored), final=final32.to(stored))
    bf16_set = replace(base, aux=aux16.to(stored), final=final16.to(stored))
    cfg = DistillConfig(steps=args.steps, lr=2e-3 if args.teacher == "target" else 5e-3, batch_tokens=2048,
                        warmup_steps=5, teacher=args.teacher)
    rank = ckpt.config.hidden_size // 8
    report["distill"] = {"teacher": args.teacher, "steps": args.steps, "rank": rank}
    for name, features in (("float32_features", float32_set), ("bf16_features", bf16_set)):
        report["distill"][name] = distil_on(features, float32_set, ckpt, parts, rank, cfg)
        _write(report, args.out)
    report["seconds"] = round(time.time() - start, 1)
    _write(report, args.out)
    print(json.dumps(report, indent=2))


def _write(report: dict, out: str | None) -> None:
    """The numbers so far, to ``out`` (each stage adds its own)."""
    if out:
        with open(out, "w") as handle:
            handle.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
