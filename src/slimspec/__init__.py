"""SlimSpec: low-rank LM heads for published EAGLE-3 drafters.

Python API: ``slimspec.convert(drafter, target, rank="d/8", **options)`` and
``slimspec.factorize(weight, rank)``. Importing ``slimspec`` is light: it imports neither vLLM nor
Triton, and the heavy pieces load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "distill", "evaluate", "factorize", "push"]

_FUNCTIONS = {
    "factorize": ("slimspec.convert.factorize", "factorize"),
    "distill": ("slimspec.distill.pipeline", "distill"),
    "evaluate": ("slimspec.evaluate.acceptance", "evaluate"),
    "push": ("slimspec.publish", "push"),
}


def __getattr__(name: str) -> Any:
    if name == "convert":  # the callable package slimspec.convert
        return importlib.import_module("slimspec.convert")
    if name in _FUNCTIONS:
        module, attr = _FUNCTIONS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'slimspec' has no attribute {name!r}")
