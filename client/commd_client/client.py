"""``Client``: hand gradients to the node's commd daemon and get them back reduced."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from commd_protocol import (
    PROTOCOL_VERSION,
    CommdError,
    CommdTypeError,
    CommdValueError,
    Done,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Joining,
    Layer,
    Ready,
    Register,
    Registered,
    Wait,
    Welcome,
    error_from_reply,
)
from commd_protocol.checks import tolerance_problem
from commd_protocol.handover import buffer_socket_path
from commd_protocol.layout import backward_offsets

from . import env
from .arguments import check_fits, check_indices, check_layers
from .batching import ReadyBatcher
from .connection import Connection
from .cuda import DeviceBuffer, parse_device
from .dtypes import numpy_dtype
from .host_buffer import HostBuffer, buffer_name
from .membership import Membership

_HELLO_TIMEOUT_S = 10.0


class Client:
    """One training process's link to the commd daemon on its node.

    Every keyword defaults from the environment as torchrun sets it (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR); COMMD_JOB, COMMD_COORDINATOR and COMMD_SOCKET
    override; ``timeout`` (seconds a call waits) defaults to COMMD_TIMEOUT, else 300. Under one
    ``torchrun --standalone`` per node, COMMD_NODE_RANK and COMMD_NNODES make the rank and
    world size global (``env``'s docstring).

    ``fault_tolerance`` (default COMMD_FAULT_TOLERANCE, else ``"fail"``): ``"fail"`` fails
    every rank with a CommdError when a rank is lost, as torch does; ``"continue"`` lets the
    survivors go on: ``wait()`` returns normally, ``avg`` divides by the ranks that
    contributed, and ``epoch``, ``members`` and ``world_size`` follow the new membership (one
    warning per change on the ``commd_client`` logger) while at least ``min_world_size``
    (default COMMD_MIN_WORLD_SIZE, else 1; 1..world size) ranks live; below it the job fails
    as with ``"fail"``. Both are checked before anything connects, and sent with every
    ``register``. ``initial_world_size`` stays the world size the job formed with.

    ``helper_of`` ``(job, epoch)`` makes this a short job serving a tolerant job's membership
    epoch (the DDP wrapper's state transfer to a joiner): its daemon fails it with
    ``RANK_LOST`` at once if that job's membership changes again on the node, since its peer
    may be the rank that was lost.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        coordinator: str | None = None,
        socket: str | None = None,
        timeout: float | None = None,
        fault_tolerance: str | None = None,
        min_world_size: int | None = None,
        helper_of: tuple[str, int] | None = None,
    ) -> None:
        who = env.resolve(job, rank, world_size, local_rank, local_world_size, coordinator, socket)
        self.job, self.rank, self.initial_world_size = who.job, who.rank, who.world_size
        self.local_rank, self.local_world_size = who.local_rank, who.local_world_size
        self.coordinator, self.socket = who.coordinator, who.socket
        self.timeout = env.timeout(timeout)  # else COMMD_TIMEOUT, else 300 s
        self.fault_tolerance = env.fault_tolerance(fault_tolerance)
        self.min_world_size = env.min_world_size(min_world_size, who.world_size)
        self.membership = Membership(self.job, who.world_size)
        # (job, membership epoch) this short job serves (the DDP wrapper's state transfer):
        # the daemon fails it once that job's membership changes again
        if helper_of is not None and not (
                isinstance(helper_of, tuple) and len(helper_of) == 2
                and isinstance(helper_of[0], str) and isinstance(helper_of[1], int)):
            raise CommdTypeError(f"commd: helper_of must be (job, epoch), not {helper_of!r}")
        self.helper_of = helper_of
        self.iteration = 0
        self.joined_at = 0  # iterations the job had completed when this rank joined it
        self.joined = False  # this rank joined a running job (fault_tolerance="continue")
        self.state_source = -1  # then: the rank that gives it the training state
        self.state_source_local = False  # ... from this node
        # ... through jobs formed at the job's coordinator now (it may have been taken over
        # since this rank's launch-time address was lost); "" when that address still is
        self.state_coordinator = ""
        # fault_tolerance="continue": called inside wait() when ranks join the running job
        self.on_joining: Callable[[Joining], None] | None = None
        self.plan_version = 0  # the merge plan the last iteration ran with
        self.ran_dense = False  # whether every group of it ran dense (False: top-k or unknown)
        self.groups: list[list[int]] = []
        self.nodes = 0
        self._host_buffer: HostBuffer | None = None
        self._device: DeviceBuffer | None = None  # a device buffer instead of the segment
        self._sizes: list[int] = []
        self._marked: set[int] = set()
        self._batch = ReadyBatcher(0)
        self._failure: CommdError | None = None
        self._closed = False
        self._connection = Connection(self.socket)
        try:
            self._hello()
        except BaseException:
            self._connection.close()
            raise

    # --- lifecycle ---------------------------------------------------------------------------

    def _hello(self) -> None:
        self._connection.send(
            Hello(
                protocol=PROTOCOL_VERSION,
                job=self.job,
                rank=self.rank,
                world_size=self.initial_world_size,
                local_rank=self.local_rank,
                local_world_size=self.local_world_size,
                coordinator=self.coordinator,
                pid=os.getpid(),
                parent=self.helper_of[0] if self.helper_of else "",
                parent_epoch=self.helper_of[1] if self.helper_of else 0,
            )
        )
        reply = self._connection.receive(
            min(self.timeout, _HELLO_TIMEOUT_S), f"the daemon at {self.socket} to answer hello"
        )
        if isinstance(reply, Error):
            raise error_from_reply(reply.code, reply.message)
        if not isinstance(reply, Welcome):
            raise CommdError(f"commd: expected a welcome, got {type(reply).__name__}")
        self.backend = reply.backend
        self._buffer_socket = reply.buffer_socket or buffer_socket_path(self.socket)

    @property
    def world_size(self) -> int:
        """How many ranks the job has now: the world size it formed with until a rank is lost
        under ``fault_tolerance="continue"``."""
        return self.membership.world_size

    @property
    def epoch(self) -> int:
        """The membership epoch of the last iteration (0 until the membership changes)."""
        return self.membership.epoch

    @property
    def members(self) -> list[int]:
        """The live ranks of the current epoch, ascending (a copy)."""
        return list(self.membership.members)

    def close(self) -> None:
        """Say goodbye, close the socket and release the gradient buffer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._connection.send(Goodbye())
        finally:
            self._connection.close()
            if self._host_buffer is not None:
                self._host_buffer.close()
            if self._device is not None:
                self._device.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- registration --------------------------------------------------------------------------

    def register(
        self,
        layers: Sequence[tuple[str, int | Sequence[int]]],
        dtype: str = "float32",
        op: str = "avg",
        planner: str | None = None,
        compression: str | None = None,
        profile: bool = True,
        device: str = "cpu",
    ) -> list[Any]:
        """Register the layers (forward order); block until the job is formed.

        Each layer is ``(name, size)``, its number of elements, or ``(name, shape)``, the
        gradient's shape (a tuple or list of positive ints, e.g. a ``torch.Size``): the size
        is then its product. Give the shape where you have it: low-rank compression views a
        gradient of 2 or more dimensions as a matrix of ``shape[0]`` rows (as torch's PowerSGD
        hook does), and a layer given by its size is never compressed low-rank. Every rank
        must give the same layers, shapes included.

        Returns one writable 1-D array per layer, all views of one shared buffer laid out in
        backward order. bfloat16 gradients come as uint16 arrays of raw bits. ``planner``
        defaults to $COMMD_PLANNER, else the daemon's default (``optimal``); ``compression``
        (``none``; ``auto``: dense, or PowerSGD where the measured network pays;
        ``powersgd:RANK[:start=N]``; ``topk:RATIO[:EXCHANGE]`` or ``topk:auto``, each
        optionally followed by ``:momentum=M``) to $COMMD_COMPRESSION, else none. Low-rank
        compression needs each layer's shape: give layers as ``(name, shape)``.
        ``profile=False`` skips the network probe and the profiling rounds: for short jobs
        that exchange a few times (the plan then uses a default network model).

        ``device="cuda"`` (the current device) or ``"cuda:N"`` puts the flat buffer in device
        memory instead (needs cupy): the views are then cupy arrays (bfloat16 as uint16),
        ``ready(..., stream=)`` and ``wait(stream=)`` order the work on CUDA streams, and
        ``device_pointer`` gives the raw pointer for other frameworks.
        """
        if self._host_buffer is not None or self._device is not None:
            raise CommdError("commd: register() was already called on this client")
        checked = check_layers(layers, dtype, op)
        index = None if device == "cpu" else parse_device(device)
        problem = tolerance_problem(self.fault_tolerance, self.min_world_size,
                                    self.initial_world_size, "cpu" if device == "cpu" else "cuda")
        if problem:
            raise CommdValueError(f"commd: register(device={device!r}): {problem}")
        self._sizes = [size for _, size, _ in checked]
        flat, where = self._allocate(sum(self._sizes), dtype, device == "cpu", index)
        offsets = backward_offsets(self._sizes)
        views = [flat[o : o + n] for o, n in zip(offsets, self._sizes, strict=True)]
        self._connection.send(
            Register(
                layers=[Layer(name=name, size=size, rows=rows) for name, size, rows in checked],
                dtype=dtype,
                op=op,
                planner=planner if planner is not None else env.planner(),
                compression=compression if compression is not None else env.compression(),
                profile=profile,
                fault_tolerance=self.fault_tolerance,
                min_world_size=self.min_world_size,
                **where,
            )
        )
        reply = self._registered()
        self.groups, self.nodes, self.planner = reply.groups, reply.nodes, reply.planner
        # A rank that joined a running (tolerant) job starts at the job's iteration.
        self.iteration = self.joined_at = reply.iteration
        self.joined, self.state_source = reply.epoch > 0, reply.source
        self.state_source_local = reply.source_local
        self.state_coordinator = reply.coordinator
        self.membership.joined(reply)
        self._batch = ReadyBatcher(len(self._sizes))
        self._batch.announce(reply.plan, reply.groups)
        self.flat = flat
        return views

    def _allocate(self, total: int, dtype: str, host: bool,
                  index: int | None) -> tuple[Any, dict[str, Any]]:
        """The flat buffer, and the register fields that tell the daemon where it is."""
        if not host:
            self._device = DeviceBuffer(total, dtype, index)
            return self._device.flat, self._device.registration_fields()
        element = numpy_dtype(dtype)
        check_fits(total * element.itemsize)
        self._host_buffer = HostBuffer(buffer_name(self.job, self.rank), total * element.itemsize)
        token = self._host_buffer.hand_over(self._buffer_socket, min(self.timeout, 30.0))
        flat = np.frombuffer(self._host_buffer.buf, dtype=element, count=total)
        return flat, {"buffer_token": token}

    def _registered(self) -> Registered:
        """The daemon's answer to register, once the whole job has formed."""
        reply = self._connection.receive(self.timeout, "the job to form (every rank to register)")
        if isinstance(reply, Error):
            raise self._latch(reply)
        if not isinstance(reply, Registered):
            raise CommdError(f"commd: expected registered, got {type(reply).__name__}")
        if self._device is not None:
            if not reply.done_event:
                raise CommdError("commd: the daemon sent no done event: it is too old for "
                                 "device buffers; upgrade commd")
            self._device.open_done(reply.done_event)
        return reply

    @property
    def device_pointer(self) -> int:
        """The raw device pointer of the flat buffer (0 for a host buffer)."""
        return int(self.flat.data.ptr) if self._device is not None else 0

    # --- iterations ----------------------------------------------------------------------------

    def ready(self, layers: int | Iterable[int], stream: Any = None) -> None:
        """Mark layers' gradients final for this iteration (normally in backward order).

        Device buffers: ``stream`` is the CUDA stream that produced the gradients (None:
        cupy's current stream; a cupy or torch stream or a raw pointer); the daemon's work
        waits for it on the GPU, never here."""
        self._check_usable("ready()")
        indices = check_indices(layers, len(self._sizes))
        for index in indices:
            if index in self._marked:
                raise CommdValueError(
                    f"commd: ready({index}) twice in iteration {self.iteration}; "
                    "call wait() before marking it again"
                )
        if self._device is not None:
            self._device.record(stream)
        elif stream is not None:
            raise CommdError("commd: ready(stream=) is for device buffers "
                             "(register(..., device='cuda'))")
        self._marked.update(indices)
        if self._batch.add(indices):
            self._send_ready()

    def _send_ready(self) -> None:
        layers, stamps = self._batch.take()
        if layers:
            self._connection.send(Ready(layers=layers, sent_at=time.monotonic(), stamps=stamps))

    def wait(self, timeout: float | None = None, stream: Any = None) -> None:
        """Block until every layer holds the sum/avg over all ranks for this iteration
        (under ``fault_tolerance="continue"``: over the ranks of the iteration's epoch).

        Device buffers: returns once the daemon has issued the iteration's work; ``stream``
        (None: cupy's current one) then waits on the GPU for its end, so whatever is queued
        on it next reads the reduced gradients."""
        self._check_usable("wait()")
        if len(self._marked) != len(self._sizes):
            missing = sorted(set(range(len(self._sizes))) - self._marked)
            raise CommdError(
                f"commd: wait() before every layer is ready; not yet marked: {missing[:10]}"
                + (" …" if len(missing) > 10 else "")
            )
        self._send_ready()
        self._connection.send(Wait(iteration=self.iteration))
        budget = self.timeout if timeout is None else timeout
        reply = self._connection.receive(budget, f"iteration {self.iteration} to be reduced")
        while not (isinstance(reply, Done) and reply.iteration == self.iteration):
            if isinstance(reply, Error):
                raise self._latch(reply)
            if isinstance(reply, Joining) and self.on_joining is not None:
                # Ranks joined: this iteration waits for them, and they may wait for this
                # rank's state (the DDP wrapper's handler gives it, when this is the source).
                self.on_joining(reply)
            reply = self._connection.receive(budget, f"iteration {self.iteration} to be reduced")
        if self._device is not None:
            self._device.wait_done(stream)
        elif stream is not None:
            raise CommdError("commd: wait(stream=) is for device buffers")
        self.iteration += 1
        self.plan_version = reply.plan
        self.ran_dense = reply.dense
        self.membership.observe(reply)
        self._marked.clear()
        self._batch.announce(reply.next_plan, reply.next_groups)
        self._batch.next_iteration()

    def _check_usable(self, call: str) -> None:
        if self._failure is not None:
            raise self._failure
        if self._host_buffer is None and self._device is None:
            raise CommdError(f"commd: {call} before register()", ErrorCode.OUT_OF_ORDER)

    def _latch(self, reply: Error) -> CommdError:
        """A fatal error fails every later call the same way; others are raised once."""
        error = error_from_reply(reply.code, reply.message)
        if reply.fatal:
            self._failure = error
        return error
