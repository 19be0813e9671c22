"""Low-rank head kernels on a CUDA GPU (written for an H200): check, then time against the full head.

    python scripts/gpu_bench.py                 # V=128256, d=4096, r=512, bf16, B in {1, 16, 64}
    python scripts/gpu_bench.py --no-sweep      # default tiles only (faster)
    python scripts/gpu_bench.py --out gpu.md    # also write the report to a file

1. Checks (each B): ``lowrank_logits`` against float64 (bf16 output: within one output rounding; float32
   output: within 1e-4 relative), ``lowrank_argmax`` == float64 argmax except exact near-ties, top-8 indices,
   and the GPU-only checks the CPU interpreter cannot make: tie-breaking of the compiled kernels (a winning
   w_up row copied to lower indices -> lowest index) and NaN (first NaN index).
2. Times (``triton.testing.do_bench``, median, L2 flushed between reps): full head ``argmax(h @ W.T)`` with
   W [V, d]; low-rank torch ``argmax((h @ W_down.T) @ W_up.T)``; fused Triton ``lowrank_argmax``; the same
   three under CUDA graphs (``do_bench_cudagraph``: no launch overhead, as vLLM runs the drafter). A small tile
   sweep shows whether another ``TileConfig`` beats the default. nu = low-rank time / full-head time;
   goal nu <= 0.16 at B = 1 (bandwidth floor (Vr + rd) / Vd = 0.129).

3. The screen-and-rescore head (``--shortlist K``, default 256; ``--hot-rows N``, default 0; ``--screen-rank``,
   default 256): ``screen_rescore`` (Triton: the low-rank logits kernel, ``torch.topk``, the gathered rescoring
   kernel) checked against a float64 reference (tokens, two-level logits, ties to the lower id in compiled code)
   and timed beside the full head, the pair and its torch path; nu beside the multiply-add share
   (r(V+d) + (K+N)d) / (Vd). ``--shortlist 0`` skips it.

``--cpu-smoke`` runs the same code at tiny shapes on the CPU under ``TRITON_INTERPRET=1`` with a wall-clock
timer (to test this script without a GPU; its times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

Timer = Callable[[Callable[[], object]], float]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64", help="comma-separated B values (default 1,16,64)")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--shortlist", type=int, default=256, help="screen-and-rescore K (0: skip the screen)")
    parser.add_argument("--hot-rows", type=int, default=0, help="screen-and-rescore N hot rows")
    parser.add_argument("--screen-rank", type=int, default=256, help="the screen's pair rank")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    return parser.parse_args()


ARGS = _parse()
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    ARGS.vocab, ARGS.hidden, ARGS.rank, ARGS.batches = 1000, 64, 24, "1,3,20"
    ARGS.screen_rank, ARGS.shortlist, ARGS.hot_rows = 12, min(ARGS.shortlist, 40), min(ARGS.hot_rows, 5)
else:
    os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels would be timed otherwise
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its current default

import torch  # noqa: E402

if not ARGS.cpu_smoke and not torch.cuda.is_available():
    sys.exit("gpu_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.")
try:
    import triton  # noqa: E402
    import triton.testing  # noqa: E402
except ImportError:
    sys.exit("gpu_bench.py needs triton (pip install triton==3.9.0); nothing was measured.")

from slimspec import kernels  # noqa: E402
from slimspec.kernels import reference, screen  # noqa: E402
from slimspec.kernels import triton_lowrank as tlr  # noqa: E402

DEVICE = torch.device("cpu" if ARGS.cpu_smoke else "cuda")
DTYPE = torch.bfloat16
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    """Record and print one check."""
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def make_inputs(batch: int, vocab: int, hidden: int, rank: int, seed: int = 0):
    """h [B, d], w_down [r, d], w_up [V, r] in bf16 with O(1) logits."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(batch, hidden, generator=g, device=DEVICE).to(DTYPE)
    w_down = (torch.randn(rank, hidden, generator=g, device=DEVICE) / hidden**0.5).to(DTYPE)
    w_up = (torch.randn(vocab, rank, generator=g, device=DEVICE) / rank**0.5).to(DTYPE)
    return h, w_down, w_up


def exact_logits(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return (h.double() @ w_down.double().T) @ w_up.double().T


def run_checks(batch: int, h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> None:
    """Correctness at full size, then tie/NaN behaviour of the compiled kernels."""
    print(f"B = {batch}: checks", flush=True)
    assert kernels.active_backend(h) == "triton", "dispatcher did not pick Triton"
    exact = exact_logits(h, w_down, w_up)
    scale = exact.abs().max().item()

    logits = kernels.lowrank_logits(h, w_down, w_up)
    err = (logits.double() - exact).abs()
    # one bf16 rounding of the output (2^-8 relative); the CPU interpreter truncates instead (2^-7)
    bound = exact.abs() * (2.0**-7 if ARGS.cpu_smoke else 2.0**-8) + 1e-4 * scale
    check(bool((err <= bound).all()) and logits.dtype == DTYPE,
          f"lowrank_logits bf16 within one bf16 rounding of float64 (max err {err.max().item():.3g})")
    logits32 = tlr.lowrank_logits(h, w_down, w_up, out_dtype=torch.float32)
    rel = (logits32.double() - exact).abs().max().item() / scale
    check(rel <= 1e-4, f"float32 logits within 1e-4 of float64 (max rel err {rel:.2e})")
    ref32 = reference.lowrank_logits_fp32(h, w_down, w_up)
    rel_torch = (ref32.double() - exact).abs().max().item() / scale
    print(f"        (torch float32 reference: max rel err {rel_torch:.2e})")

    argmax = kernels.lowrank_argmax(h, w_down, w_up)
    expected = exact.argmax(-1)
    rows = torch.arange(batch, device=DEVICE)
    gap = exact[rows, expected] - exact[rows, argmax]  # >= 0; 0 where equal
    near = gap <= 1e-5 * scale
    check(argmax.dtype == torch.int64 and bool(near.all()),
          f"lowrank_argmax == float64 argmax on {int((argmax == expected).sum())}/{batch} rows, "
          f"the rest near-ties (max logit gap {gap.max().item():.2e})")
    values, indices = kernels.lowrank_topk(h, w_down, w_up, 8)
    top = exact.topk(8, dim=-1)
    same = (indices == top.indices) | ((exact.gather(-1, indices) - top.values).abs() <= 1e-5 * scale)
    check(bool(same.all()), "lowrank_topk(k=8) == float64 top-8 (up to near-ties)")

    # Ties in compiled code: the interpreter always breaks ties to the left, the GPU only if asked to.
    w_tie = w_up.clone()
    winners = argmax.tolist()
    vocab = w_up.shape[0]
    lowest = []
    for j in winners:
        copies = [p for p in {max(j - 1, 0), j // 2, (j * 7) % vocab} if p != j]
        for p in copies:
            w_tie[p] = w_up[j]
        lowest.append(min([j, *copies]))
    exact_tie = exact_logits(h, w_down, w_tie)
    expected_tie = exact_tie.argmax(-1)
    got = kernels.lowrank_argmax(h, w_down, w_tie)
    # Copies of one row give bit-identical logits; rows b whose copies collided with another row's are skipped.
    clean = torch.tensor([exact_tie[b, lowest[b]] == exact_tie[b].max() for b in range(batch)], device=DEVICE)
    check(bool((got[clean] == expected_tie[clean]).all()) and bool(clean.any()),
          f"ties -> lowest index (winning row copied to lower indices, {int(clean.sum())} rows)")
    w_nan = w_up.clone()
    w_nan[vocab - 5] = float("nan")
    w_nan[vocab // 3] = float("nan")
    got = kernels.lowrank_argmax(h, w_down, w_nan)
    check(bool((got == vocab // 3).all()), "NaN logits -> first NaN index, like torch.argmax")


def time_methods(batch: int, fns: dict[str, Callable[[], object]], timer: Timer, graph_timer: Timer | None,
                 no_graph: tuple[str, ...] = ()) -> dict[str, object]:
    """One table row: each method's time in us (``name``) and, when graphs are timed and the method is not in
    ``no_graph``, its time under CUDA graphs (``name_graph``)."""
    row: dict[str, object] = {"B": batch}
    for name, fn in fns.items():
        row[name] = 1e3 * timer(fn)
        if graph_timer is not None and name not in no_graph:
            row[f"{name}_graph"] = 1e3 * graph_timer(fn)
    return row


def bench_rows(batch: int, h, w_down, w_up, w_full, timer: Timer, graph_timer: Timer | None,
               sweep: bool) -> dict[str, object]:
    """Times in microseconds for the three methods (+ CUDA graphs and the tile sweep)."""
    full = lambda: torch.argmax(h @ w_full.T, dim=-1)  # noqa: E731
    lowrank_torch = lambda: torch.argmax((h @ w_down.T) @ w_up.T, dim=-1)  # noqa: E731
    fused = lambda: kernels.lowrank_argmax(h, w_down, w_up)  # noqa: E731
    row = time_methods(batch, {"full": full, "torch": lowrank_torch, "fused": fused}, timer, graph_timer)
    default = tlr.default_config(batch, DTYPE)
    row["default"] = default
    row["best"], row["best_time"] = default, row["fused"]
    if sweep:
        reference_out = fused()
        for cfg in sweep_configs(batch, default):
            out = tlr.lowrank_argmax(h, w_down, w_up, config=cfg)
            if not torch.equal(out, reference_out):
                check(False, f"sweep config {cfg} gives a different argmax")
                continue
            t = 1e3 * timer(lambda cfg=cfg: tlr.lowrank_argmax(h, w_down, w_up, config=cfg))
            print(f"    {t:9.1f} us  {describe(cfg)}", flush=True)
            if t < row["best_time"]:
                row["best"], row["best_time"] = cfg, t
    return row


def sweep_configs(batch: int, default: tlr.TileConfig) -> list[tlr.TileConfig]:
    """A few alternatives around the default (FMA tiles for B <= 4, tl.dot tiles above)."""
    if not default.use_dot:
        shapes = [(128, 64, 4), (64, 64, 4), (64, 128, 4), (32, 128, 4), (128, 128, 8), (256, 64, 8), (64, 64, 2)]
        out = [replace(default, block_v=max(v // default.block_b, 1), block_r=r, num_warps=w) for v, r, w in shapes]
        bb = default.block_b
        out += [replace(default, z_block_r=zr, z_block_d=zd) for zr, zd in [(1, 4096 // bb), (4, 1024 // bb), (4, 256)]]
    else:
        out = [replace(default, split_z=False)]
        out += [replace(default, block_v=v, block_r=r, num_warps=w, num_stages=s)
                for v, r, w, s in [(128, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 3), (256, 64, 8, 3),
                                   (128, 64, 8, 4), (64, 64, 4, 4)]]
        out += [replace(default, z_block_r=zr, z_block_d=zd) for zr, zd in [(16, 64), (16, 256), (32, 128)]]
        if batch > 16:
            out.append(replace(default, block_b=16, num_warps=4))
    return [cfg for cfg in dict.fromkeys(out) if cfg != default]


def describe(cfg: tlr.TileConfig) -> str:
    path = "dot" if cfg.use_dot else "fma"
    split = "" if not cfg.use_dot else (" split_z" if cfg.split_z else " no-split")
    return (f"{path} b{cfg.block_b} v{cfg.block_v} r{cfg.block_r} w{cfg.num_warps} s{cfg.num_stages}{split}"
            f" z(r{cfg.z_block_r} d{cfg.z_block_d})")


def screen_float64(h, w_down, w_up, w_exact, k: int, hot):
    """float64 tokens (exact argmax over the stable top k + hot ids, lower id on ties) and two-level logits."""
    values = (h.double() @ w_down.double().T) @ w_up.double().T
    ids = screen.with_hot(torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k], hot)
    exact = torch.einsum("bkd,bd->bk", w_exact.double()[ids], h.double())
    return screen.shortlist_argmax(exact, ids), values.scatter(1, ids, exact)


def screen_checks_and_times(batch: int, h, w_full, timer: Timer, graph_timer: Timer | None) -> dict[str, object]:
    """The screen's checks at full size (tokens and logits vs float64, compiled ties) and its times in us."""
    k, rank = ARGS.shortlist, ARGS.screen_rank
    vocab, hidden = w_full.shape
    _, w_down, w_up = make_inputs(batch, vocab, hidden, rank, seed=100 + batch)
    hot = torch.arange(ARGS.hot_rows, device=DEVICE) if ARGS.hot_rows else None
    tokens, logits = screen.screen_rescore(h, w_down, w_up, w_full, k, hot)
    tokens64, logits64 = screen_float64(h, w_down, w_up, w_full, k, hot)
    rows = torch.arange(batch, device=DEVICE)
    gap = logits64[rows, tokens64] - logits64[rows, tokens]
    check(bool((gap <= 1e-5 * logits64.abs().max()).all()),
          f"screen_rescore tokens == float64 on {int((tokens == tokens64).sum())}/{batch} rows, the rest near-ties")
    err = (logits.double() - logits64).abs().max().item() / logits64.abs().max().item()
    check(err <= 2.0**-7, f"two-level logits within one bf16 rounding of float64 (max rel err {err:.2e})")
    w_tie = w_full.clone()  # the winning exact row copied to a lower id that is in the shortlist
    low = [int(i) for i in screen.topk_lower_ids(logits.float(), k).min(dim=-1).values]
    for b in range(batch):
        if low[b] < int(tokens[b]):
            w_tie[low[b]] = w_full[tokens[b]]
    tied, _ = screen.screen_rescore(h, w_down, w_up, w_tie, k, hot)
    expected, _ = screen_float64(h, w_down, w_up, w_tie, k, hot)
    check(torch.equal(tied, expected), "screen ties -> the lower token id (compiled gathered kernel)")
    fns = {"full": lambda: torch.argmax(h @ w_full.T, dim=-1),
           "pair": lambda: torch.argmax((h @ w_down.T) @ w_up.T, dim=-1),
           "screen": lambda: screen.screen_rescore(h, w_down, w_up, w_full, k, hot),
           "screen_torch": lambda: screen.screen_rescore_torch(h, w_down, w_up, w_full, k, hot)}
    # not under CUDA graphs: the screen's tie check syncs the host
    return time_methods(batch, fns, timer, graph_timer, no_graph=("screen",))


def screen_report(rows: list[dict[str, object]], vocab: int, hidden: int) -> str:
    k, n, rank = ARGS.shortlist, ARGS.hot_rows, ARGS.screen_rank
    share = screen.screen_share(vocab, hidden, rank, k, n)
    lines = [f"## Screen and rescore, V={vocab} d={hidden} r={rank} K={k} N={n} bf16 ({device_name()})", "",
             f"Times in microseconds (`do_bench` medians). nu = time / full head; multiply-add share {share:.3f} "
             f"(pair alone {rank * (vocab + hidden) / (vocab * hidden):.3f}).", "",
             "| B | full head | pair | screen (Triton) | screen (torch) | nu pair | nu screen | nu screen torch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full = r["full"]
        lines.append(f"| {r['B']} | {full:.1f} | {r['pair']:.1f} | {r['screen']:.1f} | {r['screen_torch']:.1f} | "
                     f"{r['pair'] / full:.3f} | {r['screen'] / full:.3f} | {r['screen_torch'] / full:.3f} |")
    return "\n".join(lines)


def report(rows: list[dict[str, object]], vocab: int, hidden: int, rank: int, graphs: bool) -> str:
    floor = (vocab * rank + rank * hidden) / (vocab * hidden)
    bytes_lowrank = 2 * (vocab * rank + rank * hidden)
    lines = [f"## Low-rank head argmax, V={vocab} d={hidden} r={rank} bf16 ({device_name()})", "",
             "Times in microseconds, median of `triton.testing.do_bench` (L2 flushed between reps). "
             "nu = low-rank / full head.", "",
             "| B | full head + argmax | low-rank torch | fused Triton | nu torch | nu fused | fused GB/s |"
             " best tiles | nu best |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full = r["full"]
        lines.append(f"| {r['B']} | {full:.1f} | {r['torch']:.1f} | {r['fused']:.1f} | {r['torch'] / full:.3f} | "
                     f"{r['fused'] / full:.3f} | {bytes_lowrank / r['fused'] / 1e3:.0f} | "
                     f"{describe(r['best'])}: {r['best_time']:.1f} | {r['best_time'] / full:.3f} |")
    if graphs:
        lines += ["", "Under CUDA graphs (`do_bench_cudagraph`, no launch overhead, L2 not flushed):", "",
                  "| B | full head + argmax | low-rank torch | fused Triton | nu torch | nu fused |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            full = r["full_graph"]
            lines.append(f"| {r['B']} | {full:.1f} | {r['torch_graph']:.1f} | {r['fused_graph']:.1f} | "
                         f"{r['torch_graph'] / full:.3f} | {r['fused_graph'] / full:.3f} |")
    b1 = [r for r in rows if r["B"] == 1]
    lines += ["", f"Bandwidth floor for nu: (Vr + rd) / Vd = {floor:.3f}."]
    if b1:
        nu = min(b1[0]["fused"], b1[0]["best_time"]) / b1[0]["full"]
        verdict = "met" if nu <= 0.16 else "NOT met"
        lines.append(f"Goal nu <= 0.16 at B = 1: {verdict} (fused, best tiles: nu = {nu:.3f}).")
    lines.append(f"Checks: {'all passed' if not FAILURES else 'FAILED: ' + '; '.join(FAILURES)}.")
    return "\n".join(lines)


def device_name() -> str:
    if DEVICE.type == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    return f"CPU interpreter smoke run, torch {torch.__version__}, triton {triton.__version__}"


def wall_timer(fn: Callable[[], object]) -> float:
    """Milliseconds per call by wall clock (CPU smoke run only)."""
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main() -> int:
    batches = [int(b) for b in ARGS.batches.split(",")]
    vocab, hidden, rank = ARGS.vocab, ARGS.hidden, ARGS.rank
    if DEVICE.type == "cuda":
        timer: Timer = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
        graph_timer: Timer | None = lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median")  # noqa: E731
    else:
        timer, graph_timer = wall_timer, None
    print(f"{device_name()}; V={vocab} d={hidden} r={rank} bf16; B in {batches}", flush=True)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w_full = (torch.randn(vocab, hidden, generator=g, device=DEVICE) / hidden**0.5).to(DTYPE)  # timing only
    rows, screen_rows = [], []
    for batch in batches:
        h, w_down, w_up = make_inputs(batch, vocab, hidden, rank, seed=batch)
        run_checks(batch, h, w_down, w_up)
        print(f"B = {batch}: timing{'' if ARGS.no_sweep else ' (+ tile sweep)'}", flush=True)
        rows.append(bench_rows(batch, h, w_down, w_up, w_full, timer, graph_timer, sweep=not ARGS.no_sweep))
        if ARGS.shortlist:
            print(f"B = {batch}: screen and rescore, checks and timing", flush=True)
            screen_rows.append(screen_checks_and_times(batch, h, w_full, timer, graph_timer))
    text = report(rows, vocab, hidden, rank, graphs=graph_timer is not None)
    if screen_rows:
        text += "\n\n" + screen_report(screen_rows, vocab, hidden)
    print("\n" + text)
    if ARGS.out:
        ARGS.out.write_text(text + "\n")
        print(f"\nwritten to {ARGS.out}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
