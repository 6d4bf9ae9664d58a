"""What a failed `commd` command must look like to its user."""

from __future__ import annotations

import subprocess


def one_error_line(result: subprocess.CompletedProcess[str], returncode: int) -> str:
    """Exit code ``returncode``, nothing on stdout and one "commd: " line on stderr, no
    traceback; that line."""
    assert result.returncode == returncode, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("commd: ")
    assert "Traceback" not in result.stderr
    return lines[0]
