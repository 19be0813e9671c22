"""Several teacher caches used as one: train on more data than one cache holds, without copying any of it.

Each cache keeps its own key (prompts, temperature, seed), so a large training set can be built a part at a time
(each part resumable, each part's transient files small) and a part can be reused by later sets.
"""

from __future__ import annotations

import hashlib
import json
from itertools import accumulate

import torch

from slimspec.distill.teacher import TeacherData
from slimspec.errors import SlimSpecError


class StackedRows:
    """Row-wise concatenation of ``[N_i, W]`` tensors (memory-mapped or not), never materialised.

    Supports what the trainer does with teacher rows: a contiguous slice (one sequence's rows) and a gather by a
    LongTensor of global row indices (any shape; the result is ``[*index.shape, W]``).
    """

    def __init__(self, parts: list[torch.Tensor]):
        if not parts:
            raise SlimSpecError("no teacher rows to stack")
        widths = {tuple(p.shape[1:]) for p in parts}
        dtypes = {p.dtype for p in parts}
        if len(widths) != 1 or len(dtypes) != 1 or parts[0].dim() != 2:
            raise SlimSpecError(f"teacher caches disagree on row shape/dtype: {sorted(widths)}, "
                                f"{sorted(map(str, dtypes))} (were they built for the same target and feature layers?)")
        self.parts = parts
        self.offsets = torch.tensor([0, *accumulate(p.shape[0] for p in parts)])
        self.dtype = parts[0].dtype
        self.shape = torch.Size([int(self.offsets[-1]), parts[0].shape[1]])

    def __len__(self) -> int:
        return self.shape[0]

    def _part_of(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.offsets[1:], rows, right=True)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise SlimSpecError("StackedRows slices must be contiguous")
            return self[torch.arange(start, max(start, stop))] if stop > start else self.parts[0][0:0]
        if not isinstance(key, torch.Tensor) or key.dtype != torch.long:
            raise TypeError(f"StackedRows takes a slice or a LongTensor of rows, not {type(key).__name__}")
        flat = key.reshape(-1).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        which = self._part_of(flat)
        if flat.numel() and bool((which == which[0]).all()):  # one part (a sequence's rows): a view when contiguous
            part, base = self.parts[int(which[0])], int(self.offsets[which[0]])
            local = flat - base
            if bool((local[1:] - local[:-1] == 1).all()):
                return part[int(local[0]):int(local[-1]) + 1].view(*key.shape, self.shape[1])
            return part[local].view(*key.shape, self.shape[1])
        out = torch.empty(flat.numel(), self.shape[1], dtype=self.dtype)
        for p in which.unique().tolist():
            sel = which == p
            out[sel] = self.parts[p][flat[sel] - int(self.offsets[p])]
        return out.view(*key.shape, self.shape[1])


def concat_teacher_data(parts: list[TeacherData]) -> TeacherData:
    """One teacher set holding every sequence of ``parts`` in order (part 0's first); hidden states stay where
    they are (rows memory-mapped stay mapped), only the token ids and loss masks (9 bytes a token) are joined."""
    if not parts:
        raise SlimSpecError("no teacher data to join")
    if len(parts) == 1:
        return parts[0]
    starts, at = [torch.zeros(1, dtype=torch.long)], 0
    for p in parts:
        starts.append(p.starts[1:] + at)
        at += p.num_tokens
    keys = [p.manifest.get("key") for p in parts]
    # one key for the joined data, in part order (what `distill --resume` checks a checkpoint's data against)
    key = hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:20] if all(keys) else None
    manifest = {"key": key, "parts": [{"key": p.manifest.get("key"), "folder": str(p.folder) if p.folder else None,
                           "num_sequences": len(p), "num_tokens": p.num_tokens} for p in parts],
                "num_sequences": sum(len(p) for p in parts), "num_tokens": at,
                "settings": [p.manifest.get("settings") for p in parts]}
    return TeacherData(input_ids=torch.cat([p.input_ids for p in parts]),
                       loss_mask=torch.cat([p.loss_mask for p in parts]),
                       aux=StackedRows([p.aux for p in parts]), final=StackedRows([p.final for p in parts]),
                       starts=torch.cat(starts), manifest=manifest, folder=None)
