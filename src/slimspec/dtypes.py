"""One table of dtype names: the short ones the CLI takes (bf16, fp16, fp32) and torch's (bfloat16, ...)."""

from __future__ import annotations

import torch

from slimspec.errors import SlimSpecError

TORCH_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "fp32": torch.float32, "float32": torch.float32}
"""Every name a dtype option accepts, short or torch's."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in :data:`TORCH_DTYPES` (case-insensitive)."""
    try:
        return TORCH_DTYPES[name.lower()]
    except KeyError:
        raise SlimSpecError(f"dtype must be one of {', '.join(TORCH_DTYPES)}; got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a floating dtype (``float32``, ``bfloat16``, ...), as configs write it."""
    return str(dtype).removeprefix("torch.")
