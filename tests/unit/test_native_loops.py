"""The compiled loops (commd/compression/_native.c) called directly, as a hostile caller would:
wrong sizes, read-only or strided buffers, bad indices. Each is refused with a clear error
before anything is written. (Their answers against numpy's: test_topk_kernels.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest

from commd.compression import native
from commd.compression.kernels import accumulate_pairs, put, take_and_clear
from commd.compression.topk import select_topk, select_topk_reference


@pytest.fixture
def loops(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    if native._compiled is None:
        pytest.skip("the compiled loops are not built (no C compiler at install)")
    monkeypatch.setattr(native, "enabled", True)
    yield native._compiled


def floats(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def test_describe_names_the_loops_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    if native._compiled is None:
        assert native.describe().startswith("numpy (the compiled loops were not built")
        return
    monkeypatch.setattr(native, "enabled", True)  # as imported without COMMD_NATIVE=0
    assert native.describe().startswith("compiled")
    monkeypatch.setattr(native, "enabled", False)
    assert native.describe() == "numpy (COMMD_NATIVE=0)"
    assert native.active() is None


def test_add_energy_refuses_mismatched_buffers(loops: ModuleType) -> None:
    residual, update = floats(1000), floats(1000, 1)
    before = residual.copy()
    sums = np.empty(1)
    plain = (0, 0, 0, None, None)  # no candidate pass

    def add(*args: object) -> object:
        return loops.add_energy(*args, *plain)

    with pytest.raises(ValueError, match="update: 999 items of 4 bytes, expected 1000"):
        add(residual, floats(999), None, 0.0, True, False, sums)
    with pytest.raises(ValueError, match="velocity"):
        add(residual, update, floats(10), 0.9, True, False, sums)
    with pytest.raises(ValueError, match="sums"):
        add(residual, update, None, 0.0, True, False, np.empty(2))
    with pytest.raises(ValueError, match="residual: 4004 bytes, not a whole number of 8-byte"):
        add(floats(1001), floats(1001), None, 0.0, True, True, sums)  # float32s as float64s
    read_only = residual.copy()
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError, TypeError)):
        add(read_only, update, None, 0.0, True, False, sums)
    with pytest.raises((BufferError, ValueError, TypeError)):  # strided: not one block
        add(floats(2000)[::2], update, None, 0.0, True, False, sums)
    with pytest.raises(TypeError):
        add(residual, update, None, "fast", True, False, sums)
    index, bits = np.empty(100, np.int32), np.empty(100, np.uint32)
    for k, limit in ((0, 50), (60, 50)):
        with pytest.raises(ValueError, match="k <= limit"):
            loops.add_energy(residual, update, None, 0.0, True, False, sums, 0, k, limit,
                             index, bits)
    with pytest.raises(ValueError, match="candidate buffers"):  # limit + SLACK > 100
        loops.add_energy(residual, update, None, 0.0, True, False, sums, 0, 10, 90, index,
                         bits)
    with pytest.raises(ValueError, match="bits"):
        loops.add_energy(residual, update, None, 0.0, True, False, sums, 0, 10, 50, index,
                         bits[:99])
    np.testing.assert_array_equal(residual, before)
    np.testing.assert_array_equal(update, floats(1000, 1))


def test_select_refuses_bad_sizes(loops: ModuleType) -> None:
    error = floats(5000)
    k, limit = 50, 200
    room = limit + loops.SLACK
    index, bits, work = (np.empty(room, np.int32), np.empty(room, np.uint32),
                         np.empty(room, np.uint32))
    out = np.full(k, -7, np.int32)
    found = loops.select(error, False, 0, k, limit, index, bits, work, out)
    assert found == -1  # threshold 0: every element is a candidate, past the limit
    for bad_k, bad_limit in ((0, limit), (-3, limit), (k, k - 1)):
        with pytest.raises(ValueError, match="k <= limit"):
            loops.select(error, False, 0, bad_k, bad_limit, index, bits, work, out)
    with pytest.raises(ValueError, match="candidate buffers"):  # no room for vector stores
        loops.select(error, False, 0, k, limit, index[:limit], bits[:limit], work, out)
    with pytest.raises(ValueError, match="bits"):
        loops.select(error, False, 0, k, limit, index, bits[:10], work, out)
    with pytest.raises(ValueError, match="out"):
        loops.select(error, False, 0, k, limit, index, bits, work, out[:-1])
    with pytest.raises(ValueError, match="k 20 of 10"):  # k beyond the array
        loops.select(error[:10], False, 0, 20, limit, index, bits, work, np.empty(20, np.int32))
    assert (out == -7).all()
    # pick after a fused pass: found is the caller's word, so it is checked against the buffers
    for found, pick_k in ((limit + 1, k), (k - 1, k), (10, 0)):
        with pytest.raises(ValueError):
            loops.pick(index, bits, found, pick_k, work, out, False)
    assert (out == -7).all()


@pytest.mark.parametrize("indices", [[3, 2, 5], [1, 1, 4], [-1, 2, 3], [0, 5, 100]],
                         ids=["descending", "repeated", "negative", "beyond"])
def test_take_and_put_refuse_bad_indices_before_writing(loops: ModuleType,
                                                        indices: list[int]) -> None:
    error = floats(100)
    before = error.copy()
    bad = np.array(indices, np.int32)
    with pytest.raises(ValueError, match="strictly ascending"):
        take_and_clear(error, bad)
    with pytest.raises(ValueError, match="strictly ascending"):
        put(error, bad, np.ones(3, np.float32))
    np.testing.assert_array_equal(error, before)


def test_accumulate_refuses_indices_out_of_range_before_writing(loops: ModuleType) -> None:
    target = floats(100)
    before = target.copy()
    for bad in ([5, 100], [-1, 3], [2**31 - 1, 0]):
        with pytest.raises(IndexError, match=r"\[0, 100\)"):
            accumulate_pairs(target, np.array(bad, np.int32), np.ones(2, np.float32))
    np.testing.assert_array_equal(target, before)  # not even zeroed
    with pytest.raises(ValueError, match="mode"):
        loops.scatter(target, np.zeros(1, np.int32), np.ones(1, np.float32), False, 3)
    with pytest.raises(ValueError, match="values"):
        loops.scatter(target, np.zeros(2, np.int32), np.ones(1, np.float32), False, 1)


def test_accumulate_many_runs_adds_in_input_order(loops: ModuleType) -> None:
    """Past MAX_RUNS ascending runs the loop goes pair by pair: still np.add.at's sums."""
    rng = np.random.default_rng(3)
    for runs in (1, 3, 1024, 1025, 5000):
        indices = np.concatenate([np.sort(rng.choice(4096, 7, replace=False))
                                  for _ in range(runs)]).astype(np.int32)
        values = rng.standard_normal(indices.size).astype(np.float32)
        expected = np.zeros(4096, np.float32)
        np.add.at(expected, indices, values)
        target = floats(4096)  # garbage: accumulate zeroes it first
        accumulate_pairs(target, indices, values)
        np.testing.assert_array_equal(target, expected)


def test_select_with_nan_inf_and_ties_matches_the_rule(loops: ModuleType) -> None:
    """NaN ranks with +inf, ties go to the lower index, with and without AVX-512."""
    rng = np.random.default_rng(5)
    data = rng.integers(-3, 4, 300_000).astype(np.float32)
    data[[10, 20_000, 299_999]] = [np.nan, np.inf, -np.inf]
    try:
        for simd in (True, False):
            loops.use_avx512(simd)
            for k in (1, 3, 4, 1000, 30_000, 150_000):
                chosen = select_topk(data, k)
                assert chosen.size == k and np.all(np.diff(chosen) > 0)
                infinite = [10, 20_000, 299_999]  # NaN, +inf, -inf: one magnitude, by index
                assert [i for i in chosen.tolist() if i in infinite] == infinite[:k]
                finite = np.nan_to_num(data, nan=np.inf, posinf=np.inf, neginf=-np.inf)
                np.testing.assert_array_equal(chosen, select_topk_reference(finite, k))
    finally:
        loops.use_avx512(True)


def test_select_float64_large_matches_the_reference(loops: ModuleType) -> None:
    data = np.random.default_rng(9).standard_normal(1_000_003)
    for k in (1, 1000, 100_000):
        np.testing.assert_array_equal(select_topk(data, k), select_topk_reference(data, k))


def test_the_compact_wire_entry_points_refuse_bad_buffers(loops: ModuleType) -> None:
    """pack_take and unpack (wire.py's compiled halves) called directly."""
    error = floats(70_000)
    indices = np.arange(0, 70_000, 100, dtype=np.int32)
    k = indices.size
    per = 4 * 2 + 4 * k  # two blocks of 2^16
    before = error.copy()
    with pytest.raises(ValueError, match=f"out: {per - 1} items of 1 bytes, expected {per}"):
        loops.pack_take(error, indices, np.empty(per - 1, np.uint8))
    read_only = error.copy()
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        loops.pack_take(read_only, indices, np.empty(per, np.uint8))
    with pytest.raises(ValueError, match="strictly ascending"):
        loops.pack_take(error, indices[::-1].copy(), np.empty(per, np.uint8))
    with pytest.raises(ValueError, match="not a whole number"):
        loops.pack_take(error.view(np.uint8)[:-1], indices, np.empty(per, np.uint8))
    np.testing.assert_array_equal(error, before)
    out = np.empty(per, np.uint8)
    loops.pack_take(error, indices, out)
    pairs = np.empty(2 * k, np.int32), np.empty(2 * k, np.float32)
    gathered = np.concatenate([out, out])
    assert loops.unpack(gathered, 2, 70_000, k, *pairs) == (0, 0, 0)
    for nodes, n, count in ((0, 70_000, k), (2, -1, k), (2, 70_000, 70_001), (2, 2**31, k)):
        with pytest.raises(ValueError, match="unpack: nodes"):
            loops.unpack(gathered, nodes, n, count, *pairs)
    with pytest.raises(ValueError, match="gathered"):
        loops.unpack(gathered[:-1], 2, 70_000, k, *pairs)
    with pytest.raises(ValueError, match="values"):
        loops.unpack(gathered, 2, 70_000, k, pairs[0], pairs[1][:-1])
    assert loops.unpack(gathered, 2, 69_000, k, *pairs)[0] == 2  # an index past n
    target = np.zeros(70_000, np.float32)
    assert loops.unpack_add(target, gathered, 2, k, True) == (0, 0, 0) and target.any()
    for nodes, count in ((0, k), (2, -1), (2, 70_001)):
        with pytest.raises(ValueError, match="unpack_add: nodes"):
            loops.unpack_add(target, gathered, nodes, count, True)
    with pytest.raises(ValueError, match="gathered"):
        loops.unpack_add(target, gathered[:-1], 2, k, True)
    fixed = target.copy()
    fixed.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        loops.unpack_add(fixed, gathered, 2, k, True)
    short = np.zeros(69_000, np.float32)  # two blocks still: the last one's offsets pass n
    assert loops.unpack_add(short, gathered, 2, k, False)[0] == 2 and not short.any()
