"""tests/unit runs in-process: every phase of each test here runs under tests/unit_guard.py, so
a test (or a fixture of any scope) that starts a process or opens a socket fails, naming what
it did. These hooks apply to the items under this folder only."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import unit_guard


def guarded_phase() -> Generator[None, None, None]:
    unit_guard.violations.clear()
    with unit_guard.guarded():
        yield
    if unit_guard.violations:
        raise unit_guard.UnitTierViolation(
            f"tests/unit runs in-process only, yet this test {unit_guard.violations[0]} "
            "(and caught the error): move it to tests/daemon (or tests/system)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    yield from guarded_phase()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield from guarded_phase()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    yield from guarded_phase()


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    """The daemon's two worker threads, as the pipeline tests give them to a Pipeline."""
    pool = ThreadPoolExecutor(2)
    yield pool
    pool.shutdown()
