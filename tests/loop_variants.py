"""A fixture that runs a test module's tests on each implementation of the compressed path's
loops: numpy's, the compiled ones, and the compiled ones without AVX-512."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from commd.compression import native


@pytest.fixture(params=["numpy", "compiled", "compiled-plain"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test runs on numpy's loops and on the compiled ones, with and without AVX-512
    (where the CPU has it): all must give the same answers. A module imports it and marks
    its tests with ``pytest.mark.usefixtures("loops")``."""
    compiled = native._compiled
    if request.param != "numpy" and compiled is None:
        pytest.skip("the compiled loops are not built (no C compiler at install)")
    if request.param == "compiled-plain" and not (compiled and compiled.AVX512):
        pytest.skip("no AVX-512 here: 'compiled' already ran the plain loops")
    monkeypatch.setattr(native, "enabled", request.param != "numpy")
    if compiled is not None:
        compiled.use_avx512(request.param == "compiled")
    yield request.param
    if compiled is not None:
        compiled.use_avx512(True)
