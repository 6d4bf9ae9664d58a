"""Real daemons as subprocesses for tests: started on 127.0.0.1 with random ports, readiness
taken from their sd_notify READY=1 (no sleeps), stopped with SIGTERM and checked for cleanup."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

READY_TIMEOUT_S = 30.0


class DaemonProcess:
    def __init__(self, workdir: Path, name: str, *extra: str, env: dict[str, str] | None = None):
        self.socket = str(workdir / f"{name}.sock")
        self.log_path = workdir / f"{name}.log"
        notify_dir = tempfile.mkdtemp(prefix="commd-notify-")
        self._notify_path = os.path.join(notify_dir, "notify")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(self._notify_path)
        self._notify.settimeout(READY_TIMEOUT_S)
        full_env = {**os.environ, "NOTIFY_SOCKET": self._notify_path, **(env or {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "commd.cli", "run", "--socket", self.socket,
             "--listen", "127.0.0.1:0", *extra],
            env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.notifications: list[str] = []
        self.port = self._await_ready()

    def _await_ready(self) -> int:
        while True:
            try:
                datagram = self._notify.recv(4096).decode()
            except TimeoutError:
                self.stop()
                raise RuntimeError(f"daemon did not become ready:\n{self.log()}") from None
            self.notifications.append(datagram)
            if "READY=1" in datagram.split("\n"):
                match = re.search(r"peers on [^:]+:(\d+)", datagram)
                assert match, datagram
                return int(match.group(1))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        self._notify.close()
        if os.path.exists(self._notify_path):
            os.unlink(self._notify_path)
            os.rmdir(os.path.dirname(self._notify_path))
        return self.process.returncode


def commd_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("commd-")}
