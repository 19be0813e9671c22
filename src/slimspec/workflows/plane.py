"""The acceptance-cost plane of one drafter, measured side by side in one run, and ``--rank auto``, which keeps the
rank the plane predicts fastest at a given kappa."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import torch

from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.target_model import load_target_parts
from slimspec.checkpoint.writer import check_output_free, temporary_sibling
from slimspec.convert.pipeline import check_not_the_source
from slimspec.distill.scratch import scratch_teacher
from slimspec.evaluate.acceptance import evaluate
from slimspec.evaluate.cost import full_head_seconds, head_latency, predicted_speedup
from slimspec.evaluate.plane import PlanePoint, best_rank
from slimspec.evaluate.trim import token_counts, trimmed_ids, write_trimmed
from slimspec.hardware import resolve_device
from slimspec.hub import resolve_model
from slimspec.prompts import load_prompts
from slimspec.workflows.convert import convert_drafter
from slimspec.workflows.recipes import brief_distillation


def build_plane(
    drafter: str,
    target: str,
    out_dir: Path,
    *,
    ranks: tuple[str, ...] = ("d/4", "d/8", "d/16"),
    vocabs: tuple[str, ...] = ("full",),
    trim_sizes: tuple[int, ...] = (1024, 4096),
    distill_steps: int = 60,
    num_prompts: int = 8,
    max_new_tokens: int = 96,
    calibration_prompts: int | None = 64,
    base_tau: float | None = None,
    progress: bool = True,
    device: str | None = None,
) -> list[PlanePoint]:
    """Measure every point of the plane, side by side in one run.

    SlimSpec points: each rank in ``ranks`` for each head vocabulary in ``vocabs`` (``full``: the stitched
    whole target vocabulary; ``draft``: the drafter's own draft vocabulary, skipped if it has none).

    ``calibration_prompts`` shipped prompts (answers regenerated, 64 tokens) serve both the distillation of
    each rank and the VocabTrim token counts (the target's own generations). ``base_tau``: the original
    drafter's tau at the same settings, when the caller has measured it already. Each rank is distilled
    ``distill_steps`` head-only steps with the demo's recipe (:func:`brief_distillation`: the source drafter's
    head as teacher). ``device``: where the teacher data, the distillations, the tau measurements and the head
    latencies run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = resolve_model(drafter, "drafter")
    ckpt = load_drafter(source)
    d, vd = ckpt.config.hidden_size, ckpt.config.draft_vocab_size
    # the demo's recipe (drafter teacher, its lr and batch) at the plane's own prompts and steps
    options, recipe = brief_distillation(distill_steps)
    options = replace(options, num_prompts=calibration_prompts, device=device)  # teacher data and distillation
    where = resolve_device(device)  # the head latencies' device

    def tau_of(folder: str) -> float:
        return evaluate(folder, target, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                        progress=progress, device=device)["tau"]

    if base_tau is None:
        base_tau = tau_of(str(source))
    points = [PlanePoint("full head", "full", 1.0, base_tau, 1.0, vd * d, str(source))]
    vocabs = tuple(v for v in vocabs if v == "full" or vd < ckpt.config.vocab_size) or ("full",)
    for vocab in vocabs:
        for rank in ranks:
            res = convert_drafter(str(source), target, rank, vocab=vocab, overwrite=True, distill_steps=distill_steps,
                                  out=out_dir / f"slimspec-{vocab}-{rank.replace('/', '_')}", data_options=options,
                                  distill_config=replace(recipe), progress=progress)
            nu = head_latency(res.report["head_vocab"], d, res.rank, source_vocab=vd, device=where)["nu"]
            tau = tau_of(str(res.out))
            label = f"SlimSpec r={rank}" + (" (draft vocab)" if vocab == "draft" and len(vocabs) > 1 else "")
            points.append(PlanePoint(label, "slimspec", nu, tau, tau / base_tau, res.report["head_params"],
                                     str(res.out)))
    sizes = [size for size in trim_sizes if size < vd]
    if sizes:
        counts = _token_counts(ckpt, load_target_parts(target), options, progress)
        for kind, size in ((kind, size) for kind in counts for size in sizes):
            folder = write_trimmed(ckpt, trimmed_ids(ckpt, counts[kind], size), out_dir / f"{kind}-{size}")
            nu = full_head_seconds(size, d, device=where) / full_head_seconds(vd, d, device=where)
            tau = tau_of(str(folder))
            label = "VocabTrim" if kind == "vocabtrim" else "FR-Spec"
            points.append(PlanePoint(f"{label} {size}", kind, nu, tau, tau / base_tau, size * d, str(folder)))
    (out_dir / "plane.json").write_text(json.dumps([asdict(p) for p in points], indent=2))
    return points


def _token_counts(ckpt, parts, options, progress: bool) -> dict[str, torch.Tensor]:
    """What the trimming baselines keep the most frequent tokens of: the target's own generations on the
    calibration prompts (VocabTrim) and the calibration prompts' tokens (FR-Spec)."""
    from transformers import AutoTokenizer

    teacher, _ = scratch_teacher(parts, options, progress)
    vocab = ckpt.config.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(parts.path)
    corpus = torch.tensor([t for p in load_prompts(None) for t in tokenizer(p.text)["input_ids"]])
    return {"vocabtrim": token_counts(teacher.response_ids(), vocab), "frspec": token_counts(corpus, vocab)}


def convert_rank_auto(drafter: str, target: str, out: Path, *, kappa: float,
                      ranks: tuple[str, ...] = ("d/4", "d/8", "d/16", "d/32"), vocab: str = "full",
                      distill_steps: int = 60, num_prompts: int = 8, max_new_tokens: int = 96,
                      calibration_prompts: int | None = 64, overwrite: bool = False, progress: bool = True,
                      device: str | None = None) -> tuple[PlanePoint, list[PlanePoint]]:
    """``--rank auto``: measure nu(r) and rho_tau(r) for each candidate rank (each briefly distilled) and keep
    the one with the highest predicted rho_TPS at ``kappa``. The paper leaves r manual; this is ours."""
    source = str(resolve_model(drafter, "drafter"))
    check_not_the_source(out, source)  # the chosen rank replaces ``out`` at the end
    check_output_free(out, overwrite)
    tmp = temporary_sibling(out, "auto-")  # the candidates: a killed run's are swept by the next run
    try:
        points = build_plane(drafter, target, tmp, ranks=ranks, vocabs=(vocab,), trim_sizes=(),
                             distill_steps=distill_steps,
                             num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                             calibration_prompts=calibration_prompts, progress=progress, device=device)
        best = best_rank(points, kappa)
        report_path = Path(best.folder) / "slimspec.json"
        report = json.loads(report_path.read_text())
        report["rho_tau"] = best.rho_tau  # read by `slimspec bench --kappa`
        # the other candidates live in the temporary folder (deleted below): only the source and the choice stay
        kept = {best.folder: str(out), source: source}
        records = [{**asdict(p), "folder": kept.get(p.folder)} for p in points]
        report["rank_auto"] = {"kappa": kappa, "chosen": best.name, "points": records,
                               "predicted_rho_tps": {p.name: predicted_speedup(p.rho_tau, p.nu, kappa)
                                                     for p in points}}
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        shutil.move(best.folder, out)
        best.folder = str(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return best, points
