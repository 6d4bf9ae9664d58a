"""What a benchmark starts and must stop: its daemons, its jobs' shared memory, its logs.

A bench builds on ``DaemonHarness`` (adding its own workers); ``close()`` stops the daemons in
reverse order, says which did not exit cleanly (with the end of their log), removes the
shared-memory segments only this run's jobs left behind (other people's commd segments on a
shared machine stay) and keeps the logs when asked or when something failed.

``JsonLineWorker`` is a bench's worker process: told what to do by lines on its stdin, it
answers with one JSON object a line on its stdout."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import stop_process


class DaemonHarness:
    """One benchmark run's daemons, work folder and jobs (the module's docstring): what ``close``
    stops and cleans up."""

    def __init__(self, prefix: str, keep_logs: bool = False) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.keep_logs = keep_logs
        self.daemons: list[LocalDaemon] = []
        self.jobs: list[str] = []  # every job this run started: its segments are ours
        self.failed = False

    def start_daemon(self, name: str, *extra: str, listen_host: str = "127.0.0.1",
                     prefix: Sequence[str] = ()) -> LocalDaemon:
        """A daemon whose socket and log are in this run's work folder (``LocalDaemon``'s
        arguments)."""
        daemon = LocalDaemon(self.workdir, name, *extra, listen_host=listen_host, prefix=prefix)
        self.daemons.append(daemon)
        return daemon

    def close(self) -> list[str]:
        """Stop the daemons; remove (and return) the segments this run's jobs leaked."""
        for daemon in reversed(self.daemons):
            code = daemon.stop()
            if code not in (0, -signal.SIGTERM):
                self.failed = True
                print(f"daemon {daemon.name} exited with {code}:\n{daemon.log()[-2000:]}",
                      file=sys.stderr)
        self.daemons.clear()
        ours = tuple(f"commd-{job}-" for job in self.jobs)
        leaked = sorted(name for name in commd_segments() if name.startswith(ours))
        for name in leaked:
            Path("/dev/shm", name).unlink(missing_ok=True)
        if self.keep_logs or self.failed:
            print(f"logs kept in {self.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return leaked


class WorkerError(RuntimeError):
    """A worker exited, did not answer in time, or answered ``{"error": …}``; the message
    ends with its stderr's last lines."""


class JsonLineWorker:
    """A worker subprocess driven by lines on its stdin, answering with JSON objects, one a
    line, on its stdout (other lines on stdout are not its answers and are passed over); its
    stderr goes to ``errors``, a file, read back when it fails."""

    def __init__(self, label: str, argv: Sequence[str], errors: IO[bytes],
                 start: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
                 cwd: Path | str | None = None) -> None:
        """``start`` makes the process from ``argv`` and Popen's keywords: a network bed's
        ``functools.partial(bed.popen, node)`` starts it inside a namespace."""
        self.label = label
        self._errors_path = errors.name
        self._buffer = b""
        self.process = start(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=errors, cwd=cwd, bufsize=0)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(line.encode() + b"\n")
        except BrokenPipeError:
            raise WorkerError(f"{self.describe()} exited early:\n{self.errors()}") from None

    def receive(self, deadline: float, idle: Callable[[], Any] | None = None) -> dict[str, Any]:
        """The next JSON answer, by ``deadline`` (time.monotonic()); ``idle()`` is called
        about four times a second while waiting."""
        assert self.process.stdout is not None
        stream = self.process.stdout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.describe()} did not answer in time:\n{self.errors()}")
            readable, _, _ = select.select([stream], [], [], min(left, 0.25))
            if not readable:
                if idle is not None:
                    idle()
                continue
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                self.process.wait()
                raise WorkerError(f"{self.describe()} exited with {self.process.returncode}:\n"
                                  f"{self.errors()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        if not line.startswith(b"{"):
            return self.receive(deadline, idle)
        message = dict(json.loads(line))
        if "error" in message:
            raise WorkerError(f"{self.describe()}: {message['error']}")
        return message

    def describe(self) -> str:
        return f"{self.label} (pid {self.process.pid})"

    def errors(self) -> str:
        """The end of the worker's stderr."""
        with contextlib.suppress(OSError):
            return Path(self._errors_path).read_text(errors="replace")[-3000:]
        return ""

    def stop(self, timeout: float = 15.0, term_grace_s: float | None = None) -> None:
        """EOF on stdin: the worker leaves its loop and exits; after ``timeout`` SIGTERM
        (when ``term_grace_s`` is given, SIGKILL that much later) or SIGKILL."""
        stop_process(self.process, grace_s=timeout, close_stdin=True, term_grace_s=term_grace_s)
        if self.process.stdout is not None:
            with contextlib.suppress(OSError):
                self.process.stdout.close()


def rank_or_main(run_rank: Callable[[dict[str, Any]], dict[str, Any]],
                 main: Callable[[], int]) -> int:
    """A bench that is also its own rank worker: ``script.py _rank '<json spec>'`` runs one
    rank and prints its result as one JSON line (what ``start_json_worker`` reads); any other
    command line is ``main()``."""
    if sys.argv[1:2] == ["_rank"]:
        print(json.dumps(run_rank(json.loads(sys.argv[2]))), flush=True)
        return 0
    return main()
