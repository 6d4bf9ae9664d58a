"""Real daemons as subprocesses for tests (see commd.testing.daemons)."""

from commd.testing.daemons import LocalDaemon as DaemonProcess
from commd.testing.daemons import commd_segments

__all__ = ["DaemonProcess", "commd_segments"]
