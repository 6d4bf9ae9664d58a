"""Attaching a rank's registered flat buffer: POSIX shared memory on the host, or device memory
through CUDA IPC. The job keeps what these return."""

from __future__ import annotations

from typing import Any

from commd.engines.base import EngineError
from commd.engines.buffer_ops import BufferOps, HostOps
from commd.engines.dtypes import numpy_dtype
from commd.job.segments import SegmentError, SharedSegment
from commd.job.state import LocalRank
from commd_protocol import DEVICES, Register


class AttachError(ValueError):
    """The buffer cannot be attached; the message says why (it goes to the client)."""


def attach(ops: BufferOps | None, member: LocalRank, message: Register, total: int,
           timeout_s: float) -> BufferOps:
    """Map ``member``'s buffer of ``total`` elements; returns the job's buffer operations,
    made for the first rank that registers. AttachError says why it cannot be mapped."""
    if ops is not None:
        problem = same_device(ops, message)
        if problem:
            raise AttachError(f"rank {member.rank} registered {problem}")
    if message.device == "cpu":
        member.segment, member.buffer = attach_host(message, total)
    if ops is None:
        ops = new_ops(message, timeout_s)
    if message.device != "cpu":
        member.buffer = attach_device(ops, member.local_rank, message, total)
    return ops


def check_fields(message: Register) -> str:
    """'' when the buffer fields of a registration fit together, else what is wrong."""
    if message.device not in DEVICES:
        return f"unsupported device {message.device!r}; use one of {', '.join(DEVICES)}"
    if message.device == "cpu":
        return "" if message.shm_name else "a host buffer needs shm_name"
    from commd.engines.cuda.memory import check_handles

    if message.compression not in ("", "none"):
        return "top-k compression needs host buffers; register with device='cpu'"
    if not message.device_bus_id:
        return "a device buffer needs device_bus_id (the GPU's PCI bus id)"
    return check_handles(message.ipc_handle, message.event_handle, message.ipc_offset)


def new_ops(message: Register, timeout_s: float) -> BufferOps:
    """The buffer operations of a job whose first rank registered ``message``."""
    if message.device == "cpu":
        return HostOps()
    from commd.engines.cuda.ops import CudaOps  # cupy only for device jobs

    try:
        return CudaOps(message.device_bus_id, timeout_s)
    except EngineError as exc:
        raise AttachError(f"cannot use GPU {message.device_bus_id}: {exc}") from None


def same_device(ops: BufferOps, message: Register) -> str:
    """'' when ``message``'s buffer can join ``ops``, else why not."""
    if ops.kind != message.device:
        return f"device {message.device} vs {ops.kind}: every local rank must agree"
    bus_id = getattr(ops, "bus_id", "")
    if message.device == "cuda" and message.device_bus_id.lower() != bus_id.lower():
        return (
            f"GPU {message.device_bus_id} vs {bus_id}: in this build the local ranks of a job "
            "must share one GPU (ranks on several GPUs of a node are not supported yet)"
        )
    return ""


def attach_host(message: Register, total: int) -> tuple[SharedSegment, Any]:
    dtype = numpy_dtype(message.dtype)
    try:
        segment = SharedSegment(message.shm_name)
    except SegmentError as exc:
        raise AttachError(str(exc)) from None
    if total * dtype.itemsize > segment.nbytes:
        segment.detach()
        raise AttachError(
            f"layers need {total * dtype.itemsize} bytes but segment "
            f"{message.shm_name!r} holds {segment.nbytes}"
        )
    return segment, segment.array(dtype, total)


def attach_device(ops: BufferOps, local_rank: int, message: Register, total: int) -> Any:
    from commd.engines.cuda.memory import DeviceMemoryError

    try:
        return ops.attach(local_rank, message.ipc_handle,  # type: ignore[attr-defined]
                          message.ipc_offset, total, message.dtype, message.event_handle)
    except (EngineError, DeviceMemoryError) as exc:
        raise AttachError(f"cannot map the device buffer of local rank {local_rank}: {exc}") \
            from None
