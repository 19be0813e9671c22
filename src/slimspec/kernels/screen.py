"""Screen-and-rescore LM head: a low-rank pair screens every token, the exact rows of a shortlist rescore it.

For hidden states h [B, d], a pair ``w_down [r, d]``, ``w_up [V, r]`` and the exact head ``w_exact [V, d]``:

- screen = (h @ w_down.T) @ w_up.T                     [B, V], float32 accumulation
- shortlist S = the ``shortlist`` (K) largest screen values of each row, then ``hot_ids`` (N tokens always scored)
- exact[S] = h @ w_exact[S].T, float32 accumulation
- token = S[argmax exact[S]]: the exact argmax over the shortlist
- logits: the two-level logits, exact on S and the pair's screen elsewhere, in h.dtype

Ties go to the lower token id everywhere: which of equal screen values enter the top K, and which of equal exact
values wins. A hot id that is also in the top K is scored twice (same value; no harm). Multiply-adds per row:
``r (V + d) + (K + N) d`` (:func:`screen_share` gives them as a share of the full head's ``V d``).

Three paths with one signature:

- :func:`screen_rescore_reference`: plain float32 torch (upcast copies, a stable sort), the tests' reference;
- :func:`screen_rescore_torch`: the fast path for the CPU (native-dtype GEMVs, ``torch.topk``, the shortlist's
  rows gathered into a reused buffer, no fresh copy per call);
- :func:`screen_rescore_triton`: the screen through the low-rank Triton kernel, ``torch.topk`` selection (a radix
  select on CUDA, no sort) and one gathered kernel that rescores the shortlist, writes the exact logits in place
  and keeps a running (max, id) per block (``slimspec.kernels.triton_screen``).

:func:`screen_rescore` picks Triton on CUDA (or under ``TRITON_INTERPRET=1``) and the fast torch path elsewhere.
Importing this module does not import triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimspec.kernels.dispatch import _on_device, _resolve
from slimspec.kernels.reference import lowrank_logits_fp32
from slimspec.kernels.shortlist import shortlist_argmax, topk_lower_ids, with_hot

__all__ = ["rescore_screen", "screen_rescore", "screen_rescore_reference", "screen_rescore_torch",
           "screen_rescore_triton", "screen_share", "served_logits", "shortlist_argmax", "topk_lower_ids", "with_hot"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# reused gather buffers, one per (device, dtype, hidden): the rows of the shortlist are copied into it each call
_BUFFERS: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
_CHUNK_BYTES = 1 << 20  # rows gathered at once on the CPU: within a core's L2


def screen_share(vocab: int, hidden: int, rank: int, shortlist: int, hot: int = 0) -> float:
    """Multiply-adds of the screen and rescore as a share of the full ``V x d`` head's: (r (V+d) + (K+N) d) / (V d)."""
    return (rank * (vocab + hidden) + (shortlist + hot) * hidden) / (vocab * hidden)


def check_inputs(hidden: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, w_exact: torch.Tensor,
                 shortlist: int, hot_ids: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of a screen-and-rescore call; ValueError/TypeError naming what is wrong."""
    if hidden.dim() != 2 or w_down.dim() != 2 or w_up.dim() != 2 or w_exact.dim() != 2:
        raise ValueError("hidden [B, d], w_down [r, d], w_up [V, r] and w_exact [V, d] must be 2-D")
    (_, dim), (rank, dim_down), (vocab, rank_up) = hidden.shape, w_down.shape, w_up.shape
    if dim_down != dim or rank_up != rank or tuple(w_exact.shape) != (vocab, dim):
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, w_down {tuple(w_down.shape)}, w_up "
                         f"{tuple(w_up.shape)}, w_exact {tuple(w_exact.shape)} (expected [B, d], [r, d], [V, r], "
                         "[V, d])")
    if hidden.dtype not in _DTYPES or any(w.dtype != hidden.dtype for w in (w_down, w_up, w_exact)):
        raise TypeError(f"hidden and the weights must share one of float32/float16/bfloat16, got {hidden.dtype}, "
                        f"{w_down.dtype}, {w_up.dtype}, {w_exact.dtype}")
    if not 1 <= shortlist <= vocab:
        raise ValueError(f"shortlist must be in [1, V={vocab}], got {shortlist}")
    devices = {t.device for t in (hidden, w_down, w_up, w_exact)} | ({hot_ids.device} if hot_ids is not None else set())
    if len(devices) > 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")
    if hot_ids is not None:
        if hot_ids.dim() != 1 or hot_ids.dtype != torch.long:
            raise TypeError(f"hot_ids must be a 1-D int64 tensor, got {hot_ids.dtype} {tuple(hot_ids.shape)}")
        if hot_ids.numel() and not (0 <= int(hot_ids.min()) and int(hot_ids.max()) < vocab):
            raise ValueError(f"hot_ids must lie in [0, V={vocab})")


def screen_rescore_reference(hidden: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, w_exact: torch.Tensor,
                             shortlist: int, hot_ids: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, two-level logits [B, V] in hidden.dtype) in plain float32 torch; the top K by a stable
    descending sort (equal screen values in id order)."""
    check_inputs(hidden, w_down, w_up, w_exact, shortlist, hot_ids)
    screen = lowrank_logits_fp32(hidden, w_down, w_up)
    top = torch.sort(screen, dim=-1, descending=True, stable=True).indices[:, :shortlist]
    ids = with_hot(top, hot_ids)
    exact = torch.einsum("bkd,bd->bk", w_exact[ids].float(), hidden.float())
    logits = screen.scatter(1, ids, exact)
    return shortlist_argmax(exact, ids), logits.to(hidden.dtype)


def _gather_buffer(like: torch.Tensor, rows: int) -> torch.Tensor:
    """A reused [rows, d] buffer of ``like``'s dtype and device (grown when too small, never shrunk)."""
    key = (str(like.device), like.dtype, like.shape[1])
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.shape[0] < rows:
        buffer = torch.empty(rows, like.shape[1], dtype=like.dtype, device=like.device)
        _BUFFERS[key] = buffer
    return buffer[:rows]


def rescore_rows(hidden: torch.Tensor, w_exact: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [B, M]: ``hidden[b] . w_exact[ids[b, m]]`` with float32 accumulation.

    On the CPU the rows are gathered a chunk at a time into a reused buffer that stays in the core's cache
    (``_CHUNK_BYTES``) and multiplied there, so no fresh [B M, d] copy is made per call. Elsewhere, or where
    autograd must see the gather, one indexed copy and a float32 product."""
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or w_exact.requires_grad)
    if needs_grad or hidden.device.type != "cpu":
        return torch.einsum("bkd,bd->bk", w_exact[ids].float(), hidden.float())
    batch, width = ids.shape
    chunk = max(1, min(width, _CHUNK_BYTES // (hidden.shape[1] * w_exact.element_size())))
    rows = _gather_buffer(w_exact, chunk)
    wide = None if w_exact.dtype == torch.float32 else _gather_buffer(hidden.float(), chunk)
    hidden32 = hidden.float()
    out = torch.empty(batch, width, dtype=torch.float32)
    for b in range(batch):
        for start in range(0, width, chunk):
            stop = min(start + chunk, width)
            part = torch.index_select(w_exact, 0, ids[b, start:stop], out=rows[: stop - start])
            if wide is not None:
                part = wide[: stop - start].copy_(part)
            torch.mv(part, hidden32[b], out=out[b, start:stop])
    return out


def screen_rescore_torch(hidden: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, w_exact: torch.Tensor,
                         shortlist: int, hot_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast torch path (any device): GEMVs in the weights' dtype, ``torch.topk`` with the lower-id tie rule,
    the shortlist's exact rows gathered into a reused buffer. Same results as the reference up to the summation
    order of the BLAS (16-bit inputs: the screen is rounded to the weights' dtype before selection)."""
    check_inputs(hidden, w_down, w_up, w_exact, shortlist, hot_ids)
    screen = F.linear(F.linear(hidden, w_down), w_up)
    ids = with_hot(topk_lower_ids(screen, shortlist), hot_ids).sort(dim=-1).values  # ascending: argmax = lower id
    exact = rescore_rows(hidden, w_exact, ids)
    logits = screen.scatter_(1, ids, exact.to(screen.dtype))
    return ids.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1), logits


def screen_rescore_triton(hidden: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, w_exact: torch.Tensor,
                          shortlist: int, hot_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path (CUDA, or any device under ``TRITON_INTERPRET=1``); forward only."""
    check_inputs(hidden, w_down, w_up, w_exact, shortlist, hot_ids)
    from slimspec.kernels import triton_screen

    with _on_device(hidden):
        return triton_screen.screen_rescore(hidden, w_down, w_up, w_exact, shortlist, hot_ids)


def screen_rescore(hidden: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, w_exact: torch.Tensor,
                   shortlist: int, hot_ids: torch.Tensor | None = None, *, backend: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy tokens [B] int64, two-level logits [B, V]): Triton where it runs (``backend="auto"``: CUDA without
    gradients), the fast torch path elsewhere; ``backend="torch"`` / ``"triton"`` force one."""
    if _resolve(backend, hidden, hidden, w_down, w_up, w_exact) == "triton":
        return screen_rescore_triton(hidden, w_down, w_up, w_exact, shortlist, hot_ids)
    return screen_rescore_torch(hidden, w_down, w_up, w_exact, shortlist, hot_ids)


def rescore_screen(hidden: torch.Tensor, screen: torch.Tensor, w_exact: torch.Tensor, shortlist: int,
                   hot_ids: torch.Tensor | None = None, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection and exact rescoring of a screen the caller computed (e.g. with vLLM's own layers): ``screen`` is
    float32 [B, V] and becomes the two-level logits in place, the exact values being ``scale * h . w_exact[id]``.
    Returns (tokens [B] int64, the two-level logits). The gathered Triton kernel runs where Triton does (forward
    only), the chunked torch rescoring elsewhere."""
    if screen.dtype != torch.float32 or screen.shape != (hidden.shape[0], w_exact.shape[0]):
        raise ValueError(f"screen must be float32 [B, V] = [{hidden.shape[0]}, {w_exact.shape[0]}], got "
                         f"{screen.dtype} {tuple(screen.shape)}")
    ids = with_hot(topk_lower_ids(screen, shortlist), hot_ids)
    if _resolve("auto", hidden) == "triton" and scale == 1.0:
        from slimspec.kernels import triton_screen

        with _on_device(hidden):
            return triton_screen.rescore(hidden, w_exact, ids, screen), screen
    ids = ids.sort(dim=-1).values
    exact = rescore_rows(hidden, w_exact, ids) * scale
    screen.scatter_(1, ids, exact)
    return ids.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1), screen


def served_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Two-level logits whose argmax is ``tokens`` (in place): every other value at or above the token's is set
    to the largest float below it. A screen value outside the shortlist can exceed every exact value of it; an
    engine that drafts ``argmax(logits)`` then still drafts the shortlist's exact argmax."""
    best = logits.gather(1, tokens[:, None])
    below = torch.nextafter(best, torch.full_like(best, float("-inf")))
    over = logits >= best
    over.scatter_(1, tokens[:, None], False)
    return logits.masked_scatter_(over, below.expand_as(logits)[over])
