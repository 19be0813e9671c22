"""The ``--vocab full`` head (``convert.pipeline.stitched_head``): the drafter's rows put into the target's a block
at a time give the head that making all of them float32 at once gives, bit for bit."""

from pathlib import Path

import pytest
import torch

from slimspec.checkpoint.drafter import DrafterCheckpoint, DrafterConfig
from slimspec.checkpoint.target import TargetHead
from slimspec.convert import pipeline

V, VD, D = 301, 97, 64


def _inputs() -> tuple[DrafterCheckpoint, TargetHead, torch.Tensor]:
    """A drafter with a bfloat16 head of 97 rows mapped by d2t onto scattered rows of a 301-token bfloat16 target
    head, and the target ids of its rows."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randperm(V, generator=gen)[:VD].sort().values
    cfg = DrafterConfig(hidden_size=D, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        intermediate_size=12, target_hidden_size=D, vocab_size=V, draft_vocab_size=VD)
    tensors = {"lm_head.weight": (3 * torch.randn(VD, D, generator=gen)).to(torch.bfloat16),
               "d2t": ids - torch.arange(VD)}
    ckpt = DrafterCheckpoint(layout="eagle", config=cfg, tensors=tensors, source=Path("drafter"), files=[],
                             raw_config={})
    target = TargetHead(weight=torch.randn(V, D, generator=gen).to(torch.bfloat16), tensor_name="lm_head.weight",
                        tied=False, config={}, source=Path("target"))
    return ckpt, target, ids


def _reference(ckpt: DrafterCheckpoint, target: TargetHead, ids: torch.Tensor, stitch: str) -> torch.Tensor:
    """The head made the straightforward way: every row float32 at once."""
    head = ckpt.tensors["lm_head.weight"].float()
    weight = target.weight.float().clone()
    if stitch == "zero":
        weight.zero_()
    elif stitch == "scaled":
        weight *= float(head.norm(dim=1).mean() / weight[ids].norm(dim=1).mean().clamp_min(1e-12))
    weight[ids] = head
    return weight


@pytest.mark.parametrize("stitch", ["target", "zero", "scaled"])
@pytest.mark.parametrize("rows", [1, 3, 32, 4096])
def test_the_stitched_head_is_the_same_whatever_the_blocks(monkeypatch, stitch, rows):
    """Catches a block of drafter rows written to the wrong target rows or skipped (a last short block: 97 rows in
    blocks of 3 or 32), target rows left where the drafter's go, and a scaled stitch whose row norms, taken a block
    at a time, give another scale: every stitch is bit-identical to the all-at-once float32 head."""
    monkeypatch.setattr(pipeline, "STITCH_ROWS", rows)
    ckpt, target, ids = _inputs()
    weight, from_drafter = pipeline.stitched_head(ckpt, target, "full", stitch)
    assert from_drafter == VD and weight.dtype == torch.float32
    assert torch.equal(weight, _reference(ckpt, target, ids, stitch))
    others = torch.ones(V, dtype=torch.bool)
    others[ids] = False  # the target's own rows stay the target's (or zero, or scaled)
    assert stitch != "target" or torch.equal(weight[others], target.weight[others].float())
