"""The acceptance-cost plane (the paper's Figure 3) for one drafter: (nu, rho_tau) of each head variant.

Points: the drafter's own head; SlimSpec at several ranks (each briefly distilled); VocabTrim-style and
FR-Spec-style trims at several sizes. Iso-speedup curves: rho_TPS = 1 at kappa k is
rho_tau = (1 + nu k) / (1 + k); a point above a curve is faster end to end at that kappa.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from slimspec.evaluate.cost import full_head_seconds, head_latency, predicted_speedup


@dataclass
class PlanePoint:
    name: str
    kind: str  # full | slimspec | vocabtrim | frspec
    nu: float
    tau: float
    rho_tau: float
    head_params: int
    folder: str


def best_rank(points: list[PlanePoint], kappa: float) -> PlanePoint:
    """The SlimSpec point with the highest predicted rho_TPS at ``kappa`` (``--rank auto``)."""
    candidates = [p for p in points if p.kind == "slimspec"]
    return max(candidates, key=lambda p: predicted_speedup(p.rho_tau, p.nu, kappa))


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
    from slimspec.checkpoint import load_drafter
    from slimspec.convert.pipeline import convert
    from slimspec.distill.pipeline import brief_distillation, load_target_parts
    from slimspec.distill.prompts import load_prompts
    from slimspec.distill.scratch import scratch_teacher
    from slimspec.evaluate.acceptance import evaluate
    from slimspec.evaluate.trim import token_counts, trimmed_ids, write_trimmed
    from slimspec.hardware import resolve_device
    from slimspec.hub import resolve_model

    out_dir.mkdir(parents=True, exist_ok=True)
    source = resolve_model(drafter, "drafter")
    ckpt = load_drafter(source)
    d, vd = ckpt.config.hidden_size, ckpt.config.draft_vocab_size
    parts = load_target_parts(target)
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
            res = convert(str(source), target, rank, vocab=vocab, overwrite=True, distill_steps=distill_steps,
                          out=out_dir / f"slimspec-{vocab}-{rank.replace('/', '_')}", data_options=options,
                          distill_config=replace(recipe), progress=progress)
            r = res.rank
            nu = head_latency(res.report["head_vocab"], d, r, source_vocab=vd, device=where)["nu"]
            tau = tau_of(str(res.out))
            label = f"SlimSpec r={rank}" + (" (draft vocab)" if vocab == "draft" and len(vocabs) > 1 else "")
            points.append(PlanePoint(label, "slimspec", nu, tau, tau / base_tau, res.report["head_params"],
                                     str(res.out)))
    sizes = [size for size in trim_sizes if size < vd]
    if sizes:  # token counts: the target's generations (VocabTrim) and the shipped prompts (FR-Spec)
        import torch
        from transformers import AutoTokenizer

        teacher, _ = scratch_teacher(parts, options, progress)
        vocab = ckpt.config.vocab_size
        generations = token_counts(teacher.response_ids(), vocab)
        tokenizer = AutoTokenizer.from_pretrained(parts.path)
        corpus = token_counts(torch.tensor([t for p in load_prompts(None) for t in tokenizer(p.text)["input_ids"]]),
                              vocab)
        for kind, counts in (("vocabtrim", generations), ("frspec", corpus)):
            for size in sizes:
                folder = write_trimmed(ckpt, trimmed_ids(ckpt, counts, size), out_dir / f"{kind}-{size}")
                nu = full_head_seconds(size, d, device=where) / full_head_seconds(vd, d, device=where)
                tau = tau_of(str(folder))
                label = "VocabTrim" if kind == "vocabtrim" else "FR-Spec"
                points.append(PlanePoint(f"{label} {size}", kind, nu, tau, tau / base_tau, size * d, str(folder)))
    (out_dir / "plane.json").write_text(json.dumps([asdict(p) for p in points], indent=2))
    return points


def plane_table(points: list[PlanePoint], kappas: tuple[float, ...]) -> list[str]:
    head = "| head | nu | tau | rho_tau | " + " | ".join(f"rho_TPS @ kappa {k}" for k in kappas) + " |"
    lines = [head, "|" + "---|" * (4 + len(kappas))]
    for p in points:
        cells = " | ".join(f"{predicted_speedup(p.rho_tau, p.nu, k):.3f}" for k in kappas)
        lines.append(f"| {p.name} | {p.nu:.3f} | {p.tau:.3f} | {p.rho_tau:.3f} | {cells} |")
    return lines


def plot_plane(points: list[PlanePoint], kappas: tuple[float, ...], path: Path, title: str) -> Path:
    """PNG: points in the (nu, rho_tau) plane with break-even curves rho_TPS = 1 for each kappa."""
    from slimspec.plotting import pyplot

    plt = pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 5))
    nus = np.linspace(0, 1.05, 100)
    for k in kappas:
        ax.plot(nus, (1 + nus * k) / (1 + k), ls="--", lw=0.8, label=f"rho_TPS = 1 at kappa {k}")
    markers = {"full": "s", "slimspec": "o", "vocabtrim": "^", "frspec": "v"}
    for p in points:
        ax.plot(p.nu, p.rho_tau, markers[p.kind], ms=7)
        ax.annotate(p.name, (p.nu, p.rho_tau), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("nu = head latency / original head latency")
    ax.set_ylabel("rho_tau = tau / tau of the original drafter")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plane_report(points: list[PlanePoint], kappas: tuple[float, ...], out_dir: Path, title: str) -> dict[str, Any]:
    table = plane_table(points, kappas)
    (out_dir / "plane.md").write_text("\n".join(table) + "\n")
    png = plot_plane(points, kappas, out_dir / "plane.png", title)
    return {"table": table, "png": str(png), "points": [asdict(p) for p in points]}


def convert_rank_auto(drafter: str, target: str, out: Path, *, kappa: float,
                      ranks: tuple[str, ...] = ("d/4", "d/8", "d/16", "d/32"), vocab: str = "full",
                      distill_steps: int = 60, num_prompts: int = 8, max_new_tokens: int = 96,
                      calibration_prompts: int | None = 64, overwrite: bool = False, progress: bool = True,
                      device: str | None = None) -> tuple[PlanePoint, list[PlanePoint]]:
    """``--rank auto``: measure nu(r) and rho_tau(r) for each candidate rank (each briefly distilled) and keep
    the one with the highest predicted rho_TPS at ``kappa``. The paper leaves r manual; this is ours."""
    import shutil

    from slimspec.checkpoint.writer import check_output_free, temporary_sibling
    from slimspec.convert.pipeline import check_not_the_source
    from slimspec.hub import resolve_model

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
