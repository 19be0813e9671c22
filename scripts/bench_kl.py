"""Full-vocabulary KL, forward + backward: chunked ``full_vocab_kl`` vs the naive materialised computation.

``bench_kl()`` returns markdown lines (for scripts/bench.py); ``python scripts/bench_kl.py`` prints them. Each
measurement runs in a fresh subprocess; peak memory is the peak RSS of the measured step minus the RSS after the
inputs were created. If the naive run does not fit in memory, both runs are repeated at half the tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB, RANK, DIM, TEACHER_DIM, TOKENS = 128256, 512, 4096, 4096, 4096


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """fp32 inputs with unit-scale (normed) hidden states and logits of standard deviation 3.

    Built in place, so creating them leaves no transient peak.
    """
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, DIM, generator=g)
    w_down = torch.randn(RANK, DIM, generator=g).mul_(DIM**-0.5)
    w_up = torch.randn(VOCAB, RANK, generator=g).mul_(3 * RANK**-0.5)
    th = torch.randn(tokens, TEACHER_DIM, generator=g)
    head = torch.randn(VOCAB, TEACHER_DIM, generator=g).mul_(3 * TEACHER_DIM**-0.5)
    return h.requires_grad_(), w_down.requires_grad_(), w_up.requires_grad_(), th, head


def child(kind: str, tokens: int) -> dict:
    """One forward + backward of ``kind`` ('naive' or 'chunked'): seconds, peak MiB above the inputs, checks."""
    from slimspec.distill.loss import DEFAULT_CHUNK_SIZE, _pick_token_chunk, full_vocab_kl, naive_full_vocab_kl

    small = (torch.randn(8, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True),
             torch.randn(300, 16, requires_grad=True), torch.randn(8, 64), torch.randn(300, 64))
    (full_vocab_kl(*small, chunk_size=128) + naive_full_vocab_kl(*small)).backward()  # load kernels; not measured
    inputs = _inputs(tokens)
    resettable = _reset_peak_rss()
    base_kib = _status_kib("VmRSS")
    start = time.perf_counter()
    if kind == "naive":
        loss = naive_full_vocab_kl(*inputs)
    else:
        loss = full_vocab_kl(*inputs)
    loss.backward()
    seconds = time.perf_counter() - start
    peak_kib = _status_kib("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    h, w_down, w_up = inputs[:3]
    return {"seconds": seconds, "peak_mib": (peak_kib - base_kib) / 1024, "loss": float(loss),
            "grad_norms": [float(t.grad.norm()) for t in (h, w_down, w_up)], "peak_exact": resettable,
            "chunk": DEFAULT_CHUNK_SIZE, "token_chunk": _pick_token_chunk(tokens, VOCAB, torch.float32)}


def run_child(kind: str, tokens: int) -> dict | None:
    """Run ``child`` in a fresh interpreter; None if it died (e.g. out of memory)."""
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(tokens)], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode != 0:
        print(f"[bench_kl] {kind} at T={tokens} failed (rc {out.returncode}): {out.stderr[-500:]}",
              file=sys.stderr, flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(tokens: int, repeats: int) -> tuple[dict[str, list[dict]], str | None]:
    """Both versions ``repeats`` times, alternating which goes first; stops at the first failed run (its kind)."""
    runs: dict[str, list[dict]] = {"naive": [], "chunked": []}
    for i in range(repeats):
        for kind in ("naive", "chunked") if i % 2 == 0 else ("chunked", "naive"):
            print(f"[bench_kl] {kind} T={tokens} run {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
            result = run_child(kind, tokens)
            if result is None:
                return runs, kind
            runs[kind].append(result)
    return runs, None


def _summary(results: list[dict]) -> dict:
    """First run's fields, with the best time and the largest peak memory over all runs."""
    return results[0] | {"seconds": min(r["seconds"] for r in results),
                         "peak_mib": max(r["peak_mib"] for r in results)}


def bench_kl(tokens: int = TOKENS, repeats: int = 2) -> list[str]:
    """Measure both versions in fresh subprocesses; markdown lines. Time: best of ``repeats``; memory: largest."""
    note = ""
    runs, failed = _measure(tokens, repeats)
    while failed == "naive" and tokens > 256:
        note = f"The naive computation did not fit at T={tokens}; T halved for both. "
        tokens //= 2
        runs, failed = _measure(tokens, repeats)
    if failed:
        return ["## Full-vocabulary KL distillation loss", "", f"The {failed} run failed at T={tokens}: see stderr.",
                ""]
    naive, chunked = _summary(runs["naive"]), _summary(runs["chunked"])
    loss_diff = abs(chunked["loss"] - naive["loss"]) / abs(naive["loss"])
    grad_diff = max(abs(a - b) / b for a, b in zip(chunked["grad_norms"], naive["grad_norms"], strict=True))
    time_ratio = chunked["seconds"] / naive["seconds"]
    mem_ratio = chunked["peak_mib"] / naive["peak_mib"]
    return [
        "## Full-vocabulary KL distillation loss (forward + backward)",
        "",
        f"KL(target || drafter) over the full vocabulary, V={VOCAB}, r={RANK}, d={DIM}, target hidden {TEACHER_DIM}, "
        f"T={tokens} tokens, fp32, gradients for h, W_down and W_up. {note}Fresh subprocess per run, "
        f"best time of {repeats}; peak memory = peak RSS during the step minus RSS after creating the inputs "
        f"(teacher head {VOCAB * TEACHER_DIM * 4 / 2**20:.0f} MiB).",
        "",
        "| case | time (s) | peak memory (MiB) |",
        "|---|---|---|",
        f"| naive (materialised [T, V] logits, plain autograd) | {naive['seconds']:.1f} | {naive['peak_mib']:.0f} |",
        f"| `full_vocab_kl` (vocab chunk {chunked['chunk']}, token chunk {chunked['token_chunk']}) | "
        f"{chunked['seconds']:.1f} | {chunked['peak_mib']:.0f} |",
        f"| ratio chunked / naive (goal time <= 1, memory <= 0.125) | {time_ratio:.2f} | {mem_ratio:.3f} |",
        "",
        f"Agreement: loss {chunked['loss']:.6f} vs {naive['loss']:.6f} (relative difference {loss_diff:.1e}); "
        f"gradient norms of h, W_down, W_up within {grad_diff:.1e} (relative).",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        kind, tokens = args.child
        print(json.dumps(child(kind, int(tokens))))
        return 0
    print("\n".join(bench_kl(args.tokens, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
