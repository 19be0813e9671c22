"""The convert pipeline: drafter + target -> SlimSpec low-rank drafter folder."""

from __future__ import annotations

import platform
import time
import warnings
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch

from slimspec.checkpoint.drafter import LOWRANK_DOWN, DrafterCheckpoint, load_drafter
from slimspec.checkpoint.files import sha256_file
from slimspec.checkpoint.target import TargetHead, load_target_head
from slimspec.checkpoint.writer import (
    atomic_folder,
    check_output_free,
    drafter_config_json,
    model_card,
    save_tensors,
    write_json,
)
from slimspec.convert.factorize import (
    centered_gram,
    factorize,
    gram_matrix,
    relative_error,
    squared_singular_values,
)
from slimspec.convert.rank import energy_curve, parse_rank
from slimspec.errors import CheckpointError, SlimSpecError, SlimSpecWarning
from slimspec.progress import Stages

VocabMode = Literal["full", "draft"]
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
NOT_CARRIED = ("lm_head.weight", LOWRANK_DOWN, "d2t", "t2d")


@dataclass
class ConvertResult:
    """Where the converted drafter went and what was measured on the way."""

    out: Path
    rank: int
    report: dict[str, Any] = field(default_factory=dict)


def model_name(spec: str) -> str:
    """Short name of a model argument, for default output folders: last path or id component."""
    return spec.rstrip("/").split(":")[-1].split("/")[-1] or "drafter"


def validate_against_target(ckpt: DrafterCheckpoint, target: TargetHead) -> None:
    """Refuse a drafter whose shapes or vocabulary disagree with the target."""
    cfg = ckpt.config
    if cfg.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"vocab size mismatch: the drafter is for a vocabulary of {cfg.vocab_size} tokens, "
            f"the target's head has {target.vocab_size}"
        )
    t2d = ckpt.tensors.get("t2d")
    if t2d is not None and t2d.numel() != target.vocab_size:
        raise CheckpointError(
            f"vocab size mismatch: t2d covers {t2d.numel()} tokens, the target has {target.vocab_size}"
        )
    if cfg.target_hidden_size != target.hidden_size:
        raise CheckpointError(
            f"shape mismatch: the drafter's fc expects target hidden states of width {cfg.target_hidden_size}, "
            f"the target's hidden size is {target.hidden_size}"
        )


def stitched_head(ckpt: DrafterCheckpoint, target: TargetHead | None, vocab: VocabMode, stitch: str = "target"
                  ) -> tuple[torch.Tensor, int]:
    """The float32 head to factorise and how many of its rows came from the drafter's own head.

    ``full``: one row per target token; tokens of the draft vocab take the drafter's rows (mapped
    through d2t), the rest the target's head. ``draft``: the drafter's own head (or the target's rows
    for its draft vocab when it shares the target's head).
    """
    head = ckpt.head_weight()
    cfg = ckpt.config
    if vocab == "draft":
        if head is None and target is None:
            raise SlimSpecError("the drafter has no LM head of its own: --target is needed to factorise the target's")
        ids = ckpt.draft_to_target_ids()
        rows = head.float().clone() if head is not None else target.weight[ids].float().clone()
        return ckpt.rows_in_target_order(rows), head.shape[0] if head is not None else 0
    if target is None:
        raise SlimSpecError("--vocab full needs --target (rows outside the draft vocab come from the target's head)")
    if cfg.hidden_size != target.hidden_size:
        raise SlimSpecError(
            f"--vocab full needs drafter hidden ({cfg.hidden_size}) == target hidden ({target.hidden_size}); "
            "use --vocab draft to keep the draft vocabulary"
        )
    weight = target.weight.float().clone()
    if head is None:
        return weight, 0
    ids = ckpt.draft_to_target_ids()
    if stitch == "zero":
        weight.zero_()
    elif stitch == "scaled":
        weight *= float(head.float().norm(dim=1).mean() / weight[ids].norm(dim=1).mean().clamp_min(1e-12))
    elif stitch != "target":
        raise SlimSpecError(f"--stitch must be target, zero or scaled; got {stitch!r}")
    weight[ids] = head.float()
    return weight, head.shape[0]


def check_finite_head(weight: torch.Tensor, rows_from_drafter: int, vocab: VocabMode) -> None:
    """A head holding inf or NaN has no SVD (LAPACK fails deep inside, "Internal Error"): name the row instead."""
    bad = ~torch.isfinite(weight).all(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        whose = "the drafter's head" if vocab == "draft" or rows_from_drafter == weight.shape[0] else \
            "the stitched head (drafter and target rows)"
        raise CheckpointError(f"{whose} holds inf or NaN ({int(bad.sum())} row(s), the first at token {row}): "
                              "such a head cannot be factorised")


def check_not_the_source(out: Path, *inputs: Path | str | None) -> None:
    """Refuse an output folder that is, or contains, an input model's folder (the drafter, the target): writing
    there (with ``--overwrite``) would replace or delete that model."""
    where = Path(out).resolve()
    for model in inputs:
        if model is None or not Path(model).exists():
            continue
        path = Path(model).resolve()
        if where == path:
            raise SlimSpecError(f"--out {out} is the drafter's own folder: write the conversion elsewhere"
                                if model is inputs[0] else f"--out {out} is the folder of {model}: write elsewhere")
        if where in path.parents:
            raise SlimSpecError(f"--out {out} contains {model}: replacing it would delete that model; "
                                "write the conversion elsewhere")


def portable(model: str) -> str:
    """A model argument as later commands must resolve it: local folders absolute (distill or eval may run from
    another folder), Hub ids and ``embedded:`` names as given."""
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else model


def _versions() -> dict[str, str]:
    import safetensors

    from slimspec import __version__

    versions = {"slimspec": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
                "python": platform.python_version()}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    return versions


def _check_rank_is_worth_it(r: int, rows: int, hidden: int, held: int | None) -> None:
    """Refuse a rank at or above ``held``, the rank of a head that is already a low-rank pair (a SlimSpec output
    converted again: a larger pair only adds zero directions); warn when the pair holds more weights than the full
    head."""
    if held is not None and r >= held:
        raise SlimSpecError(f"the head is already a rank-{held} pair: a rank-{r} pair adds only zero directions; "
                            f"pick r < {held}")
    if r * (rows + hidden) >= rows * hidden:
        warnings.warn(f"rank {r}: the pair (V x r + r x d = {r * (rows + hidden):,} weights) is no smaller than the "
                      f"full {rows} x {hidden} head ({rows * hidden:,}); pick r < {rows * hidden // (rows + hidden)}",
                      SlimSpecWarning, stacklevel=3)


def convert(
    drafter: str | Path,
    target: str | Path | None = None,
    rank: str | int = "d/8",
    *,
    vocab: VocabMode = "full",
    out: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    revision: str | None = None,
    target_revision: str | None = None,
    progress: bool = True,
    verify_samples: int = 16,
    stitch: str = "target",
    init: str = "auto",
    distill_steps: int = 0,
    data: str | list[str] | None = None,
    data_options: Any = None,
    distill_config: Any = None,
    extra_report: dict[str, Any] | None = None,
) -> ConvertResult:
    """Convert an EAGLE-3 drafter (Hub id, folder or ``embedded:`` name) to a SlimSpec low-rank head.

    ``stitch`` (``--vocab full``): rows outside the draft vocab from the target's head (``target``),
    zeros (``zero``), or the target's rows rescaled to the drafter's mean row norm (``scaled``).
    ``init``: ``svd`` (Eckart-Young on the head), ``whitened`` (activation-aware, from calibration data), or
    ``auto`` (default): whitened when distilling (it starts at about half the KL, BENCHMARKS.md), else svd.
    ``distill_steps`` > 0 then distils the pair against the target under full-vocabulary KL
    (``data``/``data_options``/``distill_config`` as for :func:`slimspec.distill`).
    ``revision`` pins the drafter's Hub revision, ``target_revision`` the target's. Without ``target``, a
    conversion that needs one (``--vocab full``, a whitened start, distillation) takes the target the drafter
    names (embedded drafters: the embedded target).
    Returns the output folder, the resolved rank and the report also written to ``slimspec.json``.
    """
    from slimspec import embedded
    from slimspec.hub import resolve_model

    if vocab not in ("full", "draft"):
        raise SlimSpecError(f"--vocab must be 'full' or 'draft', got {vocab!r}")
    if init not in ("auto", "svd", "whitened"):  # before any download or teacher data
        raise SlimSpecError(f"--init must be auto, svd or whitened; got {init!r}")
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPES:
            raise SlimSpecError(f"--dtype must be one of bf16, fp16, fp32; got {dtype!r}")
        dtype = DTYPES[dtype.lower()]
    if out is not None:
        check_output_free(Path(out), overwrite)
    stages = Stages(progress)
    started = time.perf_counter()
    drafter = str(drafter)
    with stages.stage("load_drafter", f"reading drafter {drafter}"):
        drafter_path = resolve_model(drafter, "drafter", revision)
        ckpt = load_drafter(drafter_path)
    if out is not None:
        check_not_the_source(Path(out), drafter_path)
    ckpt.warn_unknown_dropped(drafter)
    if init == "whitened" or distill_steps > 0:  # both build the PyTorch drafter: refuse one it cannot build now
        from slimspec.model import check_buildable

        check_buildable(ckpt.config)
    if target is None and embedded.is_embedded(drafter):
        target = embedded.EMBEDDED_TARGET
    if target is None and (vocab == "full" or init == "whitened" or distill_steps > 0 or not ckpt.has_head):
        target = ckpt.named_target
        if target is not None:
            stages.say(f"target {target} (named by the drafter; --target overrides)")
    if target_revision is None and target is not None:  # a SlimSpec source's pinned target revision stays pinned
        target_revision = ckpt.target_revision_for(str(target))
    target_head = None
    if target is not None:
        target = str(target)
        with stages.stage("load_target", f"reading target head {target}"):
            target_path = resolve_model(target, "target", target_revision)
            if out is not None:
                check_not_the_source(Path(out), drafter_path, target_path)
            target_head = load_target_head(target_path)
        validate_against_target(ckpt, target_head)
    cfg = ckpt.config
    stages.say(f"layout {ckpt.layout}: hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size} "
               f"of {cfg.vocab_size}, head {'low-rank' if ckpt.is_lowrank else 'own' if ckpt.has_head else 'shared'}")

    weight, rows_from_drafter = stitched_head(ckpt, target_head, vocab, stitch)
    check_finite_head(weight, rows_from_drafter, vocab)
    hidden = weight.shape[1]
    needs_spectrum = str(rank).strip().startswith("energy:")
    r = None if needs_spectrum else parse_rank(rank, hidden)
    if out is None and r is not None:
        out = Path(f"{model_name(drafter)}-slimspec-r{r}")
        check_output_free(out, overwrite)
        check_not_the_source(out, drafter_path, target_path if target is not None else None)
    with stages.stage("gram", f"Gram matrix of the {weight.shape[0]}x{hidden} head"):
        gram = gram_matrix(weight)
    with stages.stage("spectrum", "singular values"):
        s2 = squared_singular_values(gram)
        s2_centered = squared_singular_values(centered_gram(weight, gram))
    if r is None:
        r = parse_rank(rank, hidden, s2)
        if out is None:
            out = Path(f"{model_name(drafter)}-slimspec-r{r}")
        check_output_free(Path(out), overwrite)
    out = Path(out)
    source_rank = ckpt.tensors[LOWRANK_DOWN].shape[0] if ckpt.is_lowrank else None  # a SlimSpec output again
    # its head's rank, unless target rows were stitched beside its rows
    _check_rank_is_worth_it(r, weight.shape[0], hidden, source_rank if rows_from_drafter == weight.shape[0] else None)
    with stages.stage("factorize", f"rank-{r} factors"):
        w_up, w_down = factorize(weight, r, gram=gram)
    with stages.stage("error", "reconstruction error"):
        rel_err = relative_error(weight, w_up, w_down)
    d2t_out = None
    if vocab == "draft" and weight.shape[0] != cfg.vocab_size:
        d2t_out = (ckpt.draft_to_target_ids() - torch.arange(weight.shape[0])).long()
    distill_report = None
    if init == "auto":
        init = "whitened" if distill_steps > 0 else "svd"
    if init != "svd" or distill_steps > 0:
        from slimspec.distill.pipeline import DataOptions, init_and_distill, load_target_parts
        from slimspec.distill.train import DistillConfig

        if target is None:
            raise SlimSpecError("--init whitened and --distill-steps need --target")
        options = data_options or DataOptions()
        if data is not None:
            options.data = data
        dcfg = distill_config or DistillConfig()
        dcfg.steps = distill_steps
        with stages.stage("distill", f"calibration ({init} init) and {distill_steps} distillation steps"):
            w_up, w_down, distill_report = init_and_distill(
                ckpt, weight, r, w_up, w_down, d2t_out, load_target_parts(target, target_revision), options, dcfg, init,
                progress)
    svd_err = rel_err
    if distill_report is not None:  # the written factors, not the SVD start they replaced
        rel_err = relative_error(weight, w_up.float(), w_down.float())
    energy, energy_centered = (float(energy_curve(spectrum)[r - 1]) for spectrum in (s2, s2_centered))
    source_rows = ckpt.head_weight().shape[0] if ckpt.has_head else weight.shape[0]
    out_dtype = dtype or ckpt.dtype
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        out_dtype = torch.float32
    head_vocab = weight.shape[0]

    tensors = {k: v.to(out_dtype) if v.is_floating_point() else v for k, v in ckpt.tensors.items()
               if k not in NOT_CARRIED}
    tensors["lm_head.weight"] = w_up.to(out_dtype)
    tensors[LOWRANK_DOWN] = w_down.to(out_dtype)
    if d2t_out is not None:
        tensors["d2t"] = d2t_out

    report: dict[str, Any] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {
            "drafter": drafter,
            "drafter_layout": ckpt.layout,
            "drafter_files": ckpt.file_hashes(),
            "dropped_tensors": ckpt.dropped,
            "target": target,
            "target_head_tensor": target_head.tensor_name if target_head else None,
            "target_head_file": (_head_file_hash(target_head) if target_head else None),
        },
        "rank": r,
        "rank_spec": str(rank),
        "vocab_mode": vocab,
        "head_vocab": head_vocab,
        "draft_vocab_size": cfg.draft_vocab_size,
        "vocab_size": cfg.vocab_size,
        "hidden_size": hidden,
        "rows_from_drafter": rows_from_drafter,
        "rows_from_target": head_vocab - rows_from_drafter,
        "energy_kept": energy,
        "energy_kept_centered": energy_centered,  # the rows' mean removed: the part softmax sees
        "relative_frobenius_error": rel_err,
        "svd_relative_frobenius_error": svd_err,
        "head_params_source": source_rows * hidden if source_rank is None else source_rank * (source_rows + hidden),
        "head_rows_source": source_rows,
        "head_params": r * hidden + head_vocab * r,
        "head_flop_ratio": (r * hidden + head_vocab * r) / (source_rows * hidden),
        "dtype": str(out_dtype).removeprefix("torch."),
        "stitch": stitch,
        "init": init,
        "versions": _versions(),
    }
    if distill_report is not None:
        report.update(distill_report)
    report.update(extra_report or {})
    meta = {"version": report["versions"]["slimspec"], "vocab_mode": vocab, "source_drafter": portable(drafter),
            "source_layout": ckpt.layout, "aux_convention": ckpt.aux_convention,
            "target": _recorded_target(target, ckpt)}
    if revision:
        meta["source_revision"] = revision
    if target_revision:
        meta["target_revision"] = target_revision
    config = drafter_config_json(cfg, rank=r, head_vocab=head_vocab, dtype=out_dtype, slimspec_meta=meta)

    with atomic_folder(out, overwrite) as tmp:
        with stages.stage("write", f"writing {out}"):
            save_tensors(tmp / "model.safetensors", tensors)
            write_json(tmp / "config.json", config)
            (tmp / "README.md").write_text(model_card(
                drafter_id=drafter, target_id=target or ckpt.named_target or "TARGET", rank=r, hidden=hidden,
                report=report, out_name=out.name, parallel=cfg.parallel_token_id is not None))
        with stages.stage("verify", "reloading and checking logits"):
            report["verification"] = verify_folder(tmp, tensors, weight, samples=verify_samples)
        report["timings"] = {**{k: round(v, 3) for k, v in stages.timings.items()},
                             "total": round(time.perf_counter() - started, 3)}
        write_json(tmp / "slimspec.json", report)
    stages.say(f"wrote {out} (rank {r}, energy kept {energy:.4f}, head FLOP ratio {report['head_flop_ratio']:.3f})")
    return ConvertResult(out=out, rank=r, report=report)


def _recorded_target(target: str | None, ckpt: DrafterCheckpoint) -> str | None:
    """The target the output records for later commands (eval, distill): the one given, else the one the source
    names (its verifier or base model, or what a SlimSpec source recorded), portable as :func:`portable` makes it."""
    named = target if target is not None else ckpt.named_target
    return portable(str(named)) if named is not None else None


def _head_file_hash(target: TargetHead) -> dict[str, str] | None:
    from slimspec.checkpoint.files import weight_map

    path = weight_map(target.source).get(target.tensor_name)
    return {path.name: sha256_file(path)} if path is not None else None


def verify_folder(folder: Path, tensors: dict[str, torch.Tensor], weight: torch.Tensor, samples: int) -> dict:
    """Reload ``folder`` and check its factors give the in-memory logits on random hidden states."""
    reloaded = load_drafter(folder)
    for name, tensor in tensors.items():
        if name not in reloaded.tensors or not torch.equal(reloaded.tensors[name], tensor):
            raise SlimSpecError(f"verification failed: {name} did not survive the round trip")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(samples, weight.shape[1], generator=gen)
    up, down = tensors["lm_head.weight"].float(), tensors[LOWRANK_DOWN].float()
    expected = hidden @ down.T @ up.T
    got = hidden @ reloaded.tensors[LOWRANK_DOWN].float().T @ reloaded.tensors["lm_head.weight"].float().T
    diff = float((expected - got).abs().max())
    # Tensors are bit-identical (checked above); BLAS may still round differently on other alignments.
    if not diff <= 1e-5 * max(float(expected.abs().max()), 1e-30):
        raise SlimSpecError(f"verification failed: reloaded logits differ by {diff}")
    full = hidden @ weight.T
    rel = float((full - expected).norm() / full.norm())
    agree = float((full.argmax(-1) == expected.argmax(-1)).float().mean())
    return {"samples": samples, "max_abs_reload_diff": diff, "relative_logit_error_vs_full": rel,
            "argmax_agreement_vs_full": agree}
