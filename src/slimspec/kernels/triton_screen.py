"""Triton path of the screen-and-rescore head (see ``slimspec.kernels.screen`` for the semantics).

1. the screen: ``triton_lowrank.lowrank_logits`` in float32 ([B, V]; the two-level logits start from it);
2. selection: ``shortlist.topk_lower_ids`` (``torch.topk``: a radix select on CUDA, no sort; a threshold pass only for
   rows with ties at the K-th place);
3. ``_rescore_kernel``: one gathered kernel, grid (shortlist blocks, B). Each program loads its ``BLOCK_M`` ids,
   streams their exact rows in ``BLOCK_D`` chunks (the rows are read where they lie, never copied), accumulates the
   dot products with h in float32, writes them over the screen in the logits, and keeps the block's (max, lowest
   id among equal maxima);
4. the per-block winners reduce in torch ([B, cdiv(K + N, BLOCK_M)] values: a few dozen).

Interpreter: the kernel only converts 16-bit values to float32 and computes in float32 (Triton 3.9's interpreter
mis-evaluates bf16 arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimspec.kernels import triton_lowrank
from slimspec.kernels.shortlist import shortlist_argmax, topk_lower_ids, with_hot

BLOCK_M = 16  # shortlist entries per program
BLOCK_D = 256  # hidden chunk per step


@triton.jit
def _rescore_kernel(h_ptr, w_ptr, ids_ptr, logits_ptr, pmax_ptr, pid_ptr, M, D,
                    stride_hb, stride_hd, stride_wv, stride_wd, stride_ib, stride_lb, stride_pb,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """exact[b, m] = h[b] . w[ids[b, m]] written to logits[b, ids[b, m]]; (max, lowest id) of the block to
    pmax/pid[b, block]. Grid (cdiv(M, BLOCK_M), B)."""
    row = tl.program_id(1)
    block = tl.program_id(0)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ids = tl.load(ids_ptr + row * stride_ib + offs_m, mask=mask_m, other=0)
    w_rows = w_ptr + ids.to(tl.int64)[:, None] * stride_wv
    h_row = h_ptr + row.to(tl.int64) * stride_hb
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        offs_d = start + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = tl.load(h_row + offs_d * stride_hd, mask=mask_d, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_d[None, :] * stride_wd, mask=mask_m[:, None] & mask_d[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * h[None, :], axis=1)
    tl.store(logits_ptr + row.to(tl.int64) * stride_lb + ids, acc, mask=mask_m)
    values = tl.where(mask_m, acc, float("-inf"))
    best = tl.max(values, axis=0)
    winner = tl.min(tl.where(mask_m & (values == best), ids, 9223372036854775807), axis=0)
    tl.store(pmax_ptr + row * stride_pb + block, best)
    tl.store(pid_ptr + row * stride_pb + block, winner)


def rescore(hidden: torch.Tensor, w_exact: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, *,
            block_m: int = BLOCK_M, block_d: int = BLOCK_D) -> torch.Tensor:
    """Write the exact logits of ``ids`` [B, M] into ``logits`` (float32 [B, V], in place); int64 [B] winners."""
    batch, width = ids.shape
    blocks = triton.cdiv(width, block_m)
    pmax = torch.empty(batch, blocks, dtype=torch.float32, device=hidden.device)
    pid = torch.empty(batch, blocks, dtype=torch.int64, device=hidden.device)
    ids = ids.contiguous()
    _rescore_kernel[(blocks, batch)](hidden, w_exact, ids, logits, pmax, pid, width, hidden.shape[1],
                                     hidden.stride(0), hidden.stride(1), w_exact.stride(0), w_exact.stride(1),
                                     ids.stride(0), logits.stride(0), pmax.stride(0),
                                     BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    return shortlist_argmax(pmax, pid)


def screen_rescore(hidden: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, w_exact: torch.Tensor,
                   shortlist: int, hot_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, two-level logits [B, V] in hidden.dtype); inputs already validated."""
    logits = triton_lowrank.lowrank_logits(hidden, w_down, w_up, out_dtype=torch.float32)
    if hidden.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=hidden.device), logits.to(hidden.dtype)
    ids = with_hot(topk_lower_ids(logits, shortlist), hot_ids)
    tokens = rescore(hidden, w_exact, ids, logits)
    return tokens, logits.to(hidden.dtype)
