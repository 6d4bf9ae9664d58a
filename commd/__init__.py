"""commd: a per-node gradient communication daemon for synchronous data-parallel training."""

# One version for the daemon, the client and the wire protocol; it lives in commd_protocol.
from commd_protocol import __version__ as __version__
