"""Where the target's weights go while it makes teacher data, and the dtype its features are read in.

A target runs whole on one device (``--device cpu``, ``cuda:N``, or ``auto`` when it fits the first GPU, else
the CPU), or sharded by accelerate (``device_map="auto"``) over every visible GPU, then the CPU, then disk: when
``--device auto`` finds it too large for one device, or when ``--max-memory`` sets the budgets. Its features are
read in float32 where a float32 copy fits the memory it may use, else in its own dtype (bfloat16 for a float32
checkpoint); ``--feature-dtype`` chooses. Answers and features come out on the CPU in the same layout either way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from slimspec.choices import FEATURE_DTYPES
from slimspec.dtypes import dtype_name
from slimspec.embedded import cache_dir
from slimspec.errors import OptionError
from slimspec.hardware import DEVICE_ENV, available_memory, check_max_memory, parse_max_memory, resolve_device

WHOLE_SHARE = 0.9
"""Share of a device's free memory a whole target's weights may take (the rest: activations and caches)."""
GPU_SHARE, CPU_SHARE = 0.85, 0.8
"""Shares of each GPU's free memory and of the host's available memory that a sharded target's default budgets
take; ``--max-memory`` sets them instead."""


@dataclass(frozen=True)
class Placement:
    """``--device``, ``--max-memory`` (parsed budgets: shard within them) and ``--offload-folder``."""

    device: str | None = None
    max_memory: dict[int | str, int] | None = None
    offload_folder: Path | None = None

    @classmethod
    def of(cls, device: str | None = None, max_memory: str | dict | None = None,
           offload_folder: str | Path | None = None) -> Placement:
        """A placement from option values (``max_memory`` as ``--max-memory`` writes it, or parsed)."""
        budgets = parse_max_memory(max_memory) if isinstance(max_memory, str) else max_memory
        if offload_folder is not None and budgets is None and str(device or "auto").lower() != "auto":
            raise OptionError(f"{{offload_folder}} holds weights of a sharded target; {{device}} {device} keeps it "
                              "whole on one device (add {max_memory}, or use {device} auto)",
                              "offload_folder", "device", "max_memory")
        return cls(device, dict(budgets) if budgets else None, Path(offload_folder) if offload_folder else None)

    @property
    def main_device(self) -> torch.device:
        """Where a whole target runs, the drafter trains, and a sharded target's answers start."""
        return resolve_device(self.device)

    def budgets(self, target_path: Path, dtype: torch.dtype) -> dict[int | str, int] | None:
        """accelerate's ``max_memory`` for the target loaded in ``dtype``; None: whole on :attr:`main_device`."""
        if self.max_memory is not None:
            check_max_memory(self.max_memory)
            return dict(self.max_memory)
        if _explicit(self.device) or weight_bytes(target_path, dtype) <= self.whole_room():
            return None
        return default_budgets()

    def whole_room(self) -> int:
        """Bytes a whole target's weights may take on the main device."""
        return int(WHOLE_SHARE * available_memory(self.main_device))

    def fast_memory(self) -> int:
        """Bytes of the memory a float32 copy must fit for float32 features: the GPUs the target may use (their
        budgets), or the CPU's where it runs on the CPU alone. Host memory beside GPUs holds layers that run many
        times slower, and disk slower still: a 16-bit copy on the GPUs beats a float32 one spilling there."""
        budgets = self.max_memory
        if budgets is None:
            if _explicit(self.device):
                return self.whole_room()
            budgets = default_budgets()
        gpus = [size for key, size in budgets.items() if key != "cpu"]
        if gpus:
            return sum(gpus)
        return budgets.get("cpu", 0) if self.max_memory is not None else self.whole_room()


def _explicit(device: str | None) -> bool:
    """Whether ``--device`` (or ``$SLIMSPEC_DEVICE`` under auto) names one device: the target stays whole there."""
    chosen = str(device or "auto").strip().lower()
    if chosen == "auto":
        chosen = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    return chosen != "auto"


def default_budgets() -> dict[int | str, int]:
    """A sharded target's budgets where none are given: a share of every visible GPU's free memory and of the
    host's available memory (accelerate fills them in this order; the rest goes to disk)."""
    budgets: dict[int | str, int] = {}
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        budgets[index] = int(GPU_SHARE * available_memory(torch.device("cuda", index)))
    budgets["cpu"] = int(CPU_SHARE * available_memory(torch.device("cpu")))
    return budgets


def _config(target_path: Path) -> dict:
    config = json.loads((Path(target_path) / "config.json").read_text())
    return {**config, **(config.get("text_config") or {})}


def stored_dtype(target_path: Path) -> torch.dtype:
    """The dtype the target's config names (``dtype`` or ``torch_dtype``; float32 when it names none)."""
    config = _config(target_path)
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return getattr(torch, name, torch.float32) if name in ("float32", "bfloat16", "float16") else torch.float32


def own_dtype(target_path: Path) -> torch.dtype:
    """The target's own 16-bit dtype: its checkpoint's, or bfloat16 for a float32 checkpoint."""
    stored = stored_dtype(target_path)
    return stored if stored.itemsize == 2 else torch.bfloat16


def weight_bytes(target_path: Path, dtype: torch.dtype) -> int:
    """Bytes of the target's floating weights loaded in ``dtype``: parameters counted from the safetensors headers
    (no tensor read), else the ``.bin`` files' sizes at the config's dtype."""
    folder = Path(target_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        stored = sum(f.stat().st_size for f in folder.glob("*.bin"))
        return stored * dtype.itemsize // stored_dtype(folder).itemsize if stored else 0
    total = 0
    for path in files:
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                part = handle.get_slice(name)
                count = 1
                for size in part.get_shape():
                    count *= int(size)
                floating = part.get_dtype() in ("F64", "F32", "F16", "BF16")
                total += count * (dtype.itemsize if floating else _element(part.get_dtype()))
    return total


def _element(safetensors_dtype: str) -> int:
    digits = "".join(c for c in safetensors_dtype if c.isdigit())
    return max(1, int(digits) // 8) if digits else 1


def feature_dtype_for(target_path: Path, placement: Placement, chosen: str | None = None) -> str:
    """The dtype the target's features are read in: ``chosen`` unless auto; auto is float32 where a float32 copy
    fits the memory the placement may use, else the target's own 16-bit dtype."""
    chosen = chosen or "auto"
    if chosen not in FEATURE_DTYPES:
        raise OptionError(f"{{feature_dtype}} must be one of {', '.join(FEATURE_DTYPES)}, got {chosen!r}",
                          "feature_dtype")
    if chosen != "auto":
        return chosen
    return "float32" if float32_fits(target_path, placement) else dtype_name(own_dtype(target_path))


def float32_fits(target_path: Path, placement: Placement) -> bool:
    """Whether a float32 copy of the target fits the device and host memory the placement may use."""
    return weight_bytes(target_path, torch.float32) <= placement.fast_memory()


def load_sharded_target(target_path: Path, dtype: torch.dtype, budgets: dict[int | str, int],
                        offload_folder: Path | None = None):
    """The target as a transformers causal LM sharded by accelerate within ``budgets`` (GPUs first, then the CPU;
    the rest offloaded to ``offload_folder``: by default a folder of the slimspec cache removed with the model),
    and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    folder = Path(offload_folder) if offload_folder else cache_dir() / "offload" / uuid.uuid4().hex[:12]
    folder.mkdir(parents=True, exist_ok=True)
    verbosity, quiet = hf_logging.get_verbosity(), logging.getLogger("accelerate.big_modeling")
    level = quiet.level
    hf_logging.set_verbosity_error()  # "some parameters are on the meta device": that is the offload asked for
    quiet.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, device_map="auto",
                                                     max_memory=budgets, offload_folder=str(folder))
    except BaseException:
        if offload_folder is None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
        quiet.setLevel(level)
    if offload_folder is None:
        weakref.finalize(model, shutil.rmtree, folder, True)
    return model.eval(), tokenizer


def input_device(model) -> torch.device:
    """Where a model's input ids go: its device when whole; the CPU when sharded (accelerate's hooks move each
    module's inputs to where it runs)."""
    placed = getattr(model, "hf_device_map", None) or {}
    return torch.device("cpu") if len(set(placed.values())) > 1 else model.device


def placement_text(model) -> str:
    """How a loaded target is spread: ``cuda:0 12 modules, cpu 20, disk 2``, or its one device."""
    placed = getattr(model, "hf_device_map", None) or {}
    if len(set(placed.values())) <= 1:
        return str(model.device)
    counts: dict[str, int] = {}
    for where in placed.values():
        name = f"cuda:{where}" if isinstance(where, int) else str(where)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} {count} modules" for name, count in counts.items())
