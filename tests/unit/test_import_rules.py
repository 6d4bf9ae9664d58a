"""The import rules that keep the parts apart, read from the source (nothing is imported).

Every import counts: at the top, inside functions (lazy imports of torch or cupy) and under
``TYPE_CHECKING``, since a cycle hidden there is still a cycle in the design.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # import name -> folder holding it
    "commd": ROOT / "commd",
    "commd_client": ROOT / "client" / "commd_client",
    "commd_protocol": ROOT / "protocol" / "commd_protocol",
}


def module_files() -> dict[str, Path]:
    modules = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def imports_of(module: str) -> Iterator[str]:
    """Every module of ours that ``module`` imports (resolved, relative imports included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from package import module` imports the module
                candidate = f"{base}.{alias.name}"
                yield candidate if candidate in MODULES else base


@functools.cache
def graph() -> dict[str, set[str]]:
    return {m: {i for i in imports_of(m) if i in MODULES and i != m} for m in MODULES}


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_tree_is_read() -> None:
    # guards the test itself: a rename that empties MODULES would make every rule pass
    assert {"commd.daemon.server", "commd.job.pipeline", "commd_client.client",
            "commd_protocol.messages"} <= set(MODULES)
    assert "commd_protocol.layout" in graph()["commd.job.schedule"]


# The rank worker of the tests and benchmarks is a client: it runs as a rank, in a process of
# its own, so it imports commd_client; nothing else in commd imports it.
CLIENTS_IN_COMMD = {"commd.testing.rank_worker"}


@pytest.mark.parametrize(("package", "forbidden"), [
    ("commd", {"commd_client"}),
    ("commd_client", {"commd"}),
    ("commd_protocol", {"commd", "commd_client"}),
])
def test_packages_import_only_what_they_may(package: str, forbidden: set[str]) -> None:
    wrong = sorted(f"{m} imports {i}" for m in MODULES if top(m) == package
                   and m not in CLIENTS_IN_COMMD
                   for i in imports_of(m) if top(i) in forbidden)
    assert not wrong, "\n".join(wrong)


def test_no_part_of_commd_imports_the_clients_in_it() -> None:
    assert set(MODULES) >= CLIENTS_IN_COMMD  # a rename would make the exception stale
    wrong = sorted(f"{m} imports {i}" for m in MODULES if top(m) == "commd"
                   for i in graph()[m] if i in CLIENTS_IN_COMMD)
    assert not wrong, "\n".join(wrong)


# Which parts of commd each part may import (itself always; commd_protocol and the standard
# library always). Arrows point down: the daemon drives jobs, jobs drive engines; the planner
# is pure; the CLI and the test helpers sit on top or beside, never below.
MAY_IMPORT = {
    "commd.plan": set(),
    "commd.engines": set(),
    "commd.models": set(),
    # the local key, as daemons make and read it; a daemon's status, as `commd status` asks
    "commd.testing": {"commd.daemon", "commd.cli"},
    "commd.compression": {"commd.engines", "commd.plan"},
    "commd.job": {"commd.engines", "commd.compression", "commd.plan"},
    "commd.coordinator": {"commd.compression", "commd.plan"},
    "commd.daemon": {"commd", "commd.job", "commd.coordinator", "commd.engines", "commd.plan",
                     "commd.compression"},
    "commd.cli": {"commd", "commd.daemon", "commd.plan", "commd.compression", "commd.models"},
}


def part(module: str) -> str:
    """The part of commd a module belongs to: ``commd.job.pipeline`` -> ``commd.job``."""
    return ".".join(module.split(".")[:2])


def test_every_part_has_a_rule() -> None:
    parts = {part(m) for m in MODULES if top(m) == "commd" and m != "commd"}
    assert parts == set(MAY_IMPORT)


def test_parts_import_only_the_parts_below_them() -> None:
    wrong = []
    for module in MODULES:
        if top(module) != "commd" or module == "commd":
            continue
        own = part(module)
        for target in graph()[module]:
            if top(target) == "commd" and part(target) != own and \
                    part(target) not in MAY_IMPORT[own]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_no_command_imports_the_cli_back() -> None:
    commands = [m for m in MODULES if m.startswith("commd.cli.") and m != "commd.cli.main"
                and not m.endswith("__main__")]
    assert "commd.cli.status" in commands
    wrong = [m for m in commands if {"commd.cli", "commd.cli.main"} & set(imports_of(m))]
    assert not wrong, f"command modules importing the CLI: {wrong}"
