"""A screen distilled at a share of its shortlist: the training loss is the two-level KL at share x K."""

from __future__ import annotations

import pytest
import torch

from slimspec.distill.train import DistillConfig, head_factors, kl_terms
from slimspec.errors import OptionError
from slimspec.model import ScreenRescoreHead
from tests.unit.test_teacher_temperature import DECAY, _case

K = 20


def _screen_case():
    drafter, teacher, hidden, index, weight, head = _case(seed=5)
    down, up = (t.detach() for t in head_factors(drafter))
    g = torch.Generator().manual_seed(7)
    exact = torch.randn(up.shape[0], down.shape[1], generator=g)
    drafter.lm_head = ScreenRescoreHead(up.clone(), down.clone(), exact, K)
    return drafter, teacher, hidden, index, weight, head, exact


def _reference(drafter, teacher, hidden, index, weight, head, exact, shortlist):
    """float64: sum_i decay^i * weighted mean of KL(p || two-level q), the shortlist the screen's top ``shortlist``."""
    down, up = (t.detach().double() for t in head_factors(drafter))
    total = torch.zeros((), dtype=torch.float64)
    for i in range(hidden.shape[1]):
        w = weight[:, i].double()
        if float(w.sum()) <= 0:
            continue
        h = hidden[:, i].double()
        screen = h @ down.T @ up.T
        listed = torch.zeros_like(screen, dtype=torch.bool)
        listed.scatter_(1, screen.topk(shortlist, dim=-1).indices, True)
        log_q = torch.log_softmax(torch.where(listed, h @ exact.double().T, screen), -1)
        log_p = torch.log_softmax(teacher.final[index[:, i]].double() @ head.double().T, -1)
        total = total + DECAY ** i * ((log_p.exp() * (log_p - log_q)).sum(-1) * w).sum() / w.sum()
    return total


@pytest.mark.parametrize("share, trained_at", [(0.5, 10), (1.0, K), (0.26, 5)])
def test_screen_loss_is_the_two_level_kl_at_a_share_of_the_shortlist(share, trained_at):
    """Catches the share ignored (the loss at K) or applied to the served head (its shortlist changed): the loss
    equals the float64 two-level KL at round(share x K) rows, and the head keeps serving K."""
    drafter, teacher, hidden, index, weight, head, exact = _screen_case()
    loss, _ = kl_terms(drafter, hidden, index, weight, teacher, head, DECAY, shortlist_share=share)
    ref = _reference(drafter, teacher, hidden, index, weight, head, exact, trained_at)
    assert float(loss) == pytest.approx(float(ref), rel=1e-4)
    assert drafter.lm_head.shortlist == K
    other = _reference(drafter, teacher, hidden, index, weight, head, exact, K if trained_at != K else 10)
    assert abs(float(other) - float(ref)) > 1e-3  # the two shortlists give different losses on this batch


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_screen_train_share_outside_zero_one_is_refused(bad):
    """Catches a share that would train at no row, or at more rows than the head serves, accepted."""
    with pytest.raises(OptionError, match="screen_train_share"):
        DistillConfig(screen_train_share=bad)
