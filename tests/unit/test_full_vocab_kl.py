"""Chunked full-vocabulary KL against a materialised float64 autograd reference."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimspec.distill.loss import full_vocab_kl, naive_full_vocab_kl

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _case(tokens: int, dim: int, rank: int, vocab: int, teacher_dim: int, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> Inputs:
    """Unit-scale hidden states and heads giving logits of standard deviation about 2; student inputs need grad."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=g, dtype=torch.float64)
    down = torch.randn(rank, dim, generator=g, dtype=torch.float64) * dim**-0.5
    up = torch.randn(vocab, rank, generator=g, dtype=torch.float64) * 2 * rank**-0.5
    th = torch.randn(tokens, teacher_dim, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, teacher_dim, generator=g, dtype=torch.float64) * 2 * teacher_dim**-0.5
    return tuple(t.to(dtype).requires_grad_(i < 3) for i, t in enumerate((h, down, up, th, head)))  # type: ignore


def _reference(inputs: Inputs, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Loss and gradients (h, W_down, W_up) from the naive computation in float64 on the same values."""
    wide = [t.detach().double().requires_grad_(i < 3) for i, t in enumerate(inputs)]
    loss = naive_full_vocab_kl(*wide, weights=None if weights is None else weights.double())
    return loss.detach(), torch.autograd.grad(loss, wide[:3])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


SHAPES = [  # tokens, dim, rank, vocab, teacher_dim, chunk_size, token_chunk
    (1, 16, 5, 1000, 12, 128, None),
    (7, 24, 10, 1000, 20, 128, 3),
    (33, 20, 7, 257, 20, 64, None),
    (33, 12, 6, 257, 30, 64, 8),
    (7, 9, 3, 1000, 9, 1000, 1),
]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("tokens", "dim", "rank", "vocab", "teacher_dim", "chunk", "token_chunk"), SHAPES)
def test_fp32_matches_float64_reference(tokens, dim, rank, vocab, teacher_dim, chunk, token_chunk, weighted):
    """Catches a wrong last (partial) vocab chunk, online log-sum-exp rescaling, token-chunk offsets, weighting
    and any of the three gradient formulas: value and gradients must equal float64 autograd to ~1e-5."""
    inputs = _case(tokens, dim, rank, vocab, teacher_dim)
    weights = torch.rand(tokens, generator=torch.Generator().manual_seed(1)) + 0.1 if weighted else None
    loss = full_vocab_kl(*inputs, chunk_size=chunk, token_chunk=token_chunk, weights=weights)
    grads = torch.autograd.grad(loss, inputs[:3])
    ref_loss, ref_grads = _reference(inputs, weights)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - float(ref_loss)) <= 1e-5 * float(ref_loss)
    for grad, ref, name in zip(grads, ref_grads, ("h", "w_down", "w_up"), strict=True):
        assert grad.dtype == torch.float32
        assert _rel(grad, ref) <= 1e-5, name


@pytest.mark.parametrize(("tokens", "dim", "rank", "vocab", "teacher_dim", "chunk", "token_chunk"), SHAPES[1:4])
def test_float64_inputs_match_exactly(tokens, dim, rank, vocab, teacher_dim, chunk, token_chunk):
    """Catches algorithmic errors hidden by fp32 rounding (e.g. a slightly wrong rescale): float64 in, 1e-12 out."""
    inputs = _case(tokens, dim, rank, vocab, teacher_dim, seed=2, dtype=torch.float64)
    weights = torch.rand(tokens, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    loss = full_vocab_kl(*inputs, chunk_size=chunk, token_chunk=token_chunk, weights=weights)
    grads = torch.autograd.grad(loss, inputs[:3])
    ref_loss, ref_grads = _reference(inputs, weights)
    assert loss.dtype == torch.float64
    assert (loss.detach() - ref_loss).abs().item() <= 1e-12 * float(ref_loss)
    assert all(_rel(g, r) <= 1e-12 for g, r in zip(grads, ref_grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_computed_in_fp32(dtype):
    """Catches computing logits or accumulating in bf16/fp16 (value off by ~1e-2) and gradients returned in the
    wrong dtype: the value must match float64 on the same (exactly representable) values to fp32 accuracy."""
    inputs = _case(33, 20, 7, 1000, 20, seed=4, dtype=dtype)
    loss = full_vocab_kl(*inputs, chunk_size=128, token_chunk=8)
    grads = torch.autograd.grad(loss, inputs[:3])
    ref_loss, ref_grads = _reference(inputs)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - float(ref_loss)) <= 1e-5 * float(ref_loss)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == dtype
        assert _rel(grad, ref) <= 1e-2


@pytest.mark.parametrize(("tokens", "dim", "rank", "vocab", "teacher_dim", "chunk", "token_chunk"), SHAPES[1:4])
def test_bf16_matmuls_track_float64_reference(tokens, dim, rank, vocab, teacher_dim, chunk, token_chunk):
    """``matmul_dtype=bfloat16`` (mixed-precision training). Catches a bf16 path that drops a gradient term, mixes
    up chunk offsets or accumulates in bf16: value and gradients stay within bf16 rounding (~1 %) of float64;
    and catches a flag that does nothing: the result must differ from the fp32 one (the matmuls really ran bf16)."""
    inputs = _case(tokens, dim, rank, vocab, teacher_dim, seed=6)
    weights = torch.rand(tokens, generator=torch.Generator().manual_seed(7)) + 0.1
    loss = full_vocab_kl(*inputs, chunk_size=chunk, token_chunk=token_chunk, weights=weights,
                         matmul_dtype=torch.bfloat16)
    grads = torch.autograd.grad(loss, inputs[:3])
    ref_loss, ref_grads = _reference(inputs, weights)
    fp32 = full_vocab_kl(*inputs, chunk_size=chunk, token_chunk=token_chunk, weights=weights)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - float(ref_loss)) <= 2e-2 * float(ref_loss)
    assert loss.item() != fp32.item()
    for grad, ref, name in zip(grads, ref_grads, ("h", "w_down", "w_up"), strict=True):
        assert grad.dtype == torch.float32
        assert 1e-6 < _rel(grad, ref) <= 3e-2, name
    with torch.no_grad():  # the no-grad path (held-out evaluation) takes the flag too
        assert full_vocab_kl(*inputs, chunk_size=chunk, token_chunk=token_chunk, weights=weights,
                             matmul_dtype=torch.bfloat16).item() == pytest.approx(loss.item(), rel=1e-6)


def test_nonnegative_and_zero_when_student_equals_teacher():
    """Catches sign errors and a mixed-up normaliser (teacher lse used for the student or vice versa): KL >= 0
    on random inputs, and 0 (with zero gradients) when W_up @ W_down == teacher head and h == teacher hidden."""
    for seed in range(3):
        assert full_vocab_kl(*_case(7, 16, 5, 257, 16, seed=seed), chunk_size=64).item() >= 0
    # exact: r == d, W_down = I, W_up = teacher head -> bitwise equal logits
    h, _, _, _, head = _case(7, 16, 16, 257, 16, seed=5)
    h, head = h.detach(), head.detach()
    down = torch.eye(16).requires_grad_()
    up = head.clone().requires_grad_()
    loss = full_vocab_kl(h.requires_grad_(), down, up, h.detach(), head, chunk_size=64, token_chunk=3)
    assert abs(loss.item()) <= 1e-6
    assert all(float(g.abs().max()) <= 1e-6 for g in torch.autograd.grad(loss, (h, down, up)))
    # low rank: teacher head = W_up @ W_down (r = 6 < d = 16), float64
    h, down, up, _, _ = _case(33, 16, 6, 257, 16, seed=6, dtype=torch.float64)
    head = (up @ down).detach()
    loss = full_vocab_kl(h, down, up, h.detach(), head, chunk_size=64)
    assert abs(loss.item()) <= 1e-12
    assert all(float(g.abs().max()) <= 1e-12 for g in torch.autograd.grad(loss, (h, down, up)))


def test_gradcheck_float64():
    """Catches backward formulas that are wrong independently of the naive reference (finite differences)."""
    h, down, up, th, head = _case(3, 5, 3, 11, 4, seed=7, dtype=torch.float64)
    weights = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b, c: full_vocab_kl(a, b, c, th, head, chunk_size=4, token_chunk=2, weights=weights),
        (h, down, up))


def test_backward_scales_by_grad_output():
    """Catches a backward that ignores grad_output (a KL term weighted inside a larger loss)."""
    inputs = _case(7, 16, 5, 257, 12, seed=8)
    ones = torch.autograd.grad(full_vocab_kl(*inputs, chunk_size=64), inputs[:3])
    scaled = torch.autograd.grad(-2.5 * full_vocab_kl(*inputs, chunk_size=64), inputs[:3])
    assert all(_rel(s, -2.5 * o.double()) <= 1e-6 for s, o in zip(scaled, ones, strict=True))


def test_teacher_neg_inf_logits():
    """Catches NaN from 0 * -inf (p_v = 0 terms) and from exp(-inf - -inf) when a whole vocab chunk of the
    teacher is -inf (the first one, so the running max starts at -inf)."""
    h, down, up, th, head = _case(7, 16, 5, 257, 12, seed=9, dtype=torch.float64)
    th = th.clone()
    th[:, 0] = 1.0  # teacher logit = head[v, 0] * 1 + finite
    head = head.clone()
    masked = torch.cat([torch.arange(64), torch.tensor([100, 200, 256])])
    head[masked, 0] = float("-inf")
    loss = full_vocab_kl(h, down, up, th, head, chunk_size=64, token_chunk=4)
    grads = torch.autograd.grad(loss, (h, down, up))
    ref_loss, ref_grads = _reference((h, down, up, th, head))
    assert torch.isfinite(loss) and (loss.detach() - ref_loss).abs().item() <= 1e-12 * float(ref_loss)
    assert all(torch.isfinite(g).all() and _rel(g, r) <= 1e-12 for g, r in zip(grads, ref_grads, strict=True))


def test_zero_weights_skip_tokens_and_all_zero_gives_zero():
    """Catches normalising by T instead of sum(w), zero-weight tokens leaking into the loss or getting gradient,
    and NaN (0/0) for an all-zero mask."""
    inputs = _case(7, 16, 5, 257, 12, seed=10)
    weights = torch.tensor([1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 3.0])
    loss = full_vocab_kl(*inputs, chunk_size=64, weights=weights)
    keep = weights.nonzero().squeeze(1)
    sub = tuple(t[keep] if i in (0, 3) else t for i, t in enumerate(inputs))
    assert torch.allclose(loss, full_vocab_kl(*sub, chunk_size=64, weights=weights[keep]), rtol=1e-6)
    grad_h = torch.autograd.grad(loss, inputs[0])[0]
    assert float(grad_h[weights == 0].abs().max()) == 0.0
    zero = full_vocab_kl(*inputs, chunk_size=64, weights=torch.zeros(7))
    assert zero.item() == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in torch.autograd.grad(zero, inputs[:3], allow_unused=True)
               if g is not None)


def test_no_grad_and_partial_grad_paths():
    """Catches the no-grad path (plain forward) or a partly frozen student (only W_up trained) giving a different
    value or gradient than the full path."""
    h, down, up, th, head = _case(33, 20, 7, 1000, 20, seed=11)
    full = full_vocab_kl(h, down, up, th, head, chunk_size=128)
    ref_up = torch.autograd.grad(full, up)[0]
    with torch.no_grad():
        assert torch.allclose(full_vocab_kl(h, down, up, th, head, chunk_size=128), full, rtol=1e-6)
    only_up = full_vocab_kl(h.detach(), down.detach(), up, th, head, chunk_size=128)
    assert torch.allclose(only_up, full, rtol=1e-6)
    assert torch.allclose(torch.autograd.grad(only_up, up)[0], ref_up, rtol=1e-6, atol=0)


def test_bad_shapes_raise():
    """Catches silent broadcasting of mismatched shapes."""
    h, down, up, th, head = _case(7, 16, 5, 257, 12)
    with pytest.raises(ValueError, match="w_down"):
        full_vocab_kl(h, down[:, :-1], up, th, head)
    with pytest.raises(ValueError, match="teacher_head"):
        full_vocab_kl(h, down, up, th, head[:-1])
    with pytest.raises(ValueError, match="tokens"):
        full_vocab_kl(h, down, up, th[:-1], head)
    with pytest.raises(ValueError, match="weights"):
        full_vocab_kl(h, down, up, th, head, weights=torch.ones(6))


class _LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class _LargestSaved(torch.autograd.graph.saved_tensors_hooks):
    """Records the element count of the largest tensor autograd saves for backward."""

    def __init__(self) -> None:
        self.largest = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.largest = max(self.largest, t.numel())
        return t


@pytest.mark.slow
def test_memory_bounded_no_token_by_vocab_tensor():
    """Catches materialising [T, V] logits (or their gradient) anywhere in forward or backward, and saving one for
    backward, at T=512, V=50000 where naive needs several 200 MB float64 [T, V] tensors; the result still equals
    that naive computation. The detectors are checked to fire on the naive version."""
    tokens, vocab, chunk, token_chunk = 512, 50000, 4096, 128
    inputs = _case(tokens, 32, 12, vocab, 24, seed=12)
    outputs, saved = _LargestOutput(), _LargestSaved()
    with outputs, saved:
        loss = full_vocab_kl(*inputs, chunk_size=chunk, token_chunk=token_chunk)
        grads = torch.autograd.grad(loss, inputs[:3])
    bound = max(token_chunk * chunk, vocab * 12, tokens * 32, vocab * 24)  # chunk block, dW_up, h, teacher head
    assert outputs.largest <= bound < tokens * vocab
    assert saved.largest < tokens * vocab
    ref_loss, ref_grads = _reference(inputs)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert all(_rel(g, r) <= 1e-5 for g, r in zip(grads, ref_grads, strict=True))
    naive_outputs, naive_saved = _LargestOutput(), _LargestSaved()
    with naive_outputs, naive_saved:
        torch.autograd.grad(naive_full_vocab_kl(*inputs), inputs[:3])
    assert naive_outputs.largest == naive_saved.largest == tokens * vocab


def test_fused_and_op_by_op_passes_agree(monkeypatch):
    """Catches the torch.compile'd elementwise passes (the default) drifting from the op-by-op ones
    (``SLIMSPEC_COMPILE=0``), and the fused path silently never running (compile failing over to op by op here):
    both must match the float64 reference, and the compiled functions must be in use."""
    from slimspec.distill import loss as loss_module

    inputs = _case(33, 20, 7, 257, 20, seed=4)
    ref_loss, ref_grads = _reference(inputs)
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(loss_module.COMPILE_ENV, flag)
        value = full_vocab_kl(*inputs, chunk_size=64, token_chunk=8)
        results[flag] = (value.detach(), torch.autograd.grad(value, inputs[:3]))
    assert not loss_module._FUSED.get("broken")
    assert {"_fold_lse", "_kl_rows_and_grad"} <= set(loss_module._FUSED)
    for value, grads in results.values():
        assert abs(value.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        assert all(_rel(g, r) <= 1e-5 for g, r in zip(grads, ref_grads, strict=True))


def test_compile_failure_falls_back_to_op_by_op(monkeypatch):
    """Catches a machine without a working torch.compile (no C++ compiler) breaking distillation: the first call
    warns once, and this and later results are the op-by-op ones."""
    from slimspec.distill import loss as loss_module

    def broken_compile(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(loss_module, "_FUSED", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setenv(loss_module.COMPILE_ENV, "1")
    inputs = _case(7, 24, 10, 1000, 20, seed=5)
    ref_loss, _ = _reference(inputs)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        first = full_vocab_kl(*inputs, chunk_size=128)
    second = full_vocab_kl(*inputs, chunk_size=128)
    assert loss_module._FUSED["broken"]
    for value in (first, second):
        assert abs(value.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
