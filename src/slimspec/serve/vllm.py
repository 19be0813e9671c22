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

A screen-and-rescore checkpoint (config ``"slimspec": {"head": "screen_rescore", "shortlist": K, "hot_rows": N}``)
adds ``lm_head_exact`` (the exact rows ``W_exact [V_head, d]``) and, when N > 0, the buffer ``lm_head_hot_ids``: the
pair screens every draft token, the exact rows of its top K and of the hot ids are rescored
(``slimspec.kernels.screen.rescore_screen``: the gathered Triton kernel on a GPU), and ``compute_logits`` returns
float32 two-level logits (exact on the shortlist, the pair's elsewhere) in which every value at or above the
shortlist's exact maximum, other than its own, is set just below it (``served_logits``). vLLM drafts
``argmax(compute_logits(h))`` (or ``get_top_tokens`` with ``use_local_argmax_reduction``), so either way its draft
is the shortlist's exact argmax, ties to the lower draft id, as the reference decoder's.

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

from slimspec.kernels.screen import rescore_screen, served_logits

logger = logging.getLogger(__name__)

# checkpoint architecture -> "module:class" (lazy: vLLM imports the module only when it needs the class)
MODELS = {
    "Eagle3SlimSpecLlamaForCausalLM": f"{__name__}:SlimSpecEagle3LlamaForCausalLM",
    "Eagle3SlimSpecQwen3ForCausalLM": f"{__name__}:SlimSpecEagle3Qwen3ForCausalLM",
}
HEAD_TENSORS = ("lm_head.weight", "lm_head_down.weight")
SCREEN_EXACT, SCREEN_HOT_IDS = "lm_head_exact.weight", "lm_head_hot_ids"
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


def screen_options(config: object) -> tuple[int, int] | None:
    """(shortlist K, hot rows N) of a screen-and-rescore checkpoint's ``slimspec`` block; None for the plain pair."""
    meta = getattr(config, "slimspec", None)
    get = meta.get if isinstance(meta, dict) else (lambda key, default=None: getattr(meta, key, default))
    if get("head", "lowrank") in (None, "lowrank"):
        return None
    shortlist, hot_rows = get("shortlist"), get("hot_rows", 0)
    if get("head") != "screen_rescore" or not isinstance(shortlist, int) or shortlist < 1 \
            or not isinstance(hot_rows, int) or hot_rows < 0:
        raise ValueError(f"SlimSpec head {get('head')!r} with shortlist {shortlist!r}, hot_rows {hot_rows!r}: "
                         "expected 'screen_rescore' with shortlist >= 1 and hot_rows >= 0")
    return shortlist, hot_rows


class ExactRows(nn.Module):
    """Holds the screen's exact rows ``W_exact [V_head, d]`` as ``.weight`` (a plain parameter: no GEMM repacking)."""

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)


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
        self.slimspec_screen = screen_options(self.config)
        if self.slimspec_screen is not None:
            shortlist, hot_rows = self.slimspec_screen
            if shortlist > self.config.draft_vocab_size:
                raise ValueError(f"SlimSpec shortlist {shortlist} exceeds the head's "
                                 f"{self.config.draft_vocab_size} rows")
            self.lm_head_exact = ExactRows(self.config.draft_vocab_size, hidden)
            self.register_buffer(SCREEN_HOT_IDS, torch.zeros(hot_rows, dtype=torch.long) if hot_rows else None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Low-rank logits: ``W_down`` first, then the parent's logits processor with ``W_up`` and ``d2t``. A screen
        head: its float32 two-level logits, capped so that their argmax is the shortlist's exact argmax."""
        if self.slimspec_screen is None:
            return super().compute_logits(self.lm_head_down(hidden_states))
        screened = self._screen_rescore(hidden_states)
        if screened is None:
            return None
        tokens, logits = screened
        return self._to_target_vocab(served_logits(logits, tokens))

    def _screen_rescore(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(draft ids [B], two-level draft-vocab logits float32 [B, V_head]) of the screen head."""
        screen = self.logits_processor(self.lm_head, self.lm_head_down(hidden_states))
        if screen is None:  # a tensor-parallel rank that holds no logits
            return None
        shortlist, _ = self.slimspec_screen
        return rescore_screen(hidden_states, screen.float(), self.lm_head_exact.weight, shortlist,
                              getattr(self, SCREEN_HOT_IDS), scale=float(self.logits_processor.scale))

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits placed at their target ids (``-inf`` elsewhere), as the parent does with d2t."""
        d2t = self.draft_id_to_target_id
        if d2t is None:
            return logits
        placed = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        placed[:, torch.arange(logits.shape[1], device=logits.device) + d2t] = logits
        return placed

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
        fast = None if self.slimspec_screen is not None else self._fast_argmax_fn(hidden_states)
        if self.slimspec_screen is not None:
            top = self._screen_rescore(hidden_states)[0]  # the shortlist's exact argmax
        elif fast is not None and hidden_states.dtype == self.lm_head.weight.dtype:
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
        required = HEAD_TENSORS
        if self.slimspec_screen is not None:
            required += (SCREEN_EXACT,) + ((SCREEN_HOT_IDS,) if self.slimspec_screen[1] else ())
        missing = [name for name in required if name not in seen]
        if self.draft_id_to_target_id is not None and not any("d2t" in name for name in seen):
            missing.append("d2t")  # vLLM's zeros would map draft id i to target id i: silently wrong tokens
        if missing:
            raise ValueError(f"SlimSpec checkpoint lacks {', '.join(missing)}: refusing to run an "
                             "uninitialised low-rank or screen head or draft vocabulary")


class SlimSpecEagle3LlamaForCausalLM(LowRankHeadMixin, Eagle3LlamaForCausalLM):
    """vLLM's Llama EAGLE-3 drafter with SlimSpec's low-rank head."""


class SlimSpecEagle3Qwen3ForCausalLM(LowRankHeadMixin, Eagle3Qwen3ForCausalLM):
    """vLLM's Qwen3 EAGLE-3 drafter with SlimSpec's low-rank head."""
