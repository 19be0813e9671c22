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
from slimspec.evaluate.cost import head_latency, measure_kappa, predicted_speedup
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
