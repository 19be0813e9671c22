"""matplotlib, headless, or a clear error naming the extra that installs it (plots are optional)."""

from __future__ import annotations

from typing import Any

from slimspec.errors import SlimSpecError


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; SlimSpecError if matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SlimSpecError("plots need matplotlib: pip install 'slimspec[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
