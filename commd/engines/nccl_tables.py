"""What the NCCL engine needs that is pure data: dtype and op codes, the unique id's encoding.

No cupy here: the values are NCCL's stable enum values (nccl.h), so the tables and their
checks run everywhere; a GPU-less test compares them with ``cupy.cuda.nccl``'s constants when
cupy is installed.
"""

from __future__ import annotations

from collections.abc import Sequence

# ncclDataType_t (nccl.h): ncclInt32 = 2, ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8,
# ncclBfloat16 = 9 (NCCL >= 2.10). bfloat16 buffers hold raw 16-bit words (uint16 arrays).
NCCL_DTYPES: dict[str, int] = {
    "float32": 7,
    "float64": 8,
    "float16": 6,
    "bfloat16": 9,
    "int32": 2,  # top-k indices; never a gradient dtype
}
# Element size of each dtype as the buffers hold it.
ITEMSIZE: dict[str, int] = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4}

# ncclRedOp_t: ncclSum = 0, ncclAvg = 4 (NCCL >= 2.10).
NCCL_OPS: dict[str, int] = {"sum": 0, "avg": 4}

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def nccl_dtype(dtype: str) -> int:
    """The ncclDataType_t of ``dtype``; ValueError naming the valid ones."""
    try:
        return NCCL_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"the NCCL engine has no dtype {dtype!r}; valid: {', '.join(NCCL_DTYPES)}"
        ) from None


def nccl_op(op: str) -> int:
    """The ncclRedOp_t of ``op``; ValueError naming the valid ones.

    The daemon itself always reduces with ``sum`` and scales once for avg: NCCL_AVG divides
    by the number of NCCL ranks (nodes), not by the world size (all processes), and the
    scaling is fused with the copy back to the local ranks, so it costs no extra pass.
    """
    try:
        return NCCL_OPS[op]
    except KeyError:
        raise ValueError(f"the NCCL engine has no op {op!r}; valid: {', '.join(NCCL_OPS)}") \
            from None


def encode_unique_id(unique_id: bytes | Sequence[int]) -> bytes:
    """NCCL's unique id as 128 bytes for the store.

    cupy >= 14 returns bytes; older cupy a tuple of 128 signed chars (-128..127).
    """
    if isinstance(unique_id, bytes | bytearray):
        raw = bytes(unique_id)
    else:
        values = list(unique_id)
        if any(not -128 <= v <= 255 for v in values):
            raise ValueError("an NCCL unique id holds bytes (-128..255 as ints)")
        raw = bytes(v & 0xFF for v in values)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def decode_unique_id(raw: bytes, as_bytes: bool) -> bytes | tuple[int, ...]:
    """What ``NcclCommunicator`` takes: bytes (cupy >= 14) or a tuple of signed chars."""
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    if as_bytes:
        return bytes(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)


def cupy_takes_bytes(version: str) -> bool:
    """cupy 14 changed the unique id from a tuple of ints to bytes."""
    try:
        return int(version.split(".")[0]) >= 14
    except ValueError:
        return True


def unique_id_key(job_key: str) -> str:
    """Where node 0 puts the unique id in the rendezvous store."""
    return f"{job_key}/nccl_id"
