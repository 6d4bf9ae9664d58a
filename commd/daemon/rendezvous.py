"""The rendezvous store a coordinator daemon hosts for its jobs' engines (one per daemon)."""

from __future__ import annotations

import socket
from typing import Any


class Rendezvous:
    """A torch TCPStore server, bound to ``host`` at first use; each job's engine uses its
    own secret prefix on it (no authentication of its own: docs/security.md)."""

    def __init__(self) -> None:
        self._store: Any = None

    def port(self, host: str) -> int:
        if self._store is None:
            import torch.distributed as dist  # only the coordinator of a multi-node job

            # torch's store server would listen on every interface: hand it a socket that
            # listens on ``host`` alone (the store takes the descriptor over).
            listener = socket.create_server((host, 0))
            port = listener.getsockname()[1]
            self._store = dist.TCPStore(host, port, None, True, wait_for_workers=False,
                                        master_listen_fd=listener.detach())
        return int(self._store.port)

    def close(self) -> None:
        self._store = None
