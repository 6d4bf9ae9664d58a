"""cupy.cuda.nccl of the fake cupy: enough for availability checks; no communicator."""

from __future__ import annotations

import os
import time
from typing import Any

available = True
NCCL_SUM, NCCL_AVG = 0, 4
NCCL_INT32, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 2, 6, 7, 8, 9


def get_version() -> int:
    return 22105


def get_unique_id() -> bytes:
    return bytes(128)


class NcclCommunicator:
    """Fails at once, or with FAKE_CUPY_NCCL=hang never returns (a peer that never joins)."""

    def __init__(self, *args: Any) -> None:
        if os.environ.get("FAKE_CUPY_NCCL") == "hang":
            time.sleep(3600)
        raise RuntimeError("the fake cupy has no NCCL communicator")
