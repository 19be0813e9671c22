"""The target as the other layers need it: its head and embedding (``TargetParts``), the runnable model and
tokenizer, its chat template ids, where its answers stop, which of its hidden states a drafter reads, and which
target a drafter names."""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from slimspec import embedded
from slimspec.checkpoint.drafter import load_drafter
from slimspec.checkpoint.files import read_json, read_tensors, weight_map
from slimspec.checkpoint.known import known_target
from slimspec.checkpoint.target import EMBED_NAMES, load_target_head, text_config
from slimspec.errors import OptionError, SlimSpecError, SlimSpecWarning
from slimspec.hub import resolve_model


@dataclass
class TargetParts:
    """What distillation needs of the target: its folder, head [V, Ht], embedding [V, H], layer count."""

    path: Path
    head: torch.Tensor
    embedding: torch.Tensor
    num_layers: int


def load_target_parts(target: str, revision: str | None = None) -> TargetParts:
    """Resolve the target (whole model: it runs) and read its head and embedding."""
    path = resolve_model(target, "model", revision)
    head = load_target_head(path)
    files = weight_map(path)
    name = next((n for n in EMBED_NAMES if n in files), None)
    if name is None:
        raise SlimSpecError(f"{target}: no token embedding found")
    embedding = read_tensors(files, [name])[name]
    config = text_config(read_json(path / "config.json"))
    return TargetParts(path=path, head=head.weight.float(), embedding=embedding.float(),
                       num_layers=int(config["num_hidden_layers"]))


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default features: hidden states *entering* target layers 2, L//2 and L-3.

    These are HF ``output_hidden_states`` indices (index i = output of layer i-1 = input of layer i),
    the convention vLLM reads ``eagle_aux_hidden_state_layer_ids`` in.
    """
    return (2, num_layers // 2, num_layers - 3)


def aux_layers_for(ids: list[int] | None, layout: str, num_layers: int, convention: str | None = None) -> tuple:
    """HF hidden-state indices of a drafter's features.

    ``convention``: ``input`` (ids name the layer the state enters: vLLM, speculators) or ``output``
    (ids name the layer that produced it: SpecForge/ModelOpt configs, so index = id + 1). By default
    the convention follows the layout that wrote the ids.
    """
    if not ids:
        return default_aux_layers(num_layers)
    convention = convention or ("output" if layout in ("specforge", "modelopt") else "input")
    if convention not in ("input", "output"):
        raise SlimSpecError(f"aux layer convention must be 'input' or 'output', got {convention!r}")
    shift = 1 if convention == "output" else 0
    out = tuple(int(i) + shift for i in ids)
    if any(not 0 <= i <= num_layers for i in out):
        raise SlimSpecError(f"aux layers {out} out of range for a target with {num_layers} layers")
    return out


def generation_stop_ids(target_path: Path) -> list[int]:
    """The distinct eos ids of a target folder's ``generation_config.json`` (sorted; [] without one)."""
    path = Path(target_path) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    return sorted({i for i in eos_ids(eos) if isinstance(i, int)})


def eos_ids(eos) -> list:
    """An ``eos_token_id`` setting (one id, a list of ids, or None) as a list."""
    return [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list | tuple) else []


def stop_token_ids(model, tokenizer) -> list[int]:
    """Where the target's answers end: its tokenizer's eos and every eos of its generation config (Llama 3.1
    Instruct: <|eot_id|>, <|eom_id|>, <|end_of_text|>), as transformers' ``generate`` and vLLM stop."""
    config = getattr(model, "generation_config", None)
    ids = eos_ids(getattr(config, "eos_token_id", None))
    if tokenizer.eos_token_id is not None:
        ids.insert(0, tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def load_target_model(target_path: Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
    """The target as a transformers causal LM (eval mode, on ``device``: default the CPU) and its tokenizer.

    On a GPU with ``accelerate`` installed, the weights load straight onto the device (``device_map``): an 8B
    float32 target never takes 32 GB of host memory on the way; without it they pass through the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    direct = where.type != "cpu" and importlib.util.find_spec("accelerate") is not None  # transformers needs it
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype,
                                                 **({"device_map": {"": where}} if direct else {}))
    model.eval()
    if where.type != "cpu":
        model.to(where)  # without accelerate; a no-op after a direct load
    return model, tokenizer


def chat_ids(tokenizer, prompt: str, answer: str | None = None) -> tuple[list[int], int]:
    """Token ids of the chat-formatted prompt (+ answer) and where the answer starts."""
    messages = [{"role": "user", "content": prompt}]
    prefix = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prefix = list(prefix["input_ids"] if not isinstance(prefix, list) else prefix)
    if answer is None:
        return prefix, len(prefix)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=True)
    full = list(full["input_ids"] if not isinstance(full, list) else full)
    if full[: len(prefix)] != prefix:  # templates that rewrite the prefix: fall back to concatenation
        full = prefix + tokenizer(answer, add_special_tokens=False)["input_ids"]
    return full, len(prefix)


def target_of(drafter: str, ckpt=None) -> str:
    """The target a drafter names (our slimspec.json metadata or its config), or the embedded target for
    embedded drafters, else the one the table of published drafters lists for its Hub id (``checkpoint.known``,
    with a warning); SlimSpecError if none. ``ckpt``: the drafter, when already loaded."""
    if ckpt is None:
        ckpt = load_drafter(resolve_model(drafter, "drafter"))

    target = ckpt.named_target
    if target is None and embedded.is_embedded(drafter):
        target = embedded.EMBEDDED_TARGET
    if target is None:
        target = known_target(drafter)
        if target is not None:
            warnings.warn(f"{drafter} names no target: using {target} from SlimSpec's table of published "
                          "drafters (--target overrides)", SlimSpecWarning, stacklevel=2)
    if target is None:
        raise OptionError("{target} is needed: the drafter names no target and is not a published drafter "
                          "SlimSpec knows", "target")
    return target
