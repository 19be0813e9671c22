"""The precomputed teacher table of head-only distillation (``slimspec.distill.teacher_table``) and the KL given
teacher logits instead of a teacher head: against float64 references and against the per-step computation."""

from __future__ import annotations

import pytest
import torch

import slimspec.distill.train as train
from slimspec.distill.loss import full_vocab_kl, naive_full_vocab_kl
from slimspec.distill.teacher_table import TABLE_BYTES_ENV, table_budget, table_dtype, teacher_table
from slimspec.distill.train import DistillConfig, train_drafter
from slimspec.errors import SlimSpecError
from slimspec.model import LowRankHead
from tests.unit.test_full_vocab_kl import SHAPES, _case, _reference, _rel
from tests.unit.test_teacher_union import WIDTH, _parts, _tiny_drafter


@pytest.mark.parametrize("normalised", [False, True], ids=["lse", "log-probs"])
@pytest.mark.parametrize("table", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("tokens", "dim", "rank", "vocab", "teacher_dim", "chunk", "token_chunk"), SHAPES)
def test_kl_from_teacher_log_probs_matches_float64_reference(tokens, dim, rank, vocab, teacher_dim, chunk,
                                                             token_chunk, table, normalised):
    """Catches teacher logits sliced at the wrong token or vocab offset (partial chunks, token chunks), or weights
    applied to the wrong rows: the KL from a log-prob table equals the float64 head computation, value and
    gradients (fp32 table ~1e-5; an fp16 table rounds log p by <= |log p| / 2048: ~1e-3), whether the teacher's
    log-sum-exp is recomputed or taken as 0 (``teacher_log_probs``, what training on a table does)."""
    h, down, up, th, head = _case(tokens, dim, rank, vocab, teacher_dim, seed=4)
    weights = torch.rand(tokens, generator=torch.Generator().manual_seed(5))
    weights[1::3] = 0.0  # zero-weight rows are dropped before the teacher rows are sliced
    log_p = torch.log_softmax(th.detach().double() @ head.detach().double().T, -1).to(table)
    loss = full_vocab_kl(h, down, up, chunk_size=chunk, token_chunk=token_chunk, weights=weights, teacher_logits=log_p,
                         teacher_log_probs=normalised)
    grads = torch.autograd.grad(loss, (h, down, up))
    ref_loss, ref_grads = _reference((h, down, up, th, head), weights)
    tol = 1e-5 if table == torch.float32 else 3e-3
    assert loss.dtype == torch.float32
    assert abs(loss.item() - float(ref_loss)) <= tol * float(ref_loss)
    for grad, ref, name in zip(grads, ref_grads, ("h", "w_down", "w_up"), strict=True):
        assert _rel(grad, ref) <= tol, name


def test_kl_needs_the_teacher_exactly_one_way():
    """Catches a call giving both teacher forms (which one wins?) or neither being accepted silently."""
    h, down, up, th, head = _case(3, 8, 2, 50, 6)
    log_p = torch.log_softmax(th.detach() @ head.detach().T, -1)
    with pytest.raises(ValueError, match="not both"):
        full_vocab_kl(h, down, up, th, head, teacher_logits=log_p)
    with pytest.raises(ValueError, match="teacher_logits"):
        full_vocab_kl(h, down, up)
    with pytest.raises(ValueError, match=r"\[3, 50\]"):
        full_vocab_kl(h, down, up, teacher_logits=log_p[:, :49])
    naive = naive_full_vocab_kl(h.double(), down.double(), up.double(), th.double(), head.double())
    assert float(full_vocab_kl(h, down, up, teacher_logits=log_p)) == pytest.approx(float(naive), rel=1e-5)


def test_log_probs_flag_skips_the_teacher_normalisation():
    """Catches ``teacher_log_probs`` being ignored (the saving never happens) or applied to raw logits' callers:
    logits shifted by a constant give the same KL when normalised here, a different one when declared log-probs."""
    h, down, up, th, head = _case(5, 8, 3, 70, 6, seed=2)
    log_p = torch.log_softmax(th.detach() @ head.detach().T, -1)
    exact = float(full_vocab_kl(h, down, up, teacher_logits=log_p, teacher_log_probs=True))
    assert float(full_vocab_kl(h, down, up, teacher_logits=log_p + 3.0)) == pytest.approx(exact, rel=1e-5)
    skipped = float(full_vocab_kl(h, down, up, teacher_logits=log_p + 3.0, teacher_log_probs=True))
    assert abs(skipped - exact) > 1.0  # p = e^3 x the true p: the KL is no longer the right one
    with pytest.raises(ValueError, match="teacher_log_probs"):
        full_vocab_kl(h, down, up, th, head, teacher_log_probs=True)


def test_table_holds_tempered_log_probs_of_weighted_rows_only():
    """Catches rows or steps of the table shifted by one chunk, the temperature left out or applied twice, and
    zero-weight (row, step) pairs computed for nothing: each weighted entry equals float64 log-softmax(x H^T / T)."""
    g = torch.Generator().manual_seed(0)
    rows, steps, width, vocab = 11, 3, 6, 37
    inputs = torch.randn(rows, steps, width, generator=g)
    head = torch.randn(vocab, width, generator=g)
    weight = (torch.rand(rows, steps, generator=g) > 0.3).float()
    calls = []

    def teacher_rows(part: slice, i: int) -> torch.Tensor:
        calls.append((part.start, part.stop, i))
        return inputs[part, i]

    table = teacher_table(weight, teacher_rows, head, temperature=0.5, chunk=4)
    want = torch.log_softmax(inputs.double() @ head.double().T / 0.5, -1)
    assert table.shape == (rows, steps, vocab) and table.dtype == torch.float32
    on = weight > 0
    torch.testing.assert_close(table[on].double(), want[on], rtol=1e-5, atol=1e-5)
    assert bool((table[~on] == 0).all())
    assert sorted(calls) == sorted((a, min(a + 4, rows), i) for i in range(steps) for a in range(0, rows, 4))


def test_table_dtype_follows_the_budget(monkeypatch):
    """Catches a table built past its memory budget (the demo's is 3.8 GB in fp32) or never built in fp16 when only
    that fits; and a budget variable that is ignored or misread."""
    assert table_dtype(10, 3, 100, budget=12_000) == torch.float32
    assert table_dtype(10, 3, 100, budget=11_999) == torch.float16
    assert table_dtype(10, 3, 100, budget=5_999) is None
    monkeypatch.setenv(TABLE_BYTES_ENV, "0")
    assert table_budget() == 0 and table_dtype(1, 1, 1) is None
    monkeypatch.setenv(TABLE_BYTES_ENV, "2e9")
    assert table_budget() == 2_000_000_000
    monkeypatch.setenv(TABLE_BYTES_ENV, "lots")
    with pytest.raises(SlimSpecError, match=TABLE_BYTES_ENV):  # a user's bad input: one line, exit code 2
        table_budget()
    monkeypatch.delenv(TABLE_BYTES_ENV)
    assert table_budget() > 0
    # torchrun ranks on one host each build a table: they share the host's third (catches each taking all of it)
    import slimspec.distill.teacher_table as teacher_table_module

    monkeypatch.setattr(teacher_table_module, "_available_bytes", lambda: 12_000)
    assert table_budget() == 4_000
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert table_budget() == 1_000


@pytest.mark.parametrize(("teacher", "temperature"), [("target", 1.0), ("drafter", 0.5)])
def test_head_only_distillation_with_the_table_equals_the_per_step_teacher(tmp_path, monkeypatch, teacher,
                                                                          temperature):
    """Catches a table indexed by other rows than the batch (the student would learn another row's teacher), the
    drafter teacher's bias column or the temperature lost on the way, and a table that is never used: head-only
    runs with and without it must follow the same loss curve and end at the same weights (fp32: ~1e-5)."""
    data = _parts(tmp_path)[2]
    torch.manual_seed(0)
    embed, head = torch.randn(1000, WIDTH), torch.randn(1000, WIDTH)
    teacher_head = torch.cat([head, torch.randn(1000, 1)], 1) if teacher == "drafter" else head
    built = []
    spy = train.teacher_table

    def counted(*args, **kwargs):
        built.append(kwargs["dtype"])
        return spy(*args, **kwargs)

    monkeypatch.setattr(train, "teacher_table", counted)
    runs = []
    for budget in ("1e9", "0"):
        monkeypatch.setenv(TABLE_BYTES_ENV, budget)
        drafter = _tiny_drafter(head, embed)
        u, s, vh = torch.linalg.svd(head, full_matrices=False)
        drafter.lm_head = LowRankHead(u[:, :3] * s[:3], vh[:3])
        cfg = DistillConfig(steps=6, lr=1e-2, warmup_steps=1, batch_tokens=16, eval_every_nth=4, teacher=teacher,
                            teacher_temperature=temperature)
        result = train_drafter(drafter, data, teacher_head, cfg, progress=False)
        runs.append((result, drafter.lm_head.up.detach().clone(), drafter.lm_head.down.detach().clone()))
    assert built == [torch.float32]  # built for the first run only
    (a, up_a, down_a), (b, up_b, down_b) = runs
    assert [h["loss"] for h in a.history] == pytest.approx([h["loss"] for h in b.history], rel=1e-5)
    assert a.kl_after == pytest.approx(b.kl_after, rel=1e-5) and a.kl_after != a.kl_before
    if temperature == 1.0:  # the held-out KL is at T = 1: a sharper teacher need not lower it
        assert a.kl_after < a.kl_before
    torch.testing.assert_close(up_a, up_b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(down_a, down_b, rtol=1e-4, atol=1e-6)
