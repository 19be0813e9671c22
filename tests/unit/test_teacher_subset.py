"""`TeacherData.subset`: the data-scaling runs of the reference drafter train on every n-th sequence."""

import torch

from slimspec.distill.teacher import TeacherData


def _teacher(lengths: list[int]) -> TeacherData:
    total = sum(lengths)
    starts = torch.tensor([0] + lengths).cumsum(0)
    return TeacherData(input_ids=torch.arange(total), loss_mask=torch.arange(total) % 3 == 0,
                       aux=torch.randn(total, 6), final=torch.randn(total, 2), starts=starts)


def test_subset_keeps_each_sequence_whole_and_in_order():
    """Catches offsets that drift after a skipped sequence (a subset would mix tokens of two sequences)."""
    teacher = _teacher([5, 3, 7, 4, 6])
    picked = teacher.subset([0, 2, 4])
    assert len(picked) == 3
    for new, old in enumerate([0, 2, 4]):
        a, b = int(teacher.starts[old]), int(teacher.starts[old + 1])
        got, want = picked.sequence(new), teacher.sequence(old)
        for key in ("input_ids", "loss_mask", "aux", "final"):
            assert torch.equal(got[key], want[key]), key
        assert int(picked.starts[new + 1] - picked.starts[new]) == b - a
    assert picked.num_tokens == 5 + 7 + 6
