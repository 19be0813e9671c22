"""Head latency ratio nu, the FLOP floor, kappa, and the paper's end-to-end model rho_TPS.

rho_TPS = rho_tau * (1 + kappa) / (1 + nu * kappa), with kappa = draft-head time / rest of a draft+verify
cycle and nu = low-rank head time / full head time (SlimSpec, arXiv 2605.10453).

Timings run on a ``device`` (default the CPU): on a CUDA GPU each timed batch ends with a synchronisation, so the
clock reads the kernels' time, not their launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from slimspec.kernels.screen import screen_rescore, screen_share


def flop_floor(vocab: int, hidden: int, rank: int, source_vocab: int | None = None) -> float:
    """(r*d + V*r) / (V_src*d): the FLOP ratio of the low-rank head to the full one."""
    return (rank * hidden + vocab * rank) / ((source_vocab or vocab) * hidden)


def predicted_speedup(rho_tau: float, nu: float, kappa: float) -> float:
    """The paper's end-to-end throughput ratio."""
    return rho_tau * (1 + kappa) / (1 + nu * kappa)


def synchronizer(device: torch.device | str | None) -> Callable[[], None]:
    """What waits for ``device``'s queued work: ``torch.cuda.synchronize`` on a CUDA GPU, nothing on the CPU."""
    if device is not None and torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def best_time(fn: Callable[[], Any], *, repeats: int = 20, warmup: int = 3, min_seconds: float = 0.2,
              sync: Callable[[], None] | None = None) -> float:
    """Median seconds per call over ``repeats`` timed batches of equal calls, sized so that all batches together
    take about ``min_seconds`` (a batch of short GPU kernels then lasts min_seconds / repeats). ``sync`` (see
    :func:`synchronizer`) runs before each clock start and before each clock stop."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(min_seconds / once / max(repeats, 1)) + 1)
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    samples.sort()
    return samples[len(samples) // 2]


@torch.no_grad()
def head_latency(vocab: int, hidden: int, rank: int, *, batch: int = 1, dtype: torch.dtype = torch.float32,
                 source_vocab: int | None = None, repeats: int = 15, seed: int = 0,
                 device: torch.device | str = "cpu") -> dict[str, float]:
    """Greedy head step (logits + argmax), full ``[V_src, d]`` vs low-rank ``[V, r] @ [r, d]``, side by side."""
    g = torch.Generator().manual_seed(seed)
    src = source_vocab or vocab
    w = torch.randn(src, hidden, generator=g).to(device=device, dtype=dtype)
    up = torch.randn(vocab, rank, generator=g).to(device=device, dtype=dtype)
    down = torch.randn(rank, hidden, generator=g).to(device=device, dtype=dtype)
    h = torch.randn(batch, hidden, generator=g).to(device=device, dtype=dtype)
    sync = synchronizer(device)
    full = best_time(lambda: torch.argmax(h @ w.T, dim=-1), repeats=repeats, sync=sync)
    low = best_time(lambda: torch.argmax((h @ down.T) @ up.T, dim=-1), repeats=repeats, sync=sync)
    return {"full_s": full, "lowrank_s": low, "nu": low / full, "flop_floor": flop_floor(vocab, hidden, rank, src),
            "vocab": vocab, "source_vocab": src, "hidden": hidden, "rank": rank, "batch": batch,
            "dtype": str(dtype).removeprefix("torch."), "device": str(torch.device(device))}


@torch.no_grad()
def full_head_seconds(rows: int, hidden: int, *, batch: int = 1, dtype: torch.dtype = torch.float32,
                      repeats: int = 15, seed: int = 0, device: torch.device | str = "cpu") -> float:
    """Greedy step (logits + argmax) of a full ``[rows, hidden]`` head."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    h = torch.randn(batch, hidden, generator=g).to(device=device, dtype=dtype)
    return best_time(lambda: torch.argmax(h @ w.T, dim=-1), repeats=repeats, sync=synchronizer(device))


@torch.no_grad()
def measure_kappa(target, drafter, *, full_head_rows: int | None = None, draft_tokens: int = 4, context: int = 256,
                  repeats: int = 10) -> dict[str, float]:
    """kappa for one greedy draft+verify cycle: K **full**-head steps over K drafter-layer steps + one target verify.

    kappa is the original head's share (the paper's model, :func:`predicted_speedup`, applies nu to it), so a
    SlimSpec drafter's head is timed as the full ``[full_head_rows, d]`` head it replaced (default: its own head's
    rows); its low-rank head's step is reported beside it (``lowrank_head_s``). The pieces are timed separately at
    a context of ``context`` tokens, batch 1, on the device the drafter and the target share.
    """
    from transformers import DynamicCache

    hidden = drafter.config.hidden_size
    device = drafter.fc.weight.device
    sync = synchronizer(device)
    ids = torch.randint(0, int(target.config.vocab_size), (1, context), device=device)
    cache = DynamicCache(config=target.config)
    target(input_ids=ids, past_key_values=cache, use_cache=True)
    verify_ids = torch.randint(0, int(target.config.vocab_size), (1, draft_tokens + 1), device=device)

    def verify() -> None:
        target(input_ids=verify_ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        cache.crop(-(draft_tokens + 1))

    dtype = drafter.fc.weight.dtype
    # a multi-layer drafter's cache stacks its layers' kv heads on dim 1
    kv_shape = (1, drafter.config.num_key_value_heads * drafter.config.num_layers, context, drafter.config.head_dim)
    h = torch.randn(1, 1, hidden, dtype=dtype, device=device)
    k_cache = (torch.randn(kv_shape, dtype=dtype, device=device), torch.randn(kv_shape, dtype=dtype, device=device))
    token = torch.tensor([[1]], device=device)
    pos = torch.tensor([[context]], device=device)
    layer = best_time(lambda: drafter(input_ids=token, hidden=h, positions=pos, past_key_values=k_cache),
                      repeats=repeats, sync=sync)
    rows = full_head_rows or int(drafter.lm_head.weight_up.shape[0])
    full = torch.randn(rows, hidden, dtype=dtype, device=device)
    head = best_time(lambda: F.linear(drafter.norm(h), full).argmax(-1), repeats=repeats, sync=sync)
    target_s = best_time(verify, repeats=repeats, sync=sync)
    rest = draft_tokens * layer + target_s
    result = {"kappa": draft_tokens * head / rest, "head_s": head, "head_rows": rows, "drafter_layer_s": layer,
              "target_verify_s": target_s, "draft_tokens": draft_tokens, "context": context, "device": str(device),
              "dtype": str(dtype).removeprefix("torch.")}
    if drafter.lm_head.rank is not None:
        result["lowrank_head_s"] = best_time(lambda: drafter.logits(h).argmax(-1), repeats=repeats, sync=sync)
    return result


def side_by_side(fns: dict[str, Callable[[], Any]], *, rounds: int = 9, warmup: int = 2, sample_seconds: float = 0.05,
                 sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """Seconds per call of each fn and its time as a share of the first fn's, timed in interleaved rounds (each
    round times every fn once, in a rotating order), both as medians over the rounds: on a shared machine the
    ratios of one round see the same load. ``clock``: wall time by default; ``time.thread_time`` (the calling
    thread's CPU time) ignores the time other jobs hold the core, for single-threaded CPU work (:func:`cpu_clock`)."""
    sync = sync or (lambda: None)
    inner = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        sync()
        start = clock()
        fn()
        sync()
        inner[name] = max(1, int(sample_seconds / max(clock() - start, 1e-7)))
    names = list(fns)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = clock()
            for _ in range(inner[name]):
                fns[name]()
            sync()
            seconds[name].append((clock() - start) / inner[name])
    first = seconds[names[0]]
    return {name: {"s": _median(times), "share": _median([t / f for t, f in zip(times, first, strict=True)])}
            for name, times in seconds.items()}


def cpu_clock(device: torch.device | str) -> Callable[[], float] | None:
    """``time.thread_time`` where it measures the work: the CPU with torch on one thread (``OMP_NUM_THREADS=1`` or
    ``torch.set_num_threads(1)``); None (wall time) elsewhere."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return None


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@torch.no_grad()
def screen_head_latency(vocab: int, hidden: int, rank: int, shortlist: int, *, hot_rows: int = 0,
                        trim_rows: int | None = None, batch: int = 1, dtype: torch.dtype = torch.float32,
                        rounds: int = 9, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Greedy head steps timed side by side: the full ``[V, d]`` head (logits + argmax), the plain pair, the screen
    and rescore (``slimspec.kernels.screen_rescore``: its Triton path on a GPU, the fast torch path on the CPU;
    the exact rows are the full head's, as in a converted drafter) and a trimmed head of ``trim_rows`` rows
    (default: the screen's multiply-add share of V). Each time is also given as nu, a share of the full head's."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g).to(device=device, dtype=dtype)
    up = torch.randn(vocab, rank, generator=g).to(device=device, dtype=dtype)
    down = torch.randn(rank, hidden, generator=g).to(device=device, dtype=dtype)
    h = torch.randn(batch, hidden, generator=g).to(device=device, dtype=dtype)
    hot = torch.arange(hot_rows, device=device) if hot_rows else None
    share = screen_share(vocab, hidden, rank, shortlist, hot_rows)
    trim_rows = min(vocab, trim_rows or max(1, round(share * vocab)))
    trimmed = w[:trim_rows]
    timed = side_by_side({
        "full": lambda: torch.argmax(h @ w.T, dim=-1),
        "lowrank": lambda: torch.argmax((h @ down.T) @ up.T, dim=-1),
        "screen": lambda: screen_rescore(h, down, up, w, shortlist, hot),
        "trim": lambda: torch.argmax(h @ trimmed.T, dim=-1),
    }, rounds=rounds, sync=synchronizer(device), clock=cpu_clock(device) or time.perf_counter)
    return {"full_s": timed["full"]["s"], "lowrank_s": timed["lowrank"]["s"], "nu": timed["lowrank"]["share"],
            "flop_floor": flop_floor(vocab, hidden, rank), "screen_s": timed["screen"]["s"],
            "screen_nu": timed["screen"]["share"], "screen_share": share, "trim_s": timed["trim"]["s"],
            "trim_nu": timed["trim"]["share"], "trim_rows": trim_rows, "trim_share": trim_rows / vocab,
            "shortlist": shortlist, "hot_rows": hot_rows, "vocab": vocab, "source_vocab": vocab, "hidden": hidden,
            "rank": rank, "batch": batch, "dtype": str(dtype).removeprefix("torch."),
            "device": str(torch.device(device)), "threads": torch.get_num_threads(),
            "clock": "thread cpu" if cpu_clock(device) else "wall"}
