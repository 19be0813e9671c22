"""The teacher head's checksum a resumed distillation must share (``train.head_checksum``): taken a block of rows at a
time, the same within its tolerance whatever the blocks, and still refusing a resume against another head."""

import math

import pytest
import torch

from slimspec.distill import train
from slimspec.distill.teacher_union import concat_teacher_data
from slimspec.distill.train import CHECKSUM_TOLERANCE, DistillConfig, _same_head, head_checksum, train_drafter
from slimspec.errors import SlimSpecError
from tests.unit.test_teacher_union import _parts, _tiny_drafter

ROWS = 1000


def _wide_range_head() -> torch.Tensor:
    """A head whose float64 sums depend on their order: values over twelve orders of magnitude, both signs."""
    gen = torch.Generator().manual_seed(4)
    scale = 10.0 ** torch.randint(-6, 6, (ROWS, 48), generator=gen)
    return torch.randn(ROWS, 48, generator=gen) * scale


@pytest.mark.parametrize("rows", [1, 7, 333, ROWS, 4096])
def test_the_checksum_is_the_exact_sum_whatever_the_blocks(rows):
    """Catches a block that is skipped or counted twice (rows not a divisor of the head's, a last short block), a
    sum of the absolute values that is not one, and blocks summed in float32: sum and absolute sum lie within the
    resume's tolerance of the exactly rounded sums (``math.fsum``), so blockings compare equal."""
    head = _wide_range_head()
    values = head.double().flatten().tolist()
    total, magnitude = head_checksum(head, rows)
    exact_magnitude = math.fsum(abs(v) for v in values)
    assert abs(total - math.fsum(values)) <= CHECKSUM_TOLERANCE * exact_magnitude
    assert abs(magnitude - exact_magnitude) <= CHECKSUM_TOLERANCE * exact_magnitude
    now = [[ROWS, 48], *head_checksum(head)]
    assert _same_head([[ROWS, 48], total, magnitude], now)
    assert head_checksum(head.clone(), rows) == (total, magnitude)  # equal heads, equal blocks: bit for bit


def test_the_checksum_reads_the_head_without_changing_it():
    """Catches a checksum that takes absolute values in place: a float64 head on the host is its own block (no
    copy), so an in-place ``abs_`` would change the caller's head. A bfloat16 head sums as its float32 values."""
    head = _wide_range_head().double()
    before = head.clone()
    head_checksum(head)
    assert torch.equal(head, before)
    bf16 = head.to(torch.bfloat16)
    assert head_checksum(bf16, 64) == head_checksum(bf16.float(), 64)


def test_a_head_differs_beyond_rounding():
    """Catches a tolerance so wide that another head passes: a changed weight (here 1e-3 of one of 48,000) or
    another shape is refused, a sum off by rounding is not."""
    head = _wide_range_head()
    now = [[ROWS, 48], *head_checksum(head)]
    magnitude = now[2]
    assert _same_head([[ROWS, 48], now[1] + 0.1 * CHECKSUM_TOLERANCE * magnitude], now)
    assert not _same_head([[ROWS, 48], now[1] + 10 * CHECKSUM_TOLERANCE * magnitude], now)
    assert not _same_head([[ROWS, 48], now[1], now[2] * (1 + 10 * CHECKSUM_TOLERANCE)], now)
    assert not _same_head([[ROWS, 49], now[1], now[2]], now)
    changed = head.clone()
    changed[0, 0] += 1e-3 * float(head.abs().max())
    assert not _same_head([[ROWS, 48], *head_checksum(changed)], now)


def test_resume_takes_a_whole_head_sum_and_refuses_another_head(tmp_path, monkeypatch):
    """Catches a resume that refuses the checkpoint of the same run whose head sum was taken in one piece (as a
    whole-head float64 sum, without the absolute sum: the record of checkpoints written so), which differs from
    the blocks' sum in its last bits, and one that resumes against another teacher head of the same shape (the
    saved optimizer state belongs to another run)."""
    monkeypatch.setattr(train, "IDENTITY_ROWS", 7)  # blocks of a head this small
    teacher = concat_teacher_data(_parts(tmp_path))
    torch.manual_seed(0)
    embed = torch.randn(1000, 8)
    head = torch.randn(1000, 8) * 10.0 ** torch.randint(-12, 1, (1000, 8))  # sums that round
    whole = float(head.double().sum())
    assert head_checksum(head, 7)[0] != whole
    cfg = DistillConfig(steps=2, lr=1e-2, warmup_steps=1, batch_tokens=24, eval_every_nth=4, save_every=1)
    ckpts = tmp_path / "ckpts"
    train_drafter(_tiny_drafter(head, embed), teacher, head, cfg, checkpoint_dir=ckpts, progress=False)
    latest = ckpts / "step-000002.pt"
    state = torch.load(latest, weights_only=True)
    assert len(state["run"]["teacher_head"]) == 3
    state["run"]["teacher_head"] = [[1000, 8], whole]
    torch.save(state, latest)
    result = train_drafter(_tiny_drafter(head, embed), teacher, head, cfg, checkpoint_dir=ckpts, resume=True,
                           progress=False)
    assert len(result.history) == 2  # resumed at step 2: the saved history came back
    other = head.clone()
    other[5] += 0.01
    with pytest.raises(SlimSpecError, match="other teacher data or another source drafter"):
        train_drafter(_tiny_drafter(head, embed), teacher, other, cfg, checkpoint_dir=ckpts, resume=True,
                      progress=False)
