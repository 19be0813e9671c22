"""`slimspec distill`: teacher data from the target, then the loop, then an atomically written folder."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimspec.checkpoint.drafter import DrafterCheckpoint, load_drafter
from slimspec.checkpoint.writer import atomic_folder, check_output_free, save_tensors, write_json
from slimspec.distill.prompts import load_prompts
from slimspec.distill.teacher import TeacherData, TeacherSettings, aux_layers_for, build_teacher_data
from slimspec.distill.train import DistillConfig, DistillResult, _world, distill_drafter
from slimspec.errors import SlimSpecError
from slimspec.model import Eagle3Drafter, FullHead


@dataclass
class TargetParts:
    """What distillation needs of the target: its folder, head [V, Ht], embedding [V, H], layer count."""

    path: Path
    head: torch.Tensor
    embedding: torch.Tensor
    num_layers: int


@dataclass
class DataOptions:
    """Where teacher sequences come from (``--data`` etc.)."""

    data: str | list[str] | None = None
    num_prompts: int | None = None
    responses: str = "regenerate"
    max_new_tokens: int = 128
    temperature: float = 0.0
    max_length: int = 1024
    aux_layers: list[int] | None = None
    aux_convention: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_target_parts(target: str, revision: str | None = None) -> TargetParts:
    """Resolve the target (whole model: it runs) and read its head and embedding."""
    from slimspec.checkpoint.files import read_json, read_tensors, weight_map
    from slimspec.checkpoint.target import EMBED_NAMES, load_target_head, text_config
    from slimspec.hub import resolve_model

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


def teacher_for(ckpt: DrafterCheckpoint, target: TargetParts, options: DataOptions, progress: bool) -> TeacherData:
    """Teacher data for a drafter (its aux layers, in the convention of its layout unless overridden)."""
    layers = aux_layers_for(options.aux_layers or ckpt.config.aux_layer_ids, ckpt.layout if not options.aux_layers
                            else "override", target.num_layers, options.aux_convention)
    settings = TeacherSettings(responses=options.responses, max_new_tokens=options.max_new_tokens,
                               temperature=options.temperature, max_length=options.max_length,
                               aux_layers=tuple(layers))
    prompts = load_prompts(options.data, limit=options.num_prompts)
    return build_teacher_data(target.path, prompts, settings, progress=progress)


def drafter_model(ckpt: DrafterCheckpoint, target: TargetParts) -> Eagle3Drafter:
    """Our torch drafter for a checkpoint, with the target's embedding (and head, if it has none)."""
    head = None if ckpt.has_head else FullHead(target.head.clone())
    return Eagle3Drafter.from_checkpoint(ckpt, embed_weight=target.embedding, head=head)


def teacher_head_for(drafter: Eagle3Drafter, target: TargetParts) -> torch.Tensor:
    """The target's head over the drafter's head vocabulary (all of it, or the d2t-mapped draft rows)."""
    rows = drafter.lm_head.weight_up.shape[0]
    if rows == target.head.shape[0]:
        return target.head
    return target.head[drafter.draft_to_target(torch.arange(rows))]


def distill(
    checkpoint: str | Path,
    target: str | None = None,
    *,
    steps: int = 100,
    data: str | list[str] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    config: DistillConfig | None = None,
    data_options: DataOptions | None = None,
    resume: bool = False,
    progress: bool = True,
) -> tuple[Path, DistillResult]:
    """Distil a drafter folder (a SlimSpec conversion, or any EAGLE-3 drafter) against its target.

    Writes ``out`` (default ``<checkpoint>-distilled``) atomically; checkpoints of the loop go to
    ``<out>.checkpoints/`` (kept on failure, removed on success) so ``resume`` can continue.
    """
    from slimspec import embedded
    from slimspec.hub import resolve_model

    cfg = config or DistillConfig(steps=steps)
    options = data_options or DataOptions(data=data)
    if data is not None:
        options.data = data
    source = resolve_model(str(checkpoint), "drafter")
    ckpt = load_drafter(source)
    target = target or (ckpt.raw_config.get("slimspec") or {}).get("target") or ckpt.config.target_model
    if target is None and embedded.is_embedded(str(checkpoint)):
        target = embedded.EMBEDDED_TARGET
    if target is None:
        raise SlimSpecError("--target is needed (the checkpoint names no target)")
    out = Path(out) if out is not None else Path(f"{Path(source).name}-distilled")
    if out.resolve() != Path(source).resolve():
        check_output_free(out, overwrite)
    parts = load_target_parts(str(target))
    rank, world = _world()
    if rank == 0:  # under torchrun, rank 0 builds the teacher cache and the others read it
        teacher = teacher_for(ckpt, parts, options, progress)
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        teacher = teacher_for(ckpt, parts, options, False)
    drafter = drafter_model(ckpt, parts)
    checkpoints = out.parent / f"{out.name}.checkpoints"
    result = distill_drafter(drafter, teacher, teacher_head_for(drafter, parts), cfg, checkpoint_dir=checkpoints,
                             resume=resume, progress=progress)
    if rank == 0:
        write_distilled(source, ckpt, drafter, out, result, options, str(target), overwrite=True)
        shutil.rmtree(checkpoints, ignore_errors=True)
    if world > 1:
        torch.distributed.barrier()
    return out, result


def write_distilled(source: Path, ckpt: DrafterCheckpoint, drafter: Eagle3Drafter, out: Path,
                    result: DistillResult, options: DataOptions, target: str, overwrite: bool) -> None:
    """The source folder's files with the trained tensors and the distillation recorded in slimspec.json."""
    tensors = {k: v.to(ckpt.dtype) if v.is_floating_point() else v
               for k, v in drafter.canonical_state_dict().items()}
    for name in ("t2d",):
        if name in ckpt.tensors:
            tensors[name] = ckpt.tensors[name]
    report_path = source / "slimspec.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report["distill"] = {**result.summary(), "target": target, "data": asdict(options)}
    config = dict(ckpt.raw_config)
    if isinstance(config.get("slimspec"), dict):
        config["slimspec"] = {**config["slimspec"], "distilled_steps": result.steps,
                              "kl_before": result.kl_before, "kl_after": result.kl_after}
    with atomic_folder(out, overwrite) as tmp:
        save_tensors(tmp / "model.safetensors", tensors)
        write_json(tmp / "config.json", config)
        write_json(tmp / "slimspec.json", report)
        card = source / "README.md"
        if card.exists():
            text = card.read_text()
            text += (f"\n## Distillation\n\n{result.steps} steps of full-vocabulary KL against `{target}`: "
                     f"step-0 KL {result.kl_before:.4f} -> {result.kl_after:.4f} on held-out tokens.\n")
            (tmp / "README.md").write_text(text)
        load_drafter(tmp)  # the folder must read back


def lowrank_checkpoint(ckpt: DrafterCheckpoint, w_up: torch.Tensor, w_down: torch.Tensor,
                       d2t: torch.Tensor | None) -> DrafterCheckpoint:
    """``ckpt`` with its head replaced by the pair (and the draft vocab resized to the pair's rows)."""
    from dataclasses import replace

    from slimspec.checkpoint.drafter import LOWRANK_DOWN

    tensors = {k: v for k, v in ckpt.tensors.items() if k not in ("lm_head.weight", LOWRANK_DOWN, "d2t", "t2d")}
    tensors["lm_head.weight"], tensors[LOWRANK_DOWN] = w_up, w_down
    if d2t is not None:
        tensors["d2t"] = d2t
    return replace(ckpt, tensors=tensors, config=replace(ckpt.config, draft_vocab_size=int(w_up.shape[0])))


def activation_covariance(features) -> torch.Tensor:
    """``sum_t w_t h_t h_t^T`` over every TTT step's normed drafter outputs (the head's real inputs)."""
    h = features.hidden.reshape(-1, features.hidden.shape[-1]).double()
    w = features.weight.reshape(-1).double()
    return (h * w[:, None]).T @ h


def init_and_distill(
    ckpt: DrafterCheckpoint,
    weight: torch.Tensor,
    rank: int,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    d2t: torch.Tensor | None,
    target: TargetParts,
    options: DataOptions,
    cfg: DistillConfig,
    init: str,
    progress: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Step-0 KL of the SVD and whitened starts side by side, pick ``init``, then ``cfg.steps`` of distillation.

    Returns the final factors and a report (KL per start, distillation summary).
    """
    from slimspec.convert.factorize import factorize_whitened
    from slimspec.distill.train import evaluate_kl, split_sequences, student_features
    from slimspec.model import LowRankHead

    teacher = teacher_for(ckpt, target, options, progress)
    drafter = drafter_model(lowrank_checkpoint(ckpt, w_up.float(), w_down.float(), d2t), target)
    teacher_head = teacher_head_for(drafter, target)
    train_idx, eval_idx = split_sequences(teacher, cfg.eval_every_nth)
    eval_features = student_features(drafter, teacher, eval_idx, cfg.ttt_steps)
    report: dict[str, Any] = {"teacher": {"sequences": len(teacher), "tokens": teacher.num_tokens,
                                          "cache": str(teacher.folder)}}
    starts = {"svd": (w_up.float(), w_down.float())}
    if init == "whitened":
        cov = activation_covariance(student_features(drafter, teacher, train_idx, cfg.ttt_steps))
        starts["whitened"] = tuple(t.float() for t in factorize_whitened(weight.float(), rank, cov))
    report["init_kl"] = {}
    for name, (up, down) in starts.items():
        drafter.lm_head = LowRankHead(up.clone(), down.clone())
        loss, per_step = evaluate_kl(drafter, eval_features, teacher, teacher_head, cfg.decay)
        report["init_kl"][name] = {"step0_kl": per_step[0], "ttt_loss": loss, "per_step": per_step}
    if init not in starts:
        raise SlimSpecError(f"--init must be 'svd' or 'whitened', got {init!r}")
    up, down = starts[init]
    drafter.lm_head = LowRankHead(up.clone(), down.clone())
    report["init"] = init
    if cfg.steps > 0:
        result = distill_drafter(drafter, teacher, teacher_head, cfg, progress=progress)
        report["distill"] = {**result.summary(), "data": asdict(options)}
    head = drafter.lm_head
    return head.weight_up.detach(), head.weight_down.detach(), report
