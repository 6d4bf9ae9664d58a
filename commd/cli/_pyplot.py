"""matplotlib for the subcommands' ``--plot``: optional (commd[plot]), so imported only when a
plot is asked for, and drawing to files only."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; ValueError, saying how to install it, without."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'commd[plot]'") from None
    return plt
