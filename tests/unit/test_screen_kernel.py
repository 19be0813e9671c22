"""slimspec.kernels.screen: the screen-and-rescore head's three paths against a float64 reference.

Odd shapes throughout: V = 1000, d = 96, r = 7, K = 13, N = 5 hot ids, B in {1, 3}. The Triton path runs under
``TRITON_INTERPRET=1`` (set before its modules are imported); its gathered kernel is also run with 4-entry blocks
and a 64-wide hidden chunk, so the shortlist spans several blocks and the last hidden chunk is partial.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from slimspec import kernels
from slimspec.kernels import screen

V, D, R, K = 1000, 96, 7, 13
HOT = torch.tensor([5, 17, 999, 3, 400])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


@pytest.fixture(scope="module")
def tsc():
    """slimspec.kernels.triton_screen (and the low-rank kernels it uses) imported with TRITON_INTERPRET=1."""
    if not kernels.triton_available():
        if os.environ.get("SLIMSPEC_REQUIRE_VLLM") == "1":
            pytest.fail("triton is not installed, and make test requires the whole suite")
        pytest.skip("triton is not installed")
    names = ("slimspec.kernels.triton_screen", "slimspec.kernels.triton_lowrank")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        for name in names:
            sys.modules.pop(name, None)
        module = importlib.import_module(names[0])
        assert module.triton_lowrank._interpreted(), "kernels were not built by the interpreter"
        yield module
        for name in names:
            sys.modules.pop(name, None)
            if hasattr(kernels, name.rsplit(".", 1)[1]):
                delattr(kernels, name.rsplit(".", 1)[1])


def _float64(h, w_down, w_up, w_exact, k, hot):
    """Ground truth in float64: top k by a stable descending sort, the hot ids, exact argmax (lowest id on ties)."""
    screen_values = (h.double() @ w_down.double().T) @ w_up.double().T
    ids = torch.sort(screen_values, dim=-1, descending=True, stable=True).indices[:, :k]
    if hot is not None:
        ids = torch.cat([ids, hot.expand(h.shape[0], -1)], dim=1)
    exact = torch.einsum("bkd,bd->bk", w_exact.double()[ids], h.double())
    best = exact.max(dim=-1, keepdim=True).values
    tokens = torch.where(exact == best, ids, V).min(dim=-1).values
    return tokens, screen_values.scatter(1, ids, exact), ids


def _random(batch, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, D, generator=g)
    w_down = torch.randn(R, D, generator=g) / D**0.5
    w_up = torch.randn(V, R, generator=g) / R**0.5
    w_exact = torch.randn(V, D, generator=g) / D**0.5
    return [t.to(dtype) for t in (h, w_down, w_up, w_exact)]


def _integers(batch, dtype, seed=0):
    """Inputs in {-1, 0, 1}: every screen and exact value is a small integer, exact in every dtype and summation
    order, so equal values (ties) are everywhere."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, D), (R, D), (V, R), (V, D)]
    return [torch.randint(-1, 2, shape, generator=g).to(dtype) for shape in shapes]


def _paths(tsc):
    paths = {"reference": screen.screen_rescore_reference, "torch": screen.screen_rescore_torch}
    if tsc is not None:
        paths["triton"] = screen.screen_rescore_triton
    return paths


@pytest.mark.parametrize("batch", [1, 3])
def test_paths_match_float64_at_odd_shapes(tsc, batch):
    """Catches a wrong shortlist (top K + hot ids), rescoring against the wrong rows or hidden state, a two-level
    logits tensor with exact values at the wrong ids or the screen wrong elsewhere: fp32 tokens equal float64's and
    the logits lie within fp32 rounding of float64's, on every path."""
    inputs = _random(batch, torch.float32, seed=batch)
    tokens64, logits64, ids64 = _float64(*inputs, K, HOT)
    for name, fn in _paths(tsc).items():
        tokens, logits = fn(*inputs, K, HOT)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, tokens64), name
        assert logits.shape == (batch, V) and logits.dtype == torch.float32
        torch.testing.assert_close(logits.double(), logits64, rtol=1e-5, atol=1e-5, msg=name)
    # the tokens differ from the plain argmax of the pair on this data: the rescoring decided
    pair_argmax = ((inputs[0].double() @ inputs[1].double().T) @ inputs[2].double().T).argmax(-1)
    assert not torch.equal(pair_argmax, tokens64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ties_go_to_the_lower_id(tsc, dtype):
    """Catches tie-breaking other than the contract's lower id, in the selection (which of equal screen values at
    the K-th place enter the shortlist: torch.topk alone picks arbitrarily) and in the exact argmax (across the
    gathered kernel's blocks too); and hot ids overlapping the top K: on integer inputs, where ties are everywhere,
    every path's tokens and logits equal float64's exactly."""
    inputs = _integers(3, dtype, seed=1)
    screen64 = (inputs[0].double() @ inputs[1].double().T) @ inputs[2].double().T
    assert screen64.abs().max() < 256, "test data: screen values must be exact in bf16"
    kth = torch.sort(screen64, dim=-1, descending=True).values[:, K - 1:K]
    assert bool(((screen64 == kth).sum(-1) > 1).all()), "test data: no tie at the K-th place"
    tokens64, logits64, ids64 = _float64(*inputs, K, HOT)
    hot = torch.cat([HOT, ids64[0, :2]])  # two of row 0's top K are hot ids too
    tokens64, logits64, _ = _float64(*inputs, K, hot)
    exact = logits64.gather(1, torch.cat([ids64[:, :K], hot.expand(3, -1)], 1))
    assert bool(((exact == exact.max(-1, keepdim=True).values).sum(-1) > 1).any()), "test data: no exact tie"
    for name, fn in _paths(tsc).items():
        tokens, logits = fn(*inputs, K, hot)
        assert torch.equal(tokens, tokens64), name
        assert logits.dtype == dtype and torch.equal(logits.double(), logits64), name


def test_gathered_kernel_blocks_and_partial_chunks(tsc):
    """Catches a reduction across the gathered kernel's blocks that keeps a later block's equal maximum (a higher
    id), masked shortlist slots of the last partial block or the last partial hidden chunk leaking into the dots:
    4-entry blocks over 18 slots, a 64-wide chunk over d = 96."""
    h, _, _, w_exact = _integers(3, torch.float32, seed=2)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:54].view(3, 18)
    exact = torch.einsum("bkd,bd->bk", w_exact.double()[ids], h.double())
    logits = torch.full((3, V), -1e9)
    tokens = tsc.rescore(h, w_exact, ids, logits, block_m=4, block_d=64)
    best = exact.max(-1, keepdim=True).values
    assert torch.equal(tokens, torch.where(exact == best, ids, V).min(-1).values)
    assert torch.equal(logits.gather(1, ids).double(), exact)
    untouched = torch.ones(3, V, dtype=torch.bool).scatter(1, ids, False)
    assert bool((logits[untouched] == -1e9).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_inputs_accumulate_in_float32(tsc, dtype):
    """Catches 16-bit accumulation of the exact rescoring (bf16 sums of 96 products lose ~1e-2 relative): on
    random 16-bit inputs every path's tokens equal float64's and the exact logits lie within one output rounding."""
    inputs = _random(3, dtype, seed=4)
    tokens64, logits64, ids64 = _float64(*inputs, K, HOT)
    for name, fn in _paths(tsc).items():
        tokens, logits = fn(*inputs, K, HOT)
        assert torch.equal(tokens, tokens64), name
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
        torch.testing.assert_close(logits.double().gather(1, ids64), logits64.gather(1, ids64), rtol=tol, atol=tol)


def test_no_hot_ids_and_empty_batch(tsc):
    """Catches hot_ids=None / an empty hot set or an empty batch crashing (an empty Triton grid, a cat of nothing)."""
    inputs = _random(2, torch.float32, seed=5)
    tokens64, _, _ = _float64(*inputs, K, None)
    empty = _random(0, torch.float32)
    for name, fn in _paths(tsc).items():
        assert torch.equal(fn(*inputs, K, None)[0], tokens64), name
        assert torch.equal(fn(*inputs, K, torch.empty(0, dtype=torch.long))[0], tokens64), name
        tokens, logits = fn(*empty, K, HOT)
        assert tokens.shape == (0,) and logits.shape == (0, V), name


def test_topk_lower_ids_threshold():
    """Catches the selection's tie rule: with 5 values equal at the 3rd place, the lowest ids among them fill it."""
    values = torch.tensor([[0.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    picked = screen.topk_lower_ids(values, 3).sort(-1).values
    assert picked.tolist() == [[1, 2, 4], [0, 1, 2]]


def test_dispatch_and_validation():
    """Catches the CPU dispatcher taking a path other than the fast torch one, the torch path losing gradients
    (training uses it), and bad inputs passing silently."""
    h, w_down, w_up, w_exact = _random(2, torch.float32, seed=6)
    env_interpret = kernels.interpreting()
    tokens, logits = screen.screen_rescore(h, w_down, w_up, w_exact, K, HOT)
    assert torch.equal(tokens, _float64(h, w_down, w_up, w_exact, K, HOT)[0]) or env_interpret
    w_up.requires_grad_(True)
    w_exact.requires_grad_(True)
    _, logits = screen.screen_rescore(h, w_down, w_up, w_exact, K, HOT)
    logits.sum().backward()
    assert w_up.grad is not None and w_exact.grad is not None and w_exact.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="shortlist"):
        screen.screen_rescore(h, w_down, w_up, w_exact, V + 1)
    with pytest.raises(ValueError, match="hot_ids"):
        screen.screen_rescore(h, w_down, w_up, w_exact, K, torch.tensor([V]))
    with pytest.raises(ValueError, match="shape mismatch"):
        screen.screen_rescore(h, w_down, w_up, w_exact[:, :-1], K)
    with pytest.raises(TypeError):
        screen.screen_rescore(h.double(), w_down, w_up, w_exact, K)
    assert screen.screen_share(32000, 4096, 256, 256) == pytest.approx((256 * 36096 + 256 * 4096) / (32000 * 4096))



def test_served_logits_argmax_is_the_shortlist_argmax():
    """Catches serving the two-level logits raw to an engine that drafts their argmax: a screen value outside the
    shortlist above its exact maximum (row 0) or equal to it at a lower id (row 1) would be drafted. After
    served_logits the argmax is the shortlist's token and only values at or above it moved, to just below it."""
    h, w_down, w_up, w_exact = _random(2, torch.float32, seed=8)
    w_up = w_up * 4  # a loud screen: outside values beat the exact maximum
    tokens, logits = screen.screen_rescore_reference(h, w_down, w_up, w_exact, K, HOT)
    assert not torch.equal(logits.argmax(-1), tokens), "test data: the raw argmax already agrees"
    best = logits.gather(1, tokens[:, None])
    logits[1, 0] = best[1, 0]  # a tie at a lower id than row 1's token
    assert tokens[1] > 0
    served = screen.served_logits(logits.clone(), tokens)
    assert torch.equal(served.argmax(-1), tokens)
    moved = served != logits
    assert torch.equal(moved, (logits >= best) & (torch.arange(V) != tokens[:, None]))
    assert bool((served[moved] == torch.nextafter(best, torch.tensor(-1e30)).expand_as(served)[moved]).all())


def test_rescore_screen_of_a_given_screen():
    """Catches the serving entry point (a screen computed by the engine's own layers) disagreeing with the op:
    tokens and two-level logits equal the reference's, and a logit scale multiplies the exact values only."""
    h, w_down, w_up, w_exact = _random(3, torch.float32, seed=9)
    tokens64, logits64, ids64 = _float64(h, w_down, w_up, w_exact, K, HOT)
    given = (h @ w_down.T) @ w_up.T
    tokens, logits = screen.rescore_screen(h, given.clone(), w_exact, K, HOT)
    assert torch.equal(tokens, tokens64)
    torch.testing.assert_close(logits.double(), logits64, rtol=1e-5, atol=1e-5)
    _, scaled = screen.rescore_screen(h, given.clone(), w_exact, K, HOT, scale=0.5)
    torch.testing.assert_close(scaled.double().gather(1, ids64), 0.5 * logits64.gather(1, ids64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        screen.rescore_screen(h, given.double(), w_exact, K, HOT)


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from slimspec.kernels import triton_screen as ts

fn = ts._rescore_kernel
for name in ("bf16", "fp16", "fp32"):
    types = {"h_ptr": f"*{name}", "w_ptr": f"*{name}", "ids_ptr": "*i64", "logits_ptr": "*fp32", "pmax_ptr": "*fp32",
             "pid_ptr": "*i64"}
    constexprs = {"BLOCK_M": ts.BLOCK_M, "BLOCK_D": ts.BLOCK_D, "stride_hd": 1, "stride_wd": 1}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm.get("cubin"), name
"""


@pytest.mark.slow
def test_gathered_kernel_compiles_for_sm90(tmp_path):
    """Catches what the interpreter cannot see: a gathered rescoring kernel that does not lower to GPU code (the
    indexed 2-D loads, the int64 id reduction) — it must compile for the H200's sm_90 in every dtype, no GPU
    needed."""
    if not kernels.triton_available():
        pytest.skip("triton is not installed")
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
