"""The screen-and-rescore head and its two-level KL against float64 references computed here."""

from __future__ import annotations

import pytest
import torch

from slimspec.distill.loss import two_level_kl
from slimspec.model import ScreenRescoreHead, head_from_tensors, screen_cost

V, D, R, K, N = 1000, 96, 7, 13, 5


def _parts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    up, down = torch.randn(V, R, generator=g), torch.randn(R, D, generator=g) / D**0.5
    exact = torch.randn(V, D, generator=g) / D**0.5
    hot = torch.randperm(V, generator=g)[:N]
    h = torch.randn(6, 3, D, generator=g)
    return up, down, exact, hot, h


def _teacher_case(parts_seed: int, seed: int, zero_weight: int):
    """The head's parts, its states flattened to [T, D], a teacher (rows [T, 11] and head [V, 11]) and token weights
    with one zero."""
    up, down, exact, hot, h = _parts(parts_seed)
    g = torch.Generator().manual_seed(seed)
    h = h.reshape(-1, D)
    th, tw = torch.randn(h.shape[0], 11, generator=g), torch.randn(V, 11, generator=g)
    weights = torch.rand(h.shape[0], generator=g)
    weights[zero_weight] = 0
    return up, down, exact, hot, h, th, tw, weights


def _reference(h, up, down, exact, hot):
    """Float64: the shortlist by an explicit (score desc, id asc) order, the two-level logits and the exact argmax."""
    h, up, down, exact = (t.double() for t in (h, up, down, exact))
    screen = h @ down.T @ up.T
    flat_h, flat_s = h.reshape(-1, D), screen.reshape(-1, V)
    logits, tokens = flat_s.clone(), []
    for row in range(flat_s.shape[0]):
        order = sorted(range(V), key=lambda v: (-float(flat_s[row, v]), v))[:K]
        chosen = sorted(set(order) | set(hot.tolist()))
        scores = {v: float(flat_h[row] @ exact[v]) for v in chosen}
        for v, s in scores.items():
            logits[row, v] = s
        best = max(scores.values())
        tokens.append(min(v for v, s in scores.items() if s == best))
    return logits.reshape(screen.shape), torch.tensor(tokens).reshape(h.shape[:-1])


def test_two_level_logits_and_greedy_match_float64():
    """Catches a wrong shortlist (top-K, hot ids), exact scores on the wrong rows or a greedy token outside it."""
    up, down, exact, hot, h = _parts()
    head = ScreenRescoreHead(up.double(), down.double(), exact.double(), K, hot)
    logits, tokens = _reference(h, up, down, exact, hot)
    torch.testing.assert_close(head(h.double()), logits, rtol=1e-12, atol=1e-12)
    assert torch.equal(head.greedy(h.double()), tokens)
    head32 = ScreenRescoreHead(up, down, exact, K, hot)
    assert torch.equal(head32.greedy(h), tokens)
    assert head.multiply_add_share() == pytest.approx((R * (V + D) + (K + N) * D) / (V * D))
    assert screen_cost(V, D, R, K, N) == head.multiply_add_share()


def test_greedy_differs_from_two_level_argmax_and_ties_go_low():
    """Catches drafting the argmax of the two-level logits (a screened-out token can outscore the shortlist) and a
    tie broken toward the higher id, in the top-K and in the exact argmax."""
    d = 4
    up = torch.tensor([[1.0], [1.0], [1.0], [0.5], [9.0]])  # tokens 0..2 tie on the screen; 4 screens highest
    down = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    exact = torch.zeros(5, d)
    exact[1, 1] = exact[2, 1] = 1.0  # 1 and 2 tie on the exact score
    exact[4, 1] = 0.5
    head = ScreenRescoreHead(up, down, exact, shortlist=3)
    h = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert sorted(head.shortlist_ids(head.screen(h))[0].tolist()) == [0, 1, 4]  # 2 ties with 1, loses the K-th slot
    assert int(head.greedy(h)) == 1
    head = ScreenRescoreHead(up, down, exact, shortlist=4)
    assert int(head.greedy(h)) == 1  # 1 and 2 tie exactly: the lower id
    head = ScreenRescoreHead(up * 4, down, exact, shortlist=1)  # only token 4 rescored (0.5); 0..3 screen 4, 4, 4, 2
    assert int(head.greedy(h)) == 4 and int(head(h).argmax()) == 0


def test_head_round_trips_through_canonical_tensors():
    """Catches a tensor name or the hot ids lost between the head and its canonical dict."""
    up, down, exact, hot, h = _parts(1)
    head = ScreenRescoreHead(up, down, exact, K, hot)
    back = head_from_tensors(head.canonical_tensors(), K)
    assert isinstance(back, ScreenRescoreHead) and back.hot_rows == N
    assert torch.equal(back(h), head(h))
    with pytest.raises(ValueError, match="shortlist"):
        head_from_tensors(head.canonical_tensors())
    with pytest.raises(ValueError, match="shortlist"):
        ScreenRescoreHead(up, down, exact, V + 1)


def test_two_level_kl_and_gradients_match_float64():
    """Catches a loss on the wrong logits (the pair's alone), a gradient reaching the exact rows or the shortlisted
    screen logits, a token chunk dropped, or a backward that ignores the scale the loss is multiplied by."""
    up, down, exact, hot, h, th, tw, weights = _teacher_case(2, 3, zero_weight=3)

    def reference(hh, dd, uu):
        screen = hh @ dd.T @ uu.T
        mask = torch.zeros_like(screen, dtype=torch.bool)
        for row in range(screen.shape[0]):
            top = sorted(range(V), key=lambda v: (-float(screen[row, v].detach()), v))[:K]
            mask[row, top + hot.tolist()] = True
        log_q = torch.log_softmax(torch.where(mask, hh @ exact.double().T, screen), -1)
        log_p = torch.log_softmax(th.double() @ tw.double().T, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        return (weights.double() * kl).sum() / weights.double().sum()

    leaves64 = [t.double().requires_grad_() for t in (h, down, up)]
    expected = reference(*leaves64)
    expected.backward()
    leaves = [t.clone().requires_grad_() for t in (h, down, up)]
    got = two_level_kl(*leaves, exact, K, hot, th, tw, weights=weights, token_chunk=4)
    got.backward()
    assert float(got) == pytest.approx(float(expected), rel=1e-5)
    for mine, ref in zip(leaves, leaves64, strict=True):
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-3, atol=2e-5)
    scaled = [t.clone().requires_grad_() for t in (h, down, up)]
    (-3 * two_level_kl(*scaled, exact, K, hot, th, tw, weights=weights)).backward()  # training scales each TTT step
    for mine, ref in zip(scaled, leaves64, strict=True):
        torch.testing.assert_close(mine.grad.double(), -3 * ref.grad, rtol=1e-3, atol=6e-5)
    logits = th.double() @ tw.double().T
    log_probs = torch.log_softmax(logits, -1)
    table = two_level_kl(h.double(), down.double(), up.double(), exact.double(), K, hot, weights=weights,
                         teacher_logits=log_probs, teacher_log_probs=True)
    assert float(table) == pytest.approx(float(expected), rel=1e-10)


def test_shortlist_margin_loss_and_gradients_match_float64():
    """Catches the margin taken against the wrong boundary (the K-th value with the teacher's own token counted, so
    a token at the boundary is never pushed over it), hot teacher tokens not skipped, weights or a token chunk lost,
    or gradients that miss the boundary token."""
    from slimspec.distill.loss import shortlist_margin_loss

    up, down, _, hot, h, th, tw, weights = _teacher_case(4, 5, zero_weight=2)
    wanted = (th.double() @ tw.double().T).argmax(-1)
    wanted[5] = hot[0]  # a hot teacher token: always rescored, no loss
    teacher = torch.full((h.shape[0], V), -5.0).scatter(1, wanted[:, None], 5.0)

    def reference(hh, dd, uu):
        screen = hh @ dd.T @ uu.T
        terms = []
        for row in range(screen.shape[0]):
            others = [float(screen[row, v].detach()) for v in range(V)]
            others[int(wanted[row])] = float("-inf")
            boundary = sorted(range(V), key=lambda v: -others[v])[K - 1]
            free = 0.0 if int(wanted[row]) in hot.tolist() else 1.0
            terms.append(free * torch.nn.functional.softplus(1.0 + screen[row, boundary] - screen[row, wanted[row]]))
        return (weights.double() * torch.stack(terms)).sum() / weights.double().sum()

    leaves64 = [t.double().requires_grad_() for t in (h, down, up)]
    expected = reference(*leaves64)
    expected.backward()
    leaves = [t.clone().requires_grad_() for t in (h, down, up)]
    got = shortlist_margin_loss(*leaves, K, hot, weights=weights, token_chunk=4, teacher_logits=teacher)
    (2 * got).backward()
    assert float(got) == pytest.approx(float(expected), rel=1e-5)
    for mine, ref in zip(leaves, leaves64, strict=True):
        torch.testing.assert_close(mine.grad.double(), 2 * ref.grad, rtol=1e-3, atol=2e-5)
