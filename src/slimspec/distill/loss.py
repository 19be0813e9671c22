"""Full-vocabulary KL(teacher || student) for a low-rank drafter head, without [T, V] logits.

The student's logits are ``h @ W_down.T @ W_up.T``, the teacher's ``h_t @ H.T``. Neither is ever held for all
tokens at once: tokens are taken ``token_chunk`` rows at a time and the vocabulary ``chunk_size`` rows at a time.
For each token chunk, a first sweep over the vocabulary chunks computes both chunk logits and keeps a streaming
(online) log-sum-exp of each distribution; a second sweep turns the chunks into ``p`` and ``q`` and adds up the
KL and its gradients.

The loss is a scalar, so its backward only rescales the gradient: the forward therefore computes the gradient
with respect to the student logits, ``(q - p) * w_t / sum(w)``, chunk by chunk and reduces it at once to
``dz = sum_c g_c @ W_up_c`` (``z = h @ W_down.T``) and ``dW_up_c = g_c.T @ z``. This computes every teacher
logit exactly once (a backward that recomputed the chunk logits would compute the teacher's - by far the
largest matmul, ``T x H_t x V`` - twice). The price is that the logits of one token chunk are kept until its
log-sum-exp is complete: ``token_chunk x V`` values per distribution, bounded by ``BUFFER_BYTES`` when
``token_chunk`` is picked automatically. The backward forms ``dW_down = dz.T @ h`` and ``dh = dz @ W_down``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from slimspec.model import screen_shortlist

__all__ = ["DEFAULT_CHUNK_SIZE", "full_vocab_kl", "naive_full_vocab_kl", "shortlist_margin_loss", "top1_agreement",
           "two_level_kl"]

DEFAULT_CHUNK_SIZE = 4096
"""Vocabulary rows per chunk when ``chunk_size`` is None (tuned on a 2-core AVX-512 CPU, scripts/bench_kl.py)."""

BUFFER_BYTES = 256 * 2**20
"""Budget for one token chunk's teacher + student logits when ``token_chunk`` is None."""

_TOKEN_ROUND = 64


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs are computed and accumulated in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _pick_token_chunk(tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Largest token chunk whose two [token_chunk, V] logit buffers fit in ``BUFFER_BYTES``."""
    per_row = 2 * vocab * torch.empty((), dtype=dtype).element_size()
    rows = max(1, BUFFER_BYTES // per_row)
    if rows >= _TOKEN_ROUND:
        rows -= rows % _TOKEN_ROUND
    return max(1, min(tokens, rows))


def _fold_lse(logits: Tensor, running_max: Tensor, running_sum: Tensor) -> tuple[Tensor, Tensor]:
    """Fold one chunk of logits [n, c] into a streaming log-sum-exp: the new (max, rescaled sum), both [n].

    A row whose maximum is still -inf (every logit so far masked) uses 0 as the shift, so ``exp(-inf - -inf)``
    never produces NaN.
    """
    new_max = torch.maximum(running_max, logits.amax(dim=1))
    shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
    new_sum = running_sum * torch.exp(running_max - shift) + torch.exp(logits - shift[:, None]).sum(dim=1)
    return new_max, new_sum


def _p_and_kl_rows(teacher_logits: Tensor, log_q: Tensor, lse_p: Tensor) -> tuple[Tensor, Tensor]:
    """Teacher probabilities [n, c] and per-token KL(p || q) [n] of one vocabulary chunk (log_q normalised)."""
    log_p = teacher_logits - lse_p
    p = log_p.exp()
    # p_v = 0 (teacher logit -inf) contributes 0, not 0 * -inf = NaN
    return p, torch.where(p > 0, p * (log_p - log_q), 0.0).sum(dim=1)


def _kl_rows(teacher_logits: Tensor, student_logits: Tensor, lse_p: Tensor, lse_q: Tensor) -> Tensor:
    """Per-token KL(p || q) [n] of one vocabulary chunk, from its logits and both log-sum-exps [n, 1]."""
    return _p_and_kl_rows(teacher_logits, student_logits - lse_q, lse_p)[1]


def _kl_rows_and_grad(teacher_logits: Tensor, student_logits: Tensor, lse_p: Tensor, lse_q: Tensor,
                      coef: Tensor) -> tuple[Tensor, Tensor]:
    """``_kl_rows`` and the gradient of sum_t coef_t KL_t w.r.t. the chunk's student logits, (q - p) * coef."""
    log_q = student_logits - lse_q
    p, kl = _p_and_kl_rows(teacher_logits, log_q, lse_p)
    return kl, (log_q.exp() - p) * coef


COMPILE_ENV = "SLIMSPEC_COMPILE"
"""Set to 0 to run the KL's elementwise passes op by op (no ``torch.compile``)."""

_FUSED: dict[str, Any] = {}


def _fused(fn):
    """``fn`` with its elementwise passes fused into one loop by ``torch.compile`` (a whole from-scratch training
    step 1.37x faster in fp32: ``scripts/bench.py --only train-step``), or ``fn`` itself where compiling is
    switched off (``SLIMSPEC_COMPILE=0``) or fails (no C++ compiler, say: then it warns once and stays op by op)."""
    if os.environ.get(COMPILE_ENV, "1") == "0" or _FUSED.get("broken"):
        return fn
    if fn.__name__ not in _FUSED:
        compiled = torch.compile(fn, dynamic=True)

        def call(*args: Tensor):
            if _FUSED.get("broken"):
                return fn(*args)
            try:
                return compiled(*args)
            except Exception as error:  # noqa: BLE001 - any compile failure: fall back, the values are the same
                _FUSED["broken"] = True
                warnings.warn(f"torch.compile failed ({type(error).__name__}: {error}); the KL runs op by op "
                              f"(set {COMPILE_ENV}=0 to skip the attempt)", stacklevel=2)
                return fn(*args)

        _FUSED[fn.__name__] = call
    return _FUSED[fn.__name__]


def _chunked_kl(z: Tensor, w_up: Tensor, teacher_hidden: Tensor | None, teacher_head: Tensor | None, coef: Tensor,
                chunk_size: int, token_chunk: int, want_dz: bool, want_dw_up: bool,
                matmul_dtype: torch.dtype | None = None, teacher_logits: Tensor | None = None,
                teacher_log_probs: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Weighted KL sum_t coef_t KL_t and, on request, its gradients w.r.t. ``z`` [T, r] and ``w_up`` [V, r].

    ``z`` and ``coef`` are in the compute dtype; the other inputs are cast chunk by chunk. ``matmul_dtype``
    (e.g. bfloat16): the four big matmuls (both logits, both gradients) take inputs of that dtype and their results
    are widened back to the compute dtype, in which everything else is done and accumulated.
    ``teacher_logits`` [T, V] (then ``teacher_hidden`` and ``teacher_head`` are None): the teacher's logits (or
    log-probabilities) given, sliced chunk by chunk instead of multiplied out. ``teacher_log_probs``: they are
    normalised log-probabilities, so the teacher's log-sum-exp is 0 and its streaming pass is skipped.
    """
    cdtype = z.dtype
    mdtype = matmul_dtype or cdtype

    def mm(a: Tensor, b: Tensor) -> Tensor:
        return (a.to(mdtype) @ b.to(mdtype)).to(cdtype)

    def add_mm(out: Tensor, a: Tensor, b: Tensor) -> None:
        """out += a @ b: in place in the compute dtype, else through a ``matmul_dtype`` product."""
        if mdtype == cdtype:
            out.addmm_(a, b.to(cdtype))
        else:
            out.add_(mm(a, b))

    fold, kl_only, kl_and_grad = _fused(_fold_lse), _fused(_kl_rows), _fused(_kl_rows_and_grad)
    if mdtype != cdtype:  # cast the big operands once, not once per token chunk
        w_up = w_up.to(mdtype)
        teacher_head = teacher_head.to(mdtype) if teacher_head is not None else None
    tokens, rank = z.shape
    vocab = w_up.shape[0]
    bounds = [(v0, min(v0 + chunk_size, vocab)) for v0 in range(0, vocab, chunk_size)]
    neg_inf = float("-inf")
    total = z.new_zeros(())
    dz = torch.zeros_like(z) if want_dz else None
    dw_up = torch.zeros(vocab, rank, dtype=cdtype, device=z.device) if want_dw_up else None
    for t0 in range(0, tokens, token_chunk):
        t1 = min(t0 + token_chunk, tokens)
        z_t = z[t0:t1]
        z_m = z_t.to(mdtype)
        th_t = teacher_hidden[t0:t1].to(mdtype) if teacher_logits is None else None
        coef_t = coef[t0:t1, None]
        n = t1 - t0
        max_p = z.new_full((n,), neg_inf)
        sum_p = z.new_zeros(n)
        max_q = z.new_full((n,), neg_inf)
        sum_q = z.new_zeros(n)
        teacher_chunks: list[Tensor] = []
        student_chunks: list[Tensor] = []
        # sweep 1: chunk logits of both models and their streaming log-sum-exp
        for v0, v1 in bounds:
            a = mm(th_t, teacher_head[v0:v1].T) if th_t is not None else teacher_logits[t0:t1, v0:v1].to(cdtype)
            b = mm(z_m, w_up[v0:v1].T)
            if not teacher_log_probs:
                max_p, sum_p = fold(a, max_p, sum_p)
            max_q, sum_q = fold(b, max_q, sum_q)
            teacher_chunks.append(a)
            student_chunks.append(b)
        lse_p = z.new_zeros(n, 1) if teacher_log_probs else (max_p + sum_p.log())[:, None]
        lse_q = (max_q + sum_q.log())[:, None]
        kl_rows = z.new_zeros(n)
        dz_t = dz[t0:t1] if dz is not None else None
        # sweep 2: p, q, the KL terms and the gradient g = (q - p) * coef, reduced straight away
        for v0, v1 in bounds:
            a, b = teacher_chunks.pop(0), student_chunks.pop(0)  # popped so each chunk is freed once used
            if dz_t is None and dw_up is None:
                kl_rows += kl_only(a, b, lse_p, lse_q)
                continue
            rows, g = kl_and_grad(a, b, lse_p, lse_q, coef_t)
            kl_rows += rows
            del a, b
            if dz_t is not None:
                add_mm(dz_t, g, w_up[v0:v1])
            if dw_up is not None:
                add_mm(dw_up[v0:v1], g.T, z_m)
        total = total + (coef_t[:, 0] * kl_rows).sum()
    return total, dz, dw_up


class _FullVocabKL(torch.autograd.Function):
    """Forward computes the loss and the chunk-reduced gradients; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx: Any, student_hidden: Tensor, w_down: Tensor, w_up: Tensor, teacher_hidden: Tensor | None,
                teacher_head: Tensor | None, coef: Tensor, chunk_size: int, token_chunk: int,
                matmul_dtype: torch.dtype | None, teacher_logits: Tensor | None, teacher_log_probs: bool) -> Tensor:
        need_h, need_down, need_up = ctx.needs_input_grad[:3]
        cdtype = coef.dtype
        h = student_hidden.to(cdtype)
        down = w_down.to(cdtype)
        z = h @ down.T
        loss, dz, dw_up = _chunked_kl(z, w_up, teacher_hidden, teacher_head, coef, chunk_size, token_chunk,
                                      want_dz=need_h or need_down, want_dw_up=need_up, matmul_dtype=matmul_dtype,
                                      teacher_logits=teacher_logits, teacher_log_probs=teacher_log_probs)
        empty = z.new_empty(0)
        ctx.save_for_backward(student_hidden if need_down else empty, w_down if need_h else empty,
                              dz if dz is not None else empty, dw_up if dw_up is not None else empty)
        ctx.dtypes = (student_hidden.dtype, w_down.dtype, w_up.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        need_h, need_down, need_up = ctx.needs_input_grad[:3]
        h, w_down, dz, dw_up = ctx.saved_tensors
        h_dtype, down_dtype, up_dtype = ctx.dtypes
        unit = bool(grad_output == 1)
        grad_h = grad_down = grad_up = None
        if need_h or need_down:
            dz = dz if unit else dz * grad_output
            if need_h:
                grad_h = (dz @ w_down.to(dz.dtype)).to(h_dtype)
            if need_down:
                grad_down = (dz.T @ h.to(dz.dtype)).to(down_dtype)
        if need_up:
            # returned as is when grad_output == 1, so autograd can take it as .grad without a copy
            grad_up = (dw_up if unit else dw_up * grad_output).to(up_dtype)
        return grad_h, grad_down, grad_up, None, None, None, None, None, None, None, None


def _check(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, teacher_hidden: Tensor | None,
           teacher_head: Tensor | None, weights: Tensor | None, teacher_logits: Tensor | None = None) -> None:
    """Raise ValueError on inconsistent shapes, or a teacher given both ways or neither."""
    if student_hidden.dim() != 2:
        raise ValueError("student_hidden must be [T, d]")
    tokens, dim = student_hidden.shape
    if w_down.dim() != 2 or w_down.shape[1] != dim:
        raise ValueError(f"w_down must be [r, {dim}], got {list(w_down.shape)}")
    if w_up.dim() != 2 or w_up.shape[1] != w_down.shape[0]:
        raise ValueError(f"w_up must be [V, {w_down.shape[0]}], got {list(w_up.shape)}")
    if weights is not None and weights.shape != (tokens,):
        raise ValueError(f"weights must be [{tokens}], got {list(weights.shape)}")
    if teacher_logits is not None:
        if teacher_hidden is not None or teacher_head is not None:
            raise ValueError("give the teacher as teacher_logits or as teacher_hidden and teacher_head, not both")
        if teacher_logits.shape != (tokens, w_up.shape[0]):
            raise ValueError(f"teacher_logits must be [{tokens}, {w_up.shape[0]}], got {list(teacher_logits.shape)}")
        return
    if teacher_hidden is None or teacher_head is None:
        raise ValueError("give the teacher as teacher_hidden and teacher_head, or as teacher_logits")
    if teacher_hidden.dim() != 2:
        raise ValueError("teacher_hidden must be [T, Ht]")
    if teacher_hidden.shape[0] != tokens:
        raise ValueError(f"teacher_hidden has {teacher_hidden.shape[0]} tokens, student_hidden {tokens}")
    if teacher_head.dim() != 2 or teacher_head.shape != (w_up.shape[0], teacher_hidden.shape[1]):
        raise ValueError(f"teacher_head must be [{w_up.shape[0]}, {teacher_hidden.shape[1]}], "
                         f"got {list(teacher_head.shape)}")


def _token_coefficients(weights: Tensor | None, tokens: int, dtype: torch.dtype, device: torch.device
                        ) -> tuple[Tensor, Tensor | None]:
    """Per-token factors w_t / sum(w) (1/T without weights) and the indices of the nonzero-weight tokens."""
    if weights is None:
        return torch.full((tokens,), 1.0 / max(tokens, 1), dtype=dtype, device=device), None
    w = weights.detach().to(device=device, dtype=dtype)
    keep = (w != 0).nonzero().squeeze(1)
    total = w.sum()
    coef = w / total if bool(total != 0) else torch.zeros_like(w)
    return (coef, None) if keep.numel() == tokens else (coef[keep], keep)


def full_vocab_kl(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, teacher_hidden: Tensor | None = None,
                  teacher_head: Tensor | None = None, *, chunk_size: int | None = None, token_chunk: int | None = None,
                  weights: Tensor | None = None, matmul_dtype: torch.dtype | None = None,
                  teacher_logits: Tensor | None = None, teacher_log_probs: bool = False) -> Tensor:
    """Mean over tokens of KL(p || q), p = softmax(teacher_hidden @ teacher_head.T), q = softmax(h W_down^T W_up^T).

    Shapes: student_hidden [T, d], w_down [r, d], w_up [V, r], teacher_hidden [T, Ht], teacher_head [V, Ht].
    Natural log; with ``weights`` [T] the mean is sum(w * kl) / sum(w) (tokens of weight 0 are skipped; all-zero
    weights, or T == 0, give 0). Differentiable w.r.t. student_hidden, w_down and w_up; teacher inputs and
    weights are constants. bf16/fp16 inputs are computed in float32 (float64 inputs in float64); the loss comes
    back in that compute dtype, gradients in the input dtypes. Memory: one [token_chunk, chunk_size] block per
    distribution at a time plus one token chunk's logits ([token_chunk, V] per distribution), a [V, r] gradient
    and O(T r) vectors; no [T, V] tensor. ``chunk_size`` (vocab rows) defaults to ``DEFAULT_CHUNK_SIZE``,
    ``token_chunk`` to the largest multiple of 64 whose logits fit in ``BUFFER_BYTES``. ``matmul_dtype``
    (``torch.bfloat16``): the logit and gradient matmuls in that dtype (logits rounded to it, then widened),
    the softmaxes, the KL and every sum still in the compute dtype: faster where bf16 matmuls are (a whole
    training step 1.65x on a 2-core AMD EPYC, ``scripts/bench.py --only train-step``), at bf16's rounding of the
    logits (|error| <= |logit| / 256). The elementwise passes run fused by ``torch.compile`` (see ``_fused``).
    ``teacher_logits`` [T, V] instead of ``teacher_hidden`` and ``teacher_head``: the teacher's logits (or
    log-probabilities) precomputed, e.g. once per row of a frozen-feature run that revisits each row many times
    (:func:`slimspec.distill.teacher_table.teacher_table`); a float16 table is widened chunk by chunk.
    ``teacher_log_probs``: ``teacher_logits`` are normalised log-probabilities (a teacher table's): the teacher's
    log-sum-exp pass is skipped (a fp16 table's rounding then leaves p summing to 1 +- ~1e-3).
    """
    _check(student_hidden, w_down, w_up, teacher_hidden, teacher_head, weights, teacher_logits)
    if teacher_log_probs and teacher_logits is None:
        raise ValueError("teacher_log_probs describes teacher_logits, which were not given")
    if chunk_size is not None and chunk_size < 1 or token_chunk is not None and token_chunk < 1:
        raise ValueError("chunk_size and token_chunk must be positive")
    teachers = [t for t in (teacher_hidden, teacher_head, teacher_logits) if t is not None]
    cdtype = _compute_dtype(student_hidden, w_down, w_up, *teachers)
    tokens, vocab = student_hidden.shape[0], w_up.shape[0]
    coef, keep = _token_coefficients(weights, tokens, cdtype, student_hidden.device)
    if keep is not None:  # drop zero-weight tokens up front; autograd scatters their (zero) gradient back
        student_hidden = student_hidden[keep]
        if teacher_logits is None:
            teacher_hidden = teacher_hidden[keep]
        else:
            teacher_logits = teacher_logits[keep]
        tokens = keep.numel()
    if tokens == 0:
        return (student_hidden.sum() * 0 + (w_down.sum() + w_up.sum()) * 0).to(cdtype)
    chunk = min(chunk_size or DEFAULT_CHUNK_SIZE, vocab)
    tchunk = min(token_chunk or _pick_token_chunk(tokens, vocab, cdtype), tokens)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (student_hidden, w_down, w_up))
    if needs_grad:
        return _FullVocabKL.apply(student_hidden, w_down, w_up, teacher_hidden, teacher_head, coef, chunk, tchunk,
                                  matmul_dtype, teacher_logits, teacher_log_probs)
    with torch.no_grad():
        z = student_hidden.to(cdtype) @ w_down.to(cdtype).T
        return _chunked_kl(z, w_up, teacher_hidden, teacher_head, coef, chunk, tchunk, False, False, matmul_dtype,
                           teacher_logits, teacher_log_probs)[0]


def naive_full_vocab_kl(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, teacher_hidden: Tensor,
                        teacher_head: Tensor, *, weights: Tensor | None = None) -> Tensor:
    """Reference: the same loss with every [T, V] tensor materialised and plain autograd (same dtype rules)."""
    _check(student_hidden, w_down, w_up, teacher_hidden, teacher_head, weights)
    cdtype = _compute_dtype(student_hidden, w_down, w_up, teacher_hidden, teacher_head)
    with torch.no_grad():
        log_p = torch.log_softmax(teacher_hidden.to(cdtype) @ teacher_head.to(cdtype).T, dim=-1)
        p = log_p.exp()
    student_logits = student_hidden.to(cdtype) @ w_down.to(cdtype).T @ w_up.to(cdtype).T
    log_q = torch.log_softmax(student_logits, dim=-1)
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=cdtype, device=p.device)).sum(dim=-1)
    if weights is None:
        return kl.mean() if kl.numel() else kl.sum()
    w = weights.detach().to(cdtype)
    total = w.sum()
    return (w * kl).sum() / total if bool(total != 0) else (w * kl).sum() * 0


@torch.no_grad()
def top1_agreement(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, teacher_hidden: Tensor,
                   teacher_head: Tensor, *, weights: Tensor | None = None, token_chunk: int | None = None) -> float:
    """Weighted share of tokens where the student's argmax is the teacher's: sum(w [argmax q == argmax p]) / sum(w).

    Same shapes and dtype rules as :func:`full_vocab_kl`. At temperature 0 a verifier accepts exactly the argmax,
    so against the target this is the first draft position's acceptance under teacher forcing, and against the
    source drafter the share of positions where the converted head drafts the source's token. Token chunks keep
    one ``[token_chunk, V]`` logit block per distribution (``BUFFER_BYTES`` when ``token_chunk`` is None).
    NaN when no token has weight.
    """
    _check(student_hidden, w_down, w_up, teacher_hidden, teacher_head, weights)
    cdtype = _compute_dtype(student_hidden, w_down, w_up, teacher_hidden, teacher_head)
    tokens, vocab = student_hidden.shape[0], w_up.shape[0]
    w = (torch.ones(tokens, device=student_hidden.device) if weights is None else weights).to(cdtype)
    total = float(w.sum())
    if tokens == 0 or total <= 0:
        return float("nan")
    keep = (w != 0).nonzero().squeeze(1)  # zero-weight tokens (prompt positions) cost no matmul
    student_hidden, teacher_hidden, w, tokens = student_hidden[keep], teacher_hidden[keep], w[keep], keep.numel()
    chunk = min(token_chunk or _pick_token_chunk(tokens, vocab, cdtype), tokens)
    down, up, head = w_down.to(cdtype), w_up.to(cdtype), teacher_head.to(cdtype)
    agree = 0.0
    for a in range(0, tokens, chunk):
        student = (student_hidden[a:a + chunk].to(cdtype) @ down.T) @ up.T
        teacher = teacher_hidden[a:a + chunk].to(cdtype) @ head.T
        same = student.argmax(-1) == teacher.argmax(-1)
        agree += float((w[a:a + chunk] * same).sum())
    return agree / total


def _two_level_chunk(h: Tensor, z: Tensor, up: Tensor, w_exact: Tensor, hot_ids: Tensor | None, teacher: Tensor,
                     coef: Tensor, shortlist: int, log_probs: bool, want_grad: bool
                     ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """sum_t coef_t KL(p_t || q_t) of one token chunk (``teacher`` [n, V] its logits or log-probabilities) and, on
    request, its gradients w.r.t. ``z = h W_down^T`` [n, r], ``W_up`` [V, r] and (through the exact rows) ``h``.

    The exact scores are one dense ``h W_exact^T``, then gathered: a BLAS matmul is several times faster than
    gathering K rows per token, and its gradient is one dense matmul of the shortlist-masked gradient."""
    screen = z @ up.T
    ids = screen_shortlist(screen, shortlist, hot_ids, exact_ties=False)  # equal float screens: measure zero
    exact = h @ w_exact.T
    listed = torch.zeros_like(screen, dtype=torch.bool).scatter_(-1, ids, True)
    log_q = torch.log_softmax(torch.where(listed, exact, screen), dim=-1)
    log_p = teacher if log_probs else torch.log_softmax(teacher, dim=-1)
    p = log_p.exp()
    loss = (coef * torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)).sum()
    if not want_grad:
        return loss, None, None, None
    g = (log_q.exp() - p) * coef[:, None]
    g_screen = torch.where(listed, 0.0, g)
    return loss, g_screen @ up, g_screen.T @ z, torch.where(listed, g, 0.0) @ w_exact


class _TwoLevelKL(torch.autograd.Function):
    """Forward computes the loss and the gradients chunk by chunk; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx: Any, student_hidden: Tensor, w_down: Tensor, w_up: Tensor, w_exact: Tensor,
                hot_ids: Tensor | None, teachers: tuple, coef: Tensor, shortlist: int, chunk: int) -> Tensor:
        loss, dz, dw_up, dh = _two_level_sum(student_hidden, w_down, w_up, w_exact, hot_ids, teachers, coef,
                                             shortlist, chunk, want_grad=True)
        ctx.save_for_backward(student_hidden, w_down, dz, dw_up, dh)
        ctx.dtypes = (student_hidden.dtype, w_down.dtype, w_up.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        h, w_down, dz, dw_up, dh = ctx.saved_tensors
        h_dtype, down_dtype, up_dtype = ctx.dtypes
        grad_h = ((dz @ w_down.to(dz.dtype) + dh) * grad_output).to(h_dtype)
        grad_down = ((dz.T @ h.to(dz.dtype)) * grad_output).to(down_dtype)
        grad_up = (dw_up * grad_output).to(up_dtype)
        return grad_h, grad_down, grad_up, None, None, None, None, None, None


def _two_level_sum(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, w_exact: Tensor, hot_ids: Tensor | None,
                   teachers: tuple, coef: Tensor, shortlist: int, chunk: int, want_grad: bool
                   ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The weighted two-level KL over every token chunk and, with ``want_grad``, the gradients w.r.t. ``z``,
    ``w_up`` and ``h`` (exact path). ``teachers``: (teacher_hidden, teacher_head, teacher_logits, log_probs)."""
    teacher_hidden, teacher_head, teacher_logits, log_probs = teachers
    cdtype = coef.dtype
    h_all, up, exact = student_hidden.to(cdtype), w_up.to(cdtype), w_exact.to(cdtype)
    z_all = h_all @ w_down.to(cdtype).T
    total = coef.new_zeros(())
    dz = torch.zeros_like(z_all) if want_grad else None
    dw_up = torch.zeros_like(up) if want_grad else None
    dh = torch.zeros_like(h_all) if want_grad else None
    for a in range(0, h_all.shape[0], chunk):
        b = a + chunk
        teacher = (teacher_logits[a:b].to(cdtype) if teacher_logits is not None else
                   teacher_hidden[a:b].to(cdtype) @ teacher_head.to(cdtype).T)
        loss, dz_t, dup_t, dh_t = _two_level_chunk(h_all[a:b], z_all[a:b], up, exact, hot_ids, teacher,
                                                   coef[a:b], shortlist, log_probs, want_grad)
        total = total + loss
        if want_grad:
            dz[a:b], dh[a:b] = dz_t, dh_t
            dw_up += dup_t
    return total, dz, dw_up, dh


def two_level_kl(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, w_exact: Tensor, shortlist: int,
                 hot_ids: Tensor | None = None, teacher_hidden: Tensor | None = None,
                 teacher_head: Tensor | None = None, *, weights: Tensor | None = None, token_chunk: int | None = None,
                 matmul_dtype: torch.dtype | None = None, teacher_logits: Tensor | None = None,
                 teacher_log_probs: bool = False) -> Tensor:
    """Mean over tokens of KL(p || q) where q is a screen-and-rescore head's two-level distribution: softmax of the
    exact logits ``h . W_exact[v]`` on the shortlist (the pair's top ``shortlist`` and ``hot_ids``) and of the pair's
    ``h W_down^T W_up^T`` elsewhere.

    The teacher and the weights as in :func:`full_vocab_kl`. Gradients reach the pair through the tokens outside the
    shortlist (the top-K choice is a constant) and ``student_hidden`` through both levels; ``w_exact`` stays
    constant. Like :func:`full_vocab_kl`, the forward computes the gradients as it goes (tokens ``token_chunk`` at a
    time, a few [token_chunk, V] tensors live), so no [T, V] tensor is held and no logit is computed twice.
    ``matmul_dtype`` is accepted for the caller's symmetry with :func:`full_vocab_kl` and ignored: this loss
    computes in float32 (float64 inputs in float64).
    """
    del matmul_dtype
    _check(student_hidden, w_down, w_up, teacher_hidden, teacher_head, weights, teacher_logits)
    if w_exact.shape != (w_up.shape[0], student_hidden.shape[1]):
        raise ValueError(f"w_exact must be [{w_up.shape[0]}, {student_hidden.shape[1]}], got {list(w_exact.shape)}")
    teachers = [t for t in (teacher_hidden, teacher_head, teacher_logits) if t is not None]
    cdtype = _compute_dtype(student_hidden, w_down, w_up, *teachers)
    tokens, vocab = student_hidden.shape[0], w_up.shape[0]
    coef, keep = _token_coefficients(weights, tokens, cdtype, student_hidden.device)
    if keep is not None:  # drop zero-weight tokens up front; autograd scatters their (zero) gradient back
        student_hidden = student_hidden[keep]
        teacher_hidden = teacher_hidden[keep] if teacher_logits is None else None
        teacher_logits = teacher_logits[keep] if teacher_logits is not None else None
        tokens = keep.numel()
    if tokens == 0:
        return (student_hidden.sum() * 0 + (w_down.sum() + w_up.sum()) * 0).to(cdtype)
    # about seven [n, V] tensors live per chunk (screen, exact, mask, log q, teacher, p, gradient)
    chunk = token_chunk or max(1, _pick_token_chunk(tokens, vocab, cdtype) // 3)
    spec = (teacher_hidden, teacher_head, teacher_logits, teacher_log_probs and teacher_logits is not None)
    w_exact = w_exact.detach()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (student_hidden, w_down, w_up)):
        return _TwoLevelKL.apply(student_hidden, w_down, w_up, w_exact, hot_ids, spec, coef, shortlist, chunk)
    with torch.no_grad():
        return _two_level_sum(student_hidden, w_down, w_up, w_exact, hot_ids, spec, coef, shortlist, chunk,
                              want_grad=False)[0]


def _margin_chunk(h: Tensor, down: Tensor, up: Tensor, wanted: Tensor, coef: Tensor, shortlist: int,
                  margin: float) -> Tensor:
    """sum_t coef_t softplus(margin + theta_t - s_t[y_t]) of one token chunk (``wanted`` [n]: y_t)."""
    screen = (h @ down.T) @ up.T
    at_wanted = screen.gather(1, wanted[:, None])[:, 0]
    others = screen.detach().scatter(1, wanted[:, None], float("-inf"))
    values, ids = torch.topk(others, shortlist, dim=-1, sorted=False)
    boundary = screen.gather(1, ids.gather(1, values.argmin(dim=-1, keepdim=True)))[:, 0]
    return (coef * F.softplus(margin + boundary - at_wanted)).sum()


def shortlist_margin_loss(student_hidden: Tensor, w_down: Tensor, w_up: Tensor, shortlist: int,
                          hot_ids: Tensor | None = None, teacher_hidden: Tensor | None = None,
                          teacher_head: Tensor | None = None, *, weights: Tensor | None = None,
                          token_chunk: int | None = None, matmul_dtype: torch.dtype | None = None,
                          teacher_logits: Tensor | None = None, teacher_log_probs: bool = False,
                          margin: float = 1.0) -> Tensor:
    """Mean over tokens of ``softplus(margin + theta_t - s_t[y_t])``: ``y_t`` the teacher's argmax, ``s_t`` the pair's
    screen ``h W_down^T W_up^T``, ``theta_t`` the ``shortlist``-th largest screen value among the other tokens.

    A screen-and-rescore head drafts the teacher's token exactly when it is in the shortlist (its exact row then
    wins), so this trains the screen's recall of it directly: near zero once ``y_t`` clears the shortlist's boundary
    by ``margin``, its gradient raises ``s_t[y_t]`` and lowers the boundary token. Tokens whose ``y_t`` is a hot id
    (always rescored) add nothing. The teacher and weights as in :func:`full_vocab_kl`; tokens ``token_chunk`` at a
    time with each chunk's [token_chunk, V] screen recomputed in the backward, so no [T, V] tensor is held.
    ``matmul_dtype`` and ``teacher_log_probs`` are accepted for the callers' symmetry and ignored (an argmax).
    """
    del matmul_dtype, teacher_log_probs
    _check(student_hidden, w_down, w_up, teacher_hidden, teacher_head, weights, teacher_logits)
    teachers = [t for t in (teacher_hidden, teacher_head, teacher_logits) if t is not None]
    cdtype = _compute_dtype(student_hidden, w_down, w_up, *teachers)
    tokens, vocab = student_hidden.shape[0], w_up.shape[0]
    coef, keep = _token_coefficients(weights, tokens, cdtype, student_hidden.device)
    rows = torch.arange(tokens, device=student_hidden.device) if keep is None else keep
    total = (student_hidden.sum() * 0 + (w_down.sum() + w_up.sum()) * 0).to(cdtype)
    chunk = token_chunk or max(1, _pick_token_chunk(tokens, vocab, cdtype) // 2)
    h_all, down, up = student_hidden.to(cdtype), w_down.to(cdtype), w_up.to(cdtype)
    for a in range(0, rows.numel(), chunk):
        at = rows[a:a + chunk]
        with torch.no_grad():
            teacher = (teacher_logits[at].to(cdtype) if teacher_logits is not None else
                       teacher_hidden[at].to(cdtype) @ teacher_head.to(cdtype).T)
            wanted = teacher.argmax(dim=-1)
            free = coef[a:a + chunk]
            if hot_ids is not None and hot_ids.numel():
                free = free * ~torch.isin(wanted, hot_ids.to(wanted.device))
        args = (h_all[at], down, up, wanted, free, shortlist, margin)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (h_all, down, up)):
            total = total + torch.utils.checkpoint.checkpoint(_margin_chunk, *args, use_reentrant=False)
        else:
            total = total + _margin_chunk(*args)
    return total
