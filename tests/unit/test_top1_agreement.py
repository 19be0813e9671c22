"""Held-out top-1 agreement (``loss.top1_agreement``, ``train.evaluate_top1``) against materialised float64 logits."""

from __future__ import annotations

import math

import pytest
import torch

from slimspec.distill.loss import top1_agreement


def _case(tokens: int, dim: int, rank: int, vocab: int, teacher_dim: int, seed: int = 0):
    """A student head that is a noisy low-rank copy of the teacher's, so that agreement lands between 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, teacher_dim, generator=g, dtype=torch.float64)
    th = torch.cat([h, torch.ones(tokens, teacher_dim - dim, dtype=torch.float64)], 1)
    u, s, vh = torch.linalg.svd(head[:, :dim], full_matrices=False)
    up = u[:, :rank] * s[:rank] + 0.3 * torch.randn(vocab, rank, generator=g, dtype=torch.float64)
    return h, vh[:rank], up, th, head


def _reference(h, down, up, th, head, weights=None) -> float:
    same = ((h.double() @ down.double().T @ up.double().T).argmax(1) == (th.double() @ head.double().T).argmax(1))
    w = torch.ones(h.shape[0], dtype=torch.float64) if weights is None else weights.double()
    return float((same.double() * w).sum() / w.sum())


@pytest.mark.parametrize("tokens,dim,rank,vocab,teacher_dim,token_chunk", [
    (1, 16, 5, 1000, 17, None), (37, 24, 7, 1001, 25, 5), (200, 9, 3, 333, 10, 64), (64, 30, 29, 2049, 31, 1)])
def test_agreement_matches_float64_argmax(tokens, dim, rank, vocab, teacher_dim, token_chunk):
    """Catches a token chunk dropped or double counted, argmaxes taken over the wrong axis, and the teacher's bias
    column (the drafter teacher's [h, 1] rows) ignored: odd shapes, chunks that do not divide the tokens."""
    case = _case(tokens, dim, rank, vocab, teacher_dim, seed=tokens)
    expected = _reference(*case)
    got = top1_agreement(*(t.float() for t in case), token_chunk=token_chunk)
    assert got == pytest.approx(expected, abs=1.5 / tokens)  # float32 may flip a near-tie
    assert top1_agreement(*case, token_chunk=token_chunk) == pytest.approx(expected, abs=1e-12)
    if tokens > 10:
        assert 0.0 < expected < 1.0, "the case must not be trivially all or nothing"


def test_agreement_weights_rows():
    """Catches an unweighted mean (prompt rows of weight 0 counted, held-out weights ignored)."""
    case = _case(50, 12, 4, 500, 13, seed=3)
    w = torch.rand(50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w[::3] = 0.0
    got = top1_agreement(*case, weights=w, token_chunk=7)
    assert got == pytest.approx(_reference(*case, weights=w), abs=1e-12)
    assert got != pytest.approx(_reference(*case), abs=1e-3)
    assert math.isnan(top1_agreement(*case, weights=torch.zeros(50, dtype=torch.float64)))


def test_agreement_is_one_for_the_teacher_itself():
    """A full-rank student equal to the teacher drafts the teacher's argmax everywhere."""
    h, _, _, th, head = _case(40, 10, 10, 300, 11, seed=5)
    eye = torch.eye(11, dtype=torch.float64)
    assert top1_agreement(th, eye, head, th, head, token_chunk=9) == 1.0
    assert top1_agreement(h, eye[:10, :10], head[:, :10] * 0, th, head) < 0.1  # constant logits: argmax 0 only
