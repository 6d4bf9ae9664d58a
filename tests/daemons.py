"""Real daemons as subprocesses for tests (see commd.launch)."""

from commd.launch import LocalDaemon as DaemonProcess
from commd.launch import commd_segments

__all__ = ["DaemonProcess", "commd_segments"]
