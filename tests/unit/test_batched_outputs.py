"""Right-padded batches of teacher sequences in the drafter's TTT forward: exact, and few distinct shapes."""

from __future__ import annotations

import pytest
import torch

from slimspec.distill import train
from slimspec.distill.teacher import TeacherData
from slimspec.distill.train import batched_student_outputs, length_groups, student_features, student_outputs
from tests.unit.test_model import _config, _random_drafter

LENGTHS = [3, 5, 1, 70, 9, 131, 4, 66, 2, 17]  # odd, some shorter than the TTT unroll, some past one pad multiple


def _teacher(cfg, lengths: list[int], seed: int = 2) -> TeacherData:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    width = cfg.num_aux_hidden_states * cfg.target_hidden_size
    return TeacherData(input_ids=torch.randint(0, cfg.vocab_size, (n,), generator=g),
                       loss_mask=torch.rand(n, generator=g) > 0.3,
                       aux=torch.randn(n, width, generator=g, dtype=torch.float64),
                       final=torch.randn(n, cfg.target_hidden_size, generator=g, dtype=torch.float64),
                       starts=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))


@pytest.mark.parametrize("source_rows", [False, True])
def test_padded_batches_equal_one_sequence_at_a_time(source_rows, monkeypatch):
    """Catches padding that leaks into real positions (a non-causal key, a TTT diagonal key of another
    position, a mis-sliced output), a result returned for the wrong sequence, and lost gradients: values and
    parameter gradients must match the per-sequence float64 forward."""
    monkeypatch.setattr(train, "PAD_MULTIPLE", 8)
    cfg = _config()
    drafter = _random_drafter(cfg)
    teacher = _teacher(cfg, LENGTHS)
    order = [5, 0, 3, 9, 1, 7, 2, 4, 8, 6]
    batched = batched_student_outputs(drafter, teacher, order, 3, source_rows)
    single = [student_outputs(drafter, teacher, i, 3, source_rows) for i in order]
    assert len(batched) == len(order)
    for got, want in zip(batched, single, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])

    weights = torch.randn(cfg.hidden_size, dtype=torch.float64)

    def grads(outputs):
        drafter.zero_grad(set_to_none=True)
        loss = sum(((o[0] @ weights) ** 2).sum() for o in outputs if o is not None)
        loss.backward()
        return [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    drafter.requires_grad_(True)
    got = grads(batched_student_outputs(drafter, teacher, order, 3, source_rows))
    want = grads([student_outputs(drafter, teacher, i, 3, source_rows) for i in order])
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_features_in_batches_match_one_at_a_time(monkeypatch):
    """Catches ``student_features`` losing or reordering rows when its sequences go through in slices."""
    monkeypatch.setattr(train, "PAD_MULTIPLE", 8)
    cfg = _config()
    drafter = _random_drafter(cfg)
    teacher = _teacher(cfg, LENGTHS)
    features = student_features(drafter, teacher, list(range(len(LENGTHS))), 2)
    rows = [student_outputs(drafter, teacher, i, 2) for i in range(len(LENGTHS))]
    rows = [(h[w.sum(1) > 0], w[w.sum(1) > 0]) for h, _, w in (r for r in rows if r is not None)]
    torch.testing.assert_close(features.hidden, torch.cat([h for h, _ in rows]).float())
    assert torch.equal(features.weight, torch.cat([w for _, w in rows]))


def test_length_groups_cover_each_once_within_the_waste_bound():
    """Catches a grouping that drops or repeats a sequence, or pads a group past its bound (which would make
    a batch of one long and many short sequences cost many times its real positions)."""
    lengths = [700, 12, 64, 65, 130, 200, 201, 5, 3, 640, 90, 91, 92]
    groups = length_groups(lengths)
    assert sorted(j for g in groups for j in g) == list(range(len(lengths)))
    for g in (g for g in groups if len(g) > 1):  # one sequence alone is padded to the next multiple only
        padded = len(g) * -(-max(lengths[j] for j in g) // train.PAD_MULTIPLE) * train.PAD_MULTIPLE
        real = sum(lengths[j] for j in g)
        assert padded <= max(train.PAD_WASTE * real, train.PAD_MULTIPLE * len(g))
    assert len(groups) < len(lengths)  # similar lengths do share a batch
