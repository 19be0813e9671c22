"""Read only what SlimSpec needs of a target model: its config and its LM head (or tied embedding)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimspec.checkpoint.files import read_json, read_tensors, weight_map
from slimspec.errors import CheckpointError

HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")
EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "transformer.wte.weight")


def head_tensor_candidates(config: dict[str, Any]) -> tuple[str, ...]:
    """Tensor names that may hold the target's LM head, in order of preference. A config that says its head is
    not tied never falls back to the input embedding (that would be another matrix, silently)."""
    tied = config.get("tie_word_embeddings")
    if tied is False:
        return HEAD_NAMES
    return EMBED_NAMES + HEAD_NAMES if tied else HEAD_NAMES + EMBED_NAMES


@dataclass
class TargetHead:
    """A target model's LM head ``[V, Ht]`` and the config facts conversion needs."""

    weight: torch.Tensor
    tensor_name: str
    tied: bool
    config: dict[str, Any]
    source: Path

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def num_layers(self) -> int | None:
        value = self.config.get("num_hidden_layers")
        return int(value) if value is not None else None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def load_target_head(folder: str | Path) -> TargetHead:
    """Load the LM head of a target model folder, reading no other weight."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: target is not a folder")
    config = text_config(read_json(folder / "config.json"))
    files = weight_map(folder)
    for name in head_tensor_candidates(config):
        if name in files:
            weight = read_tensors(files, [name])[name]
            break
    else:
        untied = " (its config says tie_word_embeddings: false)" if config.get("tie_word_embeddings") is False else ""
        raise CheckpointError(f"{folder}: target has neither lm_head.weight nor a tied embedding{untied}")
    if weight.dim() != 2:
        raise CheckpointError(f"{folder}: {name} is not a matrix")
    if not weight.is_floating_point() or weight.element_size() < 2:  # FP8/INT8 values are not the weights
        raise CheckpointError(f"{folder}: {name} is stored as {str(weight.dtype).removeprefix('torch.')}: a "
                              "quantised head is not supported: give the unquantised target")
    hidden = config.get("hidden_size")
    if hidden is not None and int(hidden) != weight.shape[1]:
        raise CheckpointError(f"{folder}: {name} is {list(weight.shape)} but hidden_size is {hidden}")
    tied = name in EMBED_NAMES
    return TargetHead(weight=weight, tensor_name=name, tied=tied, config=config, source=folder)
