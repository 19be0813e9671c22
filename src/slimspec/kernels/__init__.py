"""Fast ops for the SlimSpec low-rank LM head ``W ~ W_up @ W_down`` (W_up [V, r], W_down [r, d]).

``lowrank_logits`` / ``lowrank_argmax`` / ``lowrank_topk`` run Triton kernels on CUDA tensors (or under
``TRITON_INTERPRET=1``) and plain torch otherwise (``reference``); ``active_backend(tensor)`` says which.
Importing this package does not import triton.
"""

from slimspec.kernels.dispatch import (
    active_backend,
    interpreting,
    lowrank_argmax,
    lowrank_logits,
    lowrank_topk,
    triton_available,
    use_triton,
)

__all__ = [
    "active_backend",
    "interpreting",
    "lowrank_argmax",
    "lowrank_logits",
    "lowrank_topk",
    "triton_available",
    "use_triton",
]
