"""Published EAGLE-3 drafters and the target each one was trained for.

Many published drafters do not name their target in their config (SafeAILab's, SpecForge's and AngelSlim's rarely
do). This table is a convenience for those: when a drafter's config names no target, a conversion (and eval,
distill) takes the target listed here and says so in one line. ``--target`` (``target=`` in the API) always
overrides it, and a drafter's own config, when it names a target, wins over the table too.

The table also answers "did you mean": a Hub id that is not found is compared with its keys, so a model card's
misspelt id (``yuhuili/EAGLE3-LLaMA3.1-8B``) points at the repository that exists.

Keys are Hub ids as their publishers spell them; lookups ignore case. This module imports nothing from slimspec:
``hub`` uses it for its error messages.
"""

from __future__ import annotations

import difflib
import re

KNOWN_TARGETS: dict[str, str] = {
    # SafeAILab / EAGLE (the EAGLE-3 authors)
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B": "meta-llama/Llama-3.3-70B-Instruct",
    "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "yuhuili/EAGLE3-Vicuna1.3-13B": "lmsys/vicuna-13b-v1.3",
    # SpecForge / SGLang
    "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge": "meta-llama/Llama-3.1-8B-Instruct",
    "lmsys/SGLang-EAGLE3-Llama-3.3-70B-Instruct-SpecForge": "meta-llama/Llama-3.3-70B-Instruct",
    "lmsys/SGLang-EAGLE3-Llama-4-Scout-17B-16E-Instruct-SpecForge": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "lmsys/sglang-EAGLE3-Llama-4-Scout-17B-16E-Instruct-v1": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "lmsys/sglang-EAGLE3-Llama-4-Maverick-17B-128E-Instruct-v1": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "lmsys/SGLang-EAGLE3-Qwen3-30B-A3B-Instruct-2507-SpecForge-Nex": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "lmsys/SGLang-EAGLE3-Qwen3-235B-A22B-Instruct-2507-SpecForge-Meituan": "Qwen/Qwen3-235B-A22B-Instruct-2507",
    "lmsys/SGLang-EAGLE3-Qwen3-Coder-30B-A3B-Instruct-SpecForge": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
    "lmsys/SGLang-EAGLE3-Qwen3-Coder-480B-A35B-Instruct-SpecForge-EigenAI": "Qwen/Qwen3-Coder-480B-A35B-Instruct",
    "lmsys/Qwen3-235B-A22B-EAGLE3": "Qwen/Qwen3-235B-A22B",
    "lmsys/EAGLE3-gpt-oss-120b-bf16": "openai/gpt-oss-120b",
    "zhuyksir/EAGLE3-gpt-oss-20b-bf16": "openai/gpt-oss-20b",
    "Tengyunw/qwen3_8b_eagle3": "Qwen/Qwen3-8B",
    "Tengyunw/qwen3_30b_moe_eagle3": "Qwen/Qwen3-30B-A3B",
    "Zjcxy-SmartAI/Eagle3-Qwen3-8B-zh": "Qwen/Qwen3-8B",
    "Zjcxy-SmartAI/Eagle3-Qwen3-32B-zh": "Qwen/Qwen3-32B",
    "AQ-MedAI/Ling-Flash-2.0-eagle3": "inclusionAI/Ling-flash-2.0",
    "AQ-MedAI/Kimi-K2-Instruct-eagle3": "moonshotai/Kimi-K2-Instruct",
    # AngelSlim (Tencent)
    "AngelSlim/Qwen3-1.7B_eagle3": "Qwen/Qwen3-1.7B",
    "AngelSlim/Qwen3-4B_eagle3": "Qwen/Qwen3-4B",
    "AngelSlim/Qwen3-8B_eagle3": "Qwen/Qwen3-8B",
    "AngelSlim/Qwen3-14B_eagle3": "Qwen/Qwen3-14B",
    "AngelSlim/Qwen3-32B_eagle3": "Qwen/Qwen3-32B",
    "AngelSlim/Qwen3-a3B_eagle3": "Qwen/Qwen3-30B-A3B",
    # vllm-project/speculators (Red Hat); their configs usually name the verifier, which wins over this table
    "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3": "meta-llama/Llama-3.1-8B-Instruct",
    "RedHatAI/Llama-3.3-70B-Instruct-speculator.eagle3": "meta-llama/Llama-3.3-70B-Instruct",
    "RedHatAI/Llama4-Maverick-17B-128E-Instruct-speculator.eagle3": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "RedHatAI/Qwen3-8B-speculator.eagle3": "Qwen/Qwen3-8B",
    "RedHatAI/Qwen3-14B-speculator.eagle3": "Qwen/Qwen3-14B",
    "RedHatAI/Qwen3-32B-speculator.eagle3": "Qwen/Qwen3-32B",
    "RedHatAI/Qwen3-30B-A3B-speculator.eagle3": "Qwen/Qwen3-30B-A3B",
    "RedHatAI/Qwen3-30B-A3B-Instruct-2507-speculator.eagle3": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "RedHatAI/Qwen3-30B-A3B-Thinking-2507-speculator.eagle3": "Qwen/Qwen3-30B-A3B-Thinking-2507",
    "RedHatAI/Qwen3-235B-A22B-speculator.eagle3": "Qwen/Qwen3-235B-A22B",
    "RedHatAI/Qwen3-235B-A22B-Instruct-2507-speculator.eagle3": "Qwen/Qwen3-235B-A22B-Instruct-2507",
    "RedHatAI/gpt-oss-20b-speculator.eagle3": "openai/gpt-oss-20b",
    "RedHatAI/gpt-oss-120b-speculator.eagle3": "openai/gpt-oss-120b",
    # NVIDIA Model Optimizer
    "nvidia/Llama-3.3-70B-Instruct-Eagle3": "meta-llama/Llama-3.3-70B-Instruct",
    "nvidia/Llama-4-Maverick-17B-128E-Eagle3": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "nvidia/Qwen3-235B-A22B-Eagle3": "Qwen/Qwen3-235B-A22B",
    "nvidia/gpt-oss-120b-Eagle3": "openai/gpt-oss-120b",
    "nvidia/gpt-oss-120b-Eagle3-v2": "openai/gpt-oss-120b",
    "nvidia/gpt-oss-120b-Eagle3-v3": "openai/gpt-oss-120b",
    "nvidia/gpt-oss-120b-Eagle3-long-context": "openai/gpt-oss-120b",
}
"""Published drafter (Hub id) -> the target it was trained for (Hub id)."""

_BY_LOWER = {drafter.lower(): drafter for drafter in KNOWN_TARGETS}


def known_target(drafter_id: str) -> str | None:
    """The target the table lists for a drafter's Hub id (case ignored), or None for a drafter it does not hold."""
    drafter = _BY_LOWER.get(str(drafter_id).strip().lower())
    return KNOWN_TARGETS[drafter] if drafter is not None else None


def close_matches(drafter_id: str, n: int = 3, cutoff: float = 0.75) -> list[str]:
    """Drafters of the table whose Hub id is close to ``drafter_id`` (case ignored), closest first, as their
    publishers spell them; never ``drafter_id`` itself.

    A match must carry every number ``drafter_id`` carries (sizes, versions): ``Llama-3.1-8B`` is close to
    ``Llama-3.3-70B`` as text, but it is another target."""
    wanted = str(drafter_id).strip().lower()
    numbers = set(re.findall(r"\d+", wanted))
    pool = [name for name in _BY_LOWER if name != wanted and numbers <= set(re.findall(r"\d+", name))]
    return [_BY_LOWER[name] for name in difflib.get_close_matches(wanted, pool, n=n, cutoff=cutoff)]
