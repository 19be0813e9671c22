"""The vLLM plugin: EAGLE-3 drafter classes whose LM head is SlimSpec's low-rank pair.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and maps our checkpoint
architectures (``Eagle3SlimSpecLlamaForCausalLM``, ``Eagle3SlimSpecQwen3ForCausalLM``) to subclasses of
vLLM's own EAGLE-3 classes, so the proposer's ``isinstance`` checks pass and everything except the head
is vLLM's code. The head:

- ``lm_head`` is a ``ParallelLMHead`` of width r holding ``W_up [V_head, r]`` (vLLM compares the drafter's
  head with the target's through ``lm_head.weight``; the shapes differ, so it is never shared);
- ``lm_head_down`` is a replicated linear holding ``W_down [r, d]`` (its name contains ``lm_head`` so
  vLLM's loader does not prefix it with ``model.``);
- logits = ``W_up (W_down h)``, then the parent's ``d2t`` scatter when the head covers a trimmed vocab.

Greedy drafting through vLLM's ``get_top_tokens`` hook (speculative config
``"use_local_argmax_reduction": true``) uses ``slimspec.kernels.lowrank_argmax`` (fused, no logits written)
when its Triton path runs on the device (``slimspec.kernels.use_triton``); otherwise the argmax of the
low-rank logits. Without that option vLLM takes ``argmax(compute_logits(h))``: still low-rank logits.

This module imports vLLM: only vLLM's plugin loader (and code already running inside vLLM) should import it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.qwen3_eagle3 import Eagle3Qwen3ForCausalLM
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix

logger = logging.getLogger(__name__)

# checkpoint architecture -> "module:class" (lazy: vLLM imports the module only when it needs the class)
MODELS = {
    "Eagle3SlimSpecLlamaForCausalLM": f"{__name__}:SlimSpecEagle3LlamaForCausalLM",
    "Eagle3SlimSpecQwen3ForCausalLM": f"{__name__}:SlimSpecEagle3Qwen3ForCausalLM",
}
HEAD_TENSORS = ("lm_head.weight", "lm_head_down.weight")
FAST_ARGMAX_ENV = "SLIMSPEC_VLLM_FAST_ARGMAX"  # "0" disables the kernel path (for comparisons)

ArgmaxFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def register() -> None:
    """vLLM plugin entry point: make vLLM's model registry know our architectures."""
    from vllm import ModelRegistry

    for arch, target in MODELS.items():
        ModelRegistry.register_model(arch, target)


def checkpoint_rank(config: object) -> int:
    """The head rank r from the drafter config's ``slimspec`` block (written by ``slimspec convert``)."""
    meta = getattr(config, "slimspec", None)
    rank = meta.get("rank") if isinstance(meta, dict) else getattr(meta, "rank", None)
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError("SlimSpec drafter config has no 'slimspec': {'rank': r} block; "
                         "was this checkpoint written by `slimspec convert`?")
    return rank


def fast_argmax_for(probe: torch.Tensor) -> ArgmaxFn | None:
    """``slimspec.kernels.lowrank_argmax`` where it exists and its Triton path runs on ``probe``'s device."""
    if os.environ.get(FAST_ARGMAX_ENV, "1") == "0":
        return None
    try:
        from slimspec import kernels
    except ImportError:
        return None
    argmax, use_triton = getattr(kernels, "lowrank_argmax", None), getattr(kernels, "use_triton", None)
    if argmax is None or use_triton is None or not use_triton(probe):
        return None  # its torch fallback is no faster than vLLM's own argmax of the logits
    return argmax


class LowRankHeadMixin(nn.Module):
    """Replaces the parent's ``[V_head, d]`` head by ``W_up [V_head, r]`` after ``W_down [r, d]``.

    Put it before vLLM's EAGLE-3 class in the bases; the parent keeps its decoder, loader and ``d2t``.
    """

    lm_head: ParallelLMHead
    lm_head_down: ReplicatedLinear
    draft_id_to_target_id: nn.Parameter | None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.slimspec_rank = checkpoint_rank(self.config)
        hidden = self.config.hidden_size
        if not 0 < self.slimspec_rank < hidden:
            raise ValueError(f"SlimSpec rank {self.slimspec_rank} must lie in (0, hidden_size={hidden})")
        # The parent allocated a full [V_head, d] head; drop it before allocating the factors.
        del self.lm_head
        self.lm_head = ParallelLMHead(
            self.config.draft_vocab_size,
            self.slimspec_rank,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.lm_head_down = ReplicatedLinear(
            hidden, self.slimspec_rank, bias=False, prefix=maybe_prefix(prefix, "lm_head_down"), return_bias=False
        )
        self._fast_argmax: ArgmaxFn | None = None
        self._fast_argmax_checked = False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Low-rank logits: ``W_down`` first, then the parent's logits processor with ``W_up`` and ``d2t``."""
        return super().compute_logits(self.lm_head_down(hidden_states))

    def _fast_argmax_fn(self, hidden_states: torch.Tensor) -> ArgmaxFn | None:
        if not self._fast_argmax_checked:
            self._fast_argmax_checked = True
            floats = (torch.float16, torch.bfloat16, torch.float32)  # unquantized factors only
            usable = (self.lm_head.tp_size == 1 and self.logits_processor.scale > 0
                      and self.lm_head.weight.dtype in floats and self.lm_head_down.weight.dtype in floats
                      # vLLM's CPU GEMM dispatch may repack a linear and leave .weight empty
                      and self.lm_head_down.weight.shape == (self.slimspec_rank, self.config.hidden_size))
            self._fast_argmax = fast_argmax_for(hidden_states) if usable else None
            logger.info("SlimSpec greedy drafting: %s",
                        "slimspec.kernels.lowrank_argmax" if self._fast_argmax else "argmax of low-rank logits")
        return self._fast_argmax

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids), without materialising logits where the kernel runs."""
        fast = self._fast_argmax_fn(hidden_states)
        if fast is not None and hidden_states.dtype == self.lm_head.weight.dtype:
            w_up = self.lm_head.weight[: self.lm_head.org_vocab_size]  # padding rows would score 0
            top = fast(hidden_states, self.lm_head_down.weight, w_up)
        else:
            top = self.logits_processor.get_top_tokens(self.lm_head, self.lm_head_down(hidden_states))
        d2t = self.draft_id_to_target_id
        return top if d2t is None else top + d2t[top]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The parent's loader, refusing a checkpoint that lacks either factor (never a random head)."""
        seen: set[str] = set()

        def tracked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                seen.add(name)
                yield name, tensor

        super().load_weights(tracked())
        missing = [name for name in HEAD_TENSORS if name not in seen]
        if self.draft_id_to_target_id is not None and not any("d2t" in name for name in seen):
            missing.append("d2t")  # vLLM's zeros would map draft id i to target id i: silently wrong tokens
        if missing:
            raise ValueError(f"SlimSpec checkpoint lacks {', '.join(missing)}: refusing to run an "
                             "uninitialised low-rank head or draft vocabulary")


class SlimSpecEagle3LlamaForCausalLM(LowRankHeadMixin, Eagle3LlamaForCausalLM):
    """vLLM's Llama EAGLE-3 drafter with SlimSpec's low-rank head."""


class SlimSpecEagle3Qwen3ForCausalLM(LowRankHeadMixin, Eagle3Qwen3ForCausalLM):
    """vLLM's Qwen3 EAGLE-3 drafter with SlimSpec's low-rank head."""
