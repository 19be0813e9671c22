"""What a user looks at before choosing a rank: layout, shapes, vocab coverage, head spectrum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slimspec.checkpoint.drafter import SCREEN_EXACT, DrafterCheckpoint, load_drafter
from slimspec.checkpoint.target import load_target_head
from slimspec.convert.factorize import centered_gram, gram_matrix, squared_singular_values
from slimspec.convert.pipeline import stitched_head, validate_against_target
from slimspec.convert.rank import energy_curve
from slimspec.errors import SlimSpecError
from slimspec.hub import resolve_model
from slimspec.model import screen_footprint

MARKED_DIVISORS = (4, 8, 16)


def inspect_drafter(drafter: str, target: str | None = None, plot: str | Path | None = None) -> dict[str, Any]:
    """Describe a drafter; with ``target``, also the stitched full-vocab head. Optionally plot energy."""
    ckpt = load_drafter(resolve_model(drafter, "drafter"))
    cfg = ckpt.config
    if plot is not None and target is None and not ckpt.has_head:
        raise SlimSpecError(f"{drafter} has no head of its own (it shares the target's): --plot needs --target")
    info: dict[str, Any] = {
        "drafter": drafter,
        "layout": ckpt.layout,
        "config": {k: v for k, v in cfg.to_dict().items() if k != "extra"},
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                    for k, v in sorted(ckpt.tensors.items())},
        "dropped_tensors": ckpt.dropped,
        "head": "low-rank" if ckpt.is_lowrank else "own" if ckpt.has_head else "shared with target",
        "draft_vocab_size": cfg.draft_vocab_size,
        "vocab_size": cfg.vocab_size,
        "vocab_coverage": cfg.draft_vocab_size / cfg.vocab_size,
    }
    if ckpt.is_lowrank:
        info["rank"] = ckpt.rank
    if ckpt.is_screen:
        info["head"] = "screen and rescore"
        info["screen"] = screen_costs(ckpt)
    spectra: dict[str, torch.Tensor] = {}
    target_head = None
    if target is not None:
        target_head = load_target_head(resolve_model(target, "target"))
        validate_against_target(ckpt, target_head)
        info["target"] = target
    centered: dict[str, torch.Tensor] = {}
    heads = {}
    if ckpt.has_head or target_head is not None:
        heads["draft vocab head"], _ = stitched_head(ckpt, target_head, "draft")
    if target_head is not None and cfg.hidden_size == target_head.hidden_size:
        heads["full vocab head"], _ = stitched_head(ckpt, target_head, "full")
    for name, head in heads.items():
        gram = gram_matrix(head)
        spectra[name] = squared_singular_values(gram)
        centered[name] = squared_singular_values(centered_gram(head, gram))
    d = cfg.hidden_size

    def at_marks(found: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
        return {name: {f"d/{n}": float(energy_curve(s2)[d // n - 1]) for n in MARKED_DIVISORS}
                for name, s2 in found.items()}

    info["energy"] = at_marks(spectra)
    info["energy_centered"] = at_marks(centered)  # the rows' mean removed: what orders the tokens
    if plot is not None and spectra:
        curves = {**spectra, **{f"{name}, rows centred": s2 for name, s2 in centered.items()}}
        info["plot"] = str(plot_energy(curves, d, Path(plot), title=f"{drafter} ({ckpt.layout})"))
    return info


def screen_costs(ckpt: DrafterCheckpoint) -> dict[str, Any]:
    """A screen-and-rescore checkpoint's :func:`slimspec.model.screen_footprint`."""
    rows, hidden = ckpt.tensors[SCREEN_EXACT].shape
    return screen_footprint(rows, hidden, ckpt.rank, ckpt.shortlist, ckpt.hot_rows,
                            ckpt.tensors[SCREEN_EXACT].element_size())


def plot_energy(spectra: dict[str, torch.Tensor], hidden: int, path: Path, title: str) -> Path:
    """PNG of the cumulative energy curve(s) with ranks d/4, d/8, d/16 marked."""
    from slimspec.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s2 in spectra.items():
        curve = energy_curve(s2).numpy()
        ax.plot(range(1, len(curve) + 1), curve, label=name)
        for n in MARKED_DIVISORS:
            r = hidden // n
            ax.plot([r], [curve[r - 1]], "o", color="black", ms=4)
            ax.annotate(f"d/{n}: {curve[r - 1]:.3f}", (r, curve[r - 1]), textcoords="offset points",
                        xytext=(6, -12), fontsize=8)
    for n in MARKED_DIVISORS:
        ax.axvline(hidden // n, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("rank r")
    ax.set_ylabel("share of squared singular values kept")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
