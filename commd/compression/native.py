"""Which loops run the compressed path: the compiled ones (``_native.c``) or numpy's.

The extension is built by ``pip install`` where a C compiler is found (setup.py: optional).
Both give the same residuals, results and selections, bit for bit; only the energies (the
gains' sums) may differ in their last bits, as the sums are added in another order. Set
``COMMD_NATIVE=0`` in the daemon's environment to run numpy's (a check, or a workaround).
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

_compiled: ModuleType | None
try:
    from commd.compression import _native as _compiled
except ImportError:  # built without a compiler: numpy runs every step
    _compiled = None

__all__ = ["active", "contiguous", "describe"]

# Read at import; tests switch it to run both paths.
enabled = _compiled is not None and os.environ.get("COMMD_NATIVE", "1") != "0"


def active() -> ModuleType | None:
    """The compiled loops, or None where numpy runs them."""
    return _compiled if enabled else None


def contiguous(*arrays: np.ndarray | None) -> bool:
    """All of ``arrays`` (None skipped) one C-contiguous block each: what the loops take."""
    return all(a is None or a.flags.c_contiguous for a in arrays)


def describe() -> str:
    """For logs and ``commd status``: which loops run, and why."""
    if _compiled is None:
        return "numpy (the compiled loops were not built: no C compiler at install)"
    if not enabled:
        return "numpy (COMMD_NATIVE=0)"
    return "compiled" + (", AVX-512" if _compiled.AVX512 else "")
