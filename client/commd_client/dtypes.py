"""Gradient dtypes and how numpy holds them."""

from __future__ import annotations

import numpy as np

from commd_protocol import DTYPES, CommdError

# numpy has no bfloat16: such buffers are handed out as uint16 arrays holding the raw bits
# (in torch: ``torch.from_numpy(a).view(torch.bfloat16)``).
_NUMPY: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s elements (raw words for bfloat16)."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise CommdError(
            f"commd: unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}"
        ) from None


def itemsize(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize
