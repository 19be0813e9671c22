"""The paper's cost model and the head-latency harness."""

import pytest
import torch

from slimspec.evaluate.cost import flop_floor, head_latency, predicted_speedup


def test_flop_floor_matches_paper():
    """(r*d + V*r) / (V*d) = 0.129 at d=4096, V=128256, r=512 (issue 4; DESIGN.md rounds it to 0.127)."""
    assert flop_floor(128256, 4096, 512) == pytest.approx(0.1290, abs=1e-4)
    assert flop_floor(49152, 576, 72, source_vocab=8192) == pytest.approx((72 * 576 + 49152 * 72) / (8192 * 576))


def test_predicted_speedup():
    """rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa) (DESIGN.md section 7), checked on hand-computed values:
    catches a swapped nu/kappa or a missing rho_tau factor."""
    assert predicted_speedup(1.0, 1.0, 0.7) == pytest.approx(1.0)  # an equally fast head changes nothing
    assert predicted_speedup(0.9, 1.0, 3.0) == pytest.approx(0.9)  # ... whatever kappa: only tau counts
    assert predicted_speedup(0.99, 0.21, 0.85) == pytest.approx(1.5541, abs=1e-4)  # 1.8315 / 1.1785
    assert predicted_speedup(1.0, 0.5, 0.0) == 1.0  # a head that costs nothing: no gain from shrinking it
    assert predicted_speedup(0.5, 0.0, 1.0) == pytest.approx(1.0)  # a free head doubles speed, half the tau


def test_head_latency_runs_both_heads():
    r = head_latency(5000, 64, 8, batch=3, repeats=3)
    assert r["full_s"] > 0 and r["lowrank_s"] > 0 and r["nu"] == pytest.approx(r["lowrank_s"] / r["full_s"])
    assert r["flop_floor"] == pytest.approx(flop_floor(5000, 64, 8))
    assert head_latency(500, 32, 4, dtype=torch.bfloat16, repeats=2)["dtype"] == "bfloat16"
