"""`--head-budget`: the budget's share, the candidates it affords, and each candidate's measured agreement."""

from __future__ import annotations

import pytest
import torch

from slimspec.errors import OptionError
from slimspec.workflows.budget import BudgetPoint, _measure, _pick, budget_share, read_share, screen_candidates
from slimspec.workflows.job import conversion_job

V, D = 301, 24


def test_budget_share_of_a_plain_pair_and_of_a_number():
    """Catches d/8 read as 1/8 of the head (it is the rank-d/8 pair's cost, r (V + d) / (V d)), and shares outside
    (0, 1) or other text accepted."""
    assert budget_share("d/8", 32000, 4096) == pytest.approx(512 * (32000 + 4096) / (32000 * 4096))
    assert budget_share("0.06", 32000, 4096) == 0.06
    for bad in ("0", "1.5", "d/1", "cheap", "-0.1"):
        with pytest.raises(OptionError, match="head_budget"):
            budget_share(bad, 32000, 4096)


def test_every_candidate_fits_the_budget_and_spends_it():
    """Catches a candidate over the budget, or a shortlist that leaves most of the budget unspent."""
    budget = 0.06
    found = screen_candidates(budget, 8192, 576)
    assert {r for r, _, _ in found} == {4, 8, 12, 16, 24}  # rank 32 alone costs 0.0595
    for rank, shortlist, hot in found:
        cost = (rank * (8192 + 576) + (shortlist + hot) * 576) / (8192 * 576)
        assert budget - 576 / (8192 * 576) < cost <= budget
        assert shortlist >= 32 and hot >= 0
    with pytest.raises(OptionError, match="raise it"):
        screen_candidates(0.001, 8192, 576)


@pytest.mark.parametrize("batch", [2, 8])
def test_candidates_at_a_serving_batch_fit_the_rows_read(batch):
    """Catches shortlists sized for one sequence at a larger serving batch: each sequence rescores its own K rows,
    so B shortlists (and the hot rows once) must fit what the budget leaves after the pair."""
    budget, v, d = 0.06, 8192, 576
    found = screen_candidates(budget, v, d, batch)
    assert found and all(k >= 32 for _, k, _ in found)
    for rank, shortlist, hot in found:
        assert read_share(v, d, rank, shortlist, hot, batch) <= budget
        assert (rank * (v + d) + min(v, hot + batch * shortlist) * d) / (v * d) == read_share(
            v, d, rank, shortlist, hot, batch)
        assert read_share(v, d, rank, shortlist + 1, hot, batch) > budget - d / (v * d) * (batch - 1)
    assert max(k for _, k, _ in found) < max(k for _, k, _ in screen_candidates(budget, v, d))
    assert screen_candidates(budget, v, d, 64) == []  # none fits: the plain pair alone is measured


def test_the_plain_pair_is_picked_only_at_a_serving_batch():
    """Catches the plain pair picked at batch 1 (a budget asks for a screen there), or a screen kept at a larger
    batch where the plain pair agrees more."""
    screen = BudgetPoint(16, 240, 0, 0.059, 0.80, 0.059)
    plain = BudgetPoint(32, 0, 0, 0.06, 0.90, 0.06)
    assert _pick([plain, screen], 1) == screen
    assert _pick([plain, screen], 8) == plain
    assert _pick([BudgetPoint(16, 240, 0, 0.059, 0.95, 0.3), plain], 8).shortlist == 240


def test_measured_agreement_matches_a_float64_recomputation():
    """Catches a candidate measured with other rows than it would rescore (hot rows ignored, the top K by the
    exact scores instead of the screen's), or the plain pair's point measured at the wrong rank."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, D, generator=g)
    states = torch.randn(400, D, generator=g)
    wanted = (states.double() @ weight.double().T).argmax(-1)
    hot_order = torch.randperm(V, generator=g)
    budget = 0.45
    points = _measure(weight, weight, torch.eye(D, dtype=torch.float64), states, wanted, budget,
                      lambda n: torch.sort(hot_order[:n]).values)
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    for p in points:
        pair = states.double() @ (u[:, :p.rank] * s[:p.rank] @ vh[:p.rank]).T
        if not p.shortlist:
            greedy = pair.argmax(-1)
        else:
            listed = torch.zeros_like(pair, dtype=torch.bool)
            listed.scatter_(1, pair.topk(p.shortlist, dim=-1).indices, True)
            listed[:, hot_order[:p.hot_rows]] = True
            greedy = torch.where(listed, states.double() @ weight.double().T, float("-inf")).argmax(-1)
        assert p.agreement == pytest.approx(float((greedy == wanted).double().mean()), abs=2 / len(states))
        assert p.share <= budget
    assert any(p.hot_rows for p in points) and sum(not p.shortlist for p in points) == 1


@pytest.mark.parametrize("extra, message", [
    ({"rank": "16"}, "drop rank"),
    ({"shortlist": 64}, "drop shortlist"),
    ({"vocab": "full"}, "use vocab draft"),
    ({"distill_steps": 0}, "measures its candidates on calibration data"),
])
def test_head_budget_refusals(extra, message):
    """Catches a head budget beside the sizes it picks, over the target's whole vocabulary, or without the
    calibration data it measures on, accepted."""
    options = {"drafter": "embedded:smollm2-135m-eagle3", "head_budget": "d/8", **extra}
    with pytest.raises(OptionError, match="head_budget") as caught:
        conversion_job(options, {"head_budget", *extra}).validate()
    assert message in str(caught.value)


def test_serve_batch_without_a_head_budget_is_refused():
    """Catches `--serve-batch` accepted on a plain conversion, where nothing reads it."""
    with pytest.raises(OptionError, match="serve_batch"):
        conversion_job({"drafter": "embedded:smollm2-135m-eagle3", "serve_batch": 8}, {"serve_batch"}).validate()
    job = conversion_job({"drafter": "embedded:smollm2-135m-eagle3", "head_budget": "0.06", "serve_batch": 8},
                         {"head_budget", "serve_batch"})
    job.validate()
    assert job.serve_batch == 8
