"""Gradient dtypes: their element sizes and the numpy dtype that holds each (both sides).

numpy is not imported here (this package needs msgspec only): each side turns the storage
name into a numpy dtype with ``numpy.dtype(storage_name(dtype))``.
"""

from __future__ import annotations

from .errors import CommdError
from .messages import DTYPES

# Bytes per element of each dtype on the wire and in the flat buffer.
ITEM_SIZES: dict[str, int] = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}

# numpy has no bfloat16: such buffers are handed out as uint16 arrays holding the raw bits
# (in torch: ``torch.from_numpy(a).view(torch.bfloat16)``).
_STORAGE: dict[str, str] = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "bfloat16": "uint16",
}


def _known(dtype: str) -> str:
    if dtype not in _STORAGE:
        raise CommdError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return dtype


def storage_name(dtype: str) -> str:
    """The numpy dtype name whose elements hold ``dtype``'s (raw words for bfloat16)."""
    return _STORAGE[_known(dtype)]


def itemsize(dtype: str) -> int:
    return ITEM_SIZES[_known(dtype)]
