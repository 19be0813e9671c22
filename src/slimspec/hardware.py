"""What this machine computes fast: the device the teacher's target runs on and the dtype it generates in.

bf16 matmuls are fast on CPUs with bf16 instructions (AVX512-BF16, AMX) and on GPUs; on a CPU without them
(AVX2 only) PyTorch emulates bf16 and a SmolLM2-135M decode step runs 3-4x *slower* than in float32
(``scripts/bench.py --only generation-dtype``; the brief recipe's 300 answers took 20 min instead of 2.5 on such a
2-core machine). So generation uses bf16 only where the hardware has it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from slimspec.errors import OptionError, SlimSpecError

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



_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)\s*$", re.IGNORECASE)


def parse_max_memory(text: str) -> dict[int | str, int]:
    """``--max-memory`` budgets as accelerate takes them: ``cuda:0=70GiB,1=70GiB,cpu=100GiB`` -> ``{0: bytes,
    1: bytes, "cpu": bytes}`` (a GPU by index or ``cuda:N``; sizes in B, KB/MB/GB/TB or KiB/MiB/GiB/TiB). Weights
    beyond the budgets go to disk. A malformed budget is a one-line OptionError."""
    budgets: dict[int | str, int] = {}
    for item in str(text).split(","):
        name, sep, size = item.partition("=")
        name = name.strip().lower()
        match = _SIZE.match(size)
        if not sep or not name or match is None:
            raise OptionError(f"{{max_memory}} takes DEVICE=SIZE pairs separated by commas (e.g. "
                              f"cuda:0=70GiB,cpu=100GiB); got {item.strip()!r}", "max_memory")
        key: int | str
        if name == "cpu":
            key = "cpu"
        elif name.removeprefix("cuda:").isdigit():
            key = int(name.removeprefix("cuda:"))
        else:
            raise OptionError(f"{{max_memory}}: unknown device {name!r} (use cpu, cuda:N or N)", "max_memory")
        if key in budgets:
            raise OptionError(f"{{max_memory}} names {name} twice", "max_memory")
        budgets[key] = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    return budgets


def check_max_memory(budgets: dict[int | str, int]) -> None:
    """Refuse budgets for GPUs PyTorch does not see (one line)."""
    gpus = [key for key in budgets if key != "cpu"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [f"cuda:{key}" for key in gpus if key >= visible]
    if missing:
        raise OptionError(f"{{max_memory}} names {', '.join(missing)}, but PyTorch sees {visible} CUDA GPU(s) here",
                          "max_memory")


def host_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's available memory: ``MemAvailable`` of /proc/meminfo, else the free pages."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(device: torch.device) -> int:
    """Bytes free now on ``device``: ``torch.cuda.mem_get_info`` on a GPU, the host's available memory on the
    CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available()
