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


@pytest.mark.parametrize("source_rows", [False, True])
def test_features_drop_states_an_earlier_sequence_shares(source_rows):
    """Catches a shared prefix (a chat template's system prompt) counted once per sequence: SmolLM2's 24-token
    system prompt was 18 % of the demo's training rows on 24 distinct states. Rows are dropped exactly where
    every token read so far equals an earlier sequence's, and those states do equal the earlier ones (float64
    reference: the per-sequence forward), so the drop loses nothing."""
    cfg = _config()
    drafter = _random_drafter(cfg)
    teacher = _teacher(cfg, [12, 15, 9])
    k, shared = 2, 6
    ids, aux = teacher.input_ids.clone(), teacher.aux.clone()
    for i in (1, 2):  # sequences 1 and 2 start with sequence 0's first 6 tokens (and so its states there)
        s = int(teacher.starts[i])
        ids[s:s + shared], aux[s:s + shared] = ids[:shared], aux[:shared]
    ids[int(teacher.starts[2]) + shared] = ids[int(teacher.starts[1]) + shared]  # 2 shares 7 with 1
    teacher = TeacherData(input_ids=ids, loss_mask=torch.ones_like(teacher.loss_mask), aux=aux,
                          final=teacher.final, starts=teacher.starts)
    repeated = train.repeated_prefixes(teacher, [0, 1, 2])
    want = torch.zeros(36, dtype=torch.bool)
    want[12:18] = True
    want[27:34] = True
    assert torch.equal(repeated, want)

    rows = {i: student_outputs(drafter, teacher, i, k, source_rows) for i in range(3)}
    # position t, step j has read tokens up to t + 1 + j: shared for t + 1 + j < 6 with sequence 0
    for t in range(shared - 1):
        for j in range(k):
            if t + 1 + j < shared:
                torch.testing.assert_close(rows[1][0][t, j], rows[0][0][t, j], rtol=1e-12, atol=1e-12)
    features = student_features(drafter, teacher, [0, 1, 2], k, all_positions=True, source_rows=source_rows)
    assert not features.hidden.requires_grad  # frozen features (the whitened start hands them to numpy)
    kept = sum(int((r[2].sum(1) > 0).sum()) for r in rows.values())
    # both steps repeated (t + 2 read tokens shared): t <= 3 in sequence 1 (6 shared), t <= 4 in 2 (7 shared)
    dropped_rows = 4 + 5
    assert features.hidden.shape[0] == kept - dropped_rows
    zero_steps = int((features.weight == 0).sum())  # step 0 repeated, step 1 not: t = 4 in 1, t = 5 in 2
    assert zero_steps == 2
    assert float(features.weight.sum()) == sum(float(r[2].sum()) for r in rows.values()) - 2 * dropped_rows - 2
