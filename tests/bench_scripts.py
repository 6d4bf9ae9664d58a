"""Loading a script (under bench/ or examples/, which are not packages) as a module
(``load_script``, from commd.testing.scripts), and checking that it refuses bad options."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from commd.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(filename: str, module_name: str) -> ModuleType:
    """bench/``filename`` imported as ``module_name``, after the bench scripts it imports
    (``import ddp_tasks``, also inside a function), each under its own name: run from bench/,
    a script finds them on sys.path[0]; here they are found by their path, and nothing is
    put on the path that could shadow a module of the tests'."""
    _load_siblings(BENCH / filename)
    return load_script(BENCH / filename, module_name)


def _load_siblings(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            sibling = BENCH / f"{name}.py"
            if name not in sys.modules and sibling.exists():
                _load_siblings(sibling)
                load_script(sibling, name)


def assert_usage_error(main: Callable[[list[str]], int], argv: list[str], says: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    """``main(argv)`` stops as argparse does on a usage error (exit 2), saying ``says``."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
