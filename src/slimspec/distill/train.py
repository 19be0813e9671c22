"""The distillation loop: AdamW + warmup + clipping over the TTT unroll, full-vocab KL to the target.

Head-only (the default) freezes the drafter's backbone, so its normed outputs for every TTT step are
computed once (:func:`student_features`) and each step only runs the head and the loss. With
``train_backbone`` the whole drafter (not the target's embedding) trains through ``ttt_forward``.

Alignment (DESIGN.md section 4): TTT step i at drafter position t predicts x_{t+2+i}; its teacher is the
target's distribution at position t+1+i, i.e. ``final[t+1+i] @ target_head^T``, weighted by the loss mask
there (response tokens) and by ``decay**i``.

With ``teacher="drafter"`` the teacher is instead the source drafter's full-rank head applied to the student's
own normed state at the same step (self-distillation of the factorised head): no next-token alignment, so every
position counts, prompt positions included. If the backbone trains too, the source head scores the *source*
backbone's states instead (:func:`source_states`, computed once before training), never the moving student's.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from slimspec.convert.factorize import balance_factors
from slimspec.distill.loss import full_vocab_kl, shortlist_margin_loss, top1_agreement, two_level_kl
from slimspec.distill.teacher import TeacherData
from slimspec.distill.teacher_table import table_budget, table_dtype, teacher_table
from slimspec.errors import OptionError, SlimSpecError
from slimspec.hardware import resolve_device
from slimspec.model import Eagle3Drafter, LowRankHead, ScreenRescoreHead

TEACHERS = ("target", "drafter")
"""What the head is distilled against: the target's next-token distribution (learns from the target, needs data),
or the source drafter's own full-rank head on the same states (recovers the original with little data)."""


SCREEN_LOSSES = ("two_level", "pair", "margin")
"""How a screen-and-rescore head distils: the KL of its two-level logits, or the plain pair's KL."""


@dataclass
class DistillConfig:
    """Knobs of the loop (saved in checkpoints; a resume must use the same)."""

    steps: int = 100
    lr: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_tokens: int = 2048
    ttt_steps: int = 3
    decay: float = 0.8
    train_backbone: bool = False
    backbone_lr: float | None = None  # peak lr of the backbone when it trains (None: ``lr``)
    save_every: int = 0
    seed: int = 0
    eval_every_nth: int = 10  # the sequences of every n-th distinct prompt are held out for the KL before/after
    teacher: str = "target"  # "target": the target's distribution; "drafter": the source drafter's own head
    bf16: bool = False  # mixed precision: backbone under bf16 autocast, KL matmuls in bf16 (sums, softmax in fp32)
    teacher_temperature: float = 1.0  # training KL against softmax(teacher logits / T); held-out KL stays at T = 1
    # a screen-and-rescore head's loss: "two_level" (KL of its two-level logits: exact on the shortlist, the pair's
    # elsewhere), "pair" (the plain pair's full-vocabulary KL, as for a low-rank head) or "margin" (the teacher's
    # argmax above the shortlist's boundary: recall alone, :func:`shortlist_margin_loss`)
    screen_loss: str = "two_level"
    # a screen-and-rescore head distils as if its shortlist were this share of K (held-out numbers stay at K): the
    # teacher's tokens are pulled into the pair's top share x K, a margin at the K it serves (docs/research.md)
    screen_train_share: float = 0.5

    def __post_init__(self) -> None:
        # checked here, where every caller builds its config, not after the teacher data is built
        if not self.lr > 0:
            raise OptionError(f"{{lr}} must be > 0, got {self.lr:g}", "lr")
        if not self.teacher_temperature > 0:
            raise OptionError(f"{{teacher_temperature}} must be > 0, got {self.teacher_temperature:g}",
                              "teacher_temperature")
        if self.warmup_steps < 0:
            raise OptionError(f"{{warmup_steps}} must be >= 0, got {self.warmup_steps}", "warmup_steps")
        if not 0 < self.screen_train_share <= 1:
            raise OptionError(f"{{screen_train_share}} must lie in (0, 1], got {self.screen_train_share:g}",
                              "screen_train_share")
        if self.screen_loss not in SCREEN_LOSSES:
            raise OptionError(f"{{screen_loss}} must be one of {', '.join(SCREEN_LOSSES)}, got {self.screen_loss!r}",
                              "screen_loss")


@dataclass
class StudentFeatures:
    """Per drafter position: normed outputs of each TTT step and where its teacher is."""

    hidden: torch.Tensor  # [M, k, H] float32
    teacher_index: torch.Tensor  # [M, k] long, rows of TeacherData.final
    weight: torch.Tensor  # [M, k] float32 (loss mask)


@dataclass
class DistillResult:
    steps: int
    kl_before: float
    kl_after: float
    kl_before_per_step: list[float]
    kl_after_per_step: list[float]
    history: list[dict] = field(default_factory=list)
    top1_before_per_step: list[float] = field(default_factory=list)  # held-out argmax agreement with the teacher
    top1_after_per_step: list[float] = field(default_factory=list)
    tokens_per_second: float = 0.0
    seconds: float = 0.0
    config: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """JSON-ready: the held-out KLs are None where no held-out answer position exists (NaN is not JSON)."""
        out = {k: v for k, v in asdict(self).items() if k != "history"} | {
            "losses": [h["loss"] for h in self.history], "history_tail": self.history[-5:]}
        for key in ("kl_before", "kl_after"):
            out[key] = finite_or_none(out[key])
            out[f"{key}_per_step"] = [finite_or_none(v) for v in out[f"{key}_per_step"]]
        for key in ("top1_before", "top1_after"):
            per_step = [finite_or_none(v) for v in out[f"{key}_per_step"]]
            out[f"{key}_per_step"] = per_step
            out[key] = per_step[0] if per_step else None
        return out


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def prompt_groups(teacher: TeacherData) -> list[int]:
    """For each sequence, the index of its prompt among the distinct prompts (in order of first appearance).

    A sequence's prompt is its tokens up to the first answer position; sequences without one (prompt-only text) are
    each their own prompt. Parts joined from one prompt set (greedy + sampled answers) share prompts."""
    mask, ids = teacher.loss_mask, teacher.input_ids
    seen: dict[bytes, int] = {}
    groups = []
    for i in range(len(teacher)):
        a, b = int(teacher.starts[i]), int(teacher.starts[i + 1])
        answer = mask[a:b].nonzero()
        end = a + int(answer[0, 0]) + 1 if answer.numel() and int(answer[0, 0]) > 0 else b
        groups.append(seen.setdefault(ids[a:end].numpy().tobytes() + bytes([end == b]), len(seen)))
    return groups


def split_sequences(teacher: TeacherData, every_nth: int) -> tuple[list[int], list[int]]:
    """(train, eval) sequence indices: the sequences of every n-th distinct prompt are held out (at least one
    sequence, never all), so the held-out KL never measures answers to a prompt that was trained on."""
    if every_nth == 1:
        raise SlimSpecError("eval_every_nth = 1 would hold out every sequence (use 0 for the default one, or >= 2)")
    n = len(teacher)
    groups = prompt_groups(teacher)
    held = [i for i in range(n) if every_nth > 0 and groups[i] % every_nth == every_nth - 1]
    if not held and n > 1:
        last = groups[-1]
        held = [i for i in range(n) if groups[i] == last] if any(g != last for g in groups) else [n - 1]
    held_set = set(held)
    train = [i for i in range(n) if i not in held_set] or list(range(n))
    return train, held


def _sequence_inputs(teacher: TeacherData, index: int, steps: int, source_rows: bool = False):
    seq = teacher.sequence(index)
    length = seq["input_ids"].numel()
    positions = length - steps
    if positions <= 0:
        return None
    start = int(teacher.starts[index])
    t = torch.arange(positions)
    if source_rows:  # rows of source_states(...) flattened to [num_tokens * k, H]: (position, step)
        teacher_index = ((start + t) * steps)[:, None] + torch.arange(steps)[None]
    else:
        teacher_index = torch.stack([start + t + 1 + i for i in range(steps)], dim=1)
    weight = torch.stack([seq["loss_mask"][t + 1 + i].float() for i in range(steps)], dim=1)
    return seq, positions, teacher_index, weight


def student_outputs(drafter: Eagle3Drafter, teacher: TeacherData, index: int, steps: int,
                    source_rows: bool = False):
    """Normed TTT outputs [T', k, H] of one sequence, with teacher rows and weights (None if too short)."""
    inputs = _sequence_inputs(teacher, index, steps, source_rows)
    if inputs is None:
        return None
    seq, positions, teacher_index, weight = inputs
    ref = drafter.fc.weight
    outs = drafter.ttt_forward(seq["input_ids"][None].to(ref.device),
                               seq["aux"][None, :positions].to(device=ref.device, dtype=ref.dtype), steps)
    hidden = torch.stack([drafter.normed(h)[0] for h in outs], dim=1)
    return hidden, teacher_index, weight


PAD_MULTIPLE = 64
"""Padded lengths of batched sequences are multiples of this: few distinct shapes, so oneDNN reuses its kernels."""
PAD_WASTE = 1.25
"""A group of sequences padded to one length may hold at most this many times their real positions."""


def _padded(length: int) -> int:
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices into ``lengths`` grouped for right-padded batches: sorted by length, a group grows while its
    padded size (members x the longest, rounded up to ``PAD_MULTIPLE``) stays within ``PAD_WASTE`` x its real
    positions (or one ``PAD_MULTIPLE`` per member, for short ones)."""
    groups: list[list[int]] = []
    real = 0
    for j in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        if groups:
            size = (len(groups[-1]) + 1) * _padded(lengths[j])
            if size <= max(PAD_WASTE * (real + lengths[j]), PAD_MULTIPLE * (len(groups[-1]) + 1)):
                groups[-1].append(j)
                real += lengths[j]
                continue
        groups.append([j])
        real = lengths[j]
    return groups


def batched_student_outputs(drafter: Eagle3Drafter, teacher: TeacherData, indices: list[int], steps: int,
                            source_rows: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """``student_outputs`` of each of ``indices`` (same order), computed in right-padded batches of similar
    lengths (``length_groups``). Exact: attention is causal and the TTT steps' extra keys are per position, so
    padding after a sequence changes none of its positions; it only replaces many small, differently shaped
    passes by a few larger ones of recurring shapes. Outputs are on the drafter's device, teacher rows and weights
    on the CPU."""
    inputs = [_sequence_inputs(teacher, i, steps, source_rows) for i in indices]
    results: list = [None] * len(indices)
    present = [j for j, x in enumerate(inputs) if x is not None]
    dtype = drafter.fc.weight.dtype
    for group in length_groups([inputs[j][1] for j in present]):
        members = [present[g] for g in group]
        width = _padded(max(inputs[j][1] for j in members))
        ids = torch.zeros(len(members), width + steps, dtype=torch.long)
        aux = torch.zeros(len(members), width, teacher.aux.shape[1], dtype=dtype)
        for row, j in enumerate(members):
            seq, positions = inputs[j][0], inputs[j][1]
            ids[row, :positions + steps] = seq["input_ids"]
            aux[row, :positions] = seq["aux"][:positions].to(dtype)
        outs = drafter.ttt_forward(ids.to(drafter.fc.weight.device), aux.to(drafter.fc.weight.device), steps)
        hidden = torch.stack([drafter.normed(h) for h in outs], dim=2)  # [B, width, k, H], on the drafter's device
        for row, j in enumerate(members):
            _, positions, teacher_index, weight = inputs[j]
            results[j] = (hidden[row, :positions], teacher_index, weight)
    return results


def repeated_prefixes(teacher: TeacherData, indices: list[int]) -> torch.Tensor:
    """[num_tokens] bool: True at a position whose whole token prefix (itself included) an earlier sequence of
    ``indices`` has too. The drafter's and the target's states there equal that sequence's, so such rows teach
    nothing new; a chat template's system prompt would otherwise count once per sequence (SmolLM2's 24 tokens
    x 300 calibration prompts: 18 % of the demo's training rows on 24 states)."""
    repeated = torch.zeros(teacher.num_tokens, dtype=torch.bool)
    seen: set[int] = set()
    for i in indices:
        start, end = int(teacher.starts[i]), int(teacher.starts[i + 1])
        key, shared = 0, True
        for offset, token in enumerate(teacher.input_ids[start:end].tolist()):
            key = hash((key, token))
            if shared and key in seen:
                repeated[start + offset] = True
            else:
                shared = False  # a prefix seen nowhere before has no seen extension either
                seen.add(key)
    return repeated


@torch.no_grad()
def student_features(drafter: Eagle3Drafter, teacher: TeacherData, indices: list[int], steps: int,
                     progress: bool = False, all_positions: bool = False,
                     source_rows: bool = False, allow_empty: bool = False) -> StudentFeatures:
    """Frozen-backbone features of the given sequences' answer positions (rows with some loss weight), on the
    drafter's device.

    ``all_positions``: every position, each with weight 1 (prompt positions too). Only for the ``drafter``
    teacher, whose targets are the source head's outputs on these very states, not the next tokens.
    ``source_rows``: teacher rows index ``source_states`` (the drafter teacher while the backbone trains).
    A (position, TTT step) whose tokens an earlier sequence shares (``repeated_prefixes``) gets weight 0.
    ``allow_empty`` (held-out sets, which may hold no answer position): no rows instead of an error.
    """
    parts = []
    repeated = repeated_prefixes(teacher, indices)
    for out in _in_batches(drafter, teacher, indices, steps, source_rows, progress, "drafter features"):
        if out is not None:
            hidden, teacher_index, weight = out
            if all_positions:
                weight = torch.ones_like(weight)
            # the last token the state at (position t, step i) has read: t + 1 + i, i.e. the target's row
            last = teacher_index // steps + 1 + teacher_index % steps if source_rows else teacher_index
            weight = weight * ~repeated[last]
            keep = weight.sum(1) > 0  # prompt positions teach nothing: batches are drawn from answers only
            if bool(keep.any()):
                parts.append((hidden[keep.to(hidden.device)], teacher_index[keep], weight[keep]))
    device = drafter.fc.weight.device
    if not parts and allow_empty:
        return StudentFeatures(hidden=torch.zeros(0, steps, drafter.config.hidden_size, device=device),
                               teacher_index=torch.zeros(0, steps, dtype=torch.long, device=device),
                               weight=torch.zeros(0, steps, device=device))
    if not parts:
        raise SlimSpecError(f"no teacher sequence has answer tokens to learn from (each needs more than {steps} "
                            "tokens, some of them answer tokens)")
    return StudentFeatures(hidden=torch.cat([p[0] for p in parts]).float(),
                           teacher_index=torch.cat([p[1] for p in parts]).to(device),
                           weight=torch.cat([p[2] for p in parts]).to(device))


def _in_batches(drafter, teacher, indices, steps, source_rows, progress, desc, tokens=8192):
    """``batched_student_outputs`` of ``indices`` in order, a slice of about ``tokens`` positions at a time."""
    bar = tqdm(total=len(indices), desc=f"[slimspec] {desc}", disable=not progress, leave=False)
    start = 0
    while start < len(indices):
        end, count = start, 0
        while end < len(indices) and (end == start or count < tokens):
            i = indices[end]
            count += int(teacher.starts[i + 1] - teacher.starts[i])
            end += 1
        yield from batched_student_outputs(drafter, teacher, indices[start:end], steps, source_rows)
        bar.update(end - start)
        start = end
    bar.close()


def head_factors(drafter: Eagle3Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_down [r, d], w_up [V, r]) of a low-rank head, or (identity, W) of a full head."""
    head = drafter.lm_head
    down = head.weight_down
    if down is None:
        up = head.weight_up
        return torch.eye(up.shape[1], dtype=up.dtype, device=up.device), up
    return down, head.weight_up


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if _world()[1] > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def source_states(drafter: Eagle3Drafter, teacher: TeacherData, indices: list[int], steps: int,
                  progress: bool = False) -> torch.Tensor:
    """The (frozen, source) drafter's normed TTT outputs at every position, [num_tokens * k, H] float32.

    Row (position * k + step); rows of positions without a draft (a sequence's last k tokens) stay zero. These
    are the drafter teacher's inputs while the backbone trains: the source head must score the *source*
    backbone's states, not the moving student's.
    """
    k, size = steps, drafter.config.hidden_size
    out = torch.zeros(teacher.num_tokens * k, size, device=drafter.fc.weight.device)
    for res in _in_batches(drafter, teacher, indices, steps, True, progress, "source drafter states"):
        if res is not None:
            out[res[1].reshape(-1).to(out.device)] = res[0].reshape(-1, size).float()
    return out


def teacher_hidden(hidden: torch.Tensor, teacher_index: torch.Tensor, teacher: TeacherData, kind: str,
                   source: torch.Tensor | None = None) -> torch.Tensor:
    """Rows the teacher head multiplies: the target's final states, or (``drafter``) [h, 1] with h the
    student's own state, or the source drafter's state (``source``: rows of ``source_states``). On ``hidden``'s
    device (the target's states are read from the CPU cache)."""
    if kind == "drafter":
        h = hidden.detach().float() if source is None else source[teacher_index]
        return torch.cat([h, h.new_ones(h.shape[0], 1, dtype=torch.float32)], 1)
    return teacher.final[teacher_index.cpu()].to(device=hidden.device, dtype=torch.float32)


def kl_terms(drafter: Eagle3Drafter, hidden: torch.Tensor, teacher_index: torch.Tensor, weight: torch.Tensor,
             teacher: TeacherData, teacher_head: torch.Tensor, decay: float, global_weight: torch.Tensor | None = None,
             kind: str = "target", source: torch.Tensor | None = None,
             matmul_dtype: torch.dtype | None = None,
             teacher_temperature: float = 1.0,
             teacher_logits: torch.Tensor | None = None,
             teacher_rows: torch.Tensor | None = None,
             screen_loss: str = "two_level", shortlist_share: float = 1.0) -> tuple[torch.Tensor, list[float]]:
    """Loss = sum_i decay^i * KL_i (KL_i the weighted mean over tokens) and the per-step KLs.

    ``global_weight`` [k] (the weight sums over all ranks) makes the per-rank losses add up to the global one.
    ``kind``: ``target`` (``teacher_head`` [V, Ht] on the target's states) or ``drafter`` (``teacher_head``
    [V, d + 1], the source head with a bias column, on the student's own states: see ``self_teacher_head``).
    ``matmul_dtype``: see :func:`full_vocab_kl` (bf16 training).
    ``teacher_temperature``: the teacher is softmax(logits / T) (T < 1 sharpens it toward its argmax, the token a
    greedy verifier accepts); scaling the teacher's rows by 1/T scales its logits exactly (a bias column too).
    ``teacher_logits`` [B, k, V]: the teacher's log-probabilities of these rows, already at ``teacher_temperature``
    (rows of a :func:`slimspec.distill.teacher_table.teacher_table`); ``teacher_head`` is then not used. With
    ``teacher_rows`` [B], ``teacher_logits`` is the whole table [N, k, V] and row b of the batch is its row
    ``teacher_rows[b]``: only the rows a step keeps are copied out of it.
    ``screen_loss``: a screen-and-rescore head's loss (``two_level`` or ``pair``, see :class:`DistillConfig`), at
    ``shortlist_share`` of its shortlist.
    """
    down, up = head_factors(drafter)
    kl_of = head_kl(drafter, screen_loss, shortlist_share)
    total = hidden.new_zeros(())
    per_step = []
    for i in range(hidden.shape[1]):
        w = weight[:, i]
        local = float(w.sum())
        denominator = float(global_weight[i]) if global_weight is not None else local
        if denominator <= 0:
            per_step.append(float("nan"))
            continue
        if local <= 0:
            per_step.append(0.0)
            total = total + 0.0 * (up.sum() + down.sum())  # keep every rank's graph the same shape
            continue
        keep = w > 0  # zero-weight rows (prompt positions) add nothing: skip their head and teacher matmuls
        if teacher_logits is not None:
            # one gather of only the kept rows (from the whole table where ``teacher_rows`` names them)
            logits = teacher_logits[keep, i] if teacher_rows is None else teacher_logits[teacher_rows[keep], i]
            kl = kl_of(hidden[keep, i], down, up, weights=w[keep], matmul_dtype=matmul_dtype,
                       teacher_logits=logits, teacher_log_probs=True)
        else:
            th = teacher_hidden(hidden[keep, i], teacher_index[keep, i], teacher, kind, source)
            if teacher_temperature != 1.0:
                th = th / teacher_temperature
            kl = kl_of(hidden[keep, i], down, up, th, teacher_head, weights=w[keep], matmul_dtype=matmul_dtype)
        share = kl * (local / denominator)
        per_step.append(float(share.detach()))
        total = total + (decay ** i) * share
    return total, per_step


def head_kl(drafter: Eagle3Drafter, screen_loss: str = "two_level", shortlist_share: float = 1.0):
    """The KL function of the drafter's head, called as :func:`full_vocab_kl`: the two-level KL for a screen-and-rescore
    head (unless ``screen_loss`` is ``pair``), else the pair's full-vocabulary KL. A screen's loss takes
    ``shortlist_share`` of its shortlist (at least one token)."""
    head = drafter.lm_head
    if not isinstance(head, ScreenRescoreHead) or screen_loss == "pair":
        return full_vocab_kl
    shortlist = max(1, round(head.shortlist * shortlist_share))
    if screen_loss == "margin":
        return partial(_screen_margin, head, shortlist)
    return partial(_screen_kl, head, shortlist)


def _screen_margin(head: ScreenRescoreHead, shortlist: int, h, down, up, *args, **kwargs):
    return shortlist_margin_loss(h, down, up, shortlist, head.hot_ids, *args, **kwargs)


def _screen_kl(head: ScreenRescoreHead, shortlist: int, h, down, up, *args, **kwargs):
    return two_level_kl(h, down, up, head.exact, shortlist, head.hot_ids, *args, **kwargs)


def _screen_top1(head: ScreenRescoreHead, h, down, up, teacher_rows, teacher_head, *, weights):
    """Weighted share of rows whose greedy screen-and-rescore token is the teacher's argmax."""
    del down, up
    w = weights.float()
    same = head.greedy(h) == (teacher_rows.float() @ teacher_head.float().T).argmax(-1)
    return float((w * same).sum() / w.sum()) if float(w.sum()) > 0 else float("nan")


def _held_out_means(drafter: Eagle3Drafter, features: StudentFeatures, teacher: TeacherData,
                    teacher_head: torch.Tensor, metric, batch: int, kind: str,
                    source: torch.Tensor | None) -> list[float]:
    """Per TTT step, the weighted mean of ``metric(h, w_down, w_up, teacher_rows, teacher_head, weights=w)`` (a
    weighted mean over its rows) over ``features`` in row batches; NaN for a step without weight."""
    k = features.hidden.shape[1]
    sums, weights = [0.0] * k, [0.0] * k
    down, up = head_factors(drafter)
    for a in range(0, features.hidden.shape[0], batch):
        for i in range(k):
            w = features.weight[a:a + batch, i]
            total = float(w.sum())
            if total <= 0:
                continue
            h = features.hidden[a:a + batch, i]
            th = teacher_hidden(h, features.teacher_index[a:a + batch, i], teacher, kind, source)
            sums[i] += float(metric(h, down.detach(), up.detach(), th, teacher_head, weights=w)) * total
            weights[i] += total
    return [s / w if w > 0 else float("nan") for s, w in zip(sums, weights, strict=True)]


@torch.no_grad()
def evaluate_kl(drafter: Eagle3Drafter, features: StudentFeatures, teacher: TeacherData,
                teacher_head: torch.Tensor, decay: float, batch: int = 4096, kind: str = "target",
                source: torch.Tensor | None = None) -> tuple[float, list[float]]:
    """Weighted-mean KL per TTT step over ``features`` and the decayed sum (the training loss)."""
    per_step = _held_out_means(drafter, features, teacher, teacher_head, head_kl(drafter), batch, kind, source)
    loss = sum((decay ** i) * v for i, v in enumerate(per_step) if not math.isnan(v))
    return loss, per_step


@torch.no_grad()
def evaluate_top1(drafter: Eagle3Drafter, features: StudentFeatures, teacher: TeacherData,
                  teacher_head: torch.Tensor, batch: int = 4096, kind: str = "target",
                  source: torch.Tensor | None = None) -> list[float]:
    """Per TTT step, the weighted share of ``features``' rows whose student argmax is the teacher's
    (:func:`slimspec.distill.loss.top1_agreement`; NaN for a step without weight)."""
    head = drafter.lm_head
    metric = partial(_screen_top1, head) if isinstance(head, ScreenRescoreHead) else top1_agreement
    return _held_out_means(drafter, features, teacher, teacher_head, metric, batch, kind, source)


def frozen_teacher_table(features: StudentFeatures, teacher: TeacherData, teacher_head: torch.Tensor, kind: str,
                         temperature: float, progress: bool = False) -> torch.Tensor | None:
    """The teacher's log-probabilities of every training row of a head-only run, or None where the table would
    not fit its budget (``slimspec.distill.teacher_table``): the loss then multiplies the teacher out per step."""
    rows, steps = features.weight.shape
    dtype = table_dtype(rows, steps, teacher_head.shape[0], table_budget(features.hidden.device))
    if dtype is None:
        return None

    def teacher_rows(part: slice, i: int) -> torch.Tensor:
        return teacher_hidden(features.hidden[part, i], features.teacher_index[part, i], teacher, kind)

    return teacher_table(features.weight, teacher_rows, teacher_head, temperature=temperature, dtype=dtype,
                         progress=progress)


def _lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def trainable_parameters(drafter: Eagle3Drafter, train_backbone: bool) -> list[torch.nn.Parameter]:
    for p in drafter.parameters():
        p.requires_grad_(False)
    params = list(drafter.lm_head.parameters()) if not train_backbone else list(drafter.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def _checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}.pt"


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("step-*.pt"))
    return found[-1] if found else None


def prepare_checkpoint_dir(folder: Path, resume: bool, overwrite: bool) -> None:
    """Before a run that saves into ``folder``: checkpoints of an earlier run there are continued (``resume``),
    removed (``overwrite``: a fresh run's saves would otherwise rank below them as "latest"), or refused."""
    last = latest_checkpoint(folder) if folder.is_dir() else None
    if resume or last is None:
        return
    if not overwrite:
        raise OptionError(f"{folder} holds checkpoints of an earlier run (latest {last.name}): {{resume}} continues "
                          "it, {overwrite} starts over", "resume", "overwrite")
    if _world()[0] == 0:
        for path in folder.glob("step-*.pt"):
            path.unlink(missing_ok=True)


def training_device(name: str | None) -> torch.device:
    """Where a run distils for ``--device`` ``name`` (see :func:`slimspec.hardware.resolve_device`); the CPU under
    torchrun, whose all-reduce and per-rank teacher tables are host-side."""
    return torch.device("cpu") if _world()[1] > 1 else resolve_device(name)


def train_drafter(
    drafter: Eagle3Drafter,
    teacher: TeacherData,
    teacher_head: torch.Tensor,
    cfg: DistillConfig,
    *,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    keep_every: int = 0,
    device: str | torch.device | None = None,
) -> DistillResult:
    """Train ``drafter`` (head only unless ``cfg.train_backbone``) in place against ``teacher``.

    ``keep_every`` > 0 keeps, of the checkpoints saved every ``cfg.save_every`` steps, only those of steps that
    are multiples of it and the latest (long runs: the resume point and a curve, not every save). Not part of
    ``cfg``, so it can change between a run and its resume.
    ``device``: where the run computes (the drafter's features, the teacher table, the steps); None: where the
    drafter is. The drafter is back on its own device afterwards, also after a failure; checkpoints hold CPU
    tensors, so a run may resume on another device. Distributed (torchrun) runs compute on the CPU."""
    world = _world()[1]
    origin = drafter.fc.weight.device
    device = torch.device(device) if device is not None else origin
    if world > 1 and device.type != "cpu":
        raise SlimSpecError(f"distributed distillation (torchrun) runs on the CPU; got device {device}")
    run = _run_identity(teacher, teacher_head)  # summed on the host: the same sums on every device
    drafter.to(device)
    try:
        return _distill(drafter, teacher, teacher_head.to(device), cfg, checkpoint_dir, resume, progress, keep_every,
                        run)
    finally:
        drafter.to(origin)


@dataclass(frozen=True, eq=False)
class TeacherSpec:
    """What the head is distilled against, as the loop's steps read it.

    ``kind``: ``target`` (the target's distribution at the next position; answer positions teach) or ``drafter``
    (the source drafter's full-rank head on the same states; every training position teaches). ``source``: rows of
    :func:`source_states`, which the drafter teacher scores while the backbone trains; None: the teacher scores
    the student's own states (``drafter``) or the target's (``target``)."""

    kind: str = "target"
    source: torch.Tensor | None = None

    @property
    def source_rows(self) -> bool:
        """Teacher rows index ``source`` (position * k + step) rather than the target's positions."""
        return self.source is not None

    @property
    def all_positions(self) -> bool:
        """Every training position teaches with weight 1, prompt positions included."""
        return self.kind == "drafter"


def teacher_spec(drafter: Eagle3Drafter, teacher: TeacherData, cfg: DistillConfig, indices: list[int],
                 progress: bool = False) -> TeacherSpec:
    """The teacher ``cfg`` names. The drafter teacher of a training backbone scores the source backbone's states,
    computed once here for the sequences ``indices`` (the student's own states move as it trains)."""
    if cfg.teacher == "drafter" and cfg.train_backbone:
        return TeacherSpec("drafter", source_states(drafter, teacher, indices, cfg.ttt_steps, progress))
    return TeacherSpec(cfg.teacher)


def _distill(drafter: Eagle3Drafter, teacher: TeacherData, teacher_head: torch.Tensor, cfg: DistillConfig,
             checkpoint_dir: Path | None, resume: bool, progress: bool, keep_every: int, run: dict) -> DistillResult:
    """:func:`train_drafter` on the device the drafter and ``teacher_head`` are on."""
    torch.manual_seed(cfg.seed)
    teacher_head = teacher_head.float()
    if cfg.teacher not in TEACHERS:
        raise SlimSpecError(f"teacher must be one of {', '.join(TEACHERS)}, got {cfg.teacher!r}")
    train_idx, eval_idx = split_sequences(teacher, cfg.eval_every_nth)
    drafter.requires_grad_(False)
    spec = teacher_spec(drafter, teacher, cfg, train_idx + eval_idx, progress)
    eval_features, kl_before, top1_before = _held_out(drafter, teacher, teacher_head, cfg, eval_idx, spec)
    train_features, table = _training_rows(drafter, teacher, teacher_head, cfg, train_idx, spec, progress)
    _balance_factors(drafter)
    params = trainable_parameters(drafter, cfg.train_backbone)
    state = _Training(drafter, teacher, teacher_head, cfg, spec, train_idx, train_features, table, params,
                      optimizer=_optimizer(drafter, params, cfg), generator=torch.Generator().manual_seed(cfg.seed),
                      checkpoint_dir=checkpoint_dir, keep_every=keep_every,
                      run={**run, "student": _student_identity(drafter, params)})
    start_step = _resume(state) if resume else 0
    tokens_per_second, seconds = _train(state, start_step, progress)
    drafter.requires_grad_(False)
    _, kl_after, top1_after = _held_out(drafter, teacher, teacher_head, cfg, eval_idx, spec,
                                        None if cfg.train_backbone else eval_features)
    return DistillResult(steps=cfg.steps, kl_before=kl_before[0], kl_after=kl_after[0], kl_before_per_step=kl_before,
                         kl_after_per_step=kl_after, history=state.history, top1_before_per_step=top1_before,
                         top1_after_per_step=top1_after, tokens_per_second=tokens_per_second, seconds=seconds,
                         config=asdict(cfg))


def _held_out(drafter: Eagle3Drafter, teacher: TeacherData, teacher_head: torch.Tensor, cfg: DistillConfig,
              eval_idx: list[int], spec: TeacherSpec,
              features: StudentFeatures | None = None) -> tuple[StudentFeatures, list[float], list[float]]:
    """(held-out features, KL per TTT step, top-1 agreement per TTT step). ``features``: those of an earlier
    evaluation, still valid while the backbone is frozen; None computes them from the drafter as it is now."""
    if features is None:
        features = student_features(drafter, teacher, eval_idx, cfg.ttt_steps, source_rows=spec.source_rows,
                                    allow_empty=True)
    _, kl_per_step = evaluate_kl(drafter, features, teacher, teacher_head, cfg.decay, kind=spec.kind,
                                 source=spec.source)
    top1 = evaluate_top1(drafter, features, teacher, teacher_head, kind=spec.kind, source=spec.source)
    return features, kl_per_step, top1


def _training_rows(drafter: Eagle3Drafter, teacher: TeacherData, teacher_head: torch.Tensor, cfg: DistillConfig,
                   train_idx: list[int], spec: TeacherSpec,
                   progress: bool) -> tuple[StudentFeatures | None, torch.Tensor | None]:
    """Head-only: the frozen drafter's features of the training rows and the teacher's log-probabilities of them
    (None where that table does not fit). A training backbone draws whole sequences each step instead: (None,
    None), once some training sequence is known to hold answer tokens (as ``student_features`` demands)."""
    k = cfg.ttt_steps
    if cfg.train_backbone:
        if not any((x := _sequence_inputs(teacher, i, k)) is not None and bool(x[3].sum() > 0) for i in train_idx):
            raise SlimSpecError(f"no teacher sequence has answer tokens to learn from (each needs more than {k} "
                                "tokens, some of them answer tokens)")
        return None, None
    features = student_features(drafter, teacher, train_idx, k, progress, all_positions=spec.all_positions)
    table = frozen_teacher_table(features, teacher, teacher_head, spec.kind, cfg.teacher_temperature, progress)
    return features, table


def _balance_factors(drafter: Eagle3Drafter) -> None:
    """Give a low-rank head's two factors one scale (Adam moves each weight by about ``lr``); a full head stays."""
    if not isinstance(drafter.lm_head, LowRankHead):
        return
    head = drafter.lm_head
    with torch.no_grad():
        up, down = balance_factors(head.up, head.down)
        head.up.copy_(up)
        head.down.copy_(down)


def _optimizer(drafter: Eagle3Drafter, params: list[torch.nn.Parameter], cfg: DistillConfig) -> torch.optim.AdamW:
    """AdamW over ``params``: the head's at ``lr``, the backbone's scaled to ``backbone_lr`` (each group's
    ``scale`` multiplies the scheduled learning rate)."""
    head_ids = {id(p) for p in drafter.lm_head.parameters()}
    groups = [{"params": [p for p in params if id(p) in head_ids], "scale": 1.0},
              {"params": [p for p in params if id(p) not in head_ids],
               "scale": (cfg.backbone_lr or cfg.lr) / cfg.lr}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, weight_decay=cfg.weight_decay,
                             betas=(0.9, 0.95))


@dataclass
class _Training:
    """What the steps of one run share: student, teacher, training rows, optimizer, random stream, history and
    where checkpoints go."""

    drafter: Eagle3Drafter
    teacher: TeacherData
    teacher_head: torch.Tensor
    cfg: DistillConfig
    spec: TeacherSpec
    train_idx: list[int]
    features: StudentFeatures | None  # head-only: the rows a step draws from
    table: torch.Tensor | None  # head-only: the teacher's log-probabilities of those rows, when they fit
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    checkpoint_dir: Path | None
    keep_every: int
    run: dict
    history: list[dict] = field(default_factory=list)


def _resume(state: _Training) -> int:
    """Load the latest checkpoint of ``state.checkpoint_dir`` into the parameters, optimizer, random stream and
    history, after checking it was saved by this run (same options, teacher data and student); the step reached."""
    folder, cfg = state.checkpoint_dir, state.cfg
    if folder is None or not (path := latest_checkpoint(folder)):
        # starting over instead would silently take whatever options this call has, and replace the output
        raise OptionError(f"{{resume}}: no checkpoint in {folder} to resume from (a run saves them with "
                          "{save_every} N); drop {resume} to start over", "resume", "save_every")
    saved_state = torch.load(path, map_location="cpu", weights_only=True)
    # a config field the checkpoint lacks counts as its default (the behaviour it was written with)
    saved = {**asdict(DistillConfig()), **saved_state["config"]}
    differ = [k for k, v in asdict(cfg).items() if k not in RESUME_FREE and saved.get(k) != v]
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in differ)
        raise SlimSpecError(f"{path}: saved with other settings ({shown}); resume needs the same options")
    if not _same_run(saved_state.get("run") or {}, state.run):
        raise OptionError(f"{path}: saved by a run on other teacher data or another source drafter; resume "
                          "needs the same {data}, prompts and checkpoint (or another {out})", "data", "out")
    with torch.no_grad():
        for p, tensor in zip(state.params, saved_state["params"], strict=True):
            p.copy_(tensor)
    state.optimizer.load_state_dict(saved_state["optimizer"])
    state.generator.set_state(saved_state["rng"])
    state.history = list(saved_state["history"])
    return int(saved_state["step"])


def _train(state: _Training, start_step: int, progress: bool) -> tuple[float, float]:
    """Steps ``start_step`` to ``cfg.steps``, each recorded in ``state.history`` and checkpointed when due:
    (rows per second over all ranks, training seconds of the whole run, earlier segments of a resumed one
    included)."""
    rank, world = _world()
    cfg = state.cfg
    # training time of the run's earlier segments (a history entry without it counts from here)
    prior_seconds = float(state.history[-1].get("seconds", 0.0)) if state.history else 0.0
    bar = tqdm(total=cfg.steps, initial=start_step, desc="[slimspec] distill", disable=not progress or rank != 0)
    tokens_seen, started = 0, time.perf_counter()
    for step in range(start_step, cfg.steps):
        loss_value, kl0, grad_norm, rows = _train_step(state, step, rank, world)
        tokens_seen += rows * world
        rate = tokens_seen / max(time.perf_counter() - started, 1e-9)
        state.history.append({"step": step + 1, "loss": loss_value, "kl0": kl0, "grad_norm": grad_norm,
                              "lr": state.optimizer.param_groups[0]["lr"],
                              "seconds": prior_seconds + time.perf_counter() - started})
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.4f}", kl=f"{kl0:.4f}", tok_s=f"{rate:.0f}")
        if state.checkpoint_dir is not None and cfg.save_every and (step + 1) % cfg.save_every == 0 and rank == 0:
            _save_checkpoint(state.checkpoint_dir, step + 1, state.params, state.optimizer, state.generator,
                             state.history, cfg, state.run)
            if state.keep_every > 0:
                prune_checkpoints(state.checkpoint_dir, state.keep_every)
    bar.close()
    seconds = time.perf_counter() - started
    return tokens_seen / max(seconds, 1e-9), prior_seconds + seconds


def _train_step(state: _Training, step: int, rank: int, world: int) -> tuple[float, float, float, int]:
    """One optimizer step on a fresh batch: (loss, KL of TTT step 0, gradient norm, this rank's rows); the loss and
    KL are summed over ranks, the gradients reduced before clipping."""
    cfg, params, optimizer = state.cfg, state.params, state.optimizer
    hidden, teacher_index, weight, logits, table_rows = _draw_batch(state, rank, world)
    global_weight = _all_reduce(weight.sum(0).double())
    for group in optimizer.param_groups:
        group["lr"] = _lr_at(step, cfg) * group["scale"]
    optimizer.zero_grad(set_to_none=True)
    loss, per_step = kl_terms(state.drafter, hidden, teacher_index, weight, state.teacher, state.teacher_head,
                              cfg.decay, global_weight, kind=state.spec.kind, source=state.spec.source,
                              matmul_dtype=torch.bfloat16 if cfg.bf16 else None,
                              teacher_temperature=cfg.teacher_temperature,
                              teacher_logits=logits, teacher_rows=table_rows, screen_loss=cfg.screen_loss,
                              shortlist_share=cfg.screen_train_share)
    if loss.requires_grad:  # a batch without weighted rows (this rank's, or all) gives a constant: no gradient
        loss.backward()
    for p in params:
        if p.grad is None and world > 1:  # a rank without rows this step: every rank must reduce every tensor
            p.grad = torch.zeros_like(p)
        if p.grad is not None:
            _all_reduce(p.grad)
    loss_value = float(_all_reduce(loss.detach().clone()))
    kl0 = float(_all_reduce(torch.tensor(per_step[0] if not math.isnan(per_step[0]) else 0.0)))
    if not math.isfinite(loss_value):
        last = latest_checkpoint(state.checkpoint_dir) if state.checkpoint_dir else None
        raise SlimSpecError(f"loss became {loss_value} at step {step + 1}; stopped"
                            + (f" (last good checkpoint: {last})" if last else " (no checkpoint saved yet)"))
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    optimizer.step()
    return loss_value, kl0, grad_norm, hidden.shape[0]


def _draw_batch(state: _Training, rank: int, world: int):
    """This rank's rows of one step: (hidden, teacher rows, weights, teacher table, table rows). Head-only: random
    rows of the precomputed features (the table, when there is one, is indexed by ``table rows``); a training
    backbone: whole random sequences through the drafter (no table)."""
    cfg = state.cfg
    if cfg.train_backbone:
        with torch.autocast(state.drafter.fc.weight.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            hidden, teacher_index, weight = _backbone_batch(state.drafter, state.teacher, state.train_idx, cfg,
                                                            state.generator, rank, world, state.spec)
        return hidden, teacher_index, weight, None, None
    features = state.features
    rows = torch.randint(0, features.hidden.shape[0], (cfg.batch_tokens,), generator=state.generator)
    rows = rows[rank::world].to(state.drafter.fc.weight.device)
    return features.hidden[rows], features.teacher_index[rows], features.weight[rows], state.table, rows


def _backbone_batch(drafter, teacher, train_idx, cfg, generator, rank, world, spec: TeacherSpec):
    """Whole sequences, drawn at random until the batch holds ``batch_tokens`` positions (split over ranks), through
    the training drafter; their teacher rows and weights as ``spec`` says."""
    chosen, count = [], 0
    while count < cfg.batch_tokens:
        i = train_idx[int(torch.randint(0, len(train_idx), (1,), generator=generator))]
        chosen.append(i)
        count += max(0, int(teacher.starts[i + 1] - teacher.starts[i]) - cfg.ttt_steps)
        if len(chosen) > 10 * len(train_idx):
            break
    parts = batched_student_outputs(drafter, teacher, chosen[rank::world], cfg.ttt_steps, spec.source_rows)
    parts = [p for p in parts if p is not None]
    if spec.all_positions:
        parts = [(h, index, torch.ones_like(w)) for h, index, w in parts]
    device = drafter.fc.weight.device
    if not parts:
        h = drafter.fc.weight.new_zeros(0, cfg.ttt_steps, drafter.config.hidden_size)
        return h, torch.zeros(0, cfg.ttt_steps, dtype=torch.long, device=device), torch.zeros(0, cfg.ttt_steps,
                                                                                            device=device)
    return (torch.cat([p[0] for p in parts]).float(), torch.cat([p[1] for p in parts]).to(device),
            torch.cat([p[2] for p in parts]).to(device))


def prune_checkpoints(folder: Path, keep_every: int) -> None:
    """Delete the checkpoints of ``folder`` but the latest and those of steps that are multiples of ``keep_every``."""
    found = sorted(folder.glob("step-*.pt"))
    for path in found[:-1]:
        if int(path.stem.removeprefix("step-")) % keep_every:
            path.unlink(missing_ok=True)


RESUME_FREE = {"save_every"}
"""DistillConfig fields a resume may change: when checkpoints are written does not change the run."""


def _student_identity(drafter: Eagle3Drafter, trained: list[torch.nn.Parameter]) -> dict:
    """The student a checkpoint's parameters belong to: the trained tensors' shapes and the sum of the frozen ones,
    so that a checkpoint of another rank is refused by name rather than by a shape error, and one of another
    drafter of the same shapes is refused rather than resumed."""
    ids = {id(p) for p in trained}
    frozen = sum(float(p.detach().double().sum()) for p in drafter.parameters() if id(p) not in ids)
    return {"shapes": [list(p.shape) for p in trained], "frozen_sum": frozen}


IDENTITY_ROWS = 4096
"""Rows of the teacher head a checksum block holds in float64 (:func:`head_checksum`): ``4096*w*8`` bytes on the
host (128 MiB at w = 4096) rather than a float64 copy of the whole head."""
CHECKSUM_TOLERANCE = 1e-10
"""How far a saved head sum may lie from this run's, relative to the sum of the head's absolute values: float64
sums of the same values in another order differ by about 1e-16 of it per level of their summation tree."""


def head_checksum(head: torch.Tensor, rows: int = IDENTITY_ROWS) -> tuple[float, float]:
    """(sum, sum of absolute values) of ``head``'s elements in float64, taken on the host ``rows`` rows at a time
    (a block's float64 copy at most, wherever the head is).

    Equal heads give equal checksums on one machine and build (the blocks are fixed and added in order), but the
    last bits of the sum depend on the summation order: another block size, another number of threads or one sum
    over the whole head at once differs by rounding. So the sums are compared within :data:`CHECKSUM_TOLERANCE` of
    the absolute sum (:func:`_same_head`), not bit for bit: a checkpoint whose sum was taken over the whole head
    resumes, and a head from another model or revision moves the sum by far more."""
    total = magnitude = 0.0
    for a in range(0, head.shape[0], rows):
        block = head[a:a + rows].detach().to("cpu", torch.float64)
        total += float(block.sum())
        magnitude += float(torch.linalg.vector_norm(block, 1))  # no second copy (nor one of a float64 head)
    return total, magnitude


def _run_identity(teacher: TeacherData, teacher_head: torch.Tensor) -> dict:
    """What a resumed run must share with the one that saved the checkpoint besides its config: the teacher data
    (cache key, sequences, tokens) and the teacher head (the source drafter's or the target's): its shape, and
    its sum and absolute sum by :func:`head_checksum`, compared by :func:`_same_head`."""
    return {"data_key": teacher.manifest.get("key"), "sequences": len(teacher), "tokens": teacher.num_tokens,
            "teacher_head": [list(teacher_head.shape), *head_checksum(teacher_head, IDENTITY_ROWS)]}


def _same_head(saved: list, now: list) -> bool:
    """Whether a checkpoint's ``teacher_head`` identity ``[shape, sum(, absolute sum)]`` is this run's ``[shape,
    sum, absolute sum]``: the same shape, and sums within :data:`CHECKSUM_TOLERANCE` of the absolute sum (a
    checkpoint that records no absolute sum is compared by its sum alone)."""
    shape, total, magnitude = now
    if list(saved[0]) != shape:
        return False
    slack = CHECKSUM_TOLERANCE * magnitude
    return abs(saved[1] - total) <= slack and (len(saved) < 3 or abs(saved[2] - magnitude) <= slack)


def _same_run(saved: dict, now: dict) -> bool:
    """Whether a checkpoint's ``run`` record matches this run's (a field the checkpoint does not record is not
    compared): the teacher head by :func:`_same_head`, the rest exactly."""
    return all(key not in saved or (_same_head(saved[key], value) if key == "teacher_head" else saved[key] == value)
               for key, value in now.items())


def _save_checkpoint(folder: Path, step: int, params, optimizer, generator, history, cfg, run: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = _checkpoint_path(folder, step)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    optimizer_state = optimizer.state_dict()  # CPU copies below: a run may resume on another device
    optimizer_state["state"] = {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in state.items()}
                                for k, state in optimizer_state["state"].items()}
    torch.save({"step": step, "params": [p.detach().cpu().clone() for p in params], "optimizer": optimizer_state,
                "rng": generator.get_state(), "history": history, "config": asdict(cfg), "run": run}, tmp)
    os.replace(tmp, path)
    return path
