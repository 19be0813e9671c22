"""research/insample_rho.py measures rho_tau on the prompts the demo's distillation fitted and on those it held out."""

import torch

from slimspec.distill.teacher import TeacherData
from slimspec.distill.train import DistillConfig, split_sequences
from tests.scripts import load_script


def test_fitted_and_held_out_prompts_are_the_distillations_own_split():
    """Catches the diagnostic drifting from the distillation's split (another every-n, or an off-by-one in which
    prompt of ten is held out): its "fitted" row would then measure prompts the head never saw, and the held-out
    row prompts it was fitted to."""
    n = 300
    ids = torch.arange(2 * n) + 1  # sequence i: a one-token prompt (distinct per i), then a one-token answer
    mask = torch.tensor([False, True]).repeat(n)
    teacher = TeacherData(input_ids=ids, loss_mask=mask, aux=torch.zeros(2 * n, 1), final=torch.zeros(2 * n, 1),
                          starts=torch.arange(0, 2 * n + 1, 2))
    fitted, held = split_sequences(teacher, DistillConfig().eval_every_nth)
    sets = load_script("insample_rho").prompt_sets([{"i": i} for i in range(n)], count=30)
    assert {r["i"] for r in sets["held_out"]} <= set(held)
    assert {r["i"] for r in sets["fitted"]} <= set(fitted)
    assert len(sets["held_out"]) == len(sets["fitted"]) == 30
    # spread over the file (chat, code, math in order), not its first 30 rows
    assert max(r["i"] for r in sets["fitted"]) > 250
