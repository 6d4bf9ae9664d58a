"""The numpy dtype of a job's buffers (the table is the protocol's, shared with clients)."""

from __future__ import annotations

import numpy as np

from commd_protocol.dtypes import storage_name


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s elements (raw uint16 words for bfloat16)."""
    return np.dtype(storage_name(dtype))
