"""Loading a script (under bench/ or examples/, which are not packages) as a module, and
checking that it refuses bad options."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(filename: str, module_name: str) -> ModuleType:
    """bench/``filename`` imported as ``module_name``. bench/ goes last on the path, for the
    script's own imports (``ddp_tasks``), so it shadows nothing of the tests'."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    return load_script(BENCH / filename, module_name)


def load_script(path: Path, module_name: str) -> ModuleType:
    """The script at ``path`` imported as ``module_name`` (registered first, as an import
    would: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(module_name, module)
    spec.loader.exec_module(module)
    return module


def assert_usage_error(main: Callable[[list[str]], int], argv: list[str], says: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    """``main(argv)`` stops as argparse does on a usage error (exit 2), saying ``says``."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
