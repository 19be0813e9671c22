"""Distilling against a tempered teacher, softmax(teacher logits / T): the training loss and its gradients."""

from __future__ import annotations

import pytest
import torch

from slimspec.distill.teacher import TeacherData
from slimspec.distill.train import head_factors, kl_terms
from tests.unit.test_model import _config, _random_drafter

DECAY = 0.8


def _case(seed: int = 3):
    cfg = _config(vocab_size=61, draft_vocab_size=61)
    drafter = _random_drafter(cfg, seed=seed).float()
    g = torch.Generator().manual_seed(seed)
    rows, k, n = 37, 3, 50  # odd sizes; some zero-weight rows (prompt positions) and one step without any
    final = torch.randn(n, cfg.target_hidden_size, generator=g, dtype=torch.float64)
    teacher = TeacherData(input_ids=torch.zeros(n, dtype=torch.long), loss_mask=torch.ones(n, dtype=torch.bool),
                          aux=torch.zeros(n, 1), final=final, starts=torch.tensor([0, n]))
    hidden = torch.randn(rows, k, cfg.hidden_size, generator=g)
    index = torch.randint(0, n, (rows, k), generator=g)
    weight = (torch.rand(rows, k, generator=g) > 0.3).float() * torch.rand(rows, k, generator=g)
    weight[:, 2] = 0.0
    head = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=g) * 2
    return drafter, teacher, hidden, index, weight, head


def _reference(drafter, teacher, hidden, index, weight, head, temperature: float):
    """float64 sum_i decay^i * weighted mean over rows of KL(softmax(t / T) || softmax(s)), and d/d W_up."""
    down, up = (t.detach().double().requires_grad_(True) for t in head_factors(drafter))
    total = torch.zeros((), dtype=torch.float64)
    for i in range(hidden.shape[1]):
        w = weight[:, i].double()
        if float(w.sum()) <= 0:
            continue
        log_p = torch.log_softmax(teacher.final[index[:, i]].double() @ head.double().T / temperature, -1)
        log_q = torch.log_softmax(hidden[:, i].double() @ down.T @ up.T, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        total = total + DECAY ** i * (kl * w).sum() / w.sum()
    total.backward()
    return total.detach(), up.grad


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_tempered_teacher_matches_float64_reference(temperature):
    """Catches a temperature applied to the student instead of the teacher, to the teacher's probabilities
    instead of its logits, or dropped on the way to the loss: value and W_up gradient against float64."""
    drafter, teacher, hidden, index, weight, head = _case()
    loss, per_step = kl_terms(drafter, hidden, index, weight, teacher, head, DECAY, teacher_temperature=temperature)
    loss.backward()
    ref_loss, ref_grad = _reference(drafter, teacher, hidden, index, weight, head, temperature)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-4)
    torch.testing.assert_close(drafter.lm_head.weight_up.grad.double(), ref_grad, rtol=1e-3, atol=1e-6)
    assert per_step[2] != per_step[2]  # NaN: no row of step 3 carries weight


def test_sharper_teacher_is_a_different_loss():
    """Catches the option being ignored: T = 0.5 and T = 1 must give different losses on the same batch."""
    drafter, teacher, hidden, index, weight, head = _case()
    sharp, _ = kl_terms(drafter, hidden, index, weight, teacher, head, DECAY, teacher_temperature=0.5)
    plain, _ = kl_terms(drafter, hidden, index, weight, teacher, head, DECAY)
    assert abs(float(sharp) - float(plain)) > 1e-2
