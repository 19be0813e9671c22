"""Train a whole EAGLE-3 drafter from scratch (used to build the embedded default's reference drafter).

The drafter takes the target's shapes (hidden, heads, MLP width, RoPE), a draft vocabulary of the
tokens most frequent in the target's own generations (d2t/t2d as in EAGLE), and either a full-rank
trimmed head or a SlimSpec low-rank head. It is written in the EAGLE (yuhuili) layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from slimspec import __version__
from slimspec.checkpoint.drafter import DrafterConfig, rope_of
from slimspec.checkpoint.target_model import TargetParts, aux_layers_for, load_target_parts
from slimspec.checkpoint.writer import (
    atomic_folder,
    check_output_free,
    drafter_config_json,
    eagle_config_json,
    save_tensors,
    write_json,
)
from slimspec.convert.factorize import factorize
from slimspec.convert.pipeline import portable
from slimspec.distill.pipeline import DataOptions
from slimspec.distill.teacher import TeacherData, TeacherSettings, build_teacher_data
from slimspec.distill.train import (
    DistillConfig,
    DistillResult,
    _world,
    prepare_checkpoint_dir,
    train_drafter,
    training_device,
)
from slimspec.errors import OptionError
from slimspec.model import Eagle3Drafter, FullHead, LowRankHead
from slimspec.prompts import load_prompts


def scratch_teacher(parts: TargetParts, options: DataOptions, progress: bool) -> tuple[TeacherData, TeacherSettings]:
    """Teacher data for a new drafter (EAGLE-3's default feature layers unless ``options`` say otherwise: ids in
    ``options.aux_convention``, default ``input``, the convention the written drafter records)."""
    settings = options.teacher_settings(aux_layers_for(options.aux_layers, "eagle", parts.num_layers,
                                                       options.aux_convention), parts.path)
    prompts = load_prompts(options.data, limit=options.num_prompts, training=True)
    answers = Path(options.answers) if options.answers else None
    return build_teacher_data(parts.path, prompts, settings, progress=progress, answers=answers,
                              placement=options.placement()), settings


def frequent_response_tokens(teacher: TeacherData, count: int) -> torch.Tensor:
    """The ``count`` target ids most frequent among response tokens (ties: lower id), sorted ascending."""
    vocab_hint = int(teacher.input_ids.max()) + 1
    ids = teacher.response_ids()
    counts = torch.bincount(ids if ids.numel() else teacher.input_ids, minlength=vocab_hint).double()
    order = torch.argsort(-counts + torch.arange(counts.numel(), dtype=torch.float64) * 1e-9)
    return order[:count].sort().values


def scratch_config(target: TargetParts, draft_vocab: int, num_layers: int = 1) -> DrafterConfig:
    """A new drafter's config: the target's shapes, ``draft_vocab`` rows, ``num_layers`` decoder layers (the
    EAGLE-3 layer, then plain ones over its hidden state, as vLLM builds them)."""
    cfg = json.loads((target.path / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_theta, rope_scaling = rope_of(cfg)
    return DrafterConfig(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg["intermediate_size"]),
        target_hidden_size=hidden, vocab_size=int(target.head.shape[0]), draft_vocab_size=draft_vocab,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        hidden_act=str(cfg.get("hidden_act", "silu")), num_layers=num_layers)


def init_drafter(config: DrafterConfig, target: TargetParts, draft_ids: torch.Tensor, rank: int | None,
                 seed: int) -> Eagle3Drafter:
    """Random backbone (std 0.02, unit norms); head initialised from the target's rows of the draft vocab."""
    torch.manual_seed(seed)
    rows = target.head[draft_ids].clone()
    if rank is None:
        head = FullHead(rows)
    else:
        head = LowRankHead(*factorize(rows, rank))
    d2t = draft_ids - torch.arange(draft_ids.numel()) if draft_ids.numel() != config.vocab_size else None
    drafter = Eagle3Drafter(config, head=head, embed_weight=target.embedding, d2t=d2t)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("lm_head"):
                continue
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return drafter


def train_from_scratch(
    target: str,
    out: str | Path,
    *,
    draft_vocab: int = 8192,
    rank: int | None = None,
    num_layers: int = 1,
    data_options: DataOptions | None = None,
    config: DistillConfig | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    every_nth_sequence: int = 1,
    training_extra: dict | None = None,
) -> tuple[Path, DistillResult]:
    """Train an EAGLE-3 drafter for ``target`` and write it in the EAGLE layout (``pytorch_model.bin``).

    ``num_layers`` > 1: more decoder layers after the EAGLE-3 one (speculators' multi-layer drafters; vLLM builds
    ``num_hidden_layers`` of them). ``every_nth_sequence`` > 1 trains on every n-th teacher sequence only
    (data-scaling curves: same prompt mix, 1/n of the data). ``training_extra``: more top-level fields of
    ``training.json`` (e.g. the build's prompt mix).
    """
    out = Path(out)
    if num_layers < 1:
        raise OptionError(f"{{layers}} must be >= 1, got {num_layers}", "layers")
    check_output_free(out, overwrite)
    checkpoints = out.parent / f"{out.name}.checkpoints"
    prepare_checkpoint_dir(checkpoints, resume, overwrite)
    options = data_options or DataOptions()
    cfg = config or DistillConfig()
    cfg.train_backbone = True
    parts = load_target_parts(target)
    if not 0 < draft_vocab <= parts.head.shape[0]:
        raise OptionError(f"{{draft_vocab}} must be in 1..{parts.head.shape[0]}, got {draft_vocab}", "draft_vocab")
    rank_id, world = _world()
    if rank_id == 0:  # under torchrun, rank 0 builds the teacher cache and the others read it
        teacher, settings = scratch_teacher(parts, options, progress)
    if world > 1:
        torch.distributed.barrier()
    if rank_id != 0:
        teacher, settings = scratch_teacher(parts, options, False)
    if every_nth_sequence > 1:
        teacher = teacher.subset(list(range(0, len(teacher), every_nth_sequence)))
    draft_ids = frequent_response_tokens(teacher, draft_vocab)
    if draft_ids.numel() < draft_vocab:  # fewer distinct tokens than asked: fill with the lowest unused ids
        unused = torch.ones(parts.head.shape[0], dtype=torch.bool)
        unused[draft_ids] = False
        draft_ids = torch.cat([draft_ids, unused.nonzero()[: draft_vocab - draft_ids.numel(), 0]]).sort().values
    dcfg = scratch_config(parts, draft_vocab, num_layers)
    # the feature layers as HF indices (the "input" convention the written config records); none: the default
    dcfg.aux_layer_ids = list(settings.aux_layers) if options.aux_layers else None
    dcfg.num_aux_hidden_states = len(settings.aux_layers)
    drafter = init_drafter(dcfg, parts, draft_ids, rank, cfg.seed)
    teacher_head = parts.head[draft_ids] if draft_vocab != parts.head.shape[0] else parts.head
    result = train_drafter(drafter, teacher, teacher_head, cfg, checkpoint_dir=checkpoints, resume=resume,
                             progress=progress, device=training_device(options.device))
    if rank_id == 0:  # one writer: under torchrun every rank holds the same trained drafter
        write_eagle_layout(drafter, dcfg, draft_ids, out, result, target, settings, overwrite, training_extra)
    if world > 1:
        torch.distributed.barrier()
    return out, result


def write_eagle_layout(drafter: Eagle3Drafter, config: DrafterConfig, draft_ids: torch.Tensor, out: Path,
                       result: DistillResult, target: str, settings: TeacherSettings, overwrite: bool,
                       training_extra: dict | None = None) -> None:
    """EAGLE (yuhuili) layout: flat Llama config with ``draft_vocab_size``, fp16 ``pytorch_model.bin``;
    ``training_extra``: more top-level fields of ``training.json``. A low-rank head is written as a SlimSpec
    checkpoint instead (its architecture, ``slimspec`` config section and ``model.safetensors``): stock vLLM
    cannot serve a ``[V, r]`` lm_head, the SlimSpec plugin can."""
    tensors = {k: v.detach().half().clone() if v.is_floating_point() else v.clone()
               for k, v in drafter.canonical_state_dict(with_embedding=False).items()}
    if config.draft_vocab_size != config.vocab_size:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        tensors["d2t"] = (draft_ids - torch.arange(draft_ids.numel())).long()
        tensors["t2d"] = t2d
    rank = drafter.lm_head.rank
    training = {"target": target, "teacher": settings.__dict__, "distill": result.summary(), **(training_extra or {})}
    with atomic_folder(out, overwrite) as tmp:
        if rank is None:
            torch.save(tensors, tmp / "pytorch_model.bin")
            write_json(tmp / "config.json", eagle_config_json(config, config.draft_vocab_size))
        else:
            tensors.pop("t2d", None)  # a SlimSpec checkpoint carries d2t only, as conversions do
            meta = {"version": __version__, "vocab_mode": "draft", "source_drafter": None,
                    "source_layout": "from-scratch", "aux_convention": "input", "target": portable(target)}
            save_tensors(tmp / "model.safetensors", tensors)
            write_json(tmp / "config.json", drafter_config_json(config, rank=rank, head_vocab=config.draft_vocab_size,
                                                                dtype=torch.float16, slimspec_meta=meta))
        write_json(tmp / "training.json", training)
