"""The head transform: the head to factorise (the drafter's rows, stitched with the target's), checks of the
inputs and the output, the low-rank tensors, and the reloaded output's verification."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import safetensors
import torch

from slimspec import __version__
from slimspec.checkpoint.drafter import LOWRANK_DOWN, SCREEN_EXACT, SCREEN_HOT_IDS, DrafterCheckpoint, load_drafter
from slimspec.checkpoint.files import sha256_file, weight_map
from slimspec.checkpoint.target import TargetHead
from slimspec.errors import CheckpointError, OptionError, SlimSpecError

VocabMode = Literal["full", "draft"]
NOT_CARRIED = ("lm_head.weight", LOWRANK_DOWN, SCREEN_EXACT, SCREEN_HOT_IDS, "d2t", "t2d")
STITCH_ROWS = 4096
"""Drafter rows made float32 at a time while they are stitched into the target's head (``--vocab full``): at most
``4096*d*4`` bytes beside the head (128 MiB at d = 8192) rather than a float32 copy of all of them."""


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
            raise OptionError("the drafter has no LM head of its own: {target} is needed to factorise the target's",
                              "target")
        ids = ckpt.draft_to_target_ids()
        rows = head.to(torch.float32, copy=True) if head is not None else target.weight[ids].float()
        return ckpt.rows_in_target_order(rows), head.shape[0] if head is not None else 0
    if target is None:
        raise OptionError("{vocab} full needs {target} (rows outside the draft vocab come from the target's head)",
                          "vocab", "target")
    if cfg.hidden_size != target.hidden_size:
        raise OptionError(
            f"{{vocab}} full needs drafter hidden ({cfg.hidden_size}) == target hidden ({target.hidden_size}); "
            "use {vocab} draft to keep the draft vocabulary", "vocab")
    weight = target.weight.to(torch.float32, copy=True)  # one float32 copy (.float().clone() made two at once)
    if head is None:
        return weight, 0
    ids = ckpt.draft_to_target_ids()
    if stitch == "zero":
        weight.zero_()
    elif stitch == "scaled":
        weight *= float(_row_norms(head).mean() / _row_norms(weight, ids).mean().clamp_min(1e-12))
    elif stitch != "target":
        raise OptionError(f"{{stitch}} must be target, zero or scaled; got {stitch!r}", "stitch")
    for a in range(0, head.shape[0], STITCH_ROWS):  # the drafter's rows made float32 a block at a time
        weight[ids[a:a + STITCH_ROWS]] = head[a:a + STITCH_ROWS].float()
    return weight, head.shape[0]


def _row_norms(matrix: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 L2 norm of each row of ``matrix`` (of rows ``ids``), taken :data:`STITCH_ROWS` rows at a time:
    the same values as ``matrix[ids].float().norm(dim=1)`` without a float32 copy of every row."""
    count = matrix.shape[0] if ids is None else ids.numel()
    return torch.cat([(matrix[a:a + STITCH_ROWS] if ids is None else matrix[ids[a:a + STITCH_ROWS]]).float()
                      .norm(dim=1) for a in range(0, count, STITCH_ROWS)])


def check_finite_head(weight: torch.Tensor, rows_from_drafter: int, vocab: VocabMode) -> None:
    """A head holding inf or NaN has no SVD (LAPACK fails deep inside, "Internal Error"): name the row instead."""
    bad = torch.cat([~torch.isfinite(weight[a:a + 4096]).all(dim=1) for a in range(0, weight.shape[0], 4096)])
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
            raise OptionError(f"{{out}} {out} is the drafter's own folder: write the conversion elsewhere"
                              if model is inputs[0] else f"{{out}} {out} is the folder of {model}: write elsewhere",
                              "out")
        if where in path.parents:
            raise OptionError(f"{{out}} {out} contains {model}: replacing it would delete that model; "
                              "write the conversion elsewhere", "out")


def portable(model: str) -> str:
    """A model argument as later commands must resolve it: local folders absolute (distill or eval may run from
    another folder), Hub ids and ``embedded:`` names as given."""
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else model


def versions() -> dict[str, str]:
    """The versions of slimspec and what it ran on, as the report records them."""
    found = {"slimspec": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
                "python": platform.python_version()}
    try:
        import transformers

        found["transformers"] = transformers.__version__
    except ImportError:
        pass
    return found


def recorded_target(target: str | None, ckpt: DrafterCheckpoint) -> str | None:
    """The target the output records for later commands (eval, distill): the one given, else the one the source
    names (its verifier or base model, or what a SlimSpec source recorded), portable as :func:`portable` makes it."""
    named = target if target is not None else ckpt.named_target
    return portable(str(named)) if named is not None else None


def head_file_hash(target: TargetHead) -> dict[str, str] | None:
    """The file holding the target's head tensor and its sha256 (None if no weight map names it)."""
    path = weight_map(target.source).get(target.tensor_name)
    return {path.name: sha256_file(path)} if path is not None else None


def lowrank_tensors(ckpt: DrafterCheckpoint, w_up: torch.Tensor, w_down: torch.Tensor, d2t: torch.Tensor | None,
                    dtype: torch.dtype, exact: torch.Tensor | None = None, hot_ids: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
    """The output's tensors: the source's (float ones in ``dtype``) with its head replaced by the pair (and, for a
    screen-and-rescore head, the ``exact`` rows and the ``hot_ids``)."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt.tensors.items()
               if k not in NOT_CARRIED}
    tensors["lm_head.weight"] = w_up.to(dtype)
    tensors[LOWRANK_DOWN] = w_down.to(dtype)
    if exact is not None:
        tensors[SCREEN_EXACT] = exact.to(dtype)
        if hot_ids is not None and hot_ids.numel():
            tensors[SCREEN_HOT_IDS] = hot_ids.long()
    if d2t is not None:
        tensors["d2t"] = d2t
    return tensors


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
