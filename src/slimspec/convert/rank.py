"""Parse ``--rank``: ``d/N``, an integer, or ``energy:F``."""

from __future__ import annotations

import re

import torch

from slimspec.errors import RankError


def energy_curve(squared_singular_values: torch.Tensor) -> torch.Tensor:
    """Cumulative share of squared singular values kept at rank 1..d."""
    total = float(squared_singular_values.sum())
    if total <= 0:
        return torch.ones_like(squared_singular_values)
    return squared_singular_values.cumsum(0) / total


def parse_rank(spec: str | int, hidden: int, squared_singular_values: torch.Tensor | None = None) -> int:
    """Resolve a rank spec against hidden size ``d``; 0 < r < d or RankError.

    ``energy:F`` needs the head's squared singular values (descending) and picks the smallest r
    keeping share F of their sum.
    """
    text = str(spec).strip().replace(" ", "")
    if re.fullmatch(r"\d+", text):
        rank = int(text)
    elif m := re.fullmatch(r"d/(\d+(?:\.\d+)?)", text):
        divisor = float(m.group(1))
        if divisor <= 0:
            raise RankError(f"rank {spec!r}: divisor must be positive")
        rank = int(round(hidden / divisor))
    elif m := re.fullmatch(r"energy:(\d*\.?\d+)", text):
        share = float(m.group(1))
        if not 0.0 < share < 1.0:
            raise RankError(f"rank {spec!r}: energy share must be between 0 and 1 (exclusive)")
        if squared_singular_values is None:
            raise RankError(f"rank {spec!r} needs the head's singular values")
        curve = energy_curve(squared_singular_values)
        rank = int(torch.searchsorted(curve, torch.tensor(share, dtype=curve.dtype)).item()) + 1
    else:
        raise RankError(f"cannot parse rank {spec!r}: use d/N (e.g. d/8), an integer, or energy:F (e.g. energy:0.9); "
                        "convert also takes auto")
    if not 0 < rank < hidden:
        raise RankError(f"rank {spec!r} gives r={rank}, but it must satisfy 0 < r < d = {hidden}")
    return rank
