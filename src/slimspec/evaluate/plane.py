"""The acceptance-cost plane (the paper's Figure 3) for one drafter: (nu, rho_tau) of each head variant.

Points: the drafter's own head; SlimSpec at several ranks (each briefly distilled); VocabTrim-style and
FR-Spec-style trims at several sizes. Iso-speedup curves: rho_TPS = 1 at kappa k is
rho_tau = (1 + nu k) / (1 + k); a point above a curve is faster end to end at that kappa.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slimspec.evaluate.cost import predicted_speedup


@dataclass
class PlanePoint:
    name: str
    kind: str  # full | slimspec | screen | vocabtrim | frspec
    nu: float
    tau: float
    rho_tau: float
    head_params: int
    folder: str
    share: float | None = None  # multiply-adds per token as a share of the full head's (None: not recorded)


def best_rank(points: list[PlanePoint], kappa: float) -> PlanePoint:
    """The SlimSpec point (a plain pair or a screen) with the highest predicted rho_TPS at ``kappa``
    (``--rank auto``)."""
    candidates = [p for p in points if p.kind in ("slimspec", "screen")]
    return max(candidates, key=lambda p: predicted_speedup(p.rho_tau, p.nu, kappa))


def share_table(points: list[PlanePoint], kappas: tuple[float, ...]) -> list[str]:
    """The plane by multiply-add share: rho_TPS predicted with nu = the share (a head bound by its multiply-adds or
    the bytes it reads), for the points that record one."""
    head = "| head | multiply-add share | rho_tau | " + " | ".join(f"rho_TPS @ kappa {k}" for k in kappas) + " |"
    lines = [head, "|" + "---|" * (3 + len(kappas))]
    for p in sorted((p for p in points if p.share is not None), key=lambda p: p.share):
        cells = " | ".join(f"{predicted_speedup(p.rho_tau, p.share, k):.3f}" for k in kappas)
        lines.append(f"| {p.name} | {p.share:.3f} | {p.rho_tau:.3f} | {cells} |")
    return lines


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
    fig, ax = plt.subplots(figsize=(7, 5))
    nus = np.linspace(0, 1.05, 100)
    for k in kappas:
        ax.plot(nus, (1 + nus * k) / (1 + k), ls="--", lw=0.8, label=f"rho_TPS = 1 at kappa {k}")
    markers = {"full": "s", "slimspec": "o", "screen": "D", "vocabtrim": "^", "frspec": "v"}
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
    by_share = share_table(points, kappas)
    (out_dir / "plane.md").write_text("\n".join(table) + "\n\n" + "\n".join(by_share) + "\n")
    png = plot_plane(points, kappas, out_dir / "plane.png", title)
    return {"table": table, "share_table": by_share, "png": str(png), "points": [asdict(p) for p in points]}


