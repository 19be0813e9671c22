"""Prompt sets: training prompts (local jsonl/json/parquet files, a `datasets` id, or the shipped calibration set),
the shipped eval sets, and the check that training never uses eval prompts."""

from __future__ import annotations

import glob
import hashlib
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from slimspec.errors import OptionError, SlimSpecError, first_line

TEXT_FIELDS = ("turns", "messages", "conversations", "prompt", "instruction", "question", "text")
PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Prompt:
    """One user prompt (first turn) and, where the source has one, a reference answer."""

    id: str
    text: str
    reference: str | None = None


def _text(value: Any) -> str | None:
    """A message's text: a string, or the text parts of an OpenAI-style content list."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, list):
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        joined = "\n".join(p for p in parts if isinstance(p, str))
        return joined if joined.strip() else None
    return None


def _first_user_turn(row: dict[str, Any]) -> str | None:
    for field in TEXT_FIELDS:
        value = row.get(field)
        if field == "instruction" and (instruction := _text(value)):  # Alpaca/Dolly: the instruction + input
            extra = _text(row.get("input")) or _text(row.get("context"))
            return f"{instruction}\n\n{extra}" if extra else instruction
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list) and value:
            first = value[0]
            if isinstance(first, str):
                return first
            if isinstance(first, dict):
                for item in value:
                    role = item.get("role") or item.get("from")
                    if role in ("user", "human"):
                        return _text(item.get("content") or item.get("value"))
    return None


def _reference(row: dict[str, Any]) -> str | None:
    ref = row.get("reference")
    if isinstance(ref, list) and ref and isinstance(ref[0], str):
        return ref[0]
    return ref if isinstance(ref, str) else None


def _rows_from_file(path: Path) -> list[dict[str, Any]]:
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return data if isinstance(data, list) else data.get("data", [])
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise SlimSpecError(f"{path}: cannot read prompts ({exc})") from None
    raise SlimSpecError(f"{path}: prompts must be .jsonl, .json or .parquet")


def shipped_calibration_path() -> Path:
    return Path(str(resources.files("slimspec").joinpath("data/calibration.jsonl")))


def load_prompts(spec: str | list[str] | None, *, limit: int | None = None, split: str = "train",
                 seed: int = 0, training: bool = False) -> list[Prompt]:
    """Prompts from files/globs, a ``datasets`` id, or (``None``) the calibration set shipped with slimspec.

    With ``limit`` below the number of prompts, a seeded random sample of ``limit`` (in source order).
    ``training``: the prompts will teach a head, so none may be one of slimspec's eval prompts.
    """
    specs = [spec] if isinstance(spec, str) else list(spec or [str(shipped_calibration_path())])
    rows: list[tuple[str, dict[str, Any]]] = []
    for item in specs:
        paths = sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
        local = [Path(p) for p in paths if Path(p).exists()]
        if local:
            for path in local:
                files = sorted(path.glob("*.jsonl")) + sorted(path.glob("*.parquet")) if path.is_dir() else [path]
                for file in files:
                    rows += [(f"{file.name}:{i}", r) for i, r in enumerate(_rows_from_file(file))]
        elif _looks_like_dataset_id(item):
            rows += [(f"{item}:{i}", r) for i, r in enumerate(_load_dataset(item, split))]
        elif any(c in item for c in "*?["):
            raise OptionError(f"{{data}} {item}: the pattern matches no file", "data")
        else:
            raise OptionError(f"{{data}} {item}: no such file" + ("" if Path(item).suffix in PROMPT_SUFFIXES
                                                                 else ", and not a datasets id (owner/name)"), "data")
    prompts = []
    for rid, row in rows:
        if not isinstance(row, dict):
            raise OptionError(f"{{data}} {rid}: a prompt row must be an object with a field among "
                              f"{', '.join(TEXT_FIELDS)}, got {type(row).__name__}", "data")
        text = _first_user_turn(row)
        if text:
            prompts.append(Prompt(id=str(row.get("id", rid)), text=text, reference=_reference(row)))
    if not prompts:
        raise OptionError(f"{{data}} {spec}: no prompts found (expected a field among {', '.join(TEXT_FIELDS)})",
                          "data")
    if limit and limit < len(prompts):
        keep = sorted(random.Random(seed).sample(range(len(prompts)), limit))
        prompts = [prompts[i] for i in keep]
    if training:
        check_not_eval(prompts)
    return prompts


def _looks_like_dataset_id(item: str) -> bool:
    """``owner/name`` without a file suffix or pattern: a ``datasets`` id (a mistyped path is not one)."""
    parts = item.split("/")
    return (len(parts) == 2 and all(parts) and not item.startswith((".", "~"))
            and Path(item).suffix not in PROMPT_SUFFIXES and not any(c in item for c in "*?["))


DATASETS = ("mt_bench", "humaneval", "gsm8k")


def eval_prompts(dataset: str, num_prompts: int | None) -> list[str]:
    """First turns of a shipped eval set (mt_bench, humaneval, gsm8k) or of any jsonl with ``turns``."""
    if dataset in DATASETS:
        text = resources.files("slimspec").joinpath(f"data/eval/{dataset}.jsonl").read_text(encoding="utf-8")
    else:
        path = Path(dataset)
        if not path.is_file():
            raise OptionError(f"{{dataset}} {dataset}: not one of {', '.join(DATASETS)} and no such file", "dataset")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise OptionError(f"{{dataset}} {dataset}: cannot read it ({exc})", "dataset") from None
    try:
        rows = [json.loads(line) for line in text.split("\n") if line.strip()]
        prompts = [r["turns"] if isinstance(r["turns"], str) else r["turns"][0] for r in rows]  # a string: one turn
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise OptionError(f"{{dataset}} {dataset}: expected jsonl rows with a 'turns' list ({exc})",
                          "dataset") from None
    return prompts[:num_prompts] if num_prompts else prompts


def check_not_eval(prompts: list[Prompt]) -> None:
    """Refuse training prompts that are slimspec's eval prompts (mt_bench, humaneval, gsm8k first turns): tau
    measured on prompts the head was fitted to would flatter it. Measuring on them is fine (``training=False``)."""
    held_out = {text.strip() for name in DATASETS for text in eval_prompts(name, None)}
    shared = [p.id for p in prompts if p.text.strip() in held_out]
    if shared:
        raise SlimSpecError(f"{len(shared)} training prompts are slimspec's eval prompts (e.g. {shared[0]}): never "
                            "train on eval data")


def _load_dataset(name: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets

        return list(datasets.load_dataset(name, split=split))
    except Exception as exc:  # network or unknown dataset: one line
        first = first_line(exc)
        raise SlimSpecError(f"cannot load dataset {name!r}: {first}") from None


def prompts_fingerprint(prompts: list[Prompt]) -> str:
    """Stable hash of the prompt texts (part of the teacher-cache key)."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(p.text.encode("utf-8"))
        digest.update(b"\0")
        digest.update((p.reference or "").encode("utf-8"))
        digest.update(b"\1")
    return digest.hexdigest()
