"""Vocabulary-trimming baselines: keep the N most frequent draft tokens of a drafter's head.

VocabTrim-style ranks tokens by frequency in the target's own generations; FR-Spec-style by frequency in
a corpus of training prompts. Both write an EAGLE-layout drafter whose head keeps N rows (d2t remapped).
"""

from __future__ import annotations

from pathlib import Path

import torch

from slimspec.checkpoint.drafter import DrafterCheckpoint
from slimspec.checkpoint.writer import atomic_folder, eagle_config_json, write_json
from slimspec.errors import SlimSpecError


def token_counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(token_ids.long().flatten(), minlength=vocab)[:vocab].double()


def trimmed_ids(ckpt: DrafterCheckpoint, counts: torch.Tensor, size: int) -> torch.Tensor:
    """Draft ids (rows of the drafter's head) of its ``size`` most frequent target tokens, sorted by target id."""
    targets = ckpt.draft_to_target_ids()
    if not 0 < size <= targets.numel():
        raise SlimSpecError(f"trim size {size} must be in 1..{targets.numel()}")
    score = counts[targets] - torch.arange(targets.numel(), dtype=torch.float64) * 1e-9  # ties: lower draft id
    keep = torch.topk(score, size).indices
    return keep[torch.argsort(targets[keep])]


def write_trimmed(ckpt: DrafterCheckpoint, keep: torch.Tensor, out: Path) -> Path:
    """An EAGLE-layout copy of ``ckpt`` whose head keeps rows ``keep`` (draft ids), with d2t/t2d for them."""
    if not ckpt.has_head or ckpt.is_lowrank:
        raise SlimSpecError("trimming needs a drafter with a full-rank head of its own")
    targets = ckpt.draft_to_target_ids()[keep]
    tensors = {k: v for k, v in ckpt.tensors.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    tensors["lm_head.weight"] = ckpt.tensors["lm_head.weight"][keep].clone()
    tensors["d2t"] = targets - torch.arange(keep.numel())
    t2d = torch.zeros(ckpt.config.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    tensors["t2d"] = t2d
    config = eagle_config_json(ckpt.config, int(keep.numel()), ckpt.aux_convention)
    with atomic_folder(Path(out), overwrite=True) as tmp:
        torch.save({k: v.contiguous().clone() for k, v in tensors.items()}, tmp / "pytorch_model.bin")
        write_json(tmp / "config.json", config)
    return Path(out)
