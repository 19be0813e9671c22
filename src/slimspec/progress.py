"""Stage-by-stage progress lines on stderr (quiet when disabled)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Stages:
    """Times named stages; prints ``[slimspec] stage ... 1.2s`` lines on stderr when ``enabled``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.timings: dict[str, float] = {}

    def say(self, message: str) -> None:
        if self.enabled:
            print(f"[slimspec] {message}", file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, name: str, message: str) -> Iterator[None]:
        start = time.perf_counter()
        if self.enabled:
            print(f"[slimspec] {message} ...", end="", file=sys.stderr, flush=True)
        try:
            yield
        except BaseException:
            if self.enabled:
                print(" failed", file=sys.stderr, flush=True)
            raise
        elapsed = time.perf_counter() - start
        self.timings[name] = self.timings.get(name, 0.0) + elapsed
        if self.enabled:
            print(f" {elapsed:.1f}s", file=sys.stderr, flush=True)
