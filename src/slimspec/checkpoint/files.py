"""Find and read the weight files of a Hugging Face style folder (safetensors or .bin, sharded or not)."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from slimspec.errors import CheckpointError, first_line

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def read_json(path: Path) -> dict:
    """Read a JSON object, turning every failure into a one-line CheckpointError."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: missing {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def weight_map(folder: Path) -> dict[str, Path]:
    """Map every tensor name of the folder's checkpoint to the file that holds it."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = folder / index_name
        if index.exists():
            entries = read_json(index).get("weight_map")
            if not isinstance(entries, dict) or not entries:
                raise CheckpointError(f"{index}: no weight_map")
            return {name: folder / file for name, file in entries.items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        path = folder / single
        if path.exists():
            return {name: path for name in _names_in_file(path)}
    raise CheckpointError(
        f"{folder}: no weights found (expected model.safetensors, pytorch_model.bin or a sharded index)"
    )


def _names_in_file(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        with _open_safetensors(path) as f:
            return list(f.keys())
    return list(_load_bin(path).keys())


def _open_safetensors(path: Path):
    if not path.exists():
        raise CheckpointError(f"{path.parent}: missing weight file {path.name}")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from None


_BIN_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def _file_identity(path: Path) -> tuple:
    """Path, inode, size and modification time: a file rewritten in place is another file."""
    st = path.stat()
    return (path.resolve(), st.st_ino, st.st_size, st.st_mtime_ns)


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """Load a pickle checkpoint with weights_only=True: a pickle must never run code."""
    if not path.exists():
        raise CheckpointError(f"{path.parent}: missing weight file {path.name}")
    key = _file_identity(path)
    if key in _BIN_CACHE:
        return _BIN_CACHE[key]
    try:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # files saved before torch 1.6's zip format cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        first = first_line(exc)
        raise CheckpointError(f"{path}: cannot be loaded safely ({first})") from None
    if isinstance(data, dict) and "state_dict" in data and isinstance(data["state_dict"], dict):
        data = data["state_dict"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    _BIN_CACHE.clear()  # keep at most one .bin mapped at a time
    _BIN_CACHE[key] = data
    return data


def read_tensors(files: dict[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors (each from the file the map gives) into memory."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, wanted in by_file.items():
        if path.suffix == ".safetensors":
            with _open_safetensors(path) as f:
                present = set(f.keys())
                for name in wanted:
                    if name not in present:
                        raise CheckpointError(f"{path}: index names tensor {name!r} but the file lacks it")
                    try:
                        out[name] = f.get_tensor(name)
                    except (SafetensorError, OSError, ValueError) as exc:
                        raise CheckpointError(f"{path}: corrupt tensor {name!r} ({exc})") from None
        else:
            data = _load_bin(path)
            for name in wanted:
                if name not in data:
                    raise CheckpointError(f"{path}: index names tensor {name!r} but the file lacks it")
                out[name] = data[name]
    return out


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
