"""SlimSpec: low-rank LM heads for published EAGLE-3 drafters.

Python API: ``slimspec.convert(drafter, target, rank="d/8", **options)`` and
``slimspec.factorize(weight, rank)``. Importing ``slimspec`` is light: it imports neither vLLM nor
Triton, and the heavy pieces load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "factorize"]


def __getattr__(name: str) -> Any:
    if name == "convert":
        return importlib.import_module("slimspec.convert")
    if name == "factorize":
        return importlib.import_module("slimspec.convert.factorize").factorize
    raise AttributeError(f"module 'slimspec' has no attribute {name!r}")
