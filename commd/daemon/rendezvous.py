"""The rendezvous store a coordinator daemon hosts for its jobs' engines (one per daemon)."""

from __future__ import annotations

from typing import Any


class Rendezvous:
    """A torch TCPStore server; each job's engine uses its own prefix on it."""

    def __init__(self) -> None:
        self._store: Any = None

    def port(self, host: str) -> int:
        if self._store is None:
            import torch.distributed as dist  # only the coordinator of a multi-node job

            bind = "0.0.0.0" if host in ("", "0.0.0.0", "::") else host
            self._store = dist.TCPStore(bind, 0, None, True, wait_for_workers=False)
        return int(self._store.port)

    def close(self) -> None:
        self._store = None
