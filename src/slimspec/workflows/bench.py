"""``slimspec bench``: the head latency of a low-rank head beside the full one (nu), and, for a checkpoint, kappa
(the full head's share of a draft+verify cycle) and the rho_TPS the cost model predicts from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimspec.checkpoint.drafter import LOWRANK_DOWN, load_drafter
from slimspec.checkpoint.files import read_json
from slimspec.checkpoint.target_model import load_target_model
from slimspec.dtypes import torch_dtype
from slimspec.errors import OptionError
from slimspec.evaluate.acceptance import load_for_eval
from slimspec.evaluate.cost import head_latency, measure_kappa, predicted_speedup, screen_head_latency
from slimspec.hardware import resolve_device
from slimspec.hub import resolve_model


@dataclass(frozen=True)
class HeadShape:
    """A low-rank head's shape, the full head it replaces, and the rho_tau recorded for it (if any)."""

    vocab: int
    hidden: int
    rank: int
    source_vocab: int | None = None
    rho_tau: float | None = None


def checkpoint_head(checkpoint: str, source_vocab: int | None = None, rho_tau: float | None = None) -> HeadShape:
    """The head of a SlimSpec checkpoint, with the full head's rows and rho_tau its report records (the given
    ones win)."""
    folder = resolve_model(checkpoint, "drafter")
    ckpt = load_drafter(folder)
    if not ckpt.is_lowrank:
        raise OptionError(f"{checkpoint} is not a SlimSpec checkpoint (no low-rank head to time)")
    up, down = ckpt.tensors["lm_head.weight"], ckpt.tensors[LOWRANK_DOWN]
    report_path = folder / "slimspec.json"
    saved = read_json(report_path) if report_path.exists() else {}
    hidden = down.shape[1]
    source_vocab = source_vocab or saved.get("head_rows_source") or (saved.get("head_params_source", 0) // hidden
                                                                    or None)
    return HeadShape(up.shape[0], hidden, down.shape[0], source_vocab, rho_tau or saved.get("rho_tau"))


@dataclass(frozen=True)
class ScreenOptions:
    """The screen-and-rescore head timed beside the pair: its shortlist K, hot rows N, and the rows of the trimmed
    head compared with it (None: the screen's multiply-add share of V)."""

    shortlist: int
    hot_rows: int = 0
    trim_rows: int | None = None


PAY_MARGIN = 0.03
"""The screen pays at a batch size while its measured nu stays within this of its multiply-add share."""


def bench_screen(head: HeadShape, screen: ScreenOptions, *, batches: tuple[int, ...] = (1, 8, 64),
                 dtypes: tuple[str, ...] = ("fp32",), device: str | None = None) -> list[dict[str, Any]]:
    """The full head, the pair, the screen and rescore and a trimmed head timed side by side at each dtype and batch
    size; each row says whether the screen pays there (nu within ``PAY_MARGIN`` of its multiply-add share)."""
    if screen.shortlist > head.vocab:
        raise OptionError(f"--shortlist {screen.shortlist} exceeds the head's {head.vocab} rows")
    where = resolve_device(device)
    rows = []
    for dtype in dtypes:
        for batch in batches:
            row = screen_head_latency(head.vocab, head.hidden, head.rank, screen.shortlist,
                                      hot_rows=screen.hot_rows, trim_rows=screen.trim_rows, batch=batch,
                                      dtype=torch_dtype(dtype), device=where)
            row["screen_pays"] = row["screen_nu"] <= row["screen_share"] + PAY_MARGIN
            rows.append(row)
    return rows


def stops_paying(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per dtype, the smallest timed batch size from which on the screen no longer pays (None: it pays at every
    one timed)."""
    result: dict[str, int | None] = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        timed = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: r["batch"])
        paying = [r["screen_pays"] for r in timed]
        result[dtype] = next((r["batch"] for i, r in enumerate(timed) if not any(paying[i:])), None)
    return result


def bench_head(head: HeadShape, *, batches: tuple[int, ...] = (1, 64), dtypes: tuple[str, ...] = ("fp32",),
               device: str | None = None) -> list[dict[str, Any]]:
    """nu and the FLOP floor of ``head`` at each dtype and batch size, timed side by side with the full head."""
    where = resolve_device(device)
    return [head_latency(head.vocab, head.hidden, head.rank, batch=b, dtype=torch_dtype(d),
                         source_vocab=head.source_vocab, device=where)
            for d in dtypes for b in batches]


def kappa_and_speedup(checkpoint: str, target: str | None, head: HeadShape, rows: list[dict[str, Any]], *,
                      dtype: str = "fp32", device: str | None = None) -> dict[str, Any]:
    """kappa of the checkpoint's cycle in ``dtype`` and the rho_TPS predicted from it, the batch-1 nu of ``rows``
    and the head's rho_tau (1.0 when none is known)."""
    where = resolve_device(device)
    drafter, _, parts, _ = load_for_eval(checkpoint, target)
    target_model, _ = load_target_model(parts.path, dtype=torch_dtype(dtype), device=where)
    kappa = measure_kappa(target_model, drafter.to(device=where, dtype=torch_dtype(dtype)),
                          full_head_rows=head.source_vocab or head.vocab)
    smallest = min(r["batch"] for r in rows)
    nu1 = next(r["nu"] for r in rows if r["batch"] == smallest)
    rho_tau = head.rho_tau if head.rho_tau is not None else 1.0
    return {"kappa": kappa, "rho_tau": rho_tau, "predicted_rho_tps": predicted_speedup(rho_tau, nu1, kappa["kappa"])}
