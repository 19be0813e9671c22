"""`split_sequences`: the held-out KL of a distillation run is measured on prompts the run never trained on."""

import pytest
import torch

from slimspec.distill.teacher import TeacherData
from slimspec.distill.train import prompt_groups, split_sequences


def _teacher(sequences: list[tuple[list[int], int]]) -> TeacherData:
    """Sequences given as (token ids, prompt length); prompt length 0 = prompt-only text (loss on every position)."""
    ids, masks, lengths = [], [], []
    for tokens, prompt in sequences:
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[max(prompt - 1, 0):] = True  # as the teacher writes it: the last prompt position predicts the answer
        ids.append(torch.tensor(tokens))
        masks.append(mask)
        lengths.append(len(tokens))
    total = sum(lengths)
    return TeacherData(input_ids=torch.cat(ids), loss_mask=torch.cat(masks), aux=torch.zeros(total, 2),
                       final=torch.zeros(total, 1), starts=torch.tensor([0] + lengths).cumsum(0))


def test_joined_parts_hold_out_whole_prompts():
    """Catches a split by sequence index on joined parts (greedy + sampled answers to the same prompts): answers to
    a held-out prompt were trained on through the other part, so the held-out KL was optimistic."""
    prompts = [[1, 50 + p, 51 + p] for p in range(0, 40, 2)]  # 20 distinct prompts
    greedy = [(p + [7, 8, 9], len(p)) for p in prompts]
    sampled = [(p + [9, 7], len(p)) for p in reversed(prompts)]  # the other part lists them in its own order
    teacher = _teacher(greedy + sampled)
    groups = prompt_groups(teacher)
    assert groups == list(range(20)) + list(range(19, -1, -1))
    train, held = split_sequences(teacher, 10)
    prompt_of = lambda i: teacher.sequence(i)["input_ids"][:3].tolist()  # noqa: E731
    assert sorted(held) == [9, 19, 20, 30]
    assert not {tuple(prompt_of(i)) for i in held} & {tuple(prompt_of(i)) for i in train}
    assert sorted(train + held) == list(range(40))


def test_one_part_keeps_the_split_by_index():
    """Catches a changed split for the common case (one answer per prompt): the demo's held-out set, and so its
    recorded held-out KL, must stay the sequences it always was."""
    teacher = _teacher([([1, 100 + i, 5, 6], 2) for i in range(25)])
    assert split_sequences(teacher, 10) == ([i for i in range(25) if i % 10 != 9], [9, 19])


def test_prompt_only_text_and_fallbacks():
    """Catches prompt-only sequences (no answer positions) collapsing into one group, and the at-least-one /
    never-all rules."""
    text = _teacher([([1, 2, 3 + i, 4], 0) for i in range(12)])
    assert prompt_groups(text) == list(range(12))
    assert split_sequences(text, 10)[1] == [9]
    few = _teacher([([1, 30 + i % 2, 5], 2) for i in range(4)])  # 2 prompts, 4 sequences: hold out the last prompt
    assert split_sequences(few, 10) == ([0, 2], [1, 3])
    same = _teacher([([1, 30, 5], 2)] * 3)  # one prompt only: one sequence held out, the rest trained
    assert split_sequences(same, 10) == ([0, 1], [2])
    one = _teacher([([1, 30, 5], 2)])
    assert split_sequences(one, 10) == ([0], [])
    with pytest.raises(Exception, match="every sequence"):
        split_sequences(one, 1)
