"""Write a SlimSpec drafter folder: vLLM-style config, safetensors, model card; atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from slimspec.checkpoint.drafter import DrafterConfig
from slimspec.dtypes import dtype_name
from slimspec.errors import SlimSpecError

ARCHITECTURES = {"llama": "Eagle3SlimSpecLlamaForCausalLM", "qwen3": "Eagle3SlimSpecQwen3ForCausalLM"}
# full-rank drafters in the EAGLE layout: vLLM serves architecture A as Eagle3A (Eagle3Qwen3ForCausalLM builds Qwen3
# layers with q/k norms, Eagle3LlamaForCausalLM Llama ones)
EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def drafter_config_json(
    cfg: DrafterConfig, *, rank: int, head_vocab: int, dtype: torch.dtype, slimspec_meta: dict[str, Any]
) -> dict[str, Any]:
    """A flat Llama/Qwen3-style EAGLE-3 config (as vLLM reads drafters) naming our architecture.

    The architecture starts with ``Eagle3`` (so vLLM keeps the name) and is unknown to vLLM without
    the SlimSpec plugin: without it vLLM refuses the checkpoint instead of running a random head.
    """
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": head_vocab,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }
    if cfg.aux_layer_ids:
        config["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    _variant_keys(config, cfg)
    config["slimspec"] = {"rank": rank, **slimspec_meta}
    return config


def eagle_config_json(cfg: DrafterConfig, draft_vocab: int, aux_convention: str = "input") -> dict[str, Any]:
    """A flat Llama/Qwen3 config in the EAGLE (yuhuili) layout, for drafters we write with full-rank heads
    (``aux_convention`` ``output``: the ids were a SpecForge/ModelOpt source's and keep its meaning)."""
    config: dict[str, Any] = {
        "architectures": [EAGLE_ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab, "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "torch_dtype": "float16", "tie_word_embeddings": False,
    }
    if cfg.aux_layer_ids:
        config["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
        if aux_convention == "output":
            config["aux_convention"] = "output"
    _variant_keys(config, cfg)
    return config


def _variant_keys(config: dict[str, Any], cfg: DrafterConfig) -> None:
    """Keys only some drafters need: the feature count (vLLM assumes 3 without it), a P-EAGLE drafter's mask-slot
    token (under the key AWS's P-EAGLE drafters use; vLLM reads it), attention_bias (vLLM then builds the biases
    the weights hold) and a sliding window: ``layer_types`` for every layer with ``sliding_window``, which vLLM's
    Llama and Qwen3 Eagle3 layers read, and ``use_sliding_window`` (without it transformers' Qwen3Config drops the
    window)."""
    if cfg.aux_layer_ids or cfg.num_aux_hidden_states != 3:
        config["num_aux_hidden_states"] = cfg.num_aux_hidden_states
    if cfg.parallel_token_id is not None:
        config["ptd_token_id"] = cfg.parallel_token_id
    if cfg.attention_bias:
        config["attention_bias"] = True
    if cfg.layer_types:
        config.update(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window, use_sliding_window=True)


def _distilled(report: dict[str, Any]) -> str:
    """How the factors were distilled after their start, for the card's first sentence ('' if they were not)."""
    distill = report.get("distill")
    if not distill:
        return ""
    teacher = (distill.get("config") or {}).get("teacher", "target")
    return f", then distilled {distill.get('steps')} steps against the {teacher}'s distribution (full-vocabulary KL)"


NOT_DISTILLED_NOTE = ("\nThe pair is not distilled: a start without distillation can keep much less of the source's "
                      "acceptance. `slimspec distill` trains it under full-vocabulary KL.\n")
"""The card's note on a conversion without distillation steps (`slimspec distill` removes it when it trains)."""


def _distill_rows(report: dict[str, Any]) -> list[str]:
    """The card's rows of held-out numbers before -> after distillation (first draft position), where measured."""
    distill = report.get("distill") or {}
    teacher = (distill.get("config") or {}).get("teacher", "target")
    rows = []
    names = {"kl": f"held-out KL to the {teacher}", "top1": f"held-out top-1 agreement with the {teacher}"}
    for key, name in names.items():
        before, after = distill.get(f"{key}_before"), distill.get(f"{key}_after")
        if before is not None and after is not None:
            rows.append(f"| {name} | {before:.4f} -> {after:.4f} |")
    return rows


def model_card(*, drafter_id: str, target_id: str, rank: int, hidden: int, report: dict[str, Any],
               out_name: str, parallel: bool = False) -> str:
    """README.md with Hub metadata, what was done, the numbers, and how to serve it (``parallel``: a P-EAGLE
    drafter, served with ``parallel_drafting``)."""
    serve = {"method": "eagle3", "model": out_name, "num_speculative_tokens": 3}
    if parallel:
        serve["parallel_drafting"] = True
    energy = report.get("energy_kept")
    err = report.get("relative_frobenius_error")
    flops = report.get("head_flop_ratio")
    lines = [
        "---",
        f"base_model: {drafter_id}",
        "tags:",
        "- speculative-decoding",
        "- eagle3",
        "- slimspec",
        "library_name: vllm",
        "---",
        "",
        f"# {out_name}",
        "",
        f"An EAGLE-3 drafter for `{target_id}` whose LM head was replaced by SlimSpec's low-rank pair",
        f"`W_up (V x {rank}) @ W_down ({rank} x {hidden})` (rank r = {rank} = d/{hidden / rank:.3g}),",
        f"initialised from {'a whitened SVD' if report.get('init') == 'whitened' else 'an SVD'} of the head of "
        f"`{drafter_id}`{_distilled(report)}.",
        *([] if report.get("distill") else [NOT_DISTILLED_NOTE.rstrip("\n")]),
        "",
        "| quantity | value |",
        "|---|---|",
        f"| rank | {rank} |",
        f"| head vocabulary | {report.get('head_vocab')} ({report.get('vocab_mode')}) |",
        f"| energy kept | {energy:.4f} |" if energy is not None else "| energy kept | - |",
        *([f"| energy kept, rows centred (what softmax sees) | {centred:.4f} |"]
          if (centred := report.get("energy_kept_centered")) is not None else []),
        f"| relative Frobenius error | {err:.4f} |" if err is not None else "| relative Frobenius error | - |",
        f"| head FLOP ratio | {flops:.4f} |" if flops is not None else "| head FLOP ratio | - |",
        *_distill_rows(report),
        "",
        "## Serve with vLLM",
        "",
        "```bash",
        "pip install 'slimspec[vllm]'",
        f"vllm serve {target_id} --speculative-config '{json.dumps(serve, separators=(',', ':'))}'",
        "```",
        "",
        "The `slimspec` plugin registers the low-rank head with vLLM; without it vLLM refuses this",
        "checkpoint (unknown architecture) rather than run a randomly initialised head.",
        "",
        "Made with [SlimSpec](https://arxiv.org/abs/2605.10453)-style conversion by the `slimspec` tool;",
        "`slimspec.json` records the sources (with sha256), the settings and the measured numbers.",
        "",
    ]
    return "\n".join(lines)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """safetensors file with contiguous, unshared tensors, readable as the umask allows (safetensors writes 0600:
    a server running as another user could not read the weights beside their world-readable config)."""
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path),
              metadata=metadata or {"format": "pt"})
    Path(path).chmod(0o666 & ~_umask())


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def nearest_existing_parent(path: Path) -> Path:
    """The closest ancestor of ``path`` that exists (a file there means ``path`` cannot be made)."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    return parent


def check_output_free(out: Path, overwrite: bool) -> None:
    """Refuse an existing output (before any work) unless overwriting."""
    if out.exists() and not overwrite:
        raise SlimSpecError(f"{out} already exists (use --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise SlimSpecError(f"{out} exists and is not a folder")
    parent = nearest_existing_parent(out)  # the folder is made at the end: a parent it cannot be made in fails now
    if not parent.is_dir():
        raise SlimSpecError(f"cannot make {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SlimSpecError(f"cannot make {out}: {parent} is not writable")


def remove_stale_temps(parent: Path, name: str) -> None:
    """Remove ``parent/.{name}.tmp-PID`` folders whose process is gone (left by a killed run)."""
    if not parent.is_dir():
        return
    for stale in parent.glob(f".{name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def temporary_sibling(out: Path, tag: str = "") -> Path:
    """A fresh empty folder ``.{out.name}.tmp-{tag}PID`` beside ``out`` (the caller removes it), after sweeping
    those a killed run left there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out.parent, out.name)
    tmp = out.parent / f".{out.name}.tmp-{tag}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def atomic_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``out``, on failure it is removed.

    A reader never sees a half-written ``out``: it is either absent, the old one, or complete.
    """
    check_output_free(out, overwrite)
    tmp = temporary_sibling(out)
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
