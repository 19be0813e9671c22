"""Saved answers: the target's responses behind a teacher cache, small enough to keep in git.

A teacher cache holds hidden states (~4.6 KB a token for SmolLM2-135M) and is lost with the machine; the answers
behind it are token ids (~2 bytes a token gzipped). ``build_teacher_data(answers=...)`` rebuilds the cache from
them with one batched forward per group of sequences (``static_prefill``) instead of decoding token by token, and
decodes only the prompts the file does not answer.

File: gzipped JSON lines; a header ``{"format", "key", "prompts"}`` (the teacher cache key: target, prompts and
settings), then one ``{"i": prompt index, "response": [token ids]}`` per answered prompt.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from slimspec.errors import SlimSpecError

FORMAT = "slimspec-answers/1"


def save_answers(path: Path, key: str, count: int, answers: dict[int, list[int]]) -> int:
    """Write ``answers`` (prompt index -> response ids) for the cache ``key`` of ``count`` prompts, atomically;
    returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.write(json.dumps({"format": FORMAT, "key": key, "prompts": count}) + "\n")
            for i in sorted(answers):
                f.write(json.dumps({"i": i, "response": answers[i]}, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write cut short leaves no half-written file behind
    return len(answers)


def load_answers(path: Path, key: str | None = None) -> dict[int, list[int]]:
    """Answers saved at ``path`` ({} when there is no file); SlimSpecError when they belong to another cache key
    (another target, prompt set or teacher settings: they would not be this cache's answers)."""
    path = Path(path)
    if not path.exists():
        return {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        header = json.loads(f.readline() or "{}")
        if header.get("format") != FORMAT:
            raise SlimSpecError(f"{path}: not a saved-answers file (header {header})")
        if key is not None and header["key"] != key:
            raise SlimSpecError(f"{path}: answers of teacher cache {header['key']}, not {key} (the target, the "
                                "prompts or the teacher settings changed); delete the file to decode afresh")
        return {int(row["i"]): [int(t) for t in row["response"]] for row in map(json.loads, f) if row}


def answers_header(path: Path) -> dict:
    """The header of a saved-answers file (its cache key and prompt count)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.loads(f.readline())


def answers_of_cache(folder: Path) -> dict[int, list[int]]:
    """The responses in a finished teacher cache (regenerated answers: sequence i answers prompt i)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["settings"]["responses"] != "regenerate":
        raise SlimSpecError(f"{folder}: its responses are not the target's ({manifest['settings']['responses']})")
    tokens = load_file(str(folder / "tokens.safetensors"))
    starts = manifest["starts"]
    out = {}
    for i in range(len(starts) - 1):
        ids = tokens["input_ids"][starts[i]:starts[i + 1]]
        first = int(tokens["loss_mask"][starts[i]:starts[i + 1]].nonzero()[0, 0])  # = prompt length - 1
        out[i] = ids[first + 1:].tolist()
    return out


def answers_in_progress(work: Path) -> dict[int, list[int]]:
    """The responses of the batches an interrupted static-engine build finished (its ``work`` folder)."""
    out, handles = {}, {}
    for i, (name, at, length, split) in batch_spans(work).items():
        if name not in handles:
            handles[name] = safe_open(str(work / name), "pt")
        out[i] = handles[name].get_slice("input_ids")[at + split:at + length].tolist()
    return out


def journal_rows(journal: Path) -> list[dict]:
    """The JSON lines of a build journal (a line cut off by a kill is skipped)."""
    rows = []
    if journal.exists():
        for line in journal.read_text().split("\n"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut off by a kill
    return rows


def batch_spans(work: Path) -> dict[int, tuple[str, int, int, int]]:
    """Where ``_static_generate`` put each finished prompt: (batch file, first row, sequence length, prompt
    length), from its journal; batches whose file is missing are left out."""
    where = {}
    for row in journal_rows(work / "batches.jsonl"):
        if not (work / row["file"]).exists():
            continue
        offset = 0
        for i, length, split in zip(row["rows"], row["lengths"], row["splits"], strict=True):
            where[int(i)] = (row["file"], offset, length, split)
            offset += length
    return where
