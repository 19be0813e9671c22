"""Pick Triton or torch for the low-rank head ops, validate inputs, handle leading batch dimensions.

Importing this module never imports triton: ``slimspec.kernels.triton_lowrank`` is imported on the first call
that runs on the Triton path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Literal

import torch

from slimspec.kernels import reference

Backend = Literal["triton", "torch"]
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRUE = {"1", "true", "yes", "y", "on"}  # what Triton itself reads as true for TRITON_INTERPRET


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` would find a package (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``tensor``'s device: CUDA (or ROCm) with triton importable,
    or any device under ``TRITON_INTERPRET=1`` with triton importable. False means the torch fallback."""
    if not triton_available():
        return False
    return tensor.is_cuda or interpreting()


def active_backend(tensor: torch.Tensor) -> Backend:
    """The path ``backend="auto"`` takes for inputs on ``tensor``'s device: ``"triton"`` or ``"torch"``."""
    return "triton" if use_triton(tensor) else "torch"


def _resolve(backend: str, tensor: torch.Tensor, *differentiable: torch.Tensor) -> Backend:
    """The path a call takes. The Triton kernels are forward-only: where autograd would track ``differentiable``
    (grad enabled, one of them requires grad), ``auto`` takes the torch path and ``triton`` is refused, rather than
    returning values without a graph."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    if backend == "auto":
        return "torch" if needs_grad else active_backend(tensor)
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if needs_grad:
            raise RuntimeError("backend='triton' is forward-only and an input requires grad: use backend='torch' "
                               "(or 'auto'), or call it under torch.no_grad()")
        if not triton_available():
            raise RuntimeError("backend='triton' but triton is not installed")
        if not (tensor.is_cuda or interpreting()):
            raise RuntimeError(f"backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1 (got {tensor.device})")
        return "triton"
    raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def _on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on the inputs' GPU even when another one is current (Triton launches on the current device)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _flatten(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Check shapes/dtypes/devices; return h as [B, d]."""
    if w_down.dim() != 2 or w_up.dim() != 2:
        raise ValueError(f"w_down [r, d] and w_up [V, r] must be 2-D, got {tuple(w_down.shape)}, {tuple(w_up.shape)}")
    if h.dim() < 1 or h.shape[-1] != w_down.shape[1] or w_up.shape[1] != w_down.shape[0]:
        raise ValueError(f"shape mismatch: h {tuple(h.shape)}, w_down {tuple(w_down.shape)}, w_up {tuple(w_up.shape)}"
                         " (expected h [..., d], w_down [r, d], w_up [V, r])")
    if h.dtype not in _DTYPES or w_down.dtype != h.dtype or w_up.dtype != h.dtype:
        raise TypeError(f"h, w_down, w_up must share one dtype among float32/float16/bfloat16, got "
                        f"{h.dtype}, {w_down.dtype}, {w_up.dtype}")
    if not (h.device == w_down.device == w_up.device):
        raise ValueError(f"tensors on different devices: {h.device}, {w_down.device}, {w_up.device}")
    return h.reshape(-1, h.shape[-1])


def lowrank_logits(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, *,
                   backend: str = "auto") -> torch.Tensor:
    """Logits [..., V] = (h @ w_down.T) @ w_up.T for h [..., d], w_down [r, d], w_up [V, r].

    Output dtype = h.dtype; float32 accumulation (z = h @ w_down.T is kept in float32).
    """
    h2 = _flatten(h, w_down, w_up)
    if _resolve(backend, h, h, w_down, w_up) == "triton":
        from slimspec.kernels import triton_lowrank

        with _on_device(h2):
            out = triton_lowrank.lowrank_logits(h2, w_down, w_up)
    else:
        out = reference.lowrank_logits(h2, w_down, w_up)
    return out.reshape(*h.shape[:-1], w_up.shape[0])


def lowrank_argmax(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, *,
                   backend: str = "auto") -> torch.Tensor:
    """int64 [...] argmax of the float32 low-rank logits, without writing them on the Triton path.

    Ties: lowest index among equal maxima. NaN: a NaN logit counts as the maximum and the first NaN index is
    returned (both as ``torch.argmax``). The argmax is taken before rounding to h.dtype.
    """
    h2 = _flatten(h, w_down, w_up)
    if _resolve(backend, h) == "triton":
        from slimspec.kernels import triton_lowrank

        with _on_device(h2):
            out = triton_lowrank.lowrank_argmax(h2, w_down, w_up)
    else:
        out = reference.lowrank_argmax(h2, w_down, w_up)
    return out.reshape(h.shape[:-1])


def lowrank_topk(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, k: int, *,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(values [..., k] in h.dtype, int64 indices [..., k]) of the k largest float32 low-rank logits.

    Sorted largest first; equal values in increasing index order; NaN counts as largest (as ``torch.sort``).
    """
    h2 = _flatten(h, w_down, w_up)
    if not 1 <= k <= w_up.shape[0]:
        raise ValueError(f"k must be in [1, V={w_up.shape[0]}], got {k}")
    if _resolve(backend, h, h, w_down, w_up) == "triton":
        from slimspec.kernels import triton_lowrank

        with _on_device(h2):
            values, indices = triton_lowrank.lowrank_topk(h2, w_down, w_up, k)
    else:
        values, indices = reference.lowrank_topk(h2, w_down, w_up, k)
    shape = (*h.shape[:-1], k)
    return values.reshape(shape), indices.reshape(shape)
