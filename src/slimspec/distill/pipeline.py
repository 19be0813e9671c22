"""`slimspec distill`: teacher data from the target, then the loop, then an atomically written folder."""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from slimspec.checkpoint.drafter import (
    LOWRANK_DOWN,
    SCREEN_EXACT,
    SCREEN_HEAD,
    SCREEN_HOT_IDS,
    DrafterCheckpoint,
    load_drafter,
)
from slimspec.checkpoint.files import read_json
from slimspec.checkpoint.placement import Placement, feature_dtype_for, float32_fits
from slimspec.checkpoint.target_model import TargetParts, aux_layers_for, load_target_parts, target_of
from slimspec.checkpoint.writer import NOT_DISTILLED_NOTE, atomic_folder, check_output_free, save_tensors, write_json
from slimspec.convert.factorize import factorize_whitened
from slimspec.convert.pipeline import model_name
from slimspec.distill.teacher import TeacherData, TeacherSettings, build_teacher_data
from slimspec.distill.train import (
    DistillConfig,
    DistillResult,
    _world,
    evaluate_kl,
    evaluate_top1,
    finite_or_none,
    prepare_checkpoint_dir,
    split_sequences,
    student_features,
    train_drafter,
    training_device,
)
from slimspec.errors import OptionError, SlimSpecError
from slimspec.hardware import default_generation_dtype
from slimspec.hub import resolve_model
from slimspec.model import Eagle3Drafter, LowRankHead, ScreenRescoreHead, drafter_model
from slimspec.prompts import load_prompts


@dataclass
class DataOptions:
    """Where teacher sequences come from (``--data`` etc.)."""

    data: str | list[str] | None = None
    num_prompts: int | None = None
    responses: str = "regenerate"
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0  # of the sampled answers (temperature > 0)
    max_length: int = 1024
    aux_layers: list[int] | None = None
    aux_convention: str | None = None
    engine: str = "transformers"  # TeacherSettings.engine: "static" decodes and takes features in the same passes
    generation_batch: int = 64  # prompts decoded together (part of the cache key: sampled answers depend on it)
    answers: str | None = None  # saved answers of this teacher data (slimspec.distill.answers): not decoded again
    generation_dtype: str | None = None  # of the answering copy (None: bf16 on a GPU or where the CPU has it natively,
    # else fp32)
    device: str | None = None  # where the target computes the teacher data (None: auto, a CUDA GPU when there is one,
    # the target sharded over every GPU, the CPU and disk when it does not fit one device)
    max_memory: str | None = None  # shard the target within these budgets (``cuda:0=70GiB,cpu=100GiB``)
    offload_folder: str | None = None  # where a sharded target's weights beyond the budgets go
    feature_dtype: str | None = None  # of the features (None: float32 where a float32 copy fits, else the target's)
    extra: dict[str, Any] = field(default_factory=dict)

    def placement(self) -> Placement:
        """Where the target's weights go (``checkpoint.placement``)."""
        return Placement.of(self.device, self.max_memory, self.offload_folder)

    def teacher_settings(self, aux_layers: list[int] | tuple[int, ...],
                         target_path: Path | None = None) -> TeacherSettings:
        """The teacher settings (and so the cache key) these options give, with features at ``aux_layers``.
        ``target_path``: the target, whose size against the placement's memory decides an auto feature dtype (and
        an auto generation dtype that would be float32); without it features are float32."""
        generation = self.generation_dtype or default_generation_dtype(device=self.device or "auto")
        features = self.feature_dtype if self.feature_dtype not in (None, "auto") else "float32"
        if target_path is not None:
            features = feature_dtype_for(target_path, self.placement(), self.feature_dtype)
            if self.generation_dtype is None and generation == "float32" and not float32_fits(target_path,
                                                                                              self.placement()):
                generation = features  # a float32 answering copy would not fit either
        return TeacherSettings(responses=self.responses, max_new_tokens=self.max_new_tokens,
                               temperature=self.temperature, seed=self.seed, max_length=self.max_length,
                               aux_layers=tuple(aux_layers), engine=self.engine,
                               generation_batch=self.generation_batch, generation_dtype=generation,
                               feature_dtype=features)


def teacher_for(ckpt: DrafterCheckpoint, target: TargetParts, options: DataOptions, progress: bool,
                training: bool = True) -> TeacherData:
    """Teacher data for a drafter, at the target layers it reads (its config's, in its convention). ``--aux-layers``
    / ``--aux-convention`` may only confirm them: the drafter's fc was trained on those states, and eval and vLLM
    feed it those states, so a head fitted to other ones would be served on the wrong features. ``training``:
    the data will teach a head (never slimspec's eval prompts); analyses that only measure pass False."""
    convention = options.aux_convention or (None if options.aux_layers else ckpt.aux_convention)
    layers = aux_layers_for(options.aux_layers or ckpt.config.aux_layer_ids, ckpt.layout if not options.aux_layers
                            else "override", target.num_layers, convention)
    own = aux_layers_for(ckpt.config.aux_layer_ids, ckpt.layout, target.num_layers, ckpt.aux_convention)
    if tuple(layers) != tuple(own):
        raise OptionError(f"{{aux_layers}}/{{aux_convention}} give target states {tuple(layers)}, but this drafter "
                          f"reads {tuple(own)} (its config); fix the drafter's eagle_aux_hidden_state_layer_ids "
                          "instead", "aux_layers", "aux_convention")
    settings = options.teacher_settings(layers, target.path)
    prompts = load_prompts(options.data, limit=options.num_prompts, training=training)
    return build_teacher_data(target.path, prompts, settings, progress=progress,
                              answers=Path(options.answers) if options.answers else None,
                              placement=options.placement())


def teacher_head_for(drafter: Eagle3Drafter, target: TargetParts) -> torch.Tensor:
    """The target's head over the drafter's head vocabulary (all of it, or the d2t-mapped draft rows)."""
    rows = drafter.lm_head.weight_up.shape[0]
    if rows == target.head.shape[0]:
        return target.head
    return target.head[drafter.draft_to_target(torch.arange(rows))]


SELF_TEACHER_MASK = -1.0e4
"""Bias of tokens the source drafter cannot propose, in the drafter teacher's logits (exp() of it is 0)."""


def self_teacher_head(ckpt: DrafterCheckpoint, target: TargetParts, rows: int) -> torch.Tensor:
    """The source drafter's head over a student vocabulary of ``rows`` tokens, as ``[rows, d + 1]``.

    The last column is a bias, multiplied by the constant 1 that ``train.teacher_hidden`` appends to the
    student's state: 0 for tokens of the source's draft vocabulary, ``SELF_TEACHER_MASK`` for the others (a
    full-vocabulary student of a trimmed drafter learns to keep the source's support). A drafter without a head
    of its own uses the target's rows, as it does when it drafts.
    """
    own = ckpt.head_weight()
    ids = ckpt.draft_to_target_ids()
    head = (own if own is not None else target.head[ids]).float()
    if rows == head.shape[0]:  # the student's rows are the source's draft rows, as the conversion wrote them
        return torch.cat([ckpt.rows_in_target_order(head), head.new_zeros(rows, 1)], dim=1)
    if rows != target.head.shape[0] or ids.numel() != head.shape[0]:
        raise SlimSpecError(f"no drafter teacher for a {rows}-token head (source head has {head.shape[0]} rows)")
    out = head.new_zeros(rows, head.shape[1] + 1)
    out[:, -1] = SELF_TEACHER_MASK
    out[ids, :-1] = head
    out[ids, -1] = 0.0
    return out


def distill_teacher_head(ckpt: DrafterCheckpoint, drafter: Eagle3Drafter, target: TargetParts, kind: str
                         ) -> torch.Tensor:
    """The head ``train_drafter`` needs for teacher ``kind`` (``target`` or ``drafter``)."""
    if kind == "drafter":
        return self_teacher_head(ckpt, target, drafter.lm_head.weight_up.shape[0])
    return teacher_head_for(drafter, target)


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
    shortlist: int | None = None,
    hot_rows: int | None = None,
) -> tuple[Path, DistillResult]:
    """Distil a drafter folder (a SlimSpec conversion, or any EAGLE-3 drafter) against its target.

    Writes ``out`` (default ``./<checkpoint name>-distilled``) atomically; checkpoints of the loop go to
    ``<out>.checkpoints/`` (kept on failure, removed on success) so ``resume`` can continue. ``shortlist`` K (and
    ``hot_rows`` N): distil and write a screen-and-rescore head rescoring the pair's top K (and the N draft tokens
    most frequent in the teacher data's answers): a screen checkpoint changes its K (N), a plain SlimSpec pair over
    its source drafter's draft vocabulary takes that drafter's head rows as its exact rows.
    """
    cfg = config or DistillConfig(steps=steps)
    options = data_options or DataOptions(data=data)
    if data is not None:
        options.data = data
    source = resolve_model(str(checkpoint), "drafter")
    ckpt = load_drafter(source)
    ckpt.warn_unknown_dropped(str(checkpoint))
    target_revision = ckpt.target_revision_for(target)  # the one it was converted against
    target = target or target_of(str(checkpoint), ckpt)
    out = Path(out) if out is not None else Path(f"{model_name(str(checkpoint))}-distilled")
    if out.resolve() != Path(source).resolve():
        check_output_free(out, overwrite)
    checkpoints = out.parent / f"{out.name}.checkpoints"
    prepare_checkpoint_dir(checkpoints, resume, overwrite)
    if shortlist is not None or hot_rows is not None:
        check_screen_source(ckpt, str(checkpoint), shortlist, hot_rows)
    teacher_ckpt = ckpt
    if cfg.teacher == "drafter":  # the teacher is the drafter the conversion started from (checked before any work)
        origin = ckpt.recorded("source_drafter")
        if not ckpt.is_lowrank or not origin:
            raise OptionError("{teacher} drafter distils a SlimSpec conversion against the drafter it came from; "
                              f"{checkpoint} names no source drafter (use {{teacher}} target)", "teacher")
        teacher_ckpt = load_drafter(resolve_model(str(origin), "drafter", ckpt.recorded("source_revision")))
    parts = load_target_parts(str(target), target_revision)
    rank, world = _world()
    if rank == 0:  # under torchrun, rank 0 builds the teacher cache and the others read it
        teacher = teacher_for(ckpt, parts, options, progress)
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        teacher = teacher_for(ckpt, parts, options, False)
    if shortlist is not None or hot_rows is not None:
        ckpt = with_screen(ckpt, shortlist or ckpt.shortlist, hot_rows, teacher)
    drafter = drafter_model(ckpt, parts)
    result = train_drafter(drafter, teacher, distill_teacher_head(teacher_ckpt, drafter, parts, cfg.teacher), cfg,
                             checkpoint_dir=checkpoints, resume=resume, progress=progress,
                             device=training_device(options.device))
    if rank == 0:
        write_distilled(source, ckpt, drafter, out, result, options, str(target), overwrite=True)
        shutil.rmtree(checkpoints, ignore_errors=True)
    if world > 1:
        torch.distributed.barrier()
    return out, result


def check_screen_source(ckpt: DrafterCheckpoint, name: str, shortlist: int | None, hot_rows: int | None) -> None:
    """Refuse a screen the checkpoint cannot be made into: a full head (convert it), a pair without the source
    drafter its exact rows come from, hot rows without a shortlist, or sizes over the vocabulary."""
    if not ckpt.is_lowrank:
        raise OptionError(f"{name} has a full head: `slimspec convert {name} --shortlist K` gives it a screen",
                          "shortlist")
    if not ckpt.is_screen:
        if shortlist is None:
            raise OptionError("{hot_rows} adds always-rescored tokens to a shortlist: give {shortlist} K too",
                              "hot_rows", "shortlist")
        if not ckpt.recorded("source_drafter"):
            raise OptionError(f"{name} names no source drafter whose head rows would rescore the shortlist: "
                              "convert the source drafter with {shortlist} K", "shortlist")
    vocab = int(ckpt.tensors["lm_head.weight"].shape[0])
    k = shortlist or ckpt.shortlist or 0
    n = ckpt.hot_rows if hot_rows is None else hot_rows
    if not 1 <= k or k + n > vocab:
        raise OptionError(f"{{shortlist}} {k} + {{hot_rows}} {n} must be >= 1 and fit the head's {vocab} tokens",
                          "shortlist", "hot_rows")


def with_screen(ckpt: DrafterCheckpoint, shortlist: int, hot_rows: int | None, teacher: TeacherData
                ) -> DrafterCheckpoint:
    """``ckpt`` with a screen-and-rescore head of shortlist K: its own exact rows, or its source drafter's head rows
    for a plain pair; ``hot_rows`` N (None: the screen's own) the draft tokens most frequent in ``teacher``'s
    answers."""
    tensors = dict(ckpt.tensors)
    vocab = int(tensors["lm_head.weight"].shape[0])
    if not ckpt.is_screen:
        source = load_drafter(resolve_model(str(ckpt.recorded("source_drafter")), "drafter",
                                            ckpt.recorded("source_revision")))
        exact = source.head_weight()
        if exact is None or exact.shape != (vocab, ckpt.config.hidden_size):
            raise OptionError(f"the source drafter's head ({None if exact is None else list(exact.shape)}) does not "
                              f"match the pair's {vocab} rows: convert the source with {{shortlist}} K", "shortlist")
        tensors[SCREEN_EXACT] = exact
    if hot_rows is not None:
        tensors.pop(SCREEN_HOT_IDS, None)
        if hot_rows:
            tensors[SCREEN_HOT_IDS] = hot_rows_of(ckpt, teacher, vocab, hot_rows)
    config = dict(ckpt.raw_config)
    config["slimspec"] = {**(config.get("slimspec") or {}), "head": SCREEN_HEAD, "shortlist": shortlist,
                          "hot_rows": int(tensors[SCREEN_HOT_IDS].numel()) if SCREEN_HOT_IDS in tensors else 0}
    return replace(ckpt, tensors=tensors, raw_config=config)


def top1_text(result: DistillResult) -> str:
    """``, top-1 agreement a -> b`` (step 0, held out) where both were measured, else nothing."""
    summary = result.summary()
    before, after = summary["top1_before"], summary["top1_after"]
    return "" if before is None or after is None else f", top-1 agreement {before:.3f} -> {after:.3f}"


def write_distilled(source: Path, ckpt: DrafterCheckpoint, drafter: Eagle3Drafter, out: Path,
                    result: DistillResult, options: DataOptions, target: str, overwrite: bool) -> None:
    """The source folder's files with the trained tensors and the distillation recorded in slimspec.json."""
    tensors = {k: v.to(ckpt.dtype) if v.is_floating_point() else v
               for k, v in drafter.canonical_state_dict().items()}
    for name in ("t2d",):
        if name in ckpt.tensors:
            tensors[name] = ckpt.tensors[name]
    report_path = source / "slimspec.json"
    report = read_json(report_path) if report_path.exists() else {}
    report["distill"] = {**result.summary(), "target": target, "data": asdict(options)}
    config = dict(ckpt.raw_config)
    if isinstance(config.get("slimspec"), dict):
        config["slimspec"] = {**config["slimspec"], "distilled_steps": result.steps,
                              "kl_before": finite_or_none(result.kl_before),
                              "kl_after": finite_or_none(result.kl_after)}
    with atomic_folder(out, overwrite) as tmp:
        save_tensors(tmp / "model.safetensors", tensors)
        write_json(tmp / "config.json", config)
        write_json(tmp / "slimspec.json", report)
        card = source / "README.md"
        if card.exists():
            text = card.read_text().replace(NOT_DISTILLED_NOTE, "", 1)
            kl = (f"step-0 KL {result.kl_before:.4f} -> {result.kl_after:.4f}{top1_text(result)} on held-out tokens"
                  if math.isfinite(result.kl_before) else "no held-out answer tokens to measure the KL on")
            text += f"\n## Distillation\n\n{result.steps} steps of full-vocabulary KL against `{target}`: {kl}.\n"
            (tmp / "README.md").write_text(text)
        load_drafter(tmp)  # the folder must read back


def lowrank_checkpoint(ckpt: DrafterCheckpoint, w_up: torch.Tensor, w_down: torch.Tensor,
                       d2t: torch.Tensor | None) -> DrafterCheckpoint:
    """``ckpt`` with its head replaced by the pair (and the draft vocab resized to the pair's rows)."""
    tensors = {k: v for k, v in ckpt.tensors.items()
               if k not in ("lm_head.weight", LOWRANK_DOWN, SCREEN_EXACT, SCREEN_HOT_IDS, "d2t", "t2d")}
    tensors["lm_head.weight"], tensors[LOWRANK_DOWN] = w_up, w_down
    if d2t is not None:
        tensors["d2t"] = d2t
    return replace(ckpt, tensors=tensors, config=replace(ckpt.config, draft_vocab_size=int(w_up.shape[0])))


def hot_rows_of(ckpt: DrafterCheckpoint, teacher: TeacherData, rows: int, count: int) -> torch.Tensor:
    """The ``count`` head rows (sorted) whose tokens are most frequent in the teacher data's answers (ties: the lower
    row); a head of one row per target token in target order, else in draft order."""
    targets = torch.arange(rows) if rows == ckpt.config.vocab_size else ckpt.draft_to_target_ids()
    counts = torch.bincount(teacher.response_ids().long(), minlength=ckpt.config.vocab_size).double()[targets]
    order = torch.argsort(-(counts - torch.arange(rows, dtype=torch.float64) * 1e-9))
    return torch.sort(order[:count]).values


def activation_covariance(features, chunk: int = 65536) -> torch.Tensor:
    """``sum_t w_t h_t h_t^T`` (float64) over every TTT step's normed drafter outputs (the head's real inputs).

    Accumulated ``chunk`` rows at a time: a float64 copy of all features at once would need twice their size
    again (it ran a 24 GiB machine out of memory at 600k calibration tokens).
    """
    h = features.hidden.reshape(-1, features.hidden.shape[-1])
    w = features.weight.reshape(-1)
    cov = torch.zeros(h.shape[1], h.shape[1], dtype=torch.float64, device=h.device)
    for a in range(0, h.shape[0], chunk):
        x = h[a:a + chunk].double()
        cov += (x * w[a:a + chunk].double()[:, None]).T @ x
    return cov.cpu()


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
    screen: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Step-0 KL of the SVD and whitened starts side by side, pick ``init``, then ``cfg.steps`` of distillation.

    The drafter's features, the KLs and the steps run on ``options.device`` (auto: a CUDA GPU when there is one).
    Returns the final factors (on the CPU) and a report (KL per start, distillation summary). ``screen`` (K, N): the
    pair screens for a screen-and-rescore head whose exact rows are ``weight``, rescoring its top K and the N draft
    tokens most frequent in the teacher data's answers (the report's ``hot_ids``); KLs and top-1 are the head's.
    """
    device = training_device(options.device)
    teacher = teacher_for(ckpt, target, options, progress)
    drafter = drafter_model(lowrank_checkpoint(ckpt, w_up.float(), w_down.float(), d2t), target)
    teacher_head = distill_teacher_head(ckpt, drafter, target, cfg.teacher).to(device)  # (from the CPU drafter)
    drafter.to(device)
    train_idx, eval_idx = split_sequences(teacher, cfg.eval_every_nth)
    eval_features = student_features(drafter, teacher, eval_idx, cfg.ttt_steps, allow_empty=True)
    report: dict[str, Any] = {"teacher": {"sequences": len(teacher), "tokens": teacher.num_tokens,
                                          "cache": str(teacher.folder)}}
    starts = {"svd": (w_up.float(), w_down.float())}
    if init == "whitened":
        cov = activation_covariance(student_features(drafter, teacher, train_idx, cfg.ttt_steps))
        starts["whitened"] = tuple(t.float() for t in factorize_whitened(weight.float(), rank, cov))
    hot = hot_rows_of(ckpt, teacher, weight.shape[0], screen[1]) if screen else None

    def make_head(up: torch.Tensor, down: torch.Tensor) -> LowRankHead:
        if screen is None:
            return LowRankHead(up.clone(), down.clone()).to(device)
        return ScreenRescoreHead(up.clone(), down.clone(), weight.float(), screen[0], hot).to(device)

    report["init_kl"] = {}
    for name, (up, down) in starts.items():
        drafter.lm_head = make_head(up, down)
        loss, per_step = evaluate_kl(drafter, eval_features, teacher, teacher_head, cfg.decay, kind=cfg.teacher)
        top1 = evaluate_top1(drafter, eval_features, teacher, teacher_head, kind=cfg.teacher)
        report["init_kl"][name] = {"step0_kl": finite_or_none(per_step[0]), "ttt_loss": loss,
                                   "per_step": [finite_or_none(v) for v in per_step],
                                   "step0_top1": finite_or_none(top1[0])}
    if init not in starts:
        raise OptionError(f"{{init}} must be 'svd' or 'whitened', got {init!r}", "init")
    up, down = starts[init]
    drafter.lm_head = make_head(up, down)
    report["init"] = init
    if hot is not None:
        report["hot_ids"] = hot.tolist()
    if cfg.steps > 0:
        result = train_drafter(drafter, teacher, teacher_head, cfg, progress=progress)
        report["distill"] = {**result.summary(), "data": asdict(options)}
    head = drafter.lm_head
    return head.weight_up.detach().cpu(), head.weight_down.detach().cpu(), report
