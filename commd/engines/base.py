"""The small interface every collective engine implements, named after the collectives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from commd.engines.buffer_ops import BufferOps
from commd.engines.completion import Completion


class EngineError(Exception):
    """A failed set-up or collective; the message carries the library's own words."""


@dataclass(frozen=True)
class EngineConfig:
    """What an engine needs to join its job's group: one engine rank per node."""

    key: str  # the job's secret prefix in the rendezvous store (unique per set-up)
    rank: int  # this node's index
    size: int  # number of nodes
    store_host: str  # the coordinator's rendezvous store
    store_port: int
    host: str  # the address this node's engine listens on
    timeout_s: float
    name: str = ""  # how messages name the group, e.g. "<job>/<generation>" (never the key)

    @property
    def label(self) -> str:
        return self.name or self.key


class Engine(ABC):
    """Collectives on buffers of one job. Every call returns at once with a future that the
    event loop awaits; the work runs on the engine's own threads or device streams."""

    name: str = ""
    buffer_kinds: tuple[str, ...] = ("cpu",)  # where the buffers it reduces may live

    def bind(self, ops: BufferOps) -> None:
        """Share the job's buffer operations before ``start`` (a device engine issues its
        collectives on their stream); EngineError when this engine cannot take such buffers."""
        if ops.kind not in self.buffer_kinds:
            raise EngineError(
                f"commd: the {self.name} engine reduces {'/'.join(self.buffer_kinds)} buffers, "
                f"not {ops.kind} ones"
            )

    @classmethod
    @abstractmethod
    def availability(cls) -> tuple[bool, str]:
        """(usable here, reason when not) — a check, not an exception."""

    @abstractmethod
    async def start(self, config: EngineConfig) -> None:
        """Join the group; raises EngineError (also on timeout)."""

    @abstractmethod
    def allreduce(self, buffer: Any, dtype: str) -> Completion:
        """Sum ``buffer`` over all nodes, in place."""

    @abstractmethod
    def allgather(self, output: Any, data: Any, dtype: str) -> Completion:
        """Concatenate every node's ``data`` (same length) into ``output``, in rank order."""

    @abstractmethod
    def broadcast(self, buffer: Any, root: int, dtype: str) -> Completion:
        """Copy ``root``'s buffer into every node's, in place."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group; safe to call twice and after a failure."""
