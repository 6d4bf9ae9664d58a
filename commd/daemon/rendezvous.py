"""The rendezvous store a coordinator daemon hosts for its jobs' engines (one per daemon)."""

from __future__ import annotations

import socket
from typing import Any

from commd.daemon.settings import Settings
from commd.daemon.sockets import route_source


class Rendezvous:
    """A torch TCPStore server; each job's engine uses its own secret prefix on it (no
    authentication of its own: docs/security.md)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._store: Any = None

    def port(self, peer_host: str) -> int:
        """The store's port; started at first use, bound to one address (never every
        interface): the one we listen on, the one we advertise, or the one that routes to
        the joining peer."""
        if self._store is None:
            host = self._settings.listen_host
            if host in ("0.0.0.0", "::", "*"):
                host = self._settings.advertise or route_source(peer_host)
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
