"""Shortlist helpers of the screen-and-rescore head shared by its torch and Triton paths
(``slimspec.kernels.screen``): top-K selection with the lower-id tie rule, the hot ids, the exact argmax."""

from __future__ import annotations

import torch


def with_hot(top_ids: torch.Tensor, hot_ids: torch.Tensor | None) -> torch.Tensor:
    """The shortlist [B, K + N]: each row's top-K ids, then the hot ids."""
    if hot_ids is None or hot_ids.numel() == 0:
        return top_ids
    return torch.cat([top_ids, hot_ids.to(top_ids.device).expand(top_ids.shape[0], -1)], dim=1)


def shortlist_argmax(exact: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the id with the largest exact value in each row, the lower id among equal values."""
    best = exact.max(dim=-1, keepdim=True).values
    sentinel = torch.iinfo(torch.int64).max
    return torch.where(exact == best, ids, torch.full_like(ids, sentinel)).min(dim=-1).values


def topk_lower_ids(screen: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [B, k]: ids of each row's k largest values, equal values at the k-th place taken lowest id first.

    ``torch.topk`` of k + 1 (a radix select on CUDA; a partial sort on the CPU, which measured faster there than a
    sampled threshold followed by a top-k of the ~2k values that pass it) does the work: where the (k+1)-th largest
    value is below the k-th, dropping it leaves the top k. Where they are equal, the picks of the tied rows are
    redone by threshold: every value above the k-th largest, then the lowest ids among those equal to it.
    """
    batch, vocab = screen.shape
    if k >= vocab:
        return torch.arange(vocab, device=screen.device).expand(batch, vocab)
    values, ids = torch.topk(screen, k + 1, dim=-1, sorted=False)
    next_value, next_at = values.min(dim=-1, keepdim=True)  # the (k+1)-th largest
    keep = torch.ones_like(values, dtype=torch.bool).scatter_(1, next_at, False)
    values, ids = values[keep].view(batch, k), ids[keep].view(batch, k)
    kth = values.min(dim=-1, keepdim=True).values
    ties = (kth == next_value).squeeze(1)
    if not bool(ties.any()):
        return ids
    rows = ties.nonzero().flatten()
    part, threshold = screen[rows], kth[rows]
    equal = part == threshold
    room = k - (part > threshold).sum(dim=-1, keepdim=True)
    chosen = (part > threshold) | (equal & (equal.cumsum(dim=-1) <= room))
    ids = ids.clone()
    ids[rows] = chosen.nonzero()[:, 1].view(len(rows), k)
    return ids
