"""The teacher's log-probabilities over the whole head vocabulary, once per (row, TTT step) of a frozen-feature run.

Head-only distillation draws ``batch_tokens`` rows of fixed features per step; the brief recipe (300 prompts,
200 steps of 2048) revisits each row ~10 times. The teacher's logits of a row never change there (its input is the
target's state or, for the ``drafter`` teacher, the frozen student state), and they are the biggest matmul of a
step (``T x H_t x V`` against the student's ``T x r x V``). Computing them once into a table makes a step ~2x
faster on a CPU (``scripts/bench.py --only teacher-table``), at the memory of the table: ``M x k x V`` values,
kept only where they fit a budget (``SLIMSPEC_TEACHER_TABLE_BYTES``, default a third of the available memory).
The table holds log-probabilities (normalised, so float16's rounding falls where probabilities are tiny): float32
where that fits, else float16, else no table (the loss then computes the teacher's logits per step, as before).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from slimspec.errors import SlimSpecError

TABLE_BYTES_ENV = "SLIMSPEC_TEACHER_TABLE_BYTES"
"""Most bytes the table may take (0: never build one). Default: a third of MemAvailable (see ``table_budget``)."""


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def table_budget(device: torch.device | str | None = None) -> int:
    """Bytes a teacher table may take: ``$SLIMSPEC_TEACHER_TABLE_BYTES``, else a third of the available memory
    where the table lives: the free memory of a CUDA ``device``, else the host's, shared by the processes of this
    host (torchrun's ``LOCAL_WORLD_SIZE``: each rank builds its own table)."""
    value = os.environ.get(TABLE_BYTES_ENV)
    if value is not None and value.strip():
        try:
            return max(0, int(float(value)))
        except ValueError as error:
            raise SlimSpecError(f"{TABLE_BYTES_ENV} must be a number of bytes, got {value!r}") from error
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0] // 3
    return _available_bytes() // 3 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def table_dtype(rows: int, steps: int, vocab: int, budget: int | None = None) -> torch.dtype | None:
    """float32 if a [rows, steps, vocab] table fits ``budget``, else float16 if that fits, else None."""
    budget = table_budget() if budget is None else budget
    for dtype in (torch.float32, torch.float16):
        if rows * steps * vocab * torch.empty((), dtype=dtype).element_size() <= budget:
            return dtype
    return None


@torch.no_grad()
def teacher_table(weight: torch.Tensor, teacher_rows: Callable[[slice, int], torch.Tensor],
                  teacher_head: torch.Tensor, *, temperature: float = 1.0, dtype: torch.dtype = torch.float32,
                  chunk: int = 1024, progress: bool = False) -> torch.Tensor:
    """[M, k, V] log-softmax(teacher_rows(rows, i) @ teacher_head.T / temperature) for every row with weight.

    ``weight`` [M, k]: (row, step) pairs of weight 0 are never read by the loss and stay 0 here (not computed).
    ``teacher_rows(slice, i)`` gives the teacher's input rows [n, H_t] of step i (float32). Computed in float32,
    stored in ``dtype``, on ``weight``'s device (``teacher_head`` and the rows must be there too).
    """
    rows, steps = weight.shape
    vocab = teacher_head.shape[0]
    chunk = max(1, min(chunk, 2**26 // max(vocab, 1)))  # one chunk's float32 logits: at most 256 MiB
    head_t = teacher_head.float().T
    table = torch.zeros(rows, steps, vocab, dtype=dtype, device=weight.device)
    bar = tqdm(total=rows * steps, desc="[slimspec] teacher table", unit="row", disable=not progress)
    for i in range(steps):
        for a in range(0, rows, chunk):
            part = slice(a, min(a + chunk, rows))
            keep = (weight[part, i] > 0).nonzero().squeeze(1)
            if keep.numel():
                whole = keep.numel() == part.stop - part.start  # then written in place, without a gather
                th = teacher_rows(part, i).float()
                th = th if whole else th[keep]
                if temperature != 1.0:
                    th = th / temperature
                log_p = torch.log_softmax(th @ head_t, dim=-1)
                if whole:
                    table[part, i] = log_p
                else:
                    table[a + keep, i] = log_p.to(dtype)
            bar.update(part.stop - part.start)
    bar.close()
    return table
