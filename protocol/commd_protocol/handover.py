"""How a rank hands its host buffer to the daemon: a file descriptor, never a file name.

The rank creates its flat buffer as a memfd sealed against shrinking and growing
(``memfd_create`` with ``MFD_ALLOW_SEALING``, then ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``)
and maps it. It connects to the daemon's buffer socket (AF_UNIX, SOCK_SEQPACKET; its path is in
``Welcome.buffer_socket``) and sends one message: a fresh token (TOKEN_CHARS hex characters)
with the descriptor attached (SCM_RIGHTS). The daemon answers one message, ``OK`` or a line
saying why it refused, and closes. Then the rank sends ``register`` with that token over the
ipc socket. The daemon takes the rank's pid and uid from the buffer socket (SO_PEERCRED), checks
the seals and the size, and maps the descriptor: it never opens a file by name, so it can reach
nothing the rank could not reach itself, and a sealed buffer cannot shrink under it.
"""

from __future__ import annotations

TOKEN_CHARS = 32  # 128 random bits, in hex
OK = b"OK"
MAX_MESSAGE = 512  # a token, or a refusal's reason
SUFFIX = ".buffers"  # the buffer socket is the ipc socket's path plus this


def buffer_socket_path(ipc_socket: str) -> str:
    return ipc_socket + SUFFIX
