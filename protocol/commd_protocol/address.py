"""Peer addresses as both sides write them: ``HOST:PORT``, IPv6 hosts in brackets."""

from __future__ import annotations


def split_host_port(address: str) -> tuple[str, int]:
    """(host without brackets, port) of ``HOST:PORT``; ValueError saying what is expected."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
