"""Start local `commd run` daemons as subprocesses and stop them: for the demo, benchmarks and
tests. Readiness comes from the daemon's own sd_notify READY=1, never from a sleep."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from commd.daemon.key_files import local_key
from commd.testing.processes import stop_process

READY_TIMEOUT_S = 30.0
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class LocalDaemon:
    """One `commd run` on 127.0.0.1 with a random peer port and its own ipc socket."""

    def __init__(self, workdir: Path | str, name: str, *extra: str,
                 env: dict[str, str] | None = None, listen_host: str = "127.0.0.1",
                 prefix: Sequence[str] = (), port: int = 0) -> None:
        """``prefix`` wraps the command, e.g. ``ip netns exec NS`` for a network namespace
        (the notify socket is a file, so readiness still reaches us). ``port``: the peer
        port (0: any free one), e.g. a dead daemon's, for one started again in its place.
        Every daemon of a
        workdir shares its key, ``workdir_key``: on loopback as its local key (its socket is
        in the workdir), beyond loopback as its --cluster-key, unless ``extra`` names
        ``--cluster-key`` or ``--insecure``."""
        workdir = Path(workdir)
        self.name = name
        self.socket = str(workdir / f"{name}.sock")
        self.log_path = workdir / f"{name}.log"
        self._notify_dir = tempfile.mkdtemp(prefix="commd-notify-")
        self._notify_path = os.path.join(self._notify_dir, "notify")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(self._notify_path)
        self._notify.settimeout(READY_TIMEOUT_S)
        if listen_host not in _LOOPBACK and not {"--cluster-key", "--insecure"} & set(extra):
            extra = (*extra, "--cluster-key", workdir_key(workdir))
        full_env = {**os.environ, "NOTIFY_SOCKET": self._notify_path, **(env or {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "commd.cli", "run", "--socket", self.socket,
             "--listen", f"{listen_host}:{port}", *extra],
            env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.host = listen_host
        self.notifications: list[str] = []
        self.port = self._await_ready()

    def _await_ready(self) -> int:
        while True:
            try:
                datagram = self._notify.recv(4096).decode()
            except TimeoutError:
                self.stop()
                raise RuntimeError(f"daemon {self.name} did not become ready:\n{self.log()}") \
                    from None
            self.notifications.append(datagram)
            if "READY=1" in datagram.split("\n"):
                match = re.search(r"peers on [^\s]+:(\d+)", datagram)
                if not match:
                    self.stop()
                    raise RuntimeError(f"daemon {self.name} sent no port: {datagram!r}")
                return int(match.group(1))
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"daemon {self.name} exited:\n{self.log()}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code. Safe to repeat."""
        code = stop_process(self.process, grace_s=timeout)
        self._log.close()
        self._notify.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._notify_path)
        with contextlib.suppress(OSError):
            os.rmdir(self._notify_dir)
        return code


@contextlib.contextmanager
def gloo_daemons(workdir: Path, names: Sequence[str] = ("d0", "d1")) -> Iterator[list[LocalDaemon]]:
    """Real `commd run` daemons (Gloo) on 127.0.0.1, one per name, stopped on the way out —
    also when one of them fails to start."""
    started: list[LocalDaemon] = []
    try:
        for name in names:
            started.append(LocalDaemon(workdir, name, "--backend", "gloo"))
        yield started
    finally:
        for daemon in started:
            daemon.stop()


@contextlib.contextmanager
def daemon_set(workdir: Path, count: int, *extra: str,
               prefixes: Sequence[Sequence[str]] = (), hosts: Sequence[str] = (),
               ) -> Iterator[list[LocalDaemon]]:
    """``count`` Gloo daemons named d0, d1, … with ``extra`` options (``prefixes`` and
    ``hosts``: per daemon, e.g. network namespaces). On the way out a daemon a test stopped
    (SIGSTOP) is continued first, so it hears its TERM; every one is stopped, and no commd
    shared-memory segment may be left behind."""
    before = commd_segments()
    started: list[LocalDaemon] = []
    try:
        for index in range(count):
            started.append(LocalDaemon(
                workdir, f"d{index}", "--backend", "gloo", *extra,
                listen_host=hosts[index] if hosts else "127.0.0.1",
                prefix=prefixes[index] if prefixes else ()))
        yield started
    finally:
        for daemon in started:
            if daemon.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(daemon.process.pid, signal.SIGCONT)
            daemon.stop()
    left = commd_segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)[:5]}"


def workdir_key(workdir: Path) -> str:
    """``workdir/cluster.key``: the local key every daemon whose socket is in ``workdir`` uses
    without --cluster-key, made if absent. Also what a daemon beyond loopback gets as its
    --cluster-key, so those need mode 0600 (an explicit key's rule; the local key allows it)."""
    path = local_key(str(workdir / "any.sock"))[1]
    os.chmod(path, 0o600)
    return path


def commd_segments() -> set[str]:
    """Names of commd's shared-memory segments now in /dev/shm."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("commd-")}
