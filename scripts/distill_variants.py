"""How much tau does a conversion keep under variants of the demo's distillation? (issue 5, d/8 rho_tau)

Converts the shipped reference drafter (or ``--source``) with the demo's brief recipe (draft vocabulary, drafter
teacher, whitened start), changed by each variant, and measures tau in vLLM at tests/e2e/test_vllm.py's settings
(8 mt_bench first turns x 64 tokens, 3 draft tokens, float32; ``scripts/rank_sweep.py``'s ``VllmTau``). A variant is
a JSON object: ``name`` (required), ``rank`` (default d/8), ``teacher`` (default drafter), ``subset`` ([teacher cache
key, N]: train on the first N sequences of that teacher cache (``teacher_cache_root()``) instead of the 300
calibration prompts, e.g. the reference drafter's own ``v3`` training answers, which
``scripts/build_reference_drafter.py --stage teacher --mix v4 --parts v3`` rebuilds), ``options`` (``DataOptions``
fields of the calibration data, e.g. ``{"temperature": 1.0, "seed": 1}``: sampled answers), ``init`` (``convert``'s:
auto, svd, whitened), ``shrink`` (alpha: the whitened start's covariance shrunk toward the isotropic one, C + alpha
mean(diag C) I), and any ``DistillConfig``
field (steps, lr, bf16, teacher_temperature, train_backbone, backbone_lr, ...). Five experiment switches exist only
here (none measured better than the demo's recipe beyond noise, BENCHMARKS.md): ``"loss": "reverse"`` trains on
KL(student || teacher) (mode-seeking; a materialised loss, ~3x slower) instead of the fused forward KL,
``"answers_only": true`` drops the prompt positions the drafter teacher otherwise also learns from, ``"target_ce": a``
adds ``a`` x cross-entropy on the target's actual next token (answer rows whose token is in the draft vocabulary),
``"focus": eps`` weighs training rows 1 where the source head's argmax is the target's next token and ``eps``
elsewhere (``"soft"``: the source's probability of that token), and ``"noise": {"kind": "iso"|"data", "scale": s}``
perturbs the student states while training (see ``with_feature_noise``). ``"train_factor": "up"|"down"`` trains
one factor only (session 39). ``"tied_up": true`` trains ``W_up`` inside the source head's column space
(``tied_up``, session 46). ``"toward_start": [a, ...]`` also converts the variant without steps (its
whitened start) and measures, for each ``a``, the factors ``start + a (distilled - start)`` (session 42: weight
interpolation, the WiSE-FT remedy for a fine-tune that transfers worse than it fits).

    python scripts/distill_variants.py --original '[{"name": "brief"},
        {"name": "v3-1500", "subset": ["1e7de22dbc1c2b3f6d12", 1500], "steps": 600}]'

Appends one JSON row per variant (and the original's tau with ``--original``) to ``--out``; the converted folders
stay under ``--work``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", help="JSON list of variants (see the module docstring)")
    parser.add_argument("--source", default="embedded:smollm2-135m-eagle3")
    parser.add_argument("--original", action="store_true", help="measure the source's own tau first")
    parser.add_argument("--out", type=Path, default=Path("out/distill_variants.jsonl"))
    parser.add_argument("--work", type=Path, default=Path("out/distill_variants"))
    args = parser.parse_args(argv)

    from rank_sweep import TARGET, VllmTau

    import slimspec.distill.pipeline as pipeline
    import slimspec.distill.train as train
    from slimspec.workflows.convert import convert_drafter
    from slimspec.distill.teacher import load_teacher_data, teacher_cache_root
    from slimspec.hub import resolve_model

    source = str(resolve_model(args.source, "drafter").resolve())  # vLLM runs from another folder
    measure = VllmTau()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    original = measure(source) if args.original else None
    if original:
        record({"name": "original", "source": args.source, **original})
    brief_teacher = pipeline.teacher_for
    fused_kl, features, kl_terms = train.full_vocab_kl, train.student_features, train.kl_terms
    covariance = pipeline.activation_covariance
    table = train.frozen_teacher_table
    distill = pipeline.train_drafter
    trainable = train.trainable_parameters
    for variant in json.loads(args.variants):
        v = dict(variant)
        name, rank, teacher = v.pop("name"), v.pop("rank", "d/8"), v.pop("teacher", "drafter")
        subset, data_overrides = v.pop("subset", None), v.pop("options", {})
        init, shrink = v.pop("init", "auto"), float(v.pop("shrink", 0.0))
        pipeline.activation_covariance = shrunk_covariance(covariance, shrink) if shrink else covariance
        loss, answers_only = v.pop("loss", "forward"), bool(v.pop("answers_only", False))
        target_ce = float(v.pop("target_ce", 0.0))
        focus = v.pop("focus", None)
        noise = v.pop("noise", None)
        factor = v.pop("train_factor", None)
        toward_start = [float(a) for a in v.pop("toward_start", [])]
        tied = bool(v.pop("tied_up", False))
        if factor not in (None, "up", "down"):
            raise SystemExit(f"{name}: train_factor must be 'up' or 'down', got {factor!r}")
        train.trainable_parameters = only_factor(trainable, factor) if factor else trainable
        if loss not in ("forward", "reverse"):
            raise SystemExit(f"{name}: loss must be 'forward' or 'reverse', got {loss!r}")
        train.kl_terms = with_target_ce(kl_terms, target_ce) if target_ce else kl_terms
        if noise is not None:
            train.kl_terms = with_feature_noise(train.kl_terms, noise)
        train.full_vocab_kl = reverse_kl_when_training(fused_kl) if loss == "reverse" else fused_kl
        # both score teacher logits of rows they change or materialise: no precomputed teacher table for them
        train.frozen_teacher_table = (lambda *a, **k: None) if loss == "reverse" or noise is not None else table
        train.student_features = ((lambda *a, all_positions=False, **k: features(*a, **k)) if answers_only
                                  else features)
        pipeline.train_drafter = focused(distill, focus) if focus is not None else distill
        if tied:
            pipeline.train_drafter = tied_up(pipeline.train_drafter)
        options, cfg = pipeline.brief_distillation(None, teacher)
        options, cfg = dataclasses.replace(options, **data_overrides), dataclasses.replace(cfg, **v)
        pipeline.teacher_for = brief_teacher
        if subset:
            data = load_teacher_data(teacher_cache_root() / subset[0])
            pipeline.teacher_for = lambda *a, data=data, n=int(subset[1]), **k: data.subset(list(range(n)))
        started = time.perf_counter()
        out = args.work / name
        report = convert_drafter(source, TARGET, rank, vocab="draft", out=out, overwrite=True, progress=False, init=init,
                         distill_steps=cfg.steps, data_options=options, distill_config=cfg).report
        row = measure(str(out.resolve()))
        distilled = report["distill"]
        row.update(name=name, rank=rank, teacher=teacher, variant=variant, seconds=round(time.perf_counter() - started),
                   teacher_tokens=report["teacher"]["tokens"], held_out_kl=distilled["kl_after_per_step"])
        if original:
            row["rho"] = row["tau"] / original["tau"]
        record(row)
        if toward_start:
            start = args.work / f"{name}-start"
            convert_drafter(source, TARGET, rank, vocab="draft", out=start, overwrite=True, progress=False, init="whitened",
                    distill_steps=0, data_options=options, distill_config=cfg)
            for alpha in toward_start:
                mixed = interpolate_heads(out, start, alpha, args.work / f"{name}-toward{alpha:g}")
                row = {**measure(str(mixed.resolve())), "name": f"{name}-toward{alpha:g}", "alpha": alpha}
                if original:
                    row["rho"] = row["tau"] / original["tau"]
                record(row)
    return 0


HEAD_FACTORS = ("lm_head.weight", "lm_head_down.weight")


def interpolate_heads(final: Path, start: Path, alpha: float, out: Path) -> Path:
    """Copy conversion ``final`` to ``out`` with its head factors at ``start + alpha (final - start)`` (float32
    arithmetic, stored in the file's dtype). Refuses two conversions that differ outside the head: then they are
    not one run's start and end."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    ends = load_file(str(final / "model.safetensors"))
    starts = load_file(str(start / "model.safetensors"))
    if ends.keys() != starts.keys() or not all(torch.equal(ends[k], starts[k]) for k in ends if k not in HEAD_FACTORS):
        raise SystemExit(f"{final} and {start} differ outside the head factors")
    mixed = dict(ends)
    for k in HEAD_FACTORS:
        a, b = starts[k].float(), ends[k].float()
        mixed[k] = (a + alpha * (b - a)).to(ends[k].dtype)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(final, out)
    save_file(mixed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def only_factor(trainable_parameters, factor: str):
    """``train.trainable_parameters`` of a head-only run limited to one factor (``up``: W_up [V, r], ``down``:
    W_down [r, d]); the other stays at the whitened start (a regulariser: fewer free parameters)."""

    def params(drafter, train_backbone):
        chosen = [getattr(drafter.lm_head, factor)]
        trainable_parameters(drafter, train_backbone)  # sets requires_grad on the head
        other = drafter.lm_head.down if factor == "up" else drafter.lm_head.up
        other.requires_grad_(False)
        return chosen

    return params


def tied_up(train_drafter):
    """``train_drafter`` training ``W_up = U C`` with ``U`` an orthonormal basis of the source head's columns
    (``[V, d]``, fixed) and ``C`` (``[d, r]``) free: the logits stay in the source head's column space, which holds
    the whitened start exactly, and the head trains ``d r + r d`` weights instead of ``V r + r d``."""
    import torch

    from slimspec.convert.factorize import balance_factors

    class TiedUpHead(torch.nn.Module):
        def __init__(self, basis, up, down):
            super().__init__()
            self.register_buffer("basis", basis)
            self.coef = torch.nn.Parameter(basis.T @ up)
            self.down = torch.nn.Parameter(down.clone())
            err = float((basis @ self.coef.detach() - up).norm() / up.norm())
            print(f"[tied] W_up outside the source head's column space: {err:.2e}", flush=True)

        def forward(self, h):
            return torch.nn.functional.linear(torch.nn.functional.linear(h, self.down), self.weight_up)

        @property
        def weight_up(self):
            return self.basis @ self.coef

        @property
        def weight_down(self):
            return self.down

    def run(drafter, teacher, teacher_head, cfg, **kwargs):
        head = drafter.lm_head
        with torch.no_grad():
            up, down = balance_factors(head.up.float(), head.down.float())
            basis = torch.linalg.svd(teacher_head[:, :-1].float(), full_matrices=False)[0]
        drafter.lm_head = TiedUpHead(basis.to(up.device), up, down)
        return train_drafter(drafter, teacher, teacher_head, cfg, **kwargs)

    return run


def shrunk_covariance(covariance, alpha: float):
    """``activation_covariance`` shrunk toward the isotropic one: ``C + alpha * mean(diag C) * I`` (alpha -> inf:
    the plain SVD start; 0: the whitened start fitted to the calibration states alone)."""
    import torch

    def shrunk(features, *args, **kwargs):
        cov = covariance(features, *args, **kwargs)
        return cov + alpha * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype)

    return shrunk


def reverse_kl_when_training(fused_kl):
    """``full_vocab_kl``'s signature, but the training loss is the weighted mean of KL(q || p) (materialised
    logits, plain autograd); without gradients (the held-out KL) it stays the forward KL, so rows compare."""
    import torch

    def loss(student_hidden, w_down, w_up, teacher_hidden, teacher_head, *, weights=None, **kwargs):
        if not torch.is_grad_enabled():
            return fused_kl(student_hidden, w_down, w_up, teacher_hidden, teacher_head, weights=weights, **kwargs)
        with torch.no_grad():
            log_p = torch.log_softmax(teacher_hidden.float() @ teacher_head.float().T, -1)
        log_q = torch.log_softmax(student_hidden.float() @ w_down.float().T @ w_up.float().T, -1)
        kl = (log_q.exp() * (log_q - log_p.clamp(min=-1e4))).sum(-1)
        w = weights.float() if weights is not None else torch.ones_like(kl)
        return (w * kl).sum() / w.sum()

    return loss


def draft_labeler(drafter, teacher):
    """A function of teacher rows giving the draft-vocabulary id of the token after each (-1: not in the draft
    vocabulary, prompt text or past the sequence's end): the token the target wrote, the one a greedy verifier
    accepts. The id map and each token's sequence are built once here, not per training step."""
    import torch

    n = teacher.num_tokens
    rows = drafter.lm_head.weight_up.shape[0]
    targets = drafter.draft_to_target(torch.arange(rows))
    to_draft = torch.full((int(max(teacher.input_ids.max(), targets.max())) + 1,), -1, dtype=torch.long)
    to_draft[targets] = torch.arange(rows)
    seq = torch.searchsorted(teacher.starts, torch.arange(n), right=True) - 1

    def labels(teacher_index):
        nxt = (teacher_index + 1).clamp(max=n - 1)
        label = to_draft[teacher.input_ids[nxt]]
        ok = ((label >= 0) & teacher.loss_mask[nxt].bool() & (seq[nxt] == seq[teacher_index])
              & (teacher_index + 1 < n))
        return torch.where(ok, label, torch.full_like(label, -1))

    return labels


def focused(train_drafter, focus):
    """``train.train_drafter`` whose training rows weigh 1 where the source head's argmax is the token the
    target wrote next and ``focus`` (a float) elsewhere: a greedy verifier accepts a draft only there, so a head
    short of rank may spend it on those rows. ``focus = "soft"``: weight = the source's probability of that
    token. The held-out KL keeps its plain weights."""
    import torch

    import slimspec.distill.train as train

    features = train.student_features

    def run(drafter, teacher, teacher_head, cfg, **kwargs):
        def weighted(*args, all_positions=False, **kw):
            out = features(*args, all_positions=all_positions, **kw)
            if not all_positions:
                return out
            label = draft_labeler(drafter, teacher)(out.teacher_index)
            weight = torch.zeros_like(out.weight)
            head = teacher_head.float()
            for a in range(0, out.hidden.shape[0], 4096):
                h = out.hidden[a:a + 4096]
                logits = torch.cat([h, h.new_ones(*h.shape[:-1], 1)], -1) @ head.T
                lab = label[a:a + 4096]
                if focus == "soft":
                    p = torch.softmax(logits, -1).gather(-1, lab.clamp(min=0)[..., None])[..., 0]
                    w = torch.where(lab >= 0, p, torch.zeros_like(p))
                else:
                    w = (logits.argmax(-1) == lab).float()
                    w = w + float(focus) * (1 - w)
                weight[a:a + 4096] = w
            print(f"[focus] mean weight per TTT step {weight.mean(0).tolist()}", flush=True)
            return train.StudentFeatures(hidden=out.hidden, teacher_index=out.teacher_index, weight=weight)

        train.student_features = weighted
        try:
            return train_drafter(drafter, teacher, teacher_head, cfg, **kwargs)
        finally:
            train.student_features = features

    return run


def with_target_ce(kl_terms, alpha: float):
    """``train.kl_terms`` plus, while training, ``alpha * decay**i`` x the cross-entropy of TTT step i's logits
    on the token the target actually wrote next (answer tokens of the draft vocabulary, within the sequence)."""
    import torch

    import slimspec.distill.train as train

    cache: dict = {}

    def terms(drafter, hidden, teacher_index, weight, teacher, teacher_head, decay, global_weight=None, **kwargs):
        total, per_step = kl_terms(drafter, hidden, teacher_index, weight, teacher, teacher_head, decay,
                                   global_weight, **kwargs)
        if not torch.is_grad_enabled():
            return total, per_step
        if not cache:
            cache["labels"] = draft_labeler(drafter, teacher)
        down, up = train.head_factors(drafter)
        for i in range(hidden.shape[1]):
            label = cache["labels"](teacher_index[:, i])
            ok = label >= 0
            if bool(ok.any()):
                logits = hidden[ok, i].float() @ down.float().T @ up.float().T
                total = total + alpha * decay**i * torch.nn.functional.cross_entropy(logits, label[ok])
        return total, per_step

    return terms


def with_feature_noise(kl_terms, noise: dict):
    """``train.kl_terms`` on perturbed student states while training (augmentation: the student learns the source
    head on a neighbourhood of its calibration states, which a rank-short head otherwise fits too tightly).
    ``{"kind": "iso", "scale": s}``: h + s * rms(h) * N(0, I) per row; ``{"kind": "data", "scale": s}``:
    h + s * (h_a - h_b) with a, b random rows of the same batch (a perturbation shaped like the data)."""
    import torch

    kind, scale = noise.get("kind", "iso"), float(noise["scale"])
    if kind not in ("iso", "data"):
        raise SystemExit(f"noise kind must be 'iso' or 'data', got {kind!r}")
    generator = torch.Generator().manual_seed(int(noise.get("seed", 0)))

    def terms(drafter, hidden, *args, **kwargs):
        if torch.is_grad_enabled():
            if kind == "iso":
                rms = hidden.pow(2).mean(-1, keepdim=True).sqrt()
                hidden = hidden + scale * rms * torch.randn(hidden.shape, generator=generator, dtype=hidden.dtype)
            else:
                a = torch.randint(0, hidden.shape[0], (hidden.shape[0],), generator=generator)
                b = torch.randint(0, hidden.shape[0], (hidden.shape[0],), generator=generator)
                hidden = hidden + scale * (hidden[a] - hidden[b])
        return kl_terms(drafter, hidden, *args, **kwargs)

    return terms


if __name__ == "__main__":
    sys.exit(main())
