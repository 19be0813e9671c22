"""Load a file of scripts/ or research/ as a module (neither is a package), for the tests of their code."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` or ``research/<name>.py``, executed as module ``name``."""
    path = next(p for p in (ROOT / "scripts" / f"{name}.py", ROOT / "research" / f"{name}.py") if p.exists())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
