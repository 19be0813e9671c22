"""Several teacher caches trained on as one (``concat_teacher_data``): the rows stay where they are."""

import pytest
import torch

from slimspec.checkpoint.drafter import DrafterConfig
from slimspec.distill.teacher import TeacherData
from slimspec.distill.teacher_union import StackedRows, concat_teacher_data
from slimspec.distill.train import DistillConfig, train_drafter
from slimspec.errors import SlimSpecError
from slimspec.model import Eagle3Drafter, FullHead
from tests.unit.test_teacher_rows import _write

WIDTH = 8  # target hidden size of the tiny teacher sets: aux rows are 3 x 8 wide


def _parts(tmp_path) -> list[TeacherData]:
    """Three caches in the rows layout (memory-mapped), of different sizes and seeds."""
    return [_write(tmp_path, lengths, aux_width=3 * WIDTH, final_width=WIDTH, seed=seed, key=f"part{seed}")
            for seed, lengths in enumerate([[9, 14, 6], [11], [7, 13, 8, 10]])]


def _joined_in_memory(parts: list[TeacherData]) -> TeacherData:
    """The reference: every tensor copied into one (what a single big cache would hold)."""
    starts = [0]
    for p in parts:
        starts += (p.starts[1:] + starts[-1]).tolist()
    return TeacherData(input_ids=torch.cat([p.input_ids for p in parts]),
                       loss_mask=torch.cat([p.loss_mask for p in parts]),
                       aux=torch.cat([p.aux[:] for p in parts]), final=torch.cat([p.final[:] for p in parts]),
                       starts=torch.tensor(starts))


def test_sequences_and_gathers_match_a_copied_join(tmp_path):
    """Catches an offset error at a part boundary (a sequence of part 2 would read part 1's rows), rows gathered
    from several parts put back out of order, and a gather whose result loses the index's shape."""
    parts = _parts(tmp_path)
    union, ref = concat_teacher_data(parts), _joined_in_memory(parts)
    assert len(union) == len(ref) == 8 and union.num_tokens == ref.num_tokens == 78
    # the joined data has a key of its own, which depends on the parts and their order (checked by --resume)
    assert union.manifest["key"] and union.manifest["key"] != concat_teacher_data(parts[::-1]).manifest["key"]
    assert union.manifest["key"] == concat_teacher_data(parts).manifest["key"]
    assert torch.equal(union.starts, ref.starts)
    for i in range(len(ref)):
        got, want = union.sequence(i), ref.sequence(i)
        for k in ("input_ids", "loss_mask", "aux", "final"):
            assert torch.equal(got[k], want[k]), (i, k)
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, ref.num_tokens, (37, 3), generator=gen)
    index[0] = torch.tensor([28, 29, 40])  # rows on both sides of each boundary (29 and 40 start parts 1 and 2)
    assert torch.equal(union.final[index], ref.final[index])
    assert torch.equal(union.aux[index], ref.aux[index])
    assert torch.equal(union.final[25:45], ref.final[25:45])  # a slice across two boundaries


def test_training_on_the_union_equals_training_on_a_copy(tmp_path):
    """Catches any difference the trainer could see between the joined view and one cache (sequence order,
    held-out split, target rows of the KL): three whole-drafter steps must give bit-identical weights."""
    parts = _parts(tmp_path)
    torch.manual_seed(0)
    embed = torch.randn(1000, WIDTH)
    head = torch.randn(1000, WIDTH)
    results = []
    for teacher in (concat_teacher_data(parts), _joined_in_memory(parts)):
        drafter = _tiny_drafter(head, embed)
        dcfg = DistillConfig(steps=3, lr=1e-2, warmup_steps=1, batch_tokens=24, train_backbone=True, eval_every_nth=4)
        result = train_drafter(drafter, teacher, head, dcfg, progress=False)
        results.append((result, {k: v.clone() for k, v in drafter.state_dict().items()}))
    (a, wa), (b, wb) = results
    assert a.kl_before == b.kl_before and a.kl_after == b.kl_after and a.kl_after != a.kl_before
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _tiny_drafter(head: torch.Tensor, embed: torch.Tensor) -> Eagle3Drafter:
    cfg = DrafterConfig(hidden_size=WIDTH, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        intermediate_size=12, target_hidden_size=WIDTH, vocab_size=1000, draft_vocab_size=1000)
    torch.manual_seed(1)
    return Eagle3Drafter(cfg, head=FullHead(head.clone()), embed_weight=embed)


def test_long_runs_keep_only_every_nth_checkpoint_and_resume_from_the_latest(tmp_path):
    """Catches pruning that deletes the latest checkpoint (a resume would restart far back) or keeps every save
    (a long build fills the disk: ~120 MB a save for the reference drafter)."""
    teacher = concat_teacher_data(_parts(tmp_path))
    torch.manual_seed(0)
    embed, head = torch.randn(1000, WIDTH), torch.randn(1000, WIDTH)
    cfg = DistillConfig(steps=7, lr=1e-2, warmup_steps=1, batch_tokens=24, train_backbone=True, eval_every_nth=4,
                        save_every=1)
    ckpts = tmp_path / "ckpts"
    drafter = _tiny_drafter(head, embed)
    train_drafter(drafter, teacher, head, cfg, checkpoint_dir=ckpts, progress=False, keep_every=3)
    assert sorted(p.name for p in ckpts.glob("step-*.pt")) == ["step-000003.pt", "step-000006.pt", "step-000007.pt"]
    again = _tiny_drafter(head, embed)
    result = train_drafter(again, teacher, head, cfg, checkpoint_dir=ckpts, resume=True, progress=False,
                             keep_every=3)
    assert len(result.history) == 7  # resumed at step 7: nothing left to train, the saved history came back
    assert all(torch.equal(a, b) for a, b in zip(drafter.parameters(), again.parameters(), strict=True))


def test_parts_of_other_shapes_are_refused(tmp_path):
    """Catches joining caches built for different targets or feature layers (rows of another width would be
    read as garbage), and gathers outside the rows."""
    a = _write(tmp_path, [9], aux_width=24, final_width=8, key="a")
    b = _write(tmp_path, [9], aux_width=32, final_width=8, key="b")
    with pytest.raises(SlimSpecError, match="disagree"):
        concat_teacher_data([a, b])
    rows = StackedRows([a.final, a.final])
    with pytest.raises(IndexError):
        rows[torch.tensor([18])]
