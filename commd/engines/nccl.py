"""NCCL through cupy.cuda.nccl: the GPU engine, one communicator per job among the nodes.

Set-up: node 0 puts a fresh unique id into the coordinator's rendezvous store under
``<job>/<generation>/nccl_id``, the other nodes read it; ``ncclCommInitRank`` runs on its own
thread with the job's timeout (cupy's init is known to hang in some set-ups), then a one-
element warm-up all-reduce. Any failure aborts the communicator and raises EngineError, which
the job turns into an error every rank of every node receives.

Collectives take the buffers' raw pointers and the job's stream (``CudaOps``): they are only
enqueued; their futures resolve, with the device time between two events, when the stream
reaches them. The engine always sums; the pipeline scales for avg (see ``nccl_tables``).
cupy is imported lazily: this module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from datetime import timedelta
from typing import Any

from commd.engines.base import Engine, EngineConfig, EngineError
from commd.engines.buffer_ops import BufferOps
from commd.engines.completion import Completion
from commd.engines.cuda import calls as cuda_calls
from commd.engines.nccl_tables import (
    ITEMSIZE,
    cupy_takes_bytes,
    decode_unique_id,
    encode_unique_id,
    nccl_dtype,
    nccl_op,
    unique_id_key,
)

log = logging.getLogger("commd.engine.nccl")


class NcclEngine(Engine):
    """One job's NCCL communicator among its nodes, on device buffers: its collectives are
    enqueued on the stream of the ``CudaOps`` bound to it (``bind``) before ``start``."""

    name = "nccl"
    buffer_kinds = ("cuda",)

    def __init__(self) -> None:
        self._comm: Any = None
        self._ops: BufferOps | None = None
        self._timeout_s = 300.0
        self.size = 0

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError:
            return False, "cupy is not installed (pip install 'commd[nccl]')"
        if not nccl.available:
            return False, "cupy has no NCCL (install nvidia-nccl-cu12, or -cu13 for CUDA 13)"
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # cudaErrorInsufficientDriver and friends
            return False, f"no usable GPU ({exc})"
        if count == 0:
            return False, "no GPU found"
        return True, f"NCCL {_version(nccl)}, {count} GPU(s)"

    def bind(self, ops: BufferOps) -> None:
        super().bind(ops)
        self._ops = ops

    # --- set-up ----------------------------------------------------------------------------------

    async def start(self, config: EngineConfig) -> None:
        ops = self._require_ops()
        self._timeout_s = config.timeout_s
        device = int(getattr(ops, "device_index", 0))
        try:
            raw = await cuda_calls.run_blocking(
                "the NCCL unique-id exchange",
                functools.partial(exchange_unique_id, config, self.new_unique_id),
                config.timeout_s,
            )
            self._comm = await cuda_calls.run_blocking(
                "ncclCommInitRank",
                functools.partial(self.connect, config.size, raw, config.rank, device),
                config.timeout_s, on_late_result=_abort_quietly,
            )
            self.size = config.size
            # The warm-up through the job's stream and watcher (the first one ran in connect).
            await self.allreduce(ops.zeros(1, "float32"), "float32")
        except EngineError:
            self.close()
            raise
        log.info("NCCL communicator %s: rank %d of %d on GPU %d", config.label, config.rank,
                 config.size, device)

    @staticmethod
    def new_unique_id() -> bytes:
        from cupy.cuda import nccl

        return encode_unique_id(cuda_calls.call("ncclGetUniqueId", nccl.get_unique_id))

    @staticmethod
    def connect(size: int, raw_id: bytes, rank: int, device: int) -> Any:
        """``ncclCommInitRank`` on ``device`` (blocks until every rank has joined)."""
        cupy = cuda_calls.import_cupy()
        from cupy.cuda import nccl

        unique_id = decode_unique_id(raw_id, cupy_takes_bytes(cupy.__version__))
        with cupy.cuda.Device(device):
            comm = cuda_calls.call("ncclCommInitRank", nccl.NcclCommunicator, size, unique_id,
                                   rank)
            try:
                # NCCL connects peers at the first collective, which can block its caller:
                # do that here, on this thread, not on the event loop.
                stream = cupy.cuda.Stream(non_blocking=True)
                with stream:
                    scratch = cupy.zeros(1, dtype=cupy.float32)
                cuda_calls.call("the NCCL warm-up all-reduce", comm.allReduce, scratch.data.ptr,
                                scratch.data.ptr, 1, nccl_dtype("float32"), nccl_op("sum"),
                                stream.ptr)
                cuda_calls.call("the NCCL warm-up all-reduce", stream.synchronize)
            except BaseException:
                _abort_quietly(comm)
                raise
            return comm

    # --- collectives -----------------------------------------------------------------------------

    def allreduce(self, buffer: Any, dtype: str, op: str = "sum") -> Completion:
        def issue(comm: Any, ops: Any) -> Completion:
            pointer, count = device_pointer(buffer, dtype)
            launched: Completion = ops.launch(
                "ncclAllReduce", comm.allReduce, pointer, pointer, count, nccl_dtype(dtype),
                nccl_op(op), ops.stream_ptr, **self._guards(comm))
            return launched

        return self._issue(issue)

    def allgather(self, output: Any, data: Any, dtype: str) -> Completion:
        def issue(comm: Any, ops: Any) -> Completion:
            source, count = device_pointer(data, dtype)
            target, total = device_pointer(output, dtype)
            if total != count * self.size:
                raise EngineError(
                    f"commd: allgather output holds {total} elements, needs {count * self.size}"
                )
            launched: Completion = ops.launch(
                "ncclAllGather", comm.allGather, source, target, count, nccl_dtype(dtype),
                ops.stream_ptr, **self._guards(comm))
            return launched

        return self._issue(issue)

    def broadcast(self, buffer: Any, root: int, dtype: str) -> Completion:
        def issue(comm: Any, ops: Any) -> Completion:
            if not 0 <= root < self.size:
                raise EngineError(f"commd: broadcast root {root} is not a rank of {self.size}")
            pointer, count = device_pointer(buffer, dtype)
            launched: Completion = ops.launch(
                "ncclBroadcast", comm.bcast, pointer, count, nccl_dtype(dtype), root,
                ops.stream_ptr, **self._guards(comm))
            return launched

        return self._issue(issue)

    def _issue(self, issue: Any) -> Completion:
        """Run ``issue`` now; any failure comes back as a failed future, never a raise."""
        try:
            if self._comm is None:
                raise EngineError("commd: the NCCL engine is not started or already closed")
            return issue(self._comm, self._require_ops())  # type: ignore[no-any-return]
        except (EngineError, ValueError) as exc:
            future: Completion = asyncio.get_running_loop().create_future()
            error = exc if isinstance(exc, EngineError) else EngineError(f"commd: {exc}")
            future.set_exception(error)
            return future

    def _guards(self, comm: Any) -> dict[str, Any]:
        return {"timeout_s": self._timeout_s, "on_timeout": self.close,
                "check": getattr(comm, "check_async_error", None)}

    def _require_ops(self) -> BufferOps:
        if self._ops is None:
            raise EngineError("commd: the NCCL engine needs the job's device buffers (bind)")
        return self._ops

    def close(self) -> None:
        """Abort the communicator: never hangs, also with collectives in flight or a peer
        gone (ncclCommDestroy could wait for them)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            _abort_quietly(comm)


def device_pointer(buffer: Any, dtype: str) -> tuple[int, int]:
    """(raw device pointer, element count) of a contiguous device buffer holding ``dtype``."""
    nccl_dtype(dtype)
    data = getattr(buffer, "data", None)
    pointer = getattr(data, "ptr", None)
    if not isinstance(pointer, int):
        raise EngineError(
            f"commd: the NCCL engine takes device buffers (cupy arrays), not "
            f"{type(buffer).__module__}.{type(buffer).__name__}"
        )
    if buffer.itemsize != ITEMSIZE[dtype]:
        raise EngineError(
            f"commd: a {dtype} collective on a buffer of {buffer.itemsize}-byte elements"
        )
    if not buffer.flags.c_contiguous:
        raise EngineError("commd: NCCL needs a contiguous buffer")
    return pointer, int(buffer.size)


def exchange_unique_id(config: EngineConfig, new_id: Any) -> bytes:
    """Node 0 creates the id and puts it into the rendezvous store; the others wait for it.
    A single node needs no store."""
    if config.size == 1:
        return bytes(new_id())
    try:
        import torch.distributed as dist
    except ImportError:
        raise EngineError(
            "commd: the rendezvous store of a multi-node NCCL job is torch's TCPStore: "
            "install torch on every node (pip install 'commd[gloo]')"
        ) from None
    store = dist.TCPStore(config.store_host, config.store_port, None, False,
                          timeout=timedelta(seconds=config.timeout_s))
    key = unique_id_key(config.key)
    if config.rank == 0:
        store.set(key, new_id())
    return bytes(store.get(key))


def _abort_quietly(comm: Any) -> None:
    with contextlib.suppress(Exception):
        cuda_calls.call("ncclCommAbort", comm.abort)


def _version(nccl: Any) -> str:
    try:
        code = int(nccl.get_version())
    except Exception:
        return "(version unknown)"
    # NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH.
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
