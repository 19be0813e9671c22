"""slimspec.kernels: torch reference, dispatcher, and the Triton kernels run by Triton's CPU interpreter.

Every Triton test runs under ``TRITON_INTERPRET=1`` (set by the ``tlr`` fixture before the kernel module is
imported), at small odd shapes: V = 1000 with BLOCK_V = 128 (last tile 104 wide), r in {72, 37} with
BLOCK_R = 32 (last rank chunk partial), d = 40 with a 16-wide d chunk, B in {1, 3, 64}, both inner-product
paths (FMA for decode, tl.dot for batches) and fp32 / fp16 / bf16.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from slimspec import kernels
from slimspec.kernels import reference

V, D = 1000, 40
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (B, path): FMA at B = 1 and 3 (block_b 4: one masked row), tl.dot at B = 3 (13 masked rows) and 64 (2 row blocks)
CASES = [(1, "fma"), (3, "fma"), (3, "dot"), (64, "dot")]
# float32 logits from 16-bit inputs are exact up to fp32 accumulation; stored 16-bit logits add one rounding
# (the interpreter truncates float32 -> bf16 instead of rounding: up to one bf16 ulp).
OUT_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _triton_missing() -> bool:
    """True where triton is not installed; under `make test` (SLIMSPEC_REQUIRE_VLLM=1: the full suite, which
    installs triton) a missing triton fails the run instead of skipping every kernel test."""
    missing = not kernels.triton_available()
    if missing and os.environ.get("SLIMSPEC_REQUIRE_VLLM") == "1":
        pytest.fail("triton is not installed, and make test requires the whole suite")
    return missing


@pytest.fixture(scope="module")
def tlr():
    """slimspec.kernels.triton_lowrank imported with TRITON_INTERPRET=1 (kernels built by the interpreter)."""
    if _triton_missing():
        pytest.skip("triton is not installed")
    name = "slimspec.kernels.triton_lowrank"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        sys.modules.pop(name, None)
        module = importlib.import_module(name)
        assert module._interpreted(), "kernels were not built by the interpreter"
        yield module
        sys.modules.pop(name, None)
        if hasattr(kernels, "triton_lowrank"):
            delattr(kernels, "triton_lowrank")


def _config(tlr, batch: int, path: str):
    """Small tiles that force masking on every axis."""
    if path == "fma":
        return tlr.TileConfig(block_b=triton_pow2(batch), block_v=128, block_r=32, use_dot=False,
                              z_block_r=4, z_block_d=16)
    return tlr.TileConfig(block_b=32 if batch > 16 else 16, block_v=128, block_r=32, use_dot=True,
                          z_block_r=16, z_block_d=16)


def triton_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _random(batch: int, rank: int, dtype: torch.dtype, seed: int = 0, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, D, generator=g).to(dtype)
    w_down = (torch.randn(rank, D, generator=g) / D**0.5).to(dtype)
    w_up = (torch.randn(vocab, rank, generator=g) / rank**0.5).to(dtype)
    return h, w_down, w_up


def _exact(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """float64 logits of the (already rounded) inputs: the ground truth."""
    return (h.double() @ w_down.double().T) @ w_up.double().T


def _planted(batch: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """Random inputs where row b's argmax is a planted w_up row at a known index, far above the rest."""
    h, w_down, w_up = _random(batch, rank, dtype, seed)
    z = h.double() @ w_down.double().T
    edges = [0, 127, 128, 999, 1, 255, 256, 897, 896]  # tile edges for BLOCK_V = 128, and the partial last tile
    others = [i for i in torch.randperm(V, generator=torch.Generator().manual_seed(seed)).tolist() if i not in edges]
    winners = (edges + others)[:batch]
    for b, j in enumerate(winners):
        w_up[j] = (4.0 * z[b] / z[b].norm()).to(dtype)
    return h, w_down, w_up, torch.tensor(winners)


def _integer_inputs(batch: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """Inputs in {-1, 0, 1}: every logit is a small integer, exact in fp32 whatever the summation order."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-1, 2, (batch, D), generator=g).to(dtype)
    w_down = torch.randint(-1, 2, (rank, D), generator=g).to(dtype)
    w_up = torch.randint(-1, 2, (V, rank), generator=g).to(dtype)
    return h, w_down, w_up


# ----------------------------------------------------------------------------------------------------------
# import hygiene, dispatcher, torch fallback


def test_import_does_not_import_triton():
    """Catches a module-level ``import triton`` in slimspec.kernels (vLLM-free / triton-free installs must import
    it, and the CPU fallback must run without loading triton)."""
    code = ("import sys, torch\n"
            "import slimspec.kernels as k\n"
            "assert 'triton' not in sys.modules, 'import'\n"
            "h, wd, wu = torch.randn(2, 8), torch.randn(4, 8), torch.randn(10, 4)\n"
            "k.lowrank_argmax(h, wd, wu); k.lowrank_logits(h, wd, wu); k.lowrank_topk(h, wd, wu, 3)\n"
            "assert k.active_backend(h) == 'torch'\n"
            "assert 'triton' not in sys.modules, 'call'\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_use_triton_dispatch(monkeypatch):
    """Catches a dispatcher that sends CPU tensors to Triton without the interpreter (or ignores it when set)."""
    cpu = torch.zeros(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.use_triton(cpu) and kernels.active_backend(cpu) == "torch"
    with pytest.raises(RuntimeError):
        kernels.lowrank_argmax(torch.zeros(1, 4), torch.zeros(2, 4), torch.zeros(5, 2), backend="triton")
    with pytest.raises(ValueError):
        kernels.lowrank_argmax(torch.zeros(1, 4), torch.zeros(2, 4), torch.zeros(5, 2), backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.use_triton(cpu) == kernels.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.use_triton(cpu)


def test_triton_path_never_drops_autograd(tlr):
    """Catches the forward-only Triton kernels returning values without a graph where the same call on the torch
    path is differentiable (backend auto on a GPU would silently train nothing): auto takes the torch path when an
    input requires grad, an explicit triton backend is refused, and under no_grad Triton runs as before."""
    h, w_down, w_up = _random(3, 8, torch.float32)
    w_up.requires_grad_(True)
    for call in (lambda **kw: kernels.lowrank_logits(h, w_down, w_up, **kw),
                 lambda **kw: kernels.lowrank_topk(h, w_down, w_up, 2, **kw)[0]):
        assert kernels.active_backend(h) == "triton"  # the interpreter is on: auto would take Triton
        out = call()
        assert out.requires_grad
        out.sum().backward()
        assert w_up.grad is not None and w_up.grad.abs().sum() > 0
        w_up.grad = None
        with pytest.raises(RuntimeError, match="forward-only"):
            call(backend="triton")
        with torch.no_grad():
            assert not call(backend="triton").requires_grad


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rank", [72, 37])
def test_reference_matches_float64(dtype, rank):
    """Catches a reference that accumulates in 16 bits, rounds z = h @ w_down.T, or mis-orders the factors."""
    h, w_down, w_up, winners = _planted(3, rank, dtype)
    exact = _exact(h, w_down, w_up)
    torch.testing.assert_close(reference.lowrank_logits_fp32(h, w_down, w_up).double(), exact, rtol=1e-5, atol=1e-5)
    logits = reference.lowrank_logits(h, w_down, w_up)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits.double(), exact, rtol=OUT_TOL[dtype][0], atol=OUT_TOL[dtype][1])
    assert torch.equal(reference.lowrank_argmax(h, w_down, w_up), winners)


def test_reference_chunked_head(monkeypatch):
    """Catches an off-by-one in the reference's chunked upcast of a 16-bit w_up (V not a multiple of the chunk)."""
    monkeypatch.setattr(reference, "_CHUNK_V", 96)
    h, w_down, w_up = _random(3, 37, torch.bfloat16)
    torch.testing.assert_close(reference.lowrank_logits_fp32(h, w_down, w_up).double(), _exact(h, w_down, w_up),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fallback_path_equals_reference(dtype, monkeypatch):
    """Catches the dispatcher's torch path diverging from reference.py (reshaping, dtype, selection rule)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w_down, w_up = _integer_inputs(6, 37, dtype)
    h3 = h.reshape(2, 3, D)
    ref_logits = reference.lowrank_logits(h, w_down, w_up).reshape(2, 3, V)
    assert torch.equal(kernels.lowrank_logits(h3, w_down, w_up), ref_logits)
    ref_argmax = reference.lowrank_argmax(h, w_down, w_up).reshape(2, 3)
    assert torch.equal(kernels.lowrank_argmax(h3, w_down, w_up), ref_argmax)
    values, indices = kernels.lowrank_topk(h3, w_down, w_up, 5)
    ref_values, ref_indices = reference.lowrank_topk(h, w_down, w_up, 5)
    assert torch.equal(values, ref_values.reshape(2, 3, 5)) and torch.equal(indices, ref_indices.reshape(2, 3, 5))
    expected = torch.argmax(_exact(h, w_down, w_up), -1)
    assert torch.equal(kernels.lowrank_argmax(h, w_down, w_up, backend="torch"), expected)


def test_reference_ties_and_nan():
    """Catches a fallback whose tie/NaN rule differs from torch.argmax (lowest index; first NaN wins)."""
    h, w_down, w_up = _integer_inputs(2, 37, torch.float32)
    w_up[:] = 0.0
    assert reference.lowrank_argmax(h, w_down, w_up).tolist() == [0, 0]
    w_up[700] = float("nan")
    w_up[650] = float("nan")
    assert reference.lowrank_argmax(h, w_down, w_up).tolist() == [650, 650]


def test_input_validation():
    """Catches silent broadcasting of mismatched shapes, mixed dtypes, or integer inputs."""
    h, w_down, w_up = _random(2, 8, torch.float32, vocab=10)
    with pytest.raises(ValueError):
        kernels.lowrank_logits(h[:, :-1], w_down, w_up)
    with pytest.raises(ValueError):
        kernels.lowrank_logits(h, w_down, w_up[:, :-1])
    with pytest.raises(TypeError):
        kernels.lowrank_argmax(h, w_down.half(), w_up)
    with pytest.raises(TypeError):
        kernels.lowrank_argmax(h.long(), w_down.long(), w_up.long())
    with pytest.raises(ValueError):
        kernels.lowrank_topk(h, w_down, w_up, 11)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter


def test_triton_smoke_via_dispatcher(tlr):
    """Catches the auto dispatcher not reaching Triton under TRITON_INTERPRET=1, or the default tile heuristic
    producing wrong results at odd shapes (leading dims, B = 3, r = 37)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    h, w_down, w_up, winners = _planted(3, 37, torch.float16)
    assert kernels.active_backend(h) == "triton"
    h3 = h.reshape(1, 3, D)
    logits = kernels.lowrank_logits(h3, w_down, w_up)
    assert logits.shape == (1, 3, V) and logits.dtype == torch.float16
    torch.testing.assert_close(logits[0].double(), _exact(h, w_down, w_up), rtol=2e-3, atol=2e-3)
    assert torch.equal(kernels.lowrank_argmax(h3, w_down, w_up)[0], winners)
    assert isinstance(kernels.lowrank_argmax(h, w_down, w_up), torch.Tensor)


@pytest.mark.parametrize("path", ["fma", "dot"])
def test_triton_strided_inputs(tlr, path):
    """Catches kernels that assume contiguous tensors (a stride swapped or dropped): h is every other row of a
    larger tensor, w_down and w_up are transposed views (rank / hidden stride != 1)."""
    h, w_down, w_up, winners = _planted(3, 37, torch.float32)
    h_strided = torch.zeros(6, D)
    h_strided[::2] = h
    w_down_t = w_down.T.contiguous().T
    w_up_t = w_up.T.contiguous().T
    assert w_up_t.stride() == (1, V) and w_down_t.stride() == (1, 37)
    cfg = _config(tlr, 3, path)
    logits = tlr.lowrank_logits(h_strided[::2], w_down_t, w_up_t, config=cfg)
    torch.testing.assert_close(logits.double(), _exact(h, w_down, w_up), rtol=1e-5, atol=1e-5)
    assert torch.equal(tlr.lowrank_argmax(h_strided[::2], w_down_t, w_up_t, config=cfg), winners)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rank", [72, 37])
@pytest.mark.parametrize(("batch", "path"), CASES)
def test_triton_logits_and_argmax_odd_shapes(tlr, batch, path, rank, dtype):
    """Catches wrong masking of the partial last V tile / rank chunk / d chunk / row block, 16-bit accumulation,
    a wrong tile -> global index mapping, and a reduction that picks the wrong tile: float32 logits within fp32
    accumulation error of float64, stored logits within one output rounding, argmax == float64 argmax on
    planted clear winners (some on tile edges and in the last partial tile)."""
    h, w_down, w_up, winners = _planted(batch, rank, dtype, seed=rank + batch)
    cfg = _config(tlr, batch, path)
    exact = _exact(h, w_down, w_up)
    logits32 = tlr.lowrank_logits(h, w_down, w_up, out_dtype=torch.float32, config=cfg)
    scale = exact.abs().max().item()
    assert (logits32.double() - exact).abs().max().item() <= 1e-4 * scale
    logits = tlr.lowrank_logits(h, w_down, w_up, config=cfg)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits.double(), exact, rtol=OUT_TOL[dtype][0], atol=OUT_TOL[dtype][1] * scale)
    top2 = exact.topk(2, dim=-1).values
    assert bool(((top2[:, 0] - top2[:, 1]) > 0.05 * top2[:, 0].abs()).all()), "test data: winners not clear"
    expected = torch.argmax(exact, dim=-1)
    assert torch.equal(expected, winners)
    argmax = tlr.lowrank_argmax(h, w_down, w_up, config=cfg)
    assert argmax.dtype == torch.int64 and torch.equal(argmax, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_triton_dot_path_keeps_z_precision(tlr, dtype):
    """Catches the tl.dot path rounding z = h @ w_down.T to 16 bits (error ~4e-3 relative for bf16, 2e-4 for
    fp16): with the hi/lo split the float32 logits stay within 1e-4 of float64, like the FMA path."""
    h, w_down, w_up = _random(64, 72, dtype, seed=3)
    exact = _exact(h, w_down, w_up)
    logits32 = tlr.lowrank_logits(h, w_down, w_up, out_dtype=torch.float32, config=_config(tlr, 64, "dot"))
    assert (logits32.double() - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()


def test_triton_fp16_dot_path_with_large_z(tlr):
    """Catches the fp16 tl.dot path turning |z| > 65504 into inf (z's fp16 high half) and then NaN: logits all
    NaN and argmax the first index, on batches above the FMA path's only, while the FMA path and the reference
    were right. Rows of z are scaled by a power of two into fp16's range and the results scaled back."""
    h, w_down, w_up = _random(8, 72, torch.float16, seed=5)
    h, w_down = h * 300, w_down * 100  # |z| up to ~1e5, beyond fp16
    h[1] = 0  # one row far smaller than the others keeps its own scale
    exact = _exact(h, w_down, w_up)
    assert (h.double() @ w_down.double().T).abs().max() > 65504
    cfg = _config(tlr, 8, "dot")
    logits32 = tlr.lowrank_logits(h, w_down, w_up, out_dtype=torch.float32, config=cfg)
    assert torch.isfinite(logits32).all()
    assert (logits32.double() - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()
    assert torch.equal(tlr.lowrank_argmax(h, w_down, w_up, config=cfg), exact.argmax(-1))
    values, indices = tlr.lowrank_topk(h, w_down, w_up, 3, config=cfg)
    top = exact.topk(3, dim=-1)
    assert torch.equal(indices, top.indices)
    # fp16 values, as the reference returns them: beyond 65504 they are inf in both
    torch.testing.assert_close(values.double(), top.values.half().double(), rtol=2e-3, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("path", ["fma", "dot"])
def test_triton_argmax_ties_lowest_index(tlr, path, dtype):
    """Catches tie-breaking that is not torch.argmax's (lowest index): exact integer logits with the winning
    w_up row duplicated inside one tile (130, 131), across tiles (515), in the partial last tile (999), and
    on a tile boundary (255 | 256); the reduction runs in 2-tile chunks, so a later chunk with an equal max
    must not replace an earlier one. Also all-equal negative logits: the partial last tile's masked columns
    (accumulator 0) must never win."""
    cfg = replace(_config(tlr, 3, path), reduce_block_t=2)
    h, w_down, w_up = _integer_inputs(3, 37, dtype, seed=1)
    z = h.double() @ w_down.double().T
    copies = {0: [999, 515, 131, 130], 1: [999, 640], 2: [256, 255]}
    for b, rows in copies.items():
        for j in rows:
            w_up[j] = (2 * torch.sign(z[b])).to(dtype)
    expected = torch.argmax(_exact(h, w_down, w_up), dim=-1)
    assert expected.tolist() == [130, 640, 255]
    assert torch.equal(tlr.lowrank_argmax(h, w_down, w_up, config=cfg), expected)
    w_up[:] = -torch.sign(z[0]).to(dtype)  # every w_up row equal: row 0's logits all equal and negative
    expected = torch.argmax(_exact(h, w_down, w_up), dim=-1)
    assert expected.tolist() == [0, 0, 0]
    assert torch.equal(tlr.lowrank_argmax(h, w_down, w_up, config=cfg), expected)


@pytest.mark.parametrize(("dtype", "path"), [(torch.float32, "fma"), (torch.bfloat16, "dot")],
                         ids=["fp32-fma", "bf16-dot"])
def test_triton_argmax_nan_like_torch(tlr, dtype, path):
    """Catches NaN handling that differs from torch.argmax (a NaN logit wins, first NaN index): NaN rows of w_up
    at 650 and 700 (two tiles; both beat the planted finite winners), and a NaN hidden state (all logits NaN:
    index 0)."""
    h, w_down, w_up, _ = _planted(3, 37, dtype)
    w_up[700] = float("nan")
    w_up[650] = float("nan")
    h[1] = float("nan")
    exact = _exact(h, w_down, w_up)
    expected = torch.argmax(exact, dim=-1)
    assert expected.tolist() == [650, 0, 650]
    for block_t in (1024, 2):  # NaN tile found within one reduction chunk / in a later chunk
        cfg = replace(_config(tlr, 3, path), reduce_block_t=block_t)
        assert torch.equal(tlr.lowrank_argmax(h, w_down, w_up, config=cfg), expected)
    assert torch.equal(reference.lowrank_argmax(h, w_down, w_up), expected)


@pytest.mark.parametrize(("batch", "path", "dtype"), [(3, "fma", torch.bfloat16), (64, "dot", torch.float16)],
                         ids=["3-fma-bf16", "64-dot-fp16"])
def test_triton_topk_matches_stable_sort(tlr, batch, path, dtype):
    """Catches per-tile top-k bugs (re-picking a taken entry, losing candidates of the partial last tile, merge
    order): on exact integer logits with many ties, indices and values equal a float64 stable descending sort
    (largest first, equal values in index order)."""
    h, w_down, w_up = _integer_inputs(batch, 37, dtype, seed=2)
    exact = _exact(h, w_down, w_up)
    ref_values, ref_indices = torch.sort(exact, dim=-1, descending=True, stable=True)
    values, indices = tlr.lowrank_topk(h, w_down, w_up, 6, config=_config(tlr, batch, path))
    assert indices.dtype == torch.int64 and values.dtype == dtype
    assert torch.equal(indices, ref_indices[:, :6])
    assert torch.equal(values.double(), ref_values[:, :6])


def test_triton_topk_nan_above_inf_like_torch(tlr):
    """Catches a per-tile top-k that ranks NaN level with +inf (the lower index won: +inf at 3 before NaN at 20 in
    one tile), where torch.sort, the merge and lowrank_argmax put NaN first."""
    h, w_down = torch.ones(1, 4), torch.ones(1, 4)
    w_up = torch.randn(40, 1, generator=torch.Generator().manual_seed(0))
    w_up[3], w_up[20] = float("inf"), float("nan")
    exact = _exact(h, w_down, w_up)
    _, ref_indices = torch.sort(exact, dim=-1, descending=True, stable=True)
    assert ref_indices[0, :2].tolist() == [20, 3]
    cfg = tlr.TileConfig(block_b=2, block_v=64, block_r=8, use_dot=False, z_block_r=4, z_block_d=16)
    for k in (1, 3):  # k = 1: the NaN must be the tile's one candidate (the merge cannot reorder what is missing)
        values, indices = tlr.lowrank_topk(h, w_down, w_up, k, config=cfg)
        assert torch.equal(indices, ref_indices[:, :k]) and values[0, 0].isnan(), (k, indices)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the -3e38 row overflows on purpose
def test_triton_topk_small_vocab_and_large_k(tlr):
    """Catches out-of-range picks leaking when a tile has fewer valid entries than k (V = 20, BLOCK_V = 16,
    k = 8; and V = 6, BLOCK_V = 4, k = 6 with a -inf logit that must rank before the padding picks), and the
    k > 32 fallback through float32 logits."""
    h, w_down, w_up = _random(2, 12, torch.float32, seed=4, vocab=20)
    exact = _exact(h, w_down, w_up)
    ref_values, ref_indices = torch.sort(exact, dim=-1, descending=True, stable=True)
    cfg = tlr.TileConfig(block_b=2, block_v=16, block_r=8, use_dot=False, z_block_r=4, z_block_d=16)
    values, indices = tlr.lowrank_topk(h, w_down, w_up, 8, config=cfg)
    assert torch.equal(indices, ref_indices[:, :8])
    torch.testing.assert_close(values.double(), ref_values[:, :8], rtol=1e-5, atol=1e-5)
    h, w_down = torch.ones(1, 2), torch.eye(2)
    w_up = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, -1.0], [-2.0, 0.0], [-3e38, -3e38]])
    cfg = tlr.TileConfig(block_b=1, block_v=4, block_r=2, use_dot=False, z_block_r=2, z_block_d=2)
    values, indices = tlr.lowrank_topk(h, w_down, w_up, 6, config=cfg)
    assert indices.tolist() == [[2, 1, 0, 3, 4, 5]] and values[0, -1].item() == float("-inf")
    h, w_down, w_up = _random(2, 12, torch.float32, seed=5, vocab=100)
    exact = _exact(h, w_down, w_up)
    values, indices = tlr.lowrank_topk(h, w_down, w_up, 40)
    assert torch.equal(indices, torch.sort(exact, dim=-1, descending=True, stable=True).indices[:, :40])


def test_triton_empty_batch(tlr):
    """Catches a launch with an empty grid (B = 0) crashing instead of returning empty results."""
    h, w_down, w_up = _random(0, 12, torch.float32, vocab=50)
    assert tlr.lowrank_logits(h, w_down, w_up).shape == (0, 50)
    assert tlr.lowrank_argmax(h, w_down, w_up).shape == (0,)
    values, indices = tlr.lowrank_topk(h, w_down, w_up, 3)
    assert values.shape == indices.shape == (0, 3)


# ----------------------------------------------------------------------------------------------------------
# ahead-of-time compilation for the H200 (no GPU needed)


def _compile_for_sm90() -> None:
    """Compile every kernel variant the default configs launch for sm_90 (Triton -> PTX -> cubin with the
    bundled ptxas). Runs in a fresh process without TRITON_INTERPRET (interpreted kernels cannot compile)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from slimspec.kernels import triton_lowrank as tlr

    target = GPUTarget("cuda", 90, 32)
    ones = {"stride_wr", "stride_hd", "stride_wd"}  # contiguous last dims: Triton specializes stride == 1
    aligned = {"h_ptr", "w_ptr", "z_ptr", "out_ptr", "pmax_ptr", "pidx_ptr", "pval_ptr", "stride_hb", "stride_zb",
               "stride_wv", "stride_ob", "R", "D"}

    def build(fn, types: dict[str, str], constexprs: dict[str, object], cfg) -> None:
        constexprs = {**constexprs, **{name: 1 for name in fn.arg_names if name in ones}}
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n in aligned and n not in constexprs}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(source, target=target,
                                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        assert kernel.asm.get("cubin"), fn.__name__

    for dtype, name, batch in [(torch.bfloat16, "bf16", 1), (torch.bfloat16, "bf16", 3), (torch.bfloat16, "bf16", 64),
                               (torch.float16, "fp16", 16), (torch.float32, "fp32", 64)]:
        cfg = tlr.default_config(batch, dtype)
        flags = tlr._flags(dtype, cfg)
        blocks = {"BLOCK_B": cfg.block_b, "BLOCK_V": cfg.block_v, "BLOCK_R": cfg.block_r}
        build(tlr._down_proj_kernel, {"h_ptr": f"*{name}", "w_ptr": f"*{name}", "z_ptr": "*fp32"},
              {"BLOCK_B": cfg.block_b, "BLOCK_R": cfg.z_block_r, "BLOCK_D": cfg.z_block_d, "USE_DOT": cfg.use_dot,
               "DOT_F32": False, "IEEE": flags["IEEE"]}, cfg)
        build(tlr._logits_kernel, {"z_ptr": "*fp32", "w_ptr": f"*{name}", "out_ptr": f"*{name}"},
              {**blocks, **flags}, cfg)
        build(tlr._argmax_tile_kernel, {"z_ptr": "*fp32", "w_ptr": f"*{name}", "pmax_ptr": "*fp32",
                                        "pidx_ptr": "*i32"}, {**blocks, **flags}, cfg)
        build(tlr._topk_tile_kernel, {"z_ptr": "*fp32", "w_ptr": f"*{name}", "pval_ptr": "*fp32",
                                      "pidx_ptr": "*i32"}, {**blocks, **flags, "K": 4}, cfg)
    build(tlr._argmax_reduce_kernel, {"pmax_ptr": "*fp32", "pidx_ptr": "*i32", "out_ptr": "*i64"},
          {"BLOCK_T": 1024}, tlr.default_config(1, torch.bfloat16))


@pytest.mark.slow
@pytest.mark.skipif(_triton_missing(), reason="triton is not installed")
def test_kernels_compile_for_sm90(tmp_path):
    """Catches what the interpreter cannot see: code that does not lower to GPU code (tl.dot shape/dtype limits,
    layouts of the 3-D FMA tile, scalar loop-carried values, bitcasts) — every default variant must compile
    for the H200's sm_90 with Triton's bundled ptxas, no GPU needed."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    code = "from tests.unit.test_kernels import _compile_for_sm90; _compile_for_sm90()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
