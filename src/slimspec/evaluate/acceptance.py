"""`slimspec eval`: acceptance length tau of a drafter on eval prompts, optionally beside a baseline."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.target_model import (
    aux_layers_for,
    chat_ids,
    load_target_model,
    load_target_parts,
    stop_token_ids,
    target_of,
)
from slimspec.errors import OptionError, SlimSpecError
from slimspec.evaluate.spec_decode import NO_ROUND, DecodeStats, SpeculativeDecoder
from slimspec.evaluate.vllm_engine import check_command, evaluate_vllm, vllm_python
from slimspec.hardware import resolve_device
from slimspec.hub import resolve_model
from slimspec.model import drafter_model
from slimspec.prompts import eval_prompts


def _stats_dict(stats: DecodeStats, num_prompts: int) -> dict[str, Any]:
    if stats.rounds == 0:  # tau NaN and no per-position rates: a table would crash, --json would print NaN
        raise SlimSpecError(NO_ROUND)
    return {"tau": stats.tau, "acceptance_per_position": stats.acceptance_per_position,
            "tokens_per_second": stats.tokens_per_second, "num_prompts": num_prompts, "rounds": stats.rounds,
            "new_tokens": stats.new_tokens, "seconds": stats.seconds}


def load_for_eval(drafter: str, target: str | None):
    """(drafter model, aux layers, target parts) for a drafter id/folder."""
    ckpt = load_drafter(resolve_model(drafter, "drafter"))
    revision = ckpt.target_revision_for(target)  # also when the recorded target is named explicitly
    target = target or target_of(drafter, ckpt)
    parts = load_target_parts(target, revision)
    layers = aux_layers_for(ckpt.config.aux_layer_ids, ckpt.layout, parts.num_layers, ckpt.aux_convention)
    return drafter_model(ckpt, parts), layers, parts, target


def evaluate(
    drafter: str,
    target: str | None = None,
    *,
    dataset: str = "mt_bench",
    num_prompts: int | None = 8,
    max_new_tokens: int = 128,
    draft_tokens: int = 4,
    temperature: float = 0.0,
    seed: int = 0,
    baseline: str | None = None,
    engine: str = "reference",
    progress: bool = True,
    device: str | None = None,
) -> dict[str, Any]:
    """tau, per-position acceptance and tokens/s of ``drafter`` (and ``baseline``, with rho_tau) on eval prompts.

    ``engine="vllm"``: the top-level numbers come from a real vLLM engine (``.venv-vllm``, SlimSpec plugin),
    with the reference decoder's beside them under ``"reference"`` (same keys).
    ``device``: where the reference decoder runs the target and the drafters (see
    :func:`slimspec.hardware.resolve_device`; auto: a CUDA GPU when there is one).
    """
    if engine == "vllm":
        return _evaluate_both(drafter, target, dataset=dataset, num_prompts=num_prompts,
                              max_new_tokens=max_new_tokens, draft_tokens=draft_tokens, temperature=temperature,
                              seed=seed, baseline=baseline, progress=progress, device=device)
    if engine != "reference":
        raise OptionError(f"{{engine}} must be 'reference' or 'vllm', got {engine!r}", "engine")

    where = resolve_device(device)  # an unusable device is an error before any model loads
    prompts = eval_prompts(dataset, num_prompts)
    results, outputs, target, target_path = _decode_runs(drafter, target, baseline, prompts, where,
                                                         max_new_tokens=max_new_tokens, draft_tokens=draft_tokens,
                                                         temperature=temperature, seed=seed, progress=progress)
    if where.type == "cuda":  # the models are gone now: hand their memory back (a vLLM engine may start next)

        gc.collect()
        torch.cuda.empty_cache()
    report = {**results["drafter"], "drafter": drafter, "target": target, "target_path": target_path,
              "dataset": dataset, "device": str(where),
              "draft_tokens": draft_tokens, "temperature": temperature, "max_new_tokens": max_new_tokens}
    if baseline is not None:
        report["baseline"] = {**results["baseline"], "drafter": baseline}
        report["rho_tau"] = results["drafter"]["tau"] / results["baseline"]["tau"]
        if temperature <= 0:
            report["outputs_identical_to_baseline"] = outputs["drafter"] == outputs["baseline"]
    return report


def _decode_runs(drafter: str, target: str | None, baseline: str | None, prompts: list[str], where: torch.device, *,
                 max_new_tokens: int, draft_tokens: int, temperature: float, seed: int, progress: bool
                 ) -> tuple[dict[str, Any], dict[str, list[list[int]]], str, str]:
    """Reference decodes of ``prompts`` by ``drafter`` (and ``baseline``) on ``where``: (stats per run, outputs per
    run, the target's name, its folder). The models live only inside this call."""
    model, layers, parts, target = load_for_eval(drafter, target)
    target_model, tokenizer = load_target_model(parts.path, device=where)
    runs = [("drafter", model.to(where), layers)]
    if baseline is not None:
        base_model, base_layers, _, _ = load_for_eval(baseline, target)
        runs.append(("baseline", base_model.to(where), base_layers))
    results: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, draft_model, aux in runs:
        decoder = SpeculativeDecoder(target_model, draft_model, aux, draft_tokens=draft_tokens,
                                     temperature=temperature, eos_token_id=stop_token_ids(target_model, tokenizer),
                                     seed=seed)
        stats = DecodeStats(accepted_per_position=[0] * draft_tokens)
        outputs[name] = []
        for prompt in tqdm(prompts, desc=f"[slimspec] eval {name}", disable=not progress, leave=False):
            ids, _ = chat_ids(tokenizer, prompt)
            out, s = decoder.generate(ids, max_new_tokens)
            outputs[name].append(out)
            stats.add(s)
        results[name] = {**_stats_dict(stats, len(prompts)),
                         "drafting": "parallel" if draft_model.is_parallel else "chain"}
    return results, outputs, target, str(parts.path)


def record_tau(folder: str | Path, report: dict[str, Any]) -> None:
    """Keep an :func:`evaluate` report's tau (and rho_tau, with a baseline) in ``folder``'s slimspec.json, with the
    settings it was measured at (`slimspec bench --kappa` and the card of `slimspec push` read them)."""
    path = Path(folder) / "slimspec.json"
    saved = json.loads(path.read_text())
    saved["tau"] = report["tau"]
    if "rho_tau" in report:
        saved.update(rho_tau=report["rho_tau"], tau_source=report["baseline"]["tau"])
    else:  # an older ratio was measured at other settings: it must not sit beside this tau
        saved.pop("rho_tau", None)
        saved.pop("tau_source", None)
    saved["tau_settings"] = {"dataset": report["dataset"], "num_prompts": report["num_prompts"],
                             "draft_tokens": report["draft_tokens"], "temperature": report["temperature"],
                             "max_new_tokens": report["max_new_tokens"], "engine": "reference"}
    path.write_text(json.dumps(saved, indent=2) + "\n")


@torch.no_grad()
def target_greedy(target_model, prompt_ids: list[int], max_new_tokens: int, eos: int | list[int] | None
                  ) -> list[int]:
    """The target's own greedy continuation (the losslessness reference)."""
    out = target_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt_ids):].tolist()


def _evaluate_both(drafter: str, target: str | None, *, dataset: str, num_prompts: int | None, max_new_tokens: int,
                   draft_tokens: int, temperature: float, seed: int, baseline: str | None,
                   progress: bool, device: str | None) -> dict[str, Any]:
    check_command(vllm_python())  # a missing vLLM fails now, not after the whole reference decode
    reference = evaluate(drafter, target, dataset=dataset, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                         draft_tokens=draft_tokens, temperature=temperature, seed=seed, baseline=baseline,
                         progress=progress, device=device)
    target_path = resolve_model(reference["target_path"], "model")  # the revision the reference engine ran
    prompts = eval_prompts(dataset, num_prompts)

    def measure(name: str) -> dict[str, Any]:
        return evaluate_vllm(resolve_model(name, "drafter"), target_path, prompts=prompts,
                             max_new_tokens=max_new_tokens, draft_tokens=draft_tokens, temperature=temperature,
                             seed=seed)

    report = {**reference, **measure(drafter), "engine": "vllm",
              "reference": {k: reference[k] for k in ("tau", "acceptance_per_position", "tokens_per_second",
                                                      "num_prompts")}}
    if baseline is not None:
        report["baseline"] = {**measure(baseline), "drafter": baseline, "drafting": reference["baseline"]["drafting"],
                              "reference": reference["baseline"]}
        report["rho_tau"] = report["tau"] / report["baseline"]["tau"]
        report["reference"]["rho_tau"] = reference["rho_tau"]
    return report
