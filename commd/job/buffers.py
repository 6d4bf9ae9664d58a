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
           timeout_s: float, host_fd: int | None) -> BufferOps:
    """Map ``member``'s buffer of ``total`` elements (a host buffer from ``host_fd``, the
    descriptor the rank handed over; the caller closes it); returns the job's buffer
    operations, made for the first rank that registers. AttachError says why not."""
    if ops is not None:
        problem = same_device(ops, message)
        if problem:
            raise AttachError(f"rank {member.rank} registered {problem}")
    if message.device == "cpu":
        if host_fd is None:
            raise AttachError(f"buffer token {message.buffer_token[:40]!r} was not handed over "
                              "to this daemon's buffer socket (or too long ago): hand the "
                              "buffer over again, then register")
        member.segment, member.buffer = attach_host(host_fd, message, total)
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
        if message.shm_name:
            return ("shm_name is not accepted (protocol 2): hand the host buffer over as a file "
                    "descriptor (see commd_protocol.handover) and register its buffer_token")
        return "" if message.buffer_token else \
            "a host buffer needs buffer_token: hand the buffer over on the buffer socket first"
    from commd.engines.cuda.memory import check_handles

    if message.compression not in ("", "none", "auto"):
        # `auto` runs a device job dense: the daemon compresses on its CPU threads
        return (f"compression {message.compression[:40]!r} needs host buffers; register with "
                "device='cpu', or compression='auto' (dense on a device)")
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


def attach_host(fd: int, message: Register, total: int) -> tuple[SharedSegment, Any]:
    dtype = numpy_dtype(message.dtype)
    try:
        segment = SharedSegment(fd, total * dtype.itemsize)
    except SegmentError as exc:
        raise AttachError(str(exc)) from None
    return segment, segment.array(dtype, total)


def attach_device(ops: BufferOps, local_rank: int, message: Register, total: int) -> Any:
    from commd.engines.cuda.memory import DeviceMemoryError

    try:
        return ops.attach(local_rank, message.ipc_handle,  # type: ignore[attr-defined]
                          message.ipc_offset, total, message.dtype, message.event_handle)
    except (EngineError, DeviceMemoryError) as exc:
        raise AttachError(f"cannot map the device buffer of local rank {local_rank}: {exc}") \
            from None
