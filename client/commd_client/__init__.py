"""commd_client: the thin library a training process uses to talk to its node's daemon.

It imports neither torch, uvloop nor cupy; ``commd_client.torch`` holds the PyTorch wrapper.
"""

from commd_protocol import CommdError, CommdTimeout, CommdTypeError, CommdValueError, __version__

from .client import Client

__all__ = [
    "Client", "CommdError", "CommdTimeout", "CommdTypeError", "CommdValueError", "__version__",
]
