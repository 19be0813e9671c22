"""SlimSpec: low-rank LM heads for published EAGLE-3 drafters.

The Python API: ``convert_drafter``, ``convert_briefly`` (with the demo's brief distillation), ``distill_drafter``,
``evaluate_drafter``, ``push`` and ``factorize``. Importing ``slimspec`` is light (no torch, vLLM or Triton): each
function loads its workflow on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

API = {
    "convert_drafter": ("slimspec.workflows.convert", "convert_drafter"),
    "convert_briefly": ("slimspec.workflows.convert", "convert_briefly"),
    "distill_drafter": ("slimspec.distill.pipeline", "distill"),
    "evaluate_drafter": ("slimspec.evaluate.acceptance", "evaluate"),
    "push": ("slimspec.workflows.publish", "push"),
    "factorize": ("slimspec.convert.factorize", "factorize"),
}
"""Each public function: the module that defines it and its name there."""

__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        module, attr = API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'slimspec' has no attribute {name!r}")
