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
from slimspec.errors import OptionError
from slimspec.evaluate.acceptance import evaluate
from slimspec.evaluate.cost import full_head_seconds, head_latency, predicted_speedup, screen_head_latency
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
    screens: tuple[str, ...] = (),
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
    whole target vocabulary; ``draft``: the drafter's own draft vocabulary, skipped if it has none). Screen points:
    each ``r:K`` or ``r:K:N`` in ``screens`` (r an integer or ``d/N``) is a screen-and-rescore head over the draft
    vocabulary, distilled like the ranks (under its two-level KL), timed by ``screen_head_latency``. Every point
    records its multiply-add share of the full head (``PlanePoint.share``).

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
    points = [PlanePoint("full head", "full", 1.0, base_tau, 1.0, vd * d, str(source), 1.0)]
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
                                     str(res.out), res.report["head_flop_ratio"]))
    for spec in screens:
        rank, shortlist, hot = parse_screen(spec)
        res = convert_drafter(str(source), target, rank, vocab="draft", overwrite=True, distill_steps=distill_steps,
                              out=out_dir / f"screen-{spec.replace('/', '_').replace(':', '-')}", data_options=options,
                              distill_config=replace(recipe), progress=progress, shortlist=shortlist, hot_rows=hot)
        nu = screen_head_latency(vd, d, res.rank, shortlist, hot_rows=hot, device=where)["screen_nu"]
        tau = tau_of(str(res.out))
        label = f"Screen r={res.rank} K={shortlist}" + (f" N={hot}" if hot else "")
        points.append(PlanePoint(label, "screen", nu, tau, tau / base_tau, res.report["head_params"], str(res.out),
                                 res.report["screen"]["multiply_add_share"]))
    sizes = [size for size in trim_sizes if size < vd]
    if sizes:
        counts = _token_counts(ckpt, load_target_parts(target), options, progress)
        for kind, size in ((kind, size) for kind in counts for size in sizes):
            folder = write_trimmed(ckpt, trimmed_ids(ckpt, counts[kind], size), out_dir / f"{kind}-{size}")
            nu = full_head_seconds(size, d, device=where) / full_head_seconds(vd, d, device=where)
            tau = tau_of(str(folder))
            label = "VocabTrim" if kind == "vocabtrim" else "FR-Spec"
            points.append(PlanePoint(f"{label} {size}", kind, nu, tau, tau / base_tau, size * d, str(folder),
                                     size / vd))
    (out_dir / "plane.json").write_text(json.dumps([asdict(p) for p in points], indent=2))
    return points


AUTO_SCREENS = ("16:240",)
"""The screen-and-rescore candidates ``convert --rank auto --vocab draft`` measures beside the plain ranks: rank 16,
the top 240 rescored, 0.059 of the full head's multiply-adds on the embedded drafter (docs/research.md)."""


def parse_screen(spec: str) -> tuple[str, int, int]:
    """``r:K`` or ``r:K:N`` -> (the rank spec, K, N)."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        shortlist, hot = int(parts[1]), int(parts[2]) if len(parts) == 3 else 0
    except ValueError:
        raise OptionError(f"{{screens}} takes rank:shortlist[:hot_rows] (e.g. 16:240), got {spec!r}",
                          "screens") from None
    if shortlist < 1 or hot < 0:
        raise OptionError(f"{{screens}} {spec!r}: the shortlist must be >= 1 and hot rows >= 0", "screens")
    return parts[0], shortlist, hot


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
                      screens: tuple[str, ...] = (),
                      distill_steps: int = 60, num_prompts: int = 8, max_new_tokens: int = 96,
                      calibration_prompts: int | None = 64, overwrite: bool = False, progress: bool = True,
                      device: str | None = None) -> tuple[PlanePoint, list[PlanePoint]]:
    """``--rank auto``: measure nu(r) and rho_tau(r) for each candidate rank (each briefly distilled) and each
    screen-and-rescore candidate in ``screens`` (``r:K[:N]``, draft vocabulary), and keep the one with the highest
    predicted rho_TPS at ``kappa``. The paper leaves r manual; this is ours."""
    source = str(resolve_model(drafter, "drafter"))
    check_not_the_source(out, source)  # the chosen rank replaces ``out`` at the end
    check_output_free(out, overwrite)
    tmp = temporary_sibling(out, "auto-")  # the candidates: a killed run's are swept by the next run
    try:
        points = build_plane(drafter, target, tmp, ranks=ranks, vocabs=(vocab,), trim_sizes=(), screens=screens,
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
