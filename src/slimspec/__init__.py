"""SlimSpec: low-rank LM heads for published EAGLE-3 drafters.

Python API: ``slimspec.convert(drafter, target, rank="d/8", **options)``,
``slimspec.convert_briefly(drafter, target, rank, out)`` (with the demo's brief distillation) and
``slimspec.factorize(weight, rank)``. Importing ``slimspec`` is light: it imports neither vLLM nor
Triton, and the heavy pieces load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "convert_briefly", "distill", "evaluate", "factorize", "push"]

_FUNCTIONS = {
    "factorize": ("slimspec.convert.factorize", "factorize"),
    "convert_briefly": ("slimspec.distill.pipeline", "convert_briefly"),
    "push": ("slimspec.publish", "push"),
}
_CALLABLE_PACKAGES = ("convert", "distill", "evaluate")
"""Packages that are the function of their name too: importing one binds it on slimspec anyway."""


def __getattr__(name: str) -> Any:
    if name in _CALLABLE_PACKAGES:
        return importlib.import_module(f"slimspec.{name}")
    if name in _FUNCTIONS:
        module, attr = _FUNCTIONS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'slimspec' has no attribute {name!r}")
