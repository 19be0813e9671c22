"""Resolve a model argument (embedded name, local folder or Hub id) to a local folder.

Downloads fetch only what conversion needs: for a drafter its config and weights, for a target its
config, tokenizer and the one shard that holds the LM head (or the tied embedding), found through
``model.safetensors.index.json``; never the whole target.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from slimspec import embedded
from slimspec.checkpoint.known import close_matches
from slimspec.checkpoint.target import head_tensor_candidates, text_config
from slimspec.errors import CheckpointError, first_line

Role = Literal["drafter", "target", "model"]  # "model": a target that will run (all its weights)

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
WEIGHT_INDEXES = ["model.safetensors.index.json", "pytorch_model.bin.index.json"]
TARGET_META_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                        "added_tokens.json", "chat_template.json", "*.jinja", "*.tiktoken", "vocab.json",
                        "merges.txt", "model.safetensors.index.json", "pytorch_model.bin.index.json"]


def _snapshot(repo_id: str, patterns: list[str], revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, revision=revision))
    except Exception as exc:  # network, auth, missing repo: all one line for the user
        first = first_line(exc)
        raise CheckpointError(f"cannot download {repo_id!r} from the Hub: {first}{_did_you_mean(repo_id, exc)}"
                              ) from None


def _did_you_mean(repo_id: str, exc: Exception) -> str:
    """``; did you mean <id>?`` when the Hub has no ``repo_id`` and the table of published drafters
    (``checkpoint.known``) holds a close one (a model card's misspelling); else empty. Gated repos exist: no hint."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if not isinstance(exc, RepositoryNotFoundError) or isinstance(exc, GatedRepoError):
        return ""
    matches = close_matches(repo_id)
    return f"; did you mean {matches[0]}?" if matches else ""


def target_weight_patterns(folder: Path) -> list[str]:
    """The weight files of a downloaded target folder that hold its LM head or tied embedding."""
    config_path = folder / "config.json"
    config = text_config(json.loads(config_path.read_text())) if config_path.exists() else {}
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            for name in head_tensor_candidates(config):
                if name in weight_map:
                    return [weight_map[name]]
            raise CheckpointError(f"{index}: names no lm_head or embedding tensor")
    return []  # unsharded: the one weight file (see _snapshot_weights)


def _snapshot_weights(repo_id: str, patterns: list[str], revision: str | None) -> Path:
    """``patterns``, then exactly the weight files the loader reads (``checkpoint.files.weight_map``): the files a
    shard index names (the safetensors index first), else the top-level ``model.safetensors``, else
    ``pytorch_model.bin``. Never both formats, and never what a glob would add: a Mistral repo's
    ``consolidated.safetensors`` (the model twice), checkpoints in subfolders."""
    folder = _snapshot(repo_id, patterns + WEIGHT_INDEXES, revision)
    for index_name in WEIGHT_INDEXES:
        index = folder / index_name
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
                raise CheckpointError(f"{repo_id}: {index_name} has no readable weight_map") from None
            return _snapshot(repo_id, patterns + [index_name, *files], revision)
    for single in ("model.safetensors", "pytorch_model.bin"):
        folder = _snapshot(repo_id, patterns + [single], revision)
        if (folder / single).exists():
            return folder
    return folder  # no weights: the loader says so in one line


def resolve_model(name: str, role: Role, revision: str | None = None) -> Path:
    """Local folder for ``name``: an ``embedded:`` model, an existing folder, or a Hub id."""
    if embedded.is_embedded(name):
        try:
            return embedded.resolve_embedded(name)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            raise CheckpointError(str(exc)) from None
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{name}: expected a folder, got a file")
        return path
    if not HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise CheckpointError(f"{name}: no such folder, and not a Hub id (owner/name)")
    if role == "drafter":
        return _snapshot_weights(name, ["config.json"], revision)
    if role == "model":  # a target that runs: all its weights (pickles only where it has no safetensors)
        return _snapshot_weights(name, TARGET_META_PATTERNS, revision)
    folder = _snapshot(name, TARGET_META_PATTERNS, revision)
    shards = target_weight_patterns(folder)  # the one shard with the head or tied embedding
    if shards:
        return _snapshot(name, TARGET_META_PATTERNS + shards, revision)
    return _snapshot_weights(name, TARGET_META_PATTERNS, revision)
