"""Loading a file that is not in a package (a script under bench/ or examples/) as a module,
by its path: nothing goes on sys.path, where it could shadow a module of
the same name for everything imported after it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, module_name: str) -> ModuleType:
    """The file at ``path`` imported as ``module_name`` (registered first, as an import
    would: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(module_name, module)
    spec.loader.exec_module(module)
    return module
