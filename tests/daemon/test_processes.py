"""commd.testing.processes with real subprocesses: stopping, collecting under one deadline,
and killing whatever is left whatever happens. Processes say they are ready on a pipe; no
sleep stands in for synchronisation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from commd.testing.processes import (
    TEARDOWN_ABORT,
    FinishTimeout,
    finish,
    kill_all,
    run_launchers,
    run_stock_launchers,
    start_json_worker,
    stop_process,
)

PIPE = subprocess.PIPE
Spawn = Callable[..., "subprocess.Popen[str]"]

# Child programs. Each says "ready" (flushed) once its signal handling is in place.
PAUSE = "import signal; print('ready', flush=True); signal.pause()"
IGNORE_TERM = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('ready', flush=True); signal.pause()")
EXIT_3_ON_EOF = ("import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "print('ready', flush=True); sys.stdin.read(); sys.exit(3)")


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``python -c CODE``; everything started is killed and its pipes closed afterwards
    (with plain Popen calls, so that cleaning up does not rely on the code under test)."""
    started: list[subprocess.Popen[Any]] = []

    def start(code: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
        popen.setdefault("text", True)
        process = subprocess.Popen([sys.executable, "-c", code, *args], **popen)
        started.append(process)
        return process

    yield start
    for process in started:
        clean_up(process)


def clean_up(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def ready(process: subprocess.Popen[str]) -> subprocess.Popen[str]:
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    return process


# --- stop_process ------------------------------------------------------------------------------


def test_sigterm_stops_a_process_that_honours_it(spawn: Spawn) -> None:
    process = ready(spawn(PAUSE, stdout=PIPE))
    began = time.monotonic()
    assert stop_process(process, grace_s=60) == -signal.SIGTERM
    assert time.monotonic() - began < 30  # it did not wait for the grace to run out


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(spawn: Spawn) -> None:
    process = ready(spawn(IGNORE_TERM, stdout=PIPE))
    began = time.monotonic()
    assert stop_process(process, grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - began >= 0.5  # the grace was given
    assert process.returncode == -signal.SIGKILL  # reaped


def test_close_stdin_stops_a_process_that_exits_on_eof(spawn: Spawn) -> None:
    process = ready(spawn(EXIT_3_ON_EOF, stdin=PIPE, stdout=PIPE))
    assert stop_process(process, grace_s=60, close_stdin=True) == 3  # its own exit, no signal
    assert process.stdin is not None and process.stdin.closed


def test_eof_then_sigterm_then_sigkill(spawn: Spawn) -> None:
    # Ignores the EOF (never reads stdin), honours SIGTERM.
    deaf = ready(spawn(PAUSE, stdin=PIPE, stdout=PIPE))
    assert stop_process(deaf, grace_s=0.2, close_stdin=True, term_grace_s=60) == -signal.SIGTERM
    # Ignores both: SIGKILL after both graces.
    stubborn = ready(spawn(IGNORE_TERM, stdin=PIPE, stdout=PIPE))
    began = time.monotonic()
    code = stop_process(stubborn, grace_s=0.2, close_stdin=True, term_grace_s=0.3)
    assert code == -signal.SIGKILL
    assert time.monotonic() - began >= 0.5


def test_a_process_that_already_exited(spawn: Spawn) -> None:
    process = spawn("raise SystemExit(7)", stdin=PIPE)
    process.wait()
    assert stop_process(process, close_stdin=True) == 7
    assert process.stdin is not None and process.stdin.closed
    assert stop_process(process) == 7  # again: still safe
    unreaped = spawn("raise SystemExit(5)", stdout=PIPE)
    assert unreaped.stdout is not None and unreaped.stdout.read() == ""  # it has exited
    assert stop_process(unreaped, grace_s=60) == 5


def test_stop_process_refuses_what_it_cannot_do(spawn: Spawn) -> None:
    process = ready(spawn(PAUSE, stdout=PIPE))
    with pytest.raises(ValueError, match="stdin=PIPE"):
        stop_process(process, close_stdin=True)
    with pytest.raises(ValueError, match="close_stdin"):
        stop_process(process, term_grace_s=1)
    assert process.poll() is None  # neither signalled it


# --- finish ------------------------------------------------------------------------------------


def test_finish_collects_output_exit_codes_and_json_lines(spawn: Spawn) -> None:
    chatty = spawn(
        "import json, sys\n"
        "print('starting')\n"
        "print(json.dumps({'a': 1}))\n"
        "print('{\"b\": [2, 3]}')\n"
        "print('bye')\n"
        "sys.stderr.write('a warning\\n')\n"
        "sys.exit(4)\n",
        stdout=PIPE, stderr=PIPE)
    silent = spawn("pass", stdout=PIPE, stderr=PIPE)
    unpiped = spawn("import sys; sys.exit(1)")
    first, second, third = finish([chatty, silent, unpiped], 60)
    assert first.returncode == 4 and first.pid == chatty.pid and not first.timed_out
    assert first.args == chatty.args
    assert first.stdout == 'starting\n{"a": 1}\n{"b": [2, 3]}\nbye\n'
    assert first.stderr == "a warning\n"
    assert first.json_lines() == [{"a": 1}, {"b": [2, 3]}]
    assert first.last_json() == {"b": [2, 3]}
    assert (second.returncode, second.stdout, second.stderr) == (0, "", "")
    assert second.json_lines() == [] and second.last_json() == {}
    assert (third.returncode, third.stdout, third.stderr) == (1, "", "")


def test_a_process_past_the_deadline_is_killed_and_reported(spawn: Spawn) -> None:
    quick = spawn("print('done')", stdout=PIPE, stderr=PIPE)
    hung = spawn("import signal, sys\n"
                 "print('partial', flush=True)\n"
                 "sys.stderr.write('ready\\n'); sys.stderr.flush()\n"
                 "signal.pause()\n", stdout=PIPE, stderr=PIPE)
    assert hung.stderr is not None and hung.stderr.readline() == "ready\n"  # "partial" is out
    with pytest.raises(FinishTimeout) as info:
        finish([quick, hung], 1.0)
    assert isinstance(info.value, subprocess.TimeoutExpired)  # what callers caught before
    assert hung.returncode == -signal.SIGKILL  # killed and reaped
    done, late = info.value.finished
    assert (done.returncode, done.stdout, done.timed_out) == (0, "done\n", False)
    assert (late.returncode, late.timed_out, late.pid) == (-signal.SIGKILL, True, hung.pid)
    assert late.stdout == "partial\n"  # what it wrote before the deadline is kept
    report = str(info.value)
    assert "1 of 2 processes" in report and "killed at the deadline" in report
    assert f"pid {quick.pid} (exit code 0)" in report


def test_the_deadline_is_one_for_all_processes(spawn: Spawn) -> None:
    hung = [spawn(PAUSE, stdout=PIPE) for _ in range(3)]
    began = time.monotonic()
    with pytest.raises(FinishTimeout) as info:
        finish(hung, 1.5)
    assert time.monotonic() - began < 4.0  # one deadline per process would take 4.5 s
    assert [p.returncode for p in hung] == [-signal.SIGKILL] * 3
    assert all(f.timed_out and f.stdout == "ready\n" for f in info.value.finished)


def test_an_exception_while_collecting_still_kills_everyone(spawn: Spawn) -> None:
    hung = spawn(PAUSE, stdout=PIPE)
    # Not UTF-8: reading its output as text fails inside finish().
    garbage = spawn("import sys; sys.stdout.buffer.write(b'\\xff\\xfe\\n')", stdout=PIPE,
                    encoding="utf-8")
    began = time.monotonic()
    with pytest.raises(UnicodeDecodeError):
        finish([hung, garbage], 120)
    assert time.monotonic() - began < 60  # raised when it happened, not at the deadline
    assert hung.returncode == -signal.SIGKILL
    assert garbage.returncode == 0


def test_outputs_are_read_at_once_so_a_full_pipe_blocks_nobody(spawn: Spawn) -> None:
    """``waiter`` exits only after ``writer`` did; ``writer`` writes more than a pipe holds.
    Reading one process after the other would wait on ``waiter`` while ``writer`` blocks."""
    read_end, write_end = os.pipe()
    try:
        waiter = spawn(f"import os; os.read({read_end}, 1); print('released')",
                       stdout=PIPE, pass_fds=(read_end,))
        writer = spawn("import sys; sys.stdout.write('x' * 1_000_000)",
                       stdout=PIPE, pass_fds=(write_end,))
    finally:
        os.close(read_end)
        os.close(write_end)
    first, second = finish([waiter, writer], 60)
    assert (first.returncode, first.stdout) == (0, "released\n")
    assert second.returncode == 0 and len(second.stdout) == 1_000_000


# --- kill_all, start_json_worker ---------------------------------------------------------------


def test_kill_all_kills_the_running_and_leaves_the_exited(spawn: Spawn) -> None:
    running = ready(spawn(IGNORE_TERM, stdout=PIPE))
    exited = spawn("pass")
    exited.wait()
    kill_all([running, exited])
    assert (running.returncode, exited.returncode) == (-signal.SIGKILL, 0)
    kill_all([running, exited])  # again: nothing to do, no error


def test_start_json_worker_passes_the_spec_and_the_environment() -> None:
    code = ("import json, os, sys; print(json.dumps({'spec': json.loads(sys.argv[1]), "
            "'env': os.environ.get('COMMD_TEST_VALUE'), 'path': 'PATH' in os.environ}))")
    worker = start_json_worker([sys.executable, "-c", code], {"rank": 1, "layers": [["w", 4]]},
                               env={"COMMD_TEST_VALUE": "42"})
    try:
        (done,) = finish([worker], 60)
    finally:
        clean_up(worker)
    assert done.returncode == 0, done.stderr
    assert done.last_json() == {"spec": {"rank": 1, "layers": [["w", 4]]}, "env": "42",
                                "path": True}
    assert done.stderr == ""  # piped, and empty


def test_a_stock_baseline_that_aborts_in_teardown_runs_once_more_and_a_commd_run_does_not(
        tmp_path: Path) -> None:
    # first run: the teardown abort's words and a failing exit; the second run succeeds
    script = (f"import pathlib, sys\nmark = pathlib.Path({str(tmp_path / 'ran')!r})\n"
              f"if mark.exists(): sys.exit(0)\nmark.touch()\nprint({TEARDOWN_ABORT!r})\n"
              "sys.exit(1)\n")
    command, log = [sys.executable, "-c", script], tmp_path / "run.log"
    assert run_stock_launchers([command], [dict(os.environ)], [log], 60) == ""
    (tmp_path / "ran").unlink()
    assert "exited with 1" in run_launchers([command], [dict(os.environ)], [log], 60)


def test_a_stock_baseline_that_fails_otherwise_is_not_run_again(tmp_path: Path) -> None:
    script = (f"import pathlib, sys\nmark = pathlib.Path({str(tmp_path / 'ran')!r})\n"
              "sys.exit(0 if mark.exists() else (mark.touch() or 1))\n")
    command = [sys.executable, "-c", script]
    assert "exited with 1" in run_stock_launchers([command], [dict(os.environ)],
                                                  [tmp_path / "run.log"], 60)
