"""Triton kernels for the low-rank LM head: logits, fused argmax and fused top-k.

Pipeline (3 launches for argmax):

1. ``_down_proj_kernel``: ``z = h @ w_down.T`` -> [B, r] float32 (tiny; fp32 accumulation, z kept in fp32).
2. a V-tiled kernel: each program owns ``BLOCK_B`` rows x ``BLOCK_V`` vocabulary entries and loops over r in
   ``BLOCK_R`` chunks, accumulating ``z @ w_up_tile.T`` in float32. Its epilogue either stores the logits
   (``_logits_kernel``) or only a per-tile (max, index) pair (``_argmax_tile_kernel``) / the tile's top K
   (``_topk_tile_kernel``): the [B, V] logits never reach memory.
3. ``_argmax_reduce_kernel`` picks, per row, the best tile (one program per row); top-k merges in torch.

Two inner-product paths, chosen per call by ``TileConfig.use_dot``:

* FMA (small B, decode): broadcast-multiply and ``tl.sum`` in float32; a GEMV streaming w_up once.
* ``tl.dot`` (B > 4): tensor cores. For 16-bit weights z is split into ``hi + lo`` halves of the weight
  dtype and both are multiplied (2 MMAs), so z keeps ~16 mantissa bits instead of being rounded to
  bf16: both paths agree to ~1e-5 relative. fp32 weights use ``input_precision="ieee"`` (no TF32).

Ties: lowest index among equal maxima (``tie_break_left`` inside a tile, strict ``>`` across tiles in index
order), as ``torch.argmax``. NaN: a NaN logit wins and the first NaN index is returned, as ``torch.argmax``.

Limits: on the fp16 tl.dot path z_hi is an fp16 value, so rows of z beyond 2**14 are divided by a power of two
first and the results multiplied back (exact; fp16 logits beyond 65504 are inf, as the reference's are);
indices are int32 inside the kernels (V < 2**31); top-k fuses k <= 32.

Interpreter (``TRITON_INTERPRET=1``): Triton 3.9's interpreter multiplies the raw bit patterns of bfloat16
``tl.dot`` operands (triton-lang/triton#11584, not supported upstream) and also mis-evaluates bf16
arithmetic; the kernels only convert bf16 values, never compute on them, and under the interpreter bf16 dot
operands are upcast to float32 first (exact; ``DOT_F32``). Compiled GPU code never takes that branch. The
interpreter also truncates float32 -> bfloat16 conversions (GPU: round to nearest even), so interpreted bf16
results can differ from torch's by one bf16 ulp, and its argmax always returns the leftmost maximum whatever
``tie_break_left`` says: compiled tie-breaking is checked by ``scripts/gpu_bench.py`` on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_FMA_MAX_B = 4  # up to this many rows per call: FMA path; above: tl.dot path
_MAX_TOPK = 32  # fused top-k up to this k; larger k goes through fp32 logits + torch.sort
_INT32_MIN: tl.constexpr = tl.constexpr(-(2**31))
_INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters; ``default_config`` picks them from B and the dtype."""

    block_b: int  # rows per program (power of 2; >= 16 when use_dot)
    block_v: int  # vocabulary entries per program (power of 2; >= 16 when use_dot)
    block_r: int  # rank chunk of the inner loop (power of 2; >= 16 when use_dot)
    use_dot: bool
    split_z: bool = True  # dot path, 16-bit weights: z as hi + lo halves (2 MMAs) instead of rounded once
    num_warps: int = 4
    num_stages: int = 3
    z_block_r: int = 16  # down-projection kernel: r per program
    z_block_d: int = 64  # down-projection kernel: d chunk
    reduce_block_t: int = 1024  # argmax reduction kernel: tiles per chunk (at most; fewer when there are fewer)


def default_config(batch: int, dtype: torch.dtype) -> TileConfig:
    """Heuristic tiles (untuned: ``scripts/gpu_bench.py`` sweeps alternatives on a GPU)."""
    del dtype  # same tiles for every dtype for now
    if batch <= _FMA_MAX_B:
        block_b = triton.next_power_of_2(max(batch, 1))
        # z kernel: r / 2 = 256 programs for r = 512, each streaming 2 rows of w_down in <= 2048-wide chunks
        return TileConfig(block_b=block_b, block_v=128 // block_b, block_r=64, use_dot=False,
                          num_warps=4, num_stages=3, z_block_r=2, z_block_d=2048 // block_b)
    block_b = min(64, max(16, triton.next_power_of_2(batch)))
    return TileConfig(block_b=block_b, block_v=128, block_r=64, use_dot=True,
                      num_warps=8 if block_b >= 64 else 4, num_stages=3, z_block_r=16, z_block_d=128)


# ----------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with float32 accumulation (see the module docstring for DOT_F32 / IEEE)."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _down_proj_kernel(h_ptr, w_ptr, z_ptr, B, R, D,
                      stride_hb, stride_hd, stride_wr, stride_wd, stride_zb,
                      BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """z[B, R] (float32) = h[B, D] @ w[R, D].T; grid (cdiv(R, BLOCK_R), cdiv(B, BLOCK_B))."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_r = offs_r < R
    mask_b = offs_b < B
    h_rows = h_ptr + offs_b.to(tl.int64)[:, None] * stride_hb
    w_rows = w_ptr + offs_r.to(tl.int64)[:, None] * stride_wr
    acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = tl.load(h_rows + offs_d[None, :] * stride_hd, mask=mask_b[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(w_rows + offs_d[None, :] * stride_wd, mask=mask_r[:, None] & mask_d[None, :], other=0.0)
        if USE_DOT:
            acc = _mma(h, tl.trans(w), acc, DOT_F32, IEEE)
        elif BLOCK_B == 1:  # 2-D layout for the single-row GEMV (decode)
            acc += tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    z_ptrs = z_ptr + offs_b.to(tl.int64)[:, None] * stride_zb + offs_r[None, :]
    tl.store(z_ptrs, acc, mask=mask_b[:, None] & mask_r[None, :])


@triton.jit
def _logits_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
                 BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                 USE_DOT: tl.constexpr, SPLIT_Z: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """float32 [BLOCK_B, BLOCK_V] tile of z @ w_up.T (rows offs_b, vocabulary offs_v); masked entries are 0."""
    if USE_DOT:
        acc = _dot_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
                        BLOCK_B, BLOCK_V, BLOCK_R, SPLIT_Z, DOT_F32, IEEE)
    else:
        acc = _fma_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
                        BLOCK_B, BLOCK_V, BLOCK_R)
    return acc


@triton.jit
def _dot_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
              BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
              SPLIT_Z: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """Tensor-core tile: per rank chunk, acc += z_chunk @ w_chunk.T (z as hi + lo halves when SPLIT_Z)."""
    mask_b = offs_b < B
    mask_v = offs_v < V
    z_rows = z_ptr + offs_b.to(tl.int64)[:, None] * stride_zb
    w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        z = tl.load(z_rows + offs_r[None, :], mask=mask_b[:, None] & mask_r[None, :], other=0.0)
        w = tl.load(w_rows + offs_r[None, :] * stride_wr, mask=mask_v[:, None] & mask_r[None, :], other=0.0)
        wt = tl.trans(w)
        if SPLIT_Z:
            z_hi = z.to(w.dtype)
            z_lo = (z - z_hi.to(tl.float32)).to(w.dtype)
            acc = _mma(z_hi, wt, acc, DOT_F32, IEEE)
            acc = _mma(z_lo, wt, acc, DOT_F32, IEEE)
        else:
            acc = _mma(z.to(w.dtype), wt, acc, DOT_F32, IEEE)
    return acc


@triton.jit
def _fma_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
              BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """CUDA-core tile for a few rows (GEMV-like): float32 multiply-adds, reduced over each rank chunk."""
    mask_b = offs_b < B
    mask_v = offs_v < V
    z_rows = z_ptr + offs_b.to(tl.int64)[:, None] * stride_zb
    w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        w = tl.load(w_rows + offs_r[None, :] * stride_wr, mask=mask_v[:, None] & mask_r[None, :], other=0.0)
        z = tl.load(z_rows + offs_r[None, :], mask=mask_b[:, None] & mask_r[None, :], other=0.0)
        if BLOCK_B == 1:  # 2-D layout for the single-row GEMV (decode)
            acc += tl.sum(w.to(tl.float32) * z, axis=1)[None, :]
        else:
            acc += tl.sum(z[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _logits_kernel(z_ptr, w_ptr, out_ptr, B, V, R, stride_zb, stride_wv, stride_wr, stride_ob,
                   BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                   USE_DOT: tl.constexpr, SPLIT_Z: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """out[B, V] = z @ w_up.T cast to out's dtype; grid (cdiv(V, BLOCK_V), cdiv(B, BLOCK_B))."""
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    acc = _logits_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
                       BLOCK_B, BLOCK_V, BLOCK_R, USE_DOT, SPLIT_Z, DOT_F32, IEEE)
    out_ptrs = out_ptr + offs_b.to(tl.int64)[:, None] * stride_ob + offs_v[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_b < B)[:, None] & (offs_v < V)[None, :])


@triton.jit
def _argmax_tile_kernel(z_ptr, w_ptr, pmax_ptr, pidx_ptr, B, V, R, stride_zb, stride_wv, stride_wr, stride_pb,
                        BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                        USE_DOT: tl.constexpr, SPLIT_Z: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """Per (row, V tile): max logit and its global index (lowest among ties; first NaN if any) -> [B, T]."""
    pid_v = tl.program_id(0)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    acc = _logits_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
                       BLOCK_B, BLOCK_V, BLOCK_R, USE_DOT, SPLIT_Z, DOT_F32, IEEE)
    local = tl.arange(0, BLOCK_V)[None, :]
    valid = (offs_v < V)[None, :]
    is_nan = (acc != acc) & valid
    vals = tl.where(valid & (acc == acc), acc, float("-inf"))
    tile_max, tile_arg = tl.max(vals, axis=1, return_indices=True, return_indices_tie_break_left=True)
    first_nan = tl.min(tl.where(is_nan, local, BLOCK_V), axis=1)
    has_nan = first_nan < BLOCK_V
    tile_max = tl.where(has_nan, float("nan"), tile_max)
    tile_arg = tl.where(has_nan, first_nan, tile_arg)
    mask_b = offs_b < B
    p_off = offs_b.to(tl.int64) * stride_pb + pid_v
    tl.store(pmax_ptr + p_off, tile_max, mask=mask_b)
    tl.store(pidx_ptr + p_off, pid_v * BLOCK_V + tile_arg, mask=mask_b)


@triton.jit
def _argmax_reduce_kernel(pmax_ptr, pidx_ptr, out_ptr, T, stride_pb, BLOCK_T: tl.constexpr):
    """out[b] (int64) = pidx[b, t*] for the first tile t* holding a NaN, else the first tile with the max."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * stride_pb
    best_val = tl.full((), float("-inf"), tl.float32)
    best_tile = tl.zeros((), tl.int32)
    nan_tile = tl.zeros((), tl.int32) + T
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        mask = offs < T
        vals = tl.load(pmax_ptr + base + offs, mask=mask, other=float("-inf"))
        is_nan = vals != vals
        nan_tile = tl.minimum(nan_tile, tl.min(tl.where(is_nan, offs, T), axis=0))
        vals = tl.where(is_nan, float("-inf"), vals)
        chunk_max, chunk_arg = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = chunk_max > best_val  # strict: an earlier tile keeps ties
        best_tile = tl.where(better, t0 + chunk_arg, best_tile)
        best_val = tl.where(better, chunk_max, best_val)
    tile = tl.where(nan_tile < T, nan_tile, best_tile)
    index = tl.load(pidx_ptr + base + tile)
    tl.store(out_ptr + row, index.to(tl.int64))


@triton.jit
def _topk_tile_kernel(z_ptr, w_ptr, pval_ptr, pidx_ptr, B, V, R, stride_zb, stride_wv, stride_wr, stride_pb,
                      K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                      USE_DOT: tl.constexpr, SPLIT_Z: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """Per (row, V tile): the tile's K largest logits (NaN largest, ties by index) -> [B, T*K] candidates.

    Selection runs on an order-preserving int32 key of the float32 logit; taken and out-of-range entries get
    INT32_MIN so they are never re-picked. A pick that is out of range (tile with fewer than K valid entries)
    is written as (-inf, INT32_MAX) so that the merge puts it after every real candidate.
    """
    pid_v = tl.program_id(0)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    acc = _logits_tile(z_ptr, w_ptr, offs_b, offs_v, B, V, R, stride_zb, stride_wv, stride_wr,
                       BLOCK_B, BLOCK_V, BLOCK_R, USE_DOT, SPLIT_Z, DOT_F32, IEEE)
    local = tl.arange(0, BLOCK_V)[None, :]
    valid = (offs_v < V)[None, :]
    bits = acc.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone float -> int32 map (+inf: 0x7F800000)
    key = tl.where(acc != acc, _INT32_MAX, key)  # NaN above +inf, as torch.sort ranks it
    key = tl.where(valid, key, _INT32_MIN)
    mask_b = offs_b < B
    p_row = offs_b.to(tl.int64) * stride_pb + pid_v * K
    for j in tl.static_range(K):
        best, arg = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        picked = local == arg[:, None]
        value = tl.sum(tl.where(picked, acc, 0.0), axis=1)
        real = best != _INT32_MIN
        value = tl.where(real, value, float("-inf"))
        index = tl.where(real, pid_v * BLOCK_V + arg, _INT32_MAX)
        tl.store(pval_ptr + p_row + j, value, mask=mask_b)
        tl.store(pidx_ptr + p_row + j, index, mask=mask_b)
        key = tl.where(picked, _INT32_MIN, key)


# ----------------------------------------------------------------------------------------------------------
# launchers


def _interpreted() -> bool:
    """True when these kernels were built by Triton's interpreter (TRITON_INTERPRET set at import)."""
    return type(_logits_kernel).__name__ == "InterpretedFunction"


def _flags(dtype: torch.dtype, cfg: TileConfig) -> dict[str, bool]:
    """constexpr flags shared by the V-tiled kernels."""
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    return {
        "USE_DOT": cfg.use_dot,
        "SPLIT_Z": cfg.split_z and sixteen_bit,
        "DOT_F32": dtype == torch.bfloat16 and _interpreted(),
        "IEEE": dtype == torch.float32,
    }


def _check_config(cfg: TileConfig) -> None:
    for name in ("block_b", "block_v", "block_r", "z_block_r", "z_block_d", "reduce_block_t"):
        value = getattr(cfg, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"TileConfig.{name} must be a power of two, got {value}")
    if cfg.use_dot and min(cfg.block_b, cfg.block_v, cfg.block_r, cfg.z_block_r, cfg.z_block_d) < 16:
        raise ValueError("TileConfig with use_dot needs every block >= 16 (tl.dot minimum)")


FP16_Z_LIMIT = 2.0 ** 14
"""Largest |z| the fp16 tensor-core path feeds as is: z's fp16 high half overflows past 65504 (inf, then NaN)."""


def _fp16_row_scale(z: torch.Tensor, flags: dict[str, bool], dtype: torch.dtype) -> torch.Tensor | None:
    """On the fp16 tensor-core path, divide each row of z by a power of two that keeps it under FP16_Z_LIMIT
    (in place; exact) and return the per-row factors [B, 1] the results are multiplied back by; else None. The
    factors stay on the device: no host sync."""
    if not (flags["USE_DOT"] and flags["SPLIT_Z"] and dtype == torch.float16) or z.shape[0] == 0:
        return None
    top = z.abs().amax(dim=1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.ones_like(top))  # inf/NaN rows stay as they are
    scale = torch.exp2(torch.ceil(torch.log2(top.clamp_min(1.0) / FP16_Z_LIMIT)).clamp_min(0.0))
    z.div_(scale)
    return scale


def _prepare(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
             config: TileConfig | None) -> tuple[torch.Tensor, TileConfig, dict[str, bool]]:
    """Config for this call and z = h @ w_down.T in float32 (first kernel)."""
    batch, dim = h.shape
    rank = w_down.shape[0]
    cfg = config or default_config(batch, h.dtype)
    _check_config(cfg)
    flags = _flags(h.dtype, cfg)
    z = torch.empty(batch, rank, dtype=torch.float32, device=h.device)
    if batch == 0:
        return z, cfg, flags
    grid = (triton.cdiv(rank, cfg.z_block_r), triton.cdiv(batch, cfg.block_b))
    _down_proj_kernel[grid](h, w_down, z, batch, rank, dim,
                            h.stride(0), h.stride(1), w_down.stride(0), w_down.stride(1), z.stride(0),
                            BLOCK_B=cfg.block_b, BLOCK_R=cfg.z_block_r, BLOCK_D=cfg.z_block_d,
                            USE_DOT=cfg.use_dot, DOT_F32=flags["DOT_F32"], IEEE=flags["IEEE"],
                            num_warps=cfg.num_warps)
    return z, cfg, flags


def _tile_args(z: torch.Tensor, w_up: torch.Tensor) -> tuple[int, ...]:
    return (z.shape[0], w_up.shape[0], w_up.shape[1], z.stride(0), w_up.stride(0), w_up.stride(1))


def lowrank_logits(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, *,
                   out_dtype: torch.dtype | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """Logits [B, V] = (h @ w_down.T) @ w_up.T, float32 accumulation, stored as ``out_dtype`` (default h.dtype).

    Expects validated 2-D inputs of one dtype on one device (``slimspec.kernels`` checks them).
    """
    z, cfg, flags = _prepare(h, w_down, w_up, config)
    batch, vocab = h.shape[0], w_up.shape[0]
    out = torch.empty(batch, vocab, dtype=out_dtype or h.dtype, device=h.device)
    if batch == 0:
        return out
    scale = _fp16_row_scale(z, flags, h.dtype)
    grid = (triton.cdiv(vocab, cfg.block_v), triton.cdiv(batch, cfg.block_b))
    _logits_kernel[grid](z, w_up, out, *_tile_args(z, w_up), out.stride(0),
                         BLOCK_B=cfg.block_b, BLOCK_V=cfg.block_v, BLOCK_R=cfg.block_r, **flags,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if scale is None else out.mul_(scale.to(out.dtype))


def lowrank_argmax(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, *,
                   config: TileConfig | None = None) -> torch.Tensor:
    """int64 [B] argmax of the float32 logits without writing them: per-tile (max, index), then a reduction."""
    z, cfg, flags = _prepare(h, w_down, w_up, config)
    batch, vocab = h.shape[0], w_up.shape[0]
    out = torch.empty(batch, dtype=torch.int64, device=h.device)
    if batch == 0:
        return out
    _fp16_row_scale(z, flags, h.dtype)  # a positive factor per row: the argmax is the same
    tiles = triton.cdiv(vocab, cfg.block_v)
    pmax = torch.empty(batch, tiles, dtype=torch.float32, device=h.device)
    pidx = torch.empty(batch, tiles, dtype=torch.int32, device=h.device)
    grid = (tiles, triton.cdiv(batch, cfg.block_b))
    _argmax_tile_kernel[grid](z, w_up, pmax, pidx, *_tile_args(z, w_up), pmax.stride(0),
                              BLOCK_B=cfg.block_b, BLOCK_V=cfg.block_v, BLOCK_R=cfg.block_r, **flags,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block_t = min(cfg.reduce_block_t, triton.next_power_of_2(tiles))
    _argmax_reduce_kernel[(batch,)](pmax, pidx, out, tiles, pmax.stride(0), BLOCK_T=block_t,
                                    num_warps=4 if block_t >= 512 else 1)
    return out


def lowrank_topk(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, k: int, *,
                 config: TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values in h.dtype, int64 indices), largest first, equal values in index order, NaN largest.

    k <= 32: per-tile top-k in the kernel (logits not written), then a stable torch merge of the
    [B, tiles * k] candidates. Larger k: float32 logits from the logits kernel + a stable torch sort.
    """
    batch, vocab = h.shape[0], w_up.shape[0]
    if k > _MAX_TOPK:
        logits = lowrank_logits(h, w_down, w_up, out_dtype=torch.float32, config=config)
        values, indices = torch.sort(logits, dim=-1, descending=True, stable=True)
        return values[:, :k].to(h.dtype), indices[:, :k]
    z, cfg, flags = _prepare(h, w_down, w_up, config)
    scale = _fp16_row_scale(z, flags, h.dtype)
    tiles = triton.cdiv(vocab, cfg.block_v)
    pval = torch.empty(batch, tiles * k, dtype=torch.float32, device=h.device)
    pidx = torch.empty(batch, tiles * k, dtype=torch.int32, device=h.device)
    if batch > 0:
        grid = (tiles, triton.cdiv(batch, cfg.block_b))
        _topk_tile_kernel[grid](z, w_up, pval, pidx, *_tile_args(z, w_up), pval.stride(0), K=k,
                                BLOCK_B=cfg.block_b, BLOCK_V=cfg.block_v, BLOCK_R=cfg.block_r, **flags,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # Candidates of one row are laid out tile after tile, each tile's in selection order, and out-of-range
    # picks carry INT32_MAX: order them by index, then a stable descending sort breaks ties by index.
    by_index = torch.argsort(pidx, dim=-1, stable=True)
    pval, pidx = pval.gather(-1, by_index), pidx.gather(-1, by_index)
    values, order = torch.sort(pval, dim=-1, descending=True, stable=True)
    values = values[:, :k] if scale is None else values[:, :k] * scale
    return values.to(h.dtype), pidx.gather(-1, order[:, :k]).long()

