"""Plain-torch low-rank head ops: the reference for the Triton kernels and the fallback on any device.

All ops compute ``z = h @ w_down.T`` ([B, r]) and ``logits = z @ w_up.T`` ([B, V]) in float32 (inputs upcast,
float32 accumulation), whatever the input dtype. Selections (argmax, top-k) are taken on those float32 logits,
before any rounding to ``h.dtype``, exactly like the Triton kernels do.
"""

from __future__ import annotations

import torch

# Rows of w_up upcast to float32 at a time: bounds the temporary copy of the head (32768 x r x 4 bytes).
_CHUNK_V = 32768


def lowrank_logits_fp32(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``(h @ w_down.T) @ w_up.T`` for h [B, d], w_down [r, d], w_up [V, r] -> [B, V]."""
    z = h.float() @ w_down.float().T
    vocab = w_up.shape[0]
    if w_up.dtype == torch.float32 or vocab <= _CHUNK_V:
        return z @ w_up.float().T
    out = torch.empty(z.shape[0], vocab, dtype=torch.float32, device=z.device)
    for start in range(0, vocab, _CHUNK_V):
        stop = min(start + _CHUNK_V, vocab)
        out[:, start:stop] = z @ w_up[start:stop].float().T
    return out


def lowrank_logits(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] in ``h.dtype`` (float32 accumulation)."""
    return lowrank_logits_fp32(h, w_down, w_up).to(h.dtype)


def lowrank_argmax(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """int64 [B]: ``torch.argmax`` of the float32 logits (lowest index among ties, first NaN wins)."""
    return torch.argmax(lowrank_logits_fp32(h, w_down, w_up), dim=-1)


def lowrank_topk(
    h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values in ``h.dtype``, int64 indices), largest first; equal values in index order, NaN largest."""
    logits = lowrank_logits_fp32(h, w_down, w_up)
    values, indices = torch.sort(logits, dim=-1, descending=True, stable=True)
    return values[:, :k].to(h.dtype), indices[:, :k]
