"""A conversion from end to end: read the drafter and its target, factorise the head, calibrate and distil the pair
when asked, then write the folder and verify it."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from slimspec import embedded
from slimspec.checkpoint.drafter import LOWRANK_DOWN, SCREEN_HEAD, DrafterCheckpoint, load_drafter
from slimspec.checkpoint.known import known_target
from slimspec.checkpoint.target import TargetHead, load_target_head
from slimspec.checkpoint.target_model import TargetParts, load_target_parts
from slimspec.checkpoint.writer import (
    atomic_folder,
    check_output_free,
    drafter_config_json,
    model_card,
    save_tensors,
    write_json,
)
from slimspec.convert.factorize import centered_gram, factorize, gram_matrix, relative_error, squared_singular_values
from slimspec.convert.pipeline import (
    ConvertResult,
    check_finite_head,
    check_not_the_source,
    head_file_hash,
    lowrank_tensors,
    model_name,
    portable,
    recorded_target,
    stitched_head,
    validate_against_target,
    verify_folder,
    versions,
)
from slimspec.convert.rank import energy_curve, parse_rank
from slimspec.distill.pipeline import DataOptions, init_and_distill
from slimspec.distill.train import DistillConfig
from slimspec.dtypes import dtype_name, torch_dtype
from slimspec.errors import OptionError, SlimSpecError, SlimSpecWarning
from slimspec.hub import resolve_model
from slimspec.model import check_buildable, screen_footprint
from slimspec.progress import Stages
from slimspec.workflows.budget import budget_share, choose_under_budget
from slimspec.workflows.job import ConvertJob, conversion_job
from slimspec.workflows.recipes import BRIEF_TEACHER, BRIEF_VOCAB, brief_distillation, default_note


@dataclass
class ConversionInputs:
    """The resolved drafter and target of a conversion."""

    drafter_path: Path
    ckpt: DrafterCheckpoint
    target: str | None
    target_revision: str | None
    target_path: Path | None
    target_head: TargetHead | None
    _parts: TargetParts | None = field(default=None, init=False, repr=False)

    def target_parts(self) -> TargetParts:
        """The target's head and embedding (read once: a head budget and the distillation share them)."""
        if self._parts is None:
            self._parts = load_target_parts(str(self.target), self.target_revision)
        return self._parts


def convert_drafter(
    drafter: str | Path,
    target: str | Path | None = None,
    rank: str | int = "d/8",
    *,
    out: str | Path | None = None,
    data: str | list[str] | None = None,
    data_options: DataOptions | None = None,
    distill_config: DistillConfig | None = None,
    distill_steps: int | None = None,
    extra_report: dict[str, Any] | None = None,
    **options: Any,
) -> ConvertResult:
    """Convert an EAGLE-3 drafter (Hub id, folder or ``embedded:`` name) to a SlimSpec low-rank head.

    ``options`` are :class:`ConvertJob`'s fields: ``vocab`` (``full`` or ``draft``), ``dtype``, ``overwrite``,
    ``revision`` / ``target_revision`` (Hub revisions), ``stitch`` (``--vocab full``: rows outside the draft vocab
    from the target's head, zeros, or the target's rows rescaled to the drafter's mean row norm), ``init``
    (``svd``, ``whitened``: activation-aware from calibration data, ``auto``: whitened when distilling),
    ``progress``, ``verify_samples``. Without ``distill_steps`` (and without ``data_options`` and
    ``distill_config``) the pair is distilled as ``slimspec convert`` does by default: the brief recipe
    (``recipe="brief"``), the options given overriding its own; ``distill_steps=0`` gives the plain SVD head;
    ``distill_steps`` > 0 distils the pair against the target under full-vocabulary KL with ``data`` /
    ``data_options`` / ``distill_config`` as for ``slimspec distill``. Without ``target``, a conversion that needs
    one takes the target the drafter names (embedded drafters: the embedded target), else the one SlimSpec's table
    of published drafters lists for its Hub id (``checkpoint.known``). Returns the output folder, the resolved rank
    and the report also written to ``slimspec.json``.
    """
    target = None if target is None else str(target)
    out = None if out is None else Path(out)
    if distill_steps is None:
        if data_options is not None or distill_config is not None:
            raise OptionError("{data_options} and {distill_config} describe a distillation of your own: give "
                              "{distill_steps} with them (0: a whitened start alone); without all three, the "
                              "default recipe sets them", "data_options", "distill_config", "distill_steps")
        given = {name for name, value in (("target", target), ("data", data)) if value is not None} | set(options)
        job = conversion_job({"drafter": str(drafter), "target": target, "data": data}, given, rank=rank, out=out,
                             extra_report=dict(extra_report or {}), **options)
        if job.distils_by_default:
            Stages(job.progress).say(default_note("distill_steps=0", "recipe='brief'"))
        return run_conversion(job)
    data_options = data_options or DataOptions()
    if data is not None:
        data_options = replace(data_options, data=data)
    job = ConvertJob(drafter=str(drafter), target=target, rank=rank, out=out, distill_steps=distill_steps,
                     data_options=data_options, distill_config=replace(distill_config or DistillConfig(),
                                                                       steps=distill_steps),
                     extra_report=dict(extra_report or {}), **options)
    return run_conversion(job)


def run_conversion(job: ConvertJob) -> ConvertResult:
    """Run one validated conversion job: read, factorise, (calibrate and distil,) write, verify."""
    job.validate()
    if job.out is not None:
        check_output_free(job.out, job.overwrite)
    stages = Stages(job.progress)
    started = time.perf_counter()
    inputs = read_inputs(job, stages)
    ckpt = inputs.ckpt
    weight, rows_from_drafter = stitched_head(ckpt, inputs.target_head, job.vocab, job.stitch)
    check_finite_head(weight, rows_from_drafter, job.vocab)
    if job.head_budget is not None:
        job = _screen_under_budget(job, inputs, weight, stages)
    _check_screen_fits(job, weight.shape[0])
    r, out, spectra = _rank_and_output(job, inputs, weight, stages)
    source_rank = ckpt.tensors[LOWRANK_DOWN].shape[0] if ckpt.is_lowrank else None  # a SlimSpec output again
    # its head's rank, unless target rows were stitched beside its rows
    _check_rank_is_worth_it(r, weight.shape[0], weight.shape[1],
                            source_rank if rows_from_drafter == weight.shape[0] else None)
    with stages.stage("factorize", f"rank-{r} factors"):
        w_up, w_down = factorize(weight, r, gram=spectra["gram"])
    with stages.stage("error", "reconstruction error"):
        svd_err = relative_error(weight, w_up, w_down)
    d2t = None
    if job.vocab == "draft" and weight.shape[0] != ckpt.config.vocab_size:
        d2t = (ckpt.draft_to_target_ids() - torch.arange(weight.shape[0])).long()
    distill_report = None
    if job.reads_data:
        w_up, w_down, distill_report = _calibrate_and_distil(job, inputs, weight, r, w_up, w_down, d2t, stages)
    hot_ids = torch.tensor((distill_report or {}).pop("hot_ids", []), dtype=torch.long)
    energy = {name: float(energy_curve(spectra[name])[r - 1]) for name in ("s2", "s2_centered")}
    out_dtype = output_dtype(job.dtype, ckpt)
    report = conversion_report(
        job, inputs, weight=weight, rank=r, rows_from_drafter=rows_from_drafter, source_rank=source_rank,
        energy=energy["s2"], energy_centered=energy["s2_centered"], svd_error=svd_err,
        error=relative_error(weight, w_up.float(), w_down.float()) if distill_report is not None else svd_err,
        out_dtype=out_dtype, init=job.resolved_init)
    report.update(distill_report or {})
    if job.shortlist:
        report["screen"] = screen_footprint(*weight.shape, r, job.shortlist, job.hot_rows,
                                            torch.empty((), dtype=out_dtype).element_size())
        report["head_params"] += weight.numel()
        report["head_flop_ratio"] = report["screen"]["multiply_add_share"]
    report.update(job.extra_report)
    tensors = lowrank_tensors(ckpt, w_up, w_down, d2t, out_dtype, exact=weight if job.shortlist else None,
                              hot_ids=hot_ids)
    config = conversion_config(job, inputs, r, weight.shape[0], out_dtype)
    _write(job, inputs, out, tensors, config, weight, report, stages, started)
    screen = f", screen and rescore top {job.shortlist}" + (f" + {job.hot_rows} hot" if job.hot_rows else "")
    stages.say(f"wrote {out} (rank {r}{screen if job.shortlist else ''}, energy kept {energy['s2']:.4f}, "
               f"head FLOP ratio {report['head_flop_ratio']:.3f})")
    return ConvertResult(out=out, rank=r, report=report)


def read_inputs(job: ConvertJob, stages: Stages) -> ConversionInputs:
    """Resolve and read the drafter, then the target its head needs (the given one, else the one it names, else the
    one the table of published drafters lists for its Hub id)."""
    with stages.stage("load_drafter", f"reading drafter {job.drafter}"):
        drafter_path = resolve_model(job.drafter, "drafter", job.revision)
        ckpt = load_drafter(drafter_path)
    if job.out is not None:
        check_not_the_source(job.out, drafter_path)
    ckpt.warn_unknown_dropped(job.drafter)
    if job.reads_data:  # both build the PyTorch drafter: refuse one it cannot build now
        check_buildable(ckpt.config)
    target = job.target
    if target is None and embedded.is_embedded(job.drafter):
        target = embedded.EMBEDDED_TARGET
    if target is None and (job.vocab == "full" or job.reads_data or not ckpt.has_head):
        target = ckpt.named_target
        if target is not None:
            stages.say(f"target {target} (named by the drafter; --target overrides)")
        elif (target := known_target(job.drafter)) is not None:
            stages.say(f"target {target} (the drafter names none: from SlimSpec's table of published drafters; "
                       "--target overrides)")
    if target is None and job.reads_data:
        raise job.no_target_error()
    target_revision = job.target_revision
    if target_revision is None and target is not None:  # a SlimSpec source's pinned target revision stays pinned
        target_revision = ckpt.target_revision_for(str(target))
    target_path = target_head = None
    if target is not None:
        target = str(target)
        with stages.stage("load_target", f"reading target head {target}"):
            target_path = resolve_model(target, "target", target_revision)
            if job.out is not None:
                check_not_the_source(job.out, drafter_path, target_path)
            target_head = load_target_head(target_path)
        validate_against_target(ckpt, target_head)
    cfg = ckpt.config
    stages.say(f"layout {ckpt.layout}: hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size} "
               f"of {cfg.vocab_size}, head {'low-rank' if ckpt.is_lowrank else 'own' if ckpt.has_head else 'shared'}")
    return ConversionInputs(drafter_path, ckpt, target, target_revision, target_path, target_head)


def _rank_and_output(job: ConvertJob, inputs: ConversionInputs, weight: torch.Tensor, stages: Stages
                     ) -> tuple[int, Path, dict[str, torch.Tensor]]:
    """The rank (an ``energy:`` spec needs the spectrum first), the output folder, and the head's spectra."""
    hidden = weight.shape[1]
    needs_spectrum = str(job.rank).strip().startswith("energy:")
    r = None if needs_spectrum else parse_rank(job.rank, hidden)
    out = job.out
    if out is None and r is not None:
        out = default_out(job, r)
        check_output_free(out, job.overwrite)
        check_not_the_source(out, inputs.drafter_path, inputs.target_path)
    with stages.stage("gram", f"Gram matrix of the {weight.shape[0]}x{hidden} head"):
        gram = gram_matrix(weight)
    with stages.stage("spectrum", "singular values"):
        spectra = {"gram": gram, "s2": squared_singular_values(gram),
                   "s2_centered": squared_singular_values(centered_gram(weight, gram))}
    if r is None:
        r = parse_rank(job.rank, hidden, spectra["s2"])
        if out is None:
            out = default_out(job, r)
        check_output_free(out, job.overwrite)
    return r, Path(out), spectra


def default_out(job: ConvertJob, rank: int) -> Path:
    """``./<drafter>-slimspec-r<r>`` (``-k<K>`` and ``-n<N>`` added for a screen-and-rescore head)."""
    screen = (f"-k{job.shortlist}" if job.shortlist else "") + (f"-n{job.hot_rows}" if job.hot_rows else "")
    return Path(f"{model_name(job.drafter)}-slimspec-r{rank}{screen}")


def _check_screen_fits(job: ConvertJob, rows: int) -> None:
    """A shortlist (and hot rows) no larger than the head's vocabulary."""
    if job.shortlist + job.hot_rows > rows:
        raise OptionError(f"{{shortlist}} {job.shortlist} + {{hot_rows}} {job.hot_rows} exceed the head's {rows} "
                          "tokens", "shortlist", "hot_rows")


def _screen_under_budget(job: ConvertJob, inputs: ConversionInputs, weight: torch.Tensor, stages: Stages
                         ) -> ConvertJob:
    """The job with the rank, shortlist and hot rows ``--head-budget`` picks from the calibration data."""
    if inputs.target is None:
        raise job.no_target_error()
    budget = budget_share(job.head_budget, *weight.shape)
    served = f" at batch {job.serve_batch}" if job.serve_batch > 1 else ""
    with stages.stage("budget", f"screens under {budget:.3f} of the head's multiply-adds{served}"):
        choice = choose_under_budget(inputs.ckpt, weight, inputs.target_parts(), job.data_options, budget,
                                     job.distill_config.eval_every_nth, job.distill_config.ttt_steps, job.progress,
                                     job.serve_batch)
    stages.say(choice.summary())
    chosen = choice.chosen
    return replace(job, rank=chosen.rank, shortlist=chosen.shortlist, hot_rows=chosen.hot_rows,
                   extra_report={**job.extra_report, "head_budget": choice.report()})


def _check_rank_is_worth_it(r: int, rows: int, hidden: int, held: int | None) -> None:
    """Refuse a rank at or above ``held``, the rank of a head that is already a low-rank pair (a SlimSpec output
    converted again: a larger pair only adds zero directions); warn when the pair holds more weights than the full
    head."""
    if held is not None and r >= held:
        raise SlimSpecError(f"the head is already a rank-{held} pair: a rank-{r} pair adds only zero directions; "
                            f"pick r < {held}")
    if r * (rows + hidden) >= rows * hidden:
        warnings.warn(f"rank {r}: the pair (V x r + r x d = {r * (rows + hidden):,} weights) is no smaller than the "
                      f"full {rows} x {hidden} head ({rows * hidden:,}); pick r < {rows * hidden // (rows + hidden)}",
                      SlimSpecWarning, stacklevel=4)


def _calibrate_and_distil(job: ConvertJob, inputs: ConversionInputs, weight: torch.Tensor, r: int,
                          w_up: torch.Tensor, w_down: torch.Tensor, d2t: torch.Tensor | None, stages: Stages):
    """The whitened start (from calibration data) and ``distill_steps`` of distillation against the target."""
    if inputs.target is None:
        raise job.no_target_error()
    init, steps = job.resolved_init, job.distill_steps
    config = replace(job.distill_config, steps=steps)
    with stages.stage("distill", f"calibration ({init} init) and {steps} distillation steps"):
        return init_and_distill(inputs.ckpt, weight, r, w_up, w_down, d2t,
                                inputs.target_parts(), job.data_options, config,
                                init, job.progress, screen=(job.shortlist, job.hot_rows) if job.shortlist else None)


def output_dtype(dtype: str | torch.dtype | None, ckpt: DrafterCheckpoint) -> torch.dtype:
    """The dtype the folder is written in: the one asked for, else the source's (float32 if that is no float)."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    chosen = dtype or ckpt.dtype
    return chosen if chosen in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def _write(job: ConvertJob, inputs: ConversionInputs, out: Path, tensors: dict[str, torch.Tensor],
           config: dict[str, Any], weight: torch.Tensor, report: dict[str, Any], stages: Stages, started: float
           ) -> None:
    """Write the folder atomically: weights, config, model card, then verify the reload and write the report."""
    ckpt, r = inputs.ckpt, report["rank"]
    with atomic_folder(out, job.overwrite) as tmp:
        with stages.stage("write", f"writing {out}"):
            save_tensors(tmp / "model.safetensors", tensors)
            write_json(tmp / "config.json", config)
            (tmp / "README.md").write_text(model_card(
                drafter_id=job.drafter, target_id=_named_target(job, inputs) or "TARGET", rank=r,
                hidden=weight.shape[1], report=report, out_name=out.name,
                parallel=ckpt.config.parallel_token_id is not None))
        with stages.stage("verify", "reloading and checking logits"):
            report["verification"] = verify_folder(tmp, tensors, weight, samples=job.verify_samples)
        report["timings"] = {**{k: round(v, 3) for k, v in stages.timings.items()},
                             "total": round(time.perf_counter() - started, 3)}
        write_json(tmp / "slimspec.json", report)


def conversion_report(job: ConvertJob, inputs: ConversionInputs, *, weight: torch.Tensor, rank: int,
                      rows_from_drafter: int, source_rank: int | None, energy: float, energy_centered: float,
                      svd_error: float, error: float, out_dtype: torch.dtype, init: str) -> dict[str, Any]:
    """What ``slimspec.json`` records of a conversion: its sources, the rank, the energy kept and the errors."""
    ckpt, target_head = inputs.ckpt, inputs.target_head
    head_vocab, hidden = weight.shape
    source_rows = ckpt.head_weight().shape[0] if ckpt.has_head else head_vocab
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {
            "drafter": job.drafter,
            "drafter_layout": ckpt.layout,
            "drafter_files": ckpt.file_hashes(),
            "dropped_tensors": ckpt.dropped,
            "target": inputs.target,
            "target_head_tensor": target_head.tensor_name if target_head else None,
            "target_head_file": head_file_hash(target_head) if target_head else None,
        },
        "rank": rank,
        "rank_spec": str(job.rank),
        "vocab_mode": job.vocab,
        "head_vocab": head_vocab,
        "draft_vocab_size": ckpt.config.draft_vocab_size,
        "vocab_size": ckpt.config.vocab_size,
        "hidden_size": hidden,
        "rows_from_drafter": rows_from_drafter,
        "rows_from_target": head_vocab - rows_from_drafter,
        "energy_kept": energy,
        "energy_kept_centered": energy_centered,  # the rows' mean removed: the part softmax sees
        "relative_frobenius_error": error,
        "svd_relative_frobenius_error": svd_error,
        "head_params_source": source_rows * hidden if source_rank is None else source_rank * (source_rows + hidden),
        "head_rows_source": source_rows,
        "head_params": rank * hidden + head_vocab * rank,
        "head_flop_ratio": (rank * hidden + head_vocab * rank) / (source_rows * hidden),
        "dtype": dtype_name(out_dtype),
        "stitch": job.stitch,
        "init": init,
        "versions": versions(),
    }


def _named_target(job: ConvertJob, inputs: ConversionInputs) -> str | None:
    """The target the output names for later commands (eval, distill) when the conversion read none: the one the
    source names, else the table's for a published drafter (the output is a local folder the table cannot match)."""
    if inputs.target is not None:
        return inputs.target
    return inputs.ckpt.named_target or known_target(job.drafter)


def conversion_config(job: ConvertJob, inputs: ConversionInputs, rank: int, head_vocab: int, out_dtype: torch.dtype
                      ) -> dict[str, Any]:
    """The output's config.json: the source's architecture with the pair's rank and SlimSpec's metadata."""
    ckpt = inputs.ckpt
    meta = {"version": versions()["slimspec"], "vocab_mode": job.vocab,
            "source_drafter": portable(job.drafter), "source_layout": ckpt.layout,
            "aux_convention": ckpt.aux_convention, "target": recorded_target(_named_target(job, inputs), ckpt)}
    if job.revision:
        meta["source_revision"] = job.revision
    if inputs.target_revision:
        meta["target_revision"] = inputs.target_revision
    if job.shortlist:
        meta.update({"head": SCREEN_HEAD, "shortlist": job.shortlist, "hot_rows": job.hot_rows})
    return drafter_config_json(ckpt.config, rank=rank, head_vocab=head_vocab, dtype=out_dtype, slimspec_meta=meta)


def convert_briefly(drafter: str | Path, target: str | Path | None, rank: str | int, out: str | Path, *,
                    teacher: str = BRIEF_TEACHER, vocab: str = BRIEF_VOCAB, steps: int | None = None,
                    overwrite: bool = False, progress: bool = False) -> ConvertResult:
    """``convert_drafter`` at ``rank`` with :func:`brief_distillation`'s recipe: what ``make demo`` runs, and what the
    vLLM tests, the decode benchmark and ``research/rank_sweep.py`` measure. Returns the ``ConvertResult``."""
    options, config = brief_distillation(steps, teacher)
    if str(target) == embedded.EMBEDDED_TARGET or target is None and str(drafter) == embedded.EMBEDDED_DRAFTER:
        # float32 answers on every CPU: the key of the answers shipped for this recipe (SHIPPED_ANSWERS)
        options = replace(options, generation_dtype="float32")
    return convert_drafter(drafter, target, rank, vocab=vocab, out=out, overwrite=overwrite, progress=progress,
                           distill_steps=config.steps, data_options=options, distill_config=config)
