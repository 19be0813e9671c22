"""What this machine computes fast: the device the teacher's target runs on and the dtype it generates in.

bf16 matmuls are fast on CPUs with bf16 instructions (AVX512-BF16, AMX) and on GPUs; on a CPU without them
(AVX2 only) PyTorch emulates bf16 and a SmolLM2-135M decode step runs 3-4x *slower* than in float32
(``scripts/bench.py --only generation-dtype``; the brief recipe's 300 answers took 20 min instead of 2.5 on such a
2-core machine). So generation uses bf16 only where the hardware has it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slimspec.errors import SlimSpecError

GENERATION_DTYPE_ENV = "SLIMSPEC_GENERATION_DTYPE"
DEVICE_ENV = "SLIMSPEC_DEVICE"
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
GENERATION_DTYPES = ("float32", "bfloat16", "float16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), not by emulation."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in _BF16_CPU_FLAGS)


def default_generation_dtype(flags: set[str] | None = None, device: str | None = None) -> str:
    """``$SLIMSPEC_GENERATION_DTYPE`` if set, else bfloat16 on a CUDA device or where the CPU has native bf16,
    else float32 (the cache key records the dtype, so a cache made on one kind of machine is not silently reused
    with answers from another)."""
    chosen = os.environ.get(GENERATION_DTYPE_ENV, "").strip()
    if chosen:
        if chosen not in GENERATION_DTYPES:
            raise SlimSpecError(f"{GENERATION_DTYPE_ENV} must be one of {', '.join(GENERATION_DTYPES)}; "
                                f"got {chosen!r}")
        return chosen
    if device is not None and resolve_device(device).type == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16(flags) else "float32"


def resolve_device(name: str | None = None):
    """The ``torch.device`` the teacher's target runs on: ``name`` (cpu, cuda, cuda:N), or for None/"auto"
    ``$SLIMSPEC_DEVICE`` if set, else the first CUDA GPU when PyTorch sees one, else the CPU. An unusable choice is
    a clear error, not a crash later."""
    chosen = str(name or "auto").strip().lower()
    if chosen == "auto":
        chosen = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if chosen == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(chosen)
    except (RuntimeError, ValueError):
        raise SlimSpecError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise SlimSpecError(f"device {name!r} is not supported: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise SlimSpecError(f"device {name!r}: PyTorch sees no CUDA GPU here (use --device cpu or auto)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise SlimSpecError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return device

