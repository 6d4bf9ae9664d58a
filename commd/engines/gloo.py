"""Gloo through torch.distributed, built directly (no init_process_group): one group per job.

Tensors are ``torch.from_numpy`` views of the shared buffers, so nothing is copied. Collectives
run on Gloo's threads; their torch futures are bridged to asyncio with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import numpy as np

from commd.engines.base import Engine, EngineConfig, EngineError
from commd.engines.completion import Completion, bridge_future

log = logging.getLogger("commd.engine.gloo")

# Engines closed while a collective was in flight: their groups cannot be destroyed yet.
_LINGERING: set[GlooEngine] = set()


def lingering() -> int:
    """Gloo groups still waiting for a stuck collective: the process must not run their
    destructors at exit (they would block), see ``Daemon.run``."""
    return len(_LINGERING)


class GlooEngine(Engine):
    """One job's Gloo group among its nodes, on host buffers: the group, the store it formed
    through, and, when it is closed with collectives in flight, the two kept until those end."""

    name = "gloo"

    def __init__(self) -> None:
        self._group: Any = None
        self._store: Any = None
        self._torch: Any = None
        self._in_flight = 0  # Gloo works not yet ended (counted on the loop)
        self._held: list[Any] = []  # a closed group and store, kept while work is in flight

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import torch.distributed as dist
        except ImportError:
            return False, "torch is not installed (pip install 'commd[gloo]')"
        if not dist.is_available() or not dist.is_gloo_available():
            return False, "this torch build has no Gloo"
        return True, ""

    async def start(self, config: EngineConfig) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Building the group blocks until every node has joined: keep it off the loop.
            await asyncio.wait_for(
                loop.run_in_executor(None, self._build, config), config.timeout_s
            )
        except TimeoutError:
            raise EngineError(
                f"Gloo group {config.label} did not form within {config.timeout_s:g}s"
            ) from None
        except Exception as exc:  # the library's own words, e.g. "Connection refused"
            raise EngineError(f"Gloo set-up failed: {exc}") from exc

    def _build(self, config: EngineConfig) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        timeout = timedelta(seconds=config.timeout_s)
        self._store = dist.TCPStore(
            config.store_host, config.store_port, None, False, timeout=timeout
        )
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=config.host)]
        options._timeout = timeout
        store = dist.PrefixStore(config.key, self._store)
        self._group = dist.ProcessGroupGloo(store, config.rank, config.size, options)

    def _tensor(self, array: np.ndarray, dtype: str) -> Any:
        tensor = self._torch.from_numpy(array)
        return tensor.view(self._torch.bfloat16) if dtype == "bfloat16" else tensor

    def _bridge(self, work: Any) -> Completion:
        loop = asyncio.get_running_loop()
        future, settle = bridge_future(loop)

        def on_done(torch_future: Any) -> None:  # on Gloo's thread, when the work ended
            loop.call_soon_threadsafe(self._work_ended)
            try:
                torch_future.value()
            except Exception as exc:
                settle(EngineError(f"Gloo collective failed: {exc}"))
            else:
                settle(None)

        self._in_flight += 1
        work.get_future().add_done_callback(on_done)
        return future

    def _work_ended(self) -> None:
        """On the loop: a Gloo work ended (the asyncio future may have been cancelled long
        before, Gloo's own work only ends now)."""
        self._in_flight -= 1
        if self._held and not self._in_flight:  # closed, and nothing waits in Gloo now
            self._held.clear()
            _LINGERING.discard(self)

    def _require_group(self) -> Any:
        if self._group is None:
            raise EngineError("the Gloo engine is not started or already closed")
        return self._group

    def allreduce(self, buffer: np.ndarray, dtype: str) -> Completion:
        return self._bridge(self._require_group().allreduce([self._tensor(buffer, dtype)]))

    def allgather(self, output: np.ndarray, data: np.ndarray, dtype: str) -> Completion:
        work = self._require_group()._allgather_base(
            self._tensor(output, dtype), self._tensor(data, dtype)
        )
        return self._bridge(work)

    def broadcast(self, buffer: np.ndarray, root: int, dtype: str) -> Completion:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        return self._bridge(
            self._require_group().broadcast([self._tensor(buffer, dtype)], options)
        )

    def close(self) -> None:
        # Gloo's group waits in its destructor, holding the GIL, for the collectives still in
        # flight: one that waits for a stopped peer would stall the whole daemon until Gloo's
        # own timeout (minutes). So a group with work in flight is kept until that work ends
        # (it fails at Gloo's timeout), and only then let go (``_finished``).
        group, store = self._group, self._store
        self._group = self._store = None
        if self._in_flight and (group is not None or store is not None):
            self._held = [group, store]
            _LINGERING.add(self)
            log.warning("a Gloo collective is still in flight (a peer stopped?): its group is "
                        "kept until Gloo's own timeout ends it")
