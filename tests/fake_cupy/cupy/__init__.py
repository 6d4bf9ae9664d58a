"""A fake cupy for CPU tests of the device plumbing (never for results that need a GPU).

"Device memory" is POSIX shared memory and kernels run at once with numpy (the host_ops
reference), so client and daemon processes exchange buffers through "IPC handles" that name
a segment. Events and streams are no-ops: all work is synchronous. Only what commd, the GPU
tests' worker and the benchmark use is here. Put tests/fake_cupy first on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import cuda
from .cuda import memory as _memory

__version__ = "14.0.0+fake"

float16, float32, float64, uint16, uint32 = (np.float16, np.float32, np.float64, np.uint16,
                                             np.uint32)
ndarray = _memory.ndarray
zeros, empty, arange, abs = np.zeros, np.empty, np.arange, np.abs


def asarray(values: Any, dtype: Any = None) -> np.ndarray:
    return np.array(values, dtype=dtype)


def asnumpy(array: Any, stream: Any = None) -> np.ndarray:
    return np.array(array)


def copyto(target: np.ndarray, source: np.ndarray) -> None:
    np.copyto(target, source)


class ElementwiseKernel:
    """Runs commd's kernels by name with the host reference (commd_<kernel>_<dtype>)."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel",
                 preamble: str = "") -> None:
        self.kernel, self.dtype = name.removeprefix("commd_").rsplit("_", 1)

    def __call__(self, *args: Any) -> None:
        from commd.engines import host_ops

        kernel, dtype = self.kernel, self.dtype
        if kernel == "add":
            host_ops.sum_into(args[1], [args[0]], dtype)
        elif kernel in ("scale", "scale_copy"):
            host_ops.scale(args[1], float(args[0]), dtype)
            if kernel == "scale_copy":
                np.copyto(args[2], args[1])
        else:
            raise ValueError(f"the fake cupy has no kernel {kernel!r}")


__all__ = ["ElementwiseKernel", "asarray", "asnumpy", "copyto", "cuda", "ndarray"]
