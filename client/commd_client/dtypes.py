"""Gradient dtypes and how numpy holds them (the table is the protocol's)."""

from __future__ import annotations

import numpy as np

from commd_protocol.dtypes import storage_name


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s elements (raw uint16 words for bfloat16);
    CommdError names the valid dtypes."""
    return np.dtype(storage_name(dtype))
