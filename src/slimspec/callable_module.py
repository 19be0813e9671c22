"""Packages that are also the API function of the same name (``slimspec.distill``, ``slimspec.evaluate``).

Importing a subpackage binds its name on ``slimspec``, over the function ``slimspec.__getattr__`` returned
before: ``slimspec.evaluate(...)`` worked once, then found the package. A callable package works either way.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


def become_callable(package: str, module: str, function: str) -> None:
    """Calling package ``package`` calls ``module.function`` (imported on the first call: the package stays light)."""

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module), function)(*args, **kwargs)

    _CallablePackage.__call__.__doc__ = f"Runs :func:`{module}.{function}`."
    sys.modules[package].__class__ = _CallablePackage
