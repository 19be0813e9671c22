"""The paper's cost model and the head-latency harness."""

import pytest
import torch

from slimspec.evaluate.cost import flop_floor, head_latency, predicted_speedup


def test_flop_floor_matches_paper():
    """(r*d + V*r) / (V*d) = 0.129 at d=4096, V=128256, r=512 (DESIGN.md rounds it to 0.127)."""
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


def test_gpu_timings_wait_for_the_device(monkeypatch):
    """Catches a GPU timing that stops the clock while the kernels are still queued (CUDA launches are
    asynchronous: a head 'timed' in microseconds whatever its size, a meaningless nu): every timed batch, and the
    first call that sizes the batches, starts and ends with the device's synchronisation."""
    from slimspec.evaluate import cost

    events = []
    cost.best_time(lambda: events.append("call"), repeats=3, warmup=2, min_seconds=0.0,
                   sync=lambda: events.append("sync"))
    assert events == ["call"] * 2 + ["sync", "call", "sync"] + ["sync", "call", "sync"] * 3
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    cost.synchronizer("cpu")()
    cost.synchronizer("cuda:1")()
    assert waited == ["cuda:1"]
    assert head_latency(500, 32, 4, repeats=2)["device"] == "cpu"


def test_kappa_times_the_full_head_a_slimspec_drafter_replaced(tiny_converted, tiny_target, monkeypatch):
    """kappa is the *original* head's share of a cycle: rho_TPS applies nu to it. Catches kappa measured on the
    low-rank head (about nu * kappa; rho_TPS then undercounts the gain). Each timed piece is "timed" by its
    matmul FLOPs, so the expected values are exact: 2 * rows * d for the full head of ``full_head_rows`` rows."""
    from torch.utils.flop_counter import FlopCounterMode

    from slimspec.checkpoint.target_model import load_target_model
    from slimspec.evaluate import cost
    from slimspec.evaluate.acceptance import load_for_eval

    def flops(fn, **_):
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    monkeypatch.setattr(cost, "best_time", flops)
    drafter, _, parts, _ = load_for_eval(str(tiny_converted), str(tiny_target))
    target, _ = load_target_model(parts.path)
    d = drafter.config.hidden_size
    measured = cost.measure_kappa(target, drafter, full_head_rows=512, context=16)
    assert measured["head_s"] == 2 * 512 * d
    assert measured["lowrank_head_s"] == 2 * (8 * d + 49152 * 8)  # the low-rank head, reported beside it
    cycle = 4 * measured["drafter_layer_s"] + measured["target_verify_s"]
    assert measured["kappa"] == pytest.approx(4 * 2 * 512 * d / cycle)
    assert cost.measure_kappa(target, drafter, context=16)["head_s"] == 2 * 49152 * d  # default: its own rows
