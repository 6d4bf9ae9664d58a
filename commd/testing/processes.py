"""Start, stop and collect subprocesses for tests, benchmarks and examples, so that nothing
they start outlives them. Standard library only: bench/gpu_check.py imports this where commd
is not installed.

- :func:`stop_process`: ask one process to stop (EOF or SIGTERM), SIGKILL it after a grace.
- :func:`kill_all`: SIGKILL and reap every process of a list that is still running.
- :func:`finish`: every process's output and exit code under one deadline; whatever happens
  (the deadline, an exception, Ctrl-C), every process is killed and reaped before it returns.
- :func:`start_json_worker`: ``command '<json spec>'`` with stdout and stderr piped as text.
- :func:`run_launchers`: launchers (``mp.spawn`` scripts, torchrun-style ranks) run to their end
  in sessions of their own, their output in files; their process groups killed afterwards.
- :func:`run_stock_launchers`: the same for a stock torch baseline, once more after torch's own
  teardown abort.
- :func:`torchrun_env`: one rank's environment as torchrun sets it on 127.0.0.1, with its
  node's daemon socket.
- :func:`await_file`: inside a worker, until a file (a test's or a benchmark's gate) exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_GRACE_S = 10.0
# After the deadline's SIGKILL, how long to wait for a process's pipes to reach EOF (they may
# stay open if it left children behind that inherited them).
_DRAIN_AFTER_KILL_S = 10.0


def stop_process(process: subprocess.Popen[Any], *, grace_s: float = DEFAULT_GRACE_S,
                 close_stdin: bool = False, term_grace_s: float | None = None) -> int:
    """Stop ``process`` and reap it; returns its exit code (``-N``: ended by signal N).

    It is asked to stop by EOF on its stdin when ``close_stdin`` (the pipe is closed even if it
    already exited), else by SIGTERM; if it still runs ``grace_s`` later it gets SIGKILL. With
    ``close_stdin`` and ``term_grace_s``, a process that ignores the EOF gets SIGTERM first and
    SIGKILL ``term_grace_s`` after that. Safe on a process that already exited.
    """
    steps: list[tuple[Callable[[], None], float]]
    if close_stdin:
        stdin = process.stdin
        if stdin is None:
            raise ValueError("close_stdin needs a process started with stdin=PIPE")
        steps = [(lambda: None, grace_s)]
        if term_grace_s is not None:
            steps.append((process.terminate, term_grace_s))
        with contextlib.suppress(OSError):  # unflushed input to a process that is gone
            stdin.close()
    elif term_grace_s is not None:
        raise ValueError("term_grace_s is the grace after SIGTERM that follows an EOF: "
                         "it needs close_stdin=True")
    else:
        steps = [(process.terminate, grace_s)]
    for nudge, wait_s in steps:
        if process.poll() is not None:
            return process.returncode
        nudge()
        try:
            return process.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    process.kill()
    return process.wait()


def kill_all(processes: Sequence[subprocess.Popen[Any]]) -> None:
    """SIGKILL every process of ``processes`` still running, then reap them all. Reads no
    output and closes no pipe."""
    for process in processes:
        process.kill()  # nothing is sent to a process already reaped
    for process in processes:
        process.wait()


@dataclass(frozen=True)
class Finished:
    """What one process left when :func:`finish` collected it."""

    args: Any  # the command, as given to Popen
    pid: int
    returncode: int
    stdout: str  # "" if stdout was not piped
    stderr: str  # "" if stderr was not piped
    timed_out: bool = False  # its output had not ended by the deadline: it was killed

    def json_lines(self) -> list[dict[str, Any]]:
        """Every line of stdout that starts with "{", parsed."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def last_json(self) -> dict[str, Any]:
        """The last line of stdout that starts with "{", parsed; {} if there is none."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("{")]
        return dict(json.loads(lines[-1])) if lines else {}


class FinishTimeout(subprocess.TimeoutExpired):
    """Raised by :func:`finish` when some process outlived the deadline. By then every process
    is killed and reaped; ``finished`` holds what each one wrote, in order."""

    def __init__(self, finished: list[Finished], timeout_s: float) -> None:
        hung = [done for done in finished if done.timed_out]
        super().__init__(hung[0].args, timeout_s, hung[0].stdout, hung[0].stderr)
        self.finished = finished

    def __str__(self) -> str:
        hung = sum(done.timed_out for done in self.finished)
        lines = [f"{hung} of {len(self.finished)} processes still ran after {self.timeout:g} s "
                 "and were killed:"]
        for done in self.finished:
            state = "killed at the deadline" if done.timed_out else f"exit code {done.returncode}"
            lines.append(f"- pid {done.pid} ({state}): {_command(done.args)}")
            tail = done.stderr[-1500:].rstrip()
            if tail:
                lines += [f"    {line}" for line in tail.splitlines()]
        return "\n".join(lines)


def finish(processes: Sequence[subprocess.Popen[Any]], timeout_s: float) -> list[Finished]:
    """Wait for every process of ``processes`` to exit, reading their piped output all at once
    (so none blocks on a full pipe), for ``timeout_s`` seconds in all; returns what each left,
    in order.

    Whatever happens, every process still running when this returns or raises is killed and
    reaped: at the deadline (then :class:`FinishTimeout` is raised after collecting what
    each wrote), on an exception while collecting (it is re-raised), on Ctrl-C.
    """
    count = len(processes)
    outputs: list[tuple[Any, Any] | None] = [None] * count
    errors: list[BaseException | None] = [None] * count
    done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def drain(index: int) -> None:
        try:
            outputs[index] = processes[index].communicate()
        except BaseException as exc:  # handed to the caller's thread
            errors[index] = exc
        finally:
            done.put(index)

    threads = [threading.Thread(target=drain, args=(index,), daemon=True,
                                name=f"finish-{process.pid}")
               for index, process in enumerate(processes)]
    pending = set(range(count))
    deadline = time.monotonic() + timeout_s
    try:
        for thread in threads:
            thread.start()
        while pending:
            index = done.get(timeout=max(0.0, deadline - time.monotonic()))
            pending.discard(index)
            error = errors[index]
            if error is not None:
                raise error
    except queue.Empty:
        pass  # the deadline: every process in ``pending`` is reported as timed out below
    finally:
        kill_all(processes)
        drain_until = time.monotonic() + _DRAIN_AFTER_KILL_S
        for thread in threads:
            if thread.ident is not None:
                thread.join(max(0.0, drain_until - time.monotonic()))
    finished = [_finished(process, outputs[index], index in pending)
                for index, process in enumerate(processes)]
    if pending:
        raise FinishTimeout(finished, timeout_s)
    return finished


def start_json_worker(command: Sequence[str], spec: Mapping[str, Any], *,
                      env: Mapping[str, str] | None = None, **popen: Any
                      ) -> subprocess.Popen[str]:
    """Start ``command`` with the JSON of ``spec`` as its last argument, stdout and stderr
    piped as text. ``env`` is added to this process's environment; ``popen`` goes to Popen."""
    full_env = None if env is None else {**os.environ, **env}
    return subprocess.Popen([*command, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, **popen)


def _finished(process: subprocess.Popen[Any], output: tuple[Any, Any] | None,
              timed_out: bool) -> Finished:
    stdout, stderr = output if output is not None else (None, None)
    return Finished(args=process.args, pid=process.pid, returncode=process.returncode,
                    stdout=_text(stdout), stderr=_text(stderr), timed_out=timed_out)


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _command(args: Any) -> str:
    words = [str(arg) for arg in args] if isinstance(args, list | tuple) else [str(args)]
    text = " ".join(words)
    return text if len(text) <= 300 else text[:297] + "..."


def run_launchers(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
                  logs: Sequence[Path], timeout_s: float) -> str:
    """Run each command with its environment, its output in its log (one file may serve
    several), in a session of its own, until all end or ``timeout_s`` passes; then every
    process group is killed, so a launcher's children (``mp.spawn``'s ranks) never outlive it.
    '' when every command exited 0, else what went wrong."""
    processes: list[subprocess.Popen[bytes]] = []
    problem = ""
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "ab") as sink:  # a file, not a pipe: spawned children share it
                processes.append(subprocess.Popen(list(command), env=dict(env), stdout=sink,
                                                  stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        for done in finish(processes, timeout_s):
            if done.returncode != 0:
                problem += f"process {done.pid} exited with {done.returncode}. "
    except FinishTimeout as timeout:
        problem = f"hung: {timeout}"
    finally:
        for process in processes:  # the launcher's children, if it was killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        kill_all(processes)  # reaped already, unless a start failed part way
    return problem


# What a C++ std::thread left joinable prints as its process exits: stock torch's Gloo and
# store teardown does it now and then, after the run has done all its work.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_stock_launchers(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
                        logs: Sequence[Path], timeout_s: float) -> str:
    """:func:`run_launchers` for a stock torch baseline (no commd in it), run once more when a
    process aborted in torch's own teardown (``TEARDOWN_ABORT`` in a log): a baseline's exit
    crash must not fail a test about commd. A commd run never gets this second chance."""
    problem = run_launchers(commands, envs, logs, timeout_s)
    files = [Path(log) for log in dict.fromkeys(logs)]
    if problem and any(TEARDOWN_ABORT in log.read_text(errors="replace") for log in files):
        for log in files:
            log.write_bytes(b"")
        problem = run_launchers(commands, envs, logs, timeout_s)
    return problem


def torchrun_env(base: Mapping[str, str], *, rank: int, world_size: int, local_rank: int,
                 local_world_size: int, master_port: int, socket: str) -> dict[str, str]:
    """``base`` with the variables torchrun gives rank ``rank`` (its rendezvous on 127.0.0.1)
    and ``COMMD_SOCKET``, the daemon of the rank's node."""
    return {**base, "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "COMMD_SOCKET": socket}


def await_file(path: Path, timeout: float) -> None:
    """Until ``path`` exists, at most ``timeout`` seconds; then SystemExit naming it (the
    worker's last words, for its parent to read)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.002)  # polling a file, with a deadline
