"""select_topk against the previous implementation, and the fused kernels against plain numpy."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commd.compression import kernels
from commd.compression.kernels import (
    accumulate_pairs,
    add_and_energy,
    put,
    take_and_clear,
    top_energies,
)
from commd.compression.topk import (
    TopkScratch,
    TopkTuning,
    sample_positions,
    select_topk,
    select_topk_reference,
)
from commd.compression.topk import accumulate_pairs as topk_accumulate_pairs

from loop_variants import loops  # noqa: F401

pytestmark = pytest.mark.usefixtures("loops")  # every test on every loop variant

# Small chunks and samples, so that arrays of a few thousand elements take the sampled path
# over many chunks; candidates_extra small enough that a bad sample overflows.
SMALL = TopkTuning(sample_size=256, dense_below=0, chunk=256, candidates_extra=256)
# A sample so small and a margin so thin that the sampled path often misses and falls back.
RISKY = TopkTuning(sample_size=16, dense_below=0, chunk=64, spread=0.0, candidates_factor=1.0,
                   candidates_extra=8)
DTYPES = [np.float32, np.float64]


@pytest.fixture
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kernel chunks of 64 elements, split over the pool from 1000 elements up."""
    monkeypatch.setattr(kernels, "CHUNK", 64)
    monkeypatch.setattr(kernels, "INDEX_CHUNK", 16)
    monkeypatch.setattr(kernels, "PARALLEL_MIN", 1000)
    yield


@st.composite
def tied_arrays(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Small integer-valued floats (many ties, zeros, both signs) and a k."""
    size = draw(st.sampled_from([1, 2, 63, 64, 65, 255, 256, 257, 1000, 2047, 2048, 3001]))
    levels = draw(st.sampled_from([1, 2, 5, 50]))
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(DTYPES))
    data = np.random.default_rng(seed).integers(-levels, levels + 1, size).astype(dtype)
    k = draw(st.sampled_from([1, 2, size - 1, size, size + 3, max(1, size // 100),
                              max(1, size // 10), max(1, size // 2)]))
    return data, max(1, k)


@settings(max_examples=150, deadline=None)
@given(tied_arrays(), st.booleans())
def test_select_topk_equals_the_reference_on_ties(case: tuple[np.ndarray, int],
                                                  with_scratch: bool) -> None:
    data, k = case
    scratch = TopkScratch(4000, data.dtype) if with_scratch else None
    expected = select_topk_reference(data, k)
    for tuning in (SMALL, RISKY, TopkTuning()):
        got = select_topk(data, k, scratch, tuning=tuning)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, expected)
    with pytest.MonkeyPatch.context() as patch:  # the candidate pass split over the pool
        patch.setattr(kernels, "PARALLEL_MIN", 500)
        np.testing.assert_array_equal(select_topk(data, k, scratch, tuning=SMALL), expected)
        np.testing.assert_array_equal(select_topk(data, k, scratch, tuning=RISKY), expected)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(DTYPES),
       st.sampled_from([0.0005, 0.01, 0.1, 0.3]),
       st.sampled_from([70_000, 131_071, 131_072, 131_073, 262_145]))  # default chunk edges
def test_select_topk_equals_the_reference_on_continuous_data(seed: int, dtype: type,
                                                             ratio: float, size: int) -> None:
    data = np.random.default_rng(seed).standard_cauchy(size).astype(dtype)
    k = max(1, int(ratio * data.size))
    np.testing.assert_array_equal(select_topk(data, k), select_topk_reference(data, k))
    np.testing.assert_array_equal(select_topk(data, k, tuning=SMALL),
                                  select_topk_reference(data, k))


def test_all_equal_arrays_zeros_and_edges() -> None:
    for data in (np.zeros(5000, np.float32), np.full(5000, -2.5), np.ones(70_000, np.float32)):
        for k in (1, 7, 2500, data.size - 1, data.size):
            np.testing.assert_array_equal(select_topk(data, k, tuning=SMALL), np.arange(k))
            np.testing.assert_array_equal(select_topk(data, k), np.arange(k))
    assert select_topk(np.array([3.0], np.float32), 1).tolist() == [0]
    assert select_topk(np.arange(3, dtype=np.float32), 7).tolist() == [0, 1, 2]
    assert select_topk(np.zeros(0, np.float32), 1).tolist() == []


def path_of(data: np.ndarray, k: int, tuning: TopkTuning) -> str:
    scratch = TopkScratch(data.size, data.dtype)
    np.testing.assert_array_equal(select_topk(data, k, scratch, tuning=tuning),
                                  select_topk_reference(data, k))
    return scratch.last_path


def test_each_path_is_taken_and_exact() -> None:
    rng = np.random.default_rng(7)
    data = rng.standard_normal(10_000).astype(np.float32)
    assert path_of(data, 50, SMALL) == "sample"
    assert path_of(data, 10_000, SMALL) == "all"
    assert path_of(data, 50, TopkTuning()) == "dense"  # below dense_below
    assert path_of(data, 9_000, SMALL) == "dense"  # k too large a share for a sample
    positions = sample_positions(data.size, SMALL.sample_size)
    # the sample sees only huge values: the threshold is too high, too few candidates
    few = data.copy()
    few[positions] = 1000 + np.arange(positions.size)
    assert path_of(few, 1000, TopkTuning(sample_size=256, dense_below=0, chunk=256,
                                         candidates_factor=4)) == "fallback-few"
    # the sample sees only zeros: the threshold is 0, everything is a candidate
    many = data.copy()
    many[positions] = 0
    assert path_of(many, 10, TopkTuning(sample_size=256, dense_below=0, chunk=256,
                                        candidates_extra=500)) == "fallback-many"


@settings(max_examples=60, deadline=None)
@given(tied_arrays(), st.integers(0, 2**32 - 1))
def test_nan_counts_as_an_infinite_magnitude(case: tuple[np.ndarray, int], seed: int) -> None:
    data, k = case
    rng = np.random.default_rng(seed)
    spots = rng.integers(0, data.size, rng.integers(1, 4) * max(1, data.size // 50))
    data[spots] = rng.choice(np.array([np.nan, np.inf, -np.inf], data.dtype), spots.size)
    as_inf = np.where(np.isnan(data), np.inf, data)  # the documented meaning of NaN
    expected = select_topk_reference(as_inf, k)
    np.testing.assert_array_equal(select_topk(data, k, tuning=SMALL), expected)
    np.testing.assert_array_equal(select_topk(data, k), expected)


def test_all_nan_and_all_inf_finish() -> None:
    for value in (np.nan, np.inf, -np.inf):
        data = np.full(70_000, value, np.float32)
        np.testing.assert_array_equal(select_topk(data, 700), np.arange(700))
        np.testing.assert_array_equal(select_topk(data, 70, tuning=SMALL), np.arange(70))


def test_scratch_is_reused_across_sizes_and_dtypes_are_checked() -> None:
    rng = np.random.default_rng(3)
    scratch = TopkScratch(300_000, np.float32)
    for size in (300_000, 70_000, 1000, 299_999, 131_073):
        data = rng.standard_normal(size).astype(np.float32)
        for k in (1, size // 1000 + 1, size // 10):
            np.testing.assert_array_equal(select_topk(data, k, scratch),
                                          select_topk_reference(data, k))
    with pytest.raises(TypeError, match="scratch"):
        select_topk(np.zeros(10), 1, scratch)
    with pytest.raises(ValueError, match="capacity"):
        select_topk(np.zeros(300_001, np.float32), 1, scratch)


def test_a_scratch_in_use_is_refused() -> None:
    scratch = TopkScratch(100, np.float32)
    with scratch._busy, pytest.raises(RuntimeError, match="in use"):
        select_topk(np.zeros(100, np.float32), 1, scratch)


def peak_bytes(function: object, *args: object) -> int:
    tracemalloc.start()
    try:
        function(*args)  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_nothing_full_size_is_allocated() -> None:
    size = 4_000_000
    rng = np.random.default_rng(5)
    error = rng.standard_normal(size).astype(np.float32)
    update = rng.standard_normal(size).astype(np.float32)
    scratch = TopkScratch(size, np.float32)
    k = size // 1000
    indices = select_topk(error, k, scratch)  # grows the scratch once
    values = np.empty(k, np.float32)
    limit = error.nbytes // 20
    assert peak_bytes(select_topk, error, k, scratch) < limit
    assert peak_bytes(add_and_energy, error, update) < limit
    assert peak_bytes(take_and_clear, error, indices, values) < limit
    assert peak_bytes(put, update, indices, values) < limit
    pairs = np.concatenate([indices, indices[::2], indices[1::2]])
    assert peak_bytes(accumulate_pairs, update, pairs, np.ones(pairs.size, np.float32)) < limit


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_equal_plain_numpy(tiny_chunks: None, dtype: type) -> None:
    rng = np.random.default_rng(11)
    for size in (0, 1, 63, 64, 65, 999, 1000, 5000):
        residual = rng.standard_normal(size).astype(dtype)
        update = rng.standard_normal(size).astype(dtype)
        expected = residual + update
        energy = add_and_energy(residual, update)
        np.testing.assert_array_equal(residual, expected)
        assert energy == pytest.approx(float(np.sum(expected.astype(np.float64) ** 2)),
                                       rel=1e-5)
        indices = np.flatnonzero(rng.random(size) < 0.3).astype(np.int32)
        values, energy = take_and_clear(residual, indices)
        np.testing.assert_array_equal(values, expected[indices])
        assert energy == pytest.approx(float(np.sum(values.astype(np.float64) ** 2)), rel=1e-5)
        expected[indices] = 0
        np.testing.assert_array_equal(residual, expected)
        update[:] = 0
        put(update, indices, values)
        dense = np.zeros(size, dtype)
        dense[indices] = values
        np.testing.assert_array_equal(update, dense)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_path_clears_the_sum_and_writes_back_into_it(tiny_chunks: None,
                                                                dtype: type) -> None:
    """add_and_energy(clear=True) zeroes the update in its pass; put and
    accumulate_pairs(zeroed=True) then write into it without a pass of their own."""
    rng = np.random.default_rng(12)
    for size in (0, 1, 65, 999, 5000):
        residual = rng.standard_normal(size).astype(dtype)
        update = rng.standard_normal(size).astype(dtype)
        expected = residual + update
        add_and_energy(residual, update, clear=True)
        np.testing.assert_array_equal(residual, expected)
        assert not update.any()
        indices = np.flatnonzero(rng.random(size) < 0.3).astype(np.int32)
        values = rng.standard_normal(indices.size).astype(dtype)
        put(update, indices, values)
        dense = np.zeros(size, dtype)
        dense[indices] = values
        np.testing.assert_array_equal(update, dense)
        pairs = np.concatenate([indices, indices[::2]])
        pair_values = rng.standard_normal(pairs.size).astype(dtype)
        update[:] = 0
        accumulate_pairs(update, pairs, pair_values, zeroed=True)
        added = np.zeros(size, dtype)
        np.add.at(added, pairs, pair_values)
        np.testing.assert_array_equal(update, added)


def test_kernels_on_strided_views(tiny_chunks: None) -> None:
    rng = np.random.default_rng(12)
    base = rng.standard_normal(4000).astype(np.float32)
    target, untouched = base[::2], base[1::2].copy()  # not contiguous: no byte-wise zeroing
    indices = np.arange(0, 2000, 3, dtype=np.int32)
    values = rng.standard_normal(indices.size).astype(np.float32)
    target[:] = 0
    put(target, indices, values)
    dense = np.zeros(2000, np.float32)
    dense[indices] = values
    np.testing.assert_array_equal(target, dense)
    np.testing.assert_array_equal(base[1::2], untouched)
    pairs = np.concatenate([indices, indices])
    accumulate_pairs(target, pairs, np.concatenate([values, values]))
    np.testing.assert_array_equal(target, dense + dense)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 3000), st.integers(0, 2**32 - 1),
       st.sampled_from(DTYPES), st.booleans())
def test_accumulate_pairs_equals_add_at(nodes: int, size: int, seed: int, dtype: type,
                                        split: bool) -> None:
    rng = np.random.default_rng(seed)
    k = rng.integers(0, size + 1)
    blocks = [np.sort(rng.choice(size, k, replace=False)).astype(np.int32)
              for _ in range(nodes)]
    indices = np.concatenate(blocks) if blocks else np.zeros(0, np.int32)
    values = rng.standard_normal(indices.size).astype(dtype)
    values[::7] = -0.0
    expected = np.zeros(size, dtype)
    np.add.at(expected, indices, values)
    target = rng.standard_normal(size).astype(dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "CHUNK", 64)
        patch.setattr(kernels, "PARALLEL_MIN", 500 if split else 10**9)
        accumulate_pairs(target, indices, values)
    np.testing.assert_allclose(target, expected, rtol=1e-6)
    np.testing.assert_array_equal(target, expected)  # the same summation order: bit-identical


def test_accumulate_pairs_in_any_order_and_the_topk_name() -> None:
    rng = np.random.default_rng(2)
    indices = rng.integers(0, 500, 5000).astype(np.int64)  # thousands of runs: np.add.at
    values = rng.standard_normal(indices.size)
    target, expected = np.empty(500), np.zeros(500)
    np.add.at(expected, indices, values)
    topk_accumulate_pairs(target, indices, values)
    np.testing.assert_array_equal(target, expected)


def test_results_do_not_depend_on_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    base = rng.standard_normal(20_000).astype(np.float32)
    update = rng.standard_normal(20_000).astype(np.float32)
    results = []
    for parallel_min in (10**9, 1):
        monkeypatch.setattr(kernels, "PARALLEL_MIN", parallel_min)
        monkeypatch.setattr(kernels, "CHUNK", 512)
        residual = base.copy()
        energy = add_and_energy(residual, update)
        chosen = select_topk(residual, 700, tuning=TopkTuning(dense_below=0, chunk=512,
                                                              sample_size=256))
        values, taken = take_and_clear(residual, chosen)
        results.append((energy, taken, chosen.tolist(), values.tobytes(), residual.tobytes()))
    assert results[0] == results[1]


def test_kernels_run_from_several_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "PARALLEL_MIN", 10_000)  # every call uses the pool
    monkeypatch.setattr(kernels, "CHUNK", 1024)
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(50_000).astype(np.float32) for _ in range(3)]
    expected = [float(np.sum((a.astype(np.float64) * 2) ** 2)) for a in arrays]
    got: list[float] = [0.0] * 3

    def run(i: int) -> None:
        got[i] = add_and_energy(arrays[i], arrays[i].copy())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == pytest.approx(expected, rel=1e-5)


def test_hostile_inputs_raise() -> None:
    data = np.zeros(100, np.float32)
    for k in (0, -3):
        with pytest.raises(ValueError, match="k must be positive"):
            select_topk(data, k)
    with pytest.raises(TypeError, match="k must be an integer"):
        select_topk(data, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="error must be float32 or float64"):
        select_topk(np.zeros(10, np.int32), 1)
    with pytest.raises(ValueError, match="error must be 1-D"):
        select_topk(np.zeros((2, 5), np.float32), 1)
    with pytest.raises(TypeError, match="error must be a numpy array"):
        select_topk([1.0, 2.0], 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TopkScratch dtype"):
        TopkScratch(10, np.float16)
    values = np.ones(2, np.float32)
    for bad in ([5, 100], [-1, 5], [7, 3], [4, 4]):
        data[:] = np.arange(100)
        with pytest.raises(ValueError, match="ascending"):
            take_and_clear(data, np.array(bad, np.int32))
        np.testing.assert_array_equal(data, np.arange(100))  # checked before any write
        data[:] = np.arange(100)
        with pytest.raises(ValueError, match="ascending"):
            put(data, np.array(bad, np.int32), values)
        np.testing.assert_array_equal(data, np.arange(100))  # checked before any write
    for bad in ([5, 100], [-1, 5]):
        with pytest.raises(IndexError, match="indices must be in"):
            accumulate_pairs(data, np.array(bad, np.int32), values)
    with pytest.raises(IndexError, match="indices must be in"):
        accumulate_pairs(data, np.tile(np.array([3, 1000, 0], np.int32), 2000),
                         np.ones(6000, np.float32))
    with pytest.raises(ValueError, match="1 values for 2 indices"):
        put(data, np.array([1, 2], np.int32), values[:1])
    with pytest.raises(TypeError, match="values are float64"):
        accumulate_pairs(data, np.array([1, 2], np.int32), np.ones(2))
    for wrong in (np.array([1.0, 2.0]), np.array([1, 2], np.uint64)):
        with pytest.raises(TypeError, match="indices must hold integers"):
            put(data, wrong, values)
    with pytest.raises(TypeError, match="update is float64"):
        add_and_energy(data, np.zeros(100))
    with pytest.raises(ValueError, match="out must be float32 of 2"):
        take_and_clear(data, np.array([1, 2], np.int32), out=np.zeros(3, np.float32))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), max_size=300),
       st.lists(st.integers(0, 400), max_size=4))
def test_top_energies_equal_a_full_sort(values: list[float], counts: list[int]) -> None:
    array = np.array(values, np.float32)
    descending = np.sort(np.square(array.astype(np.float64)))[::-1]
    expected = [float(descending[:count].sum()) for count in counts]
    assert top_energies(array, counts) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_top_energies_refuse_hostile_counts_and_buffers() -> None:
    for bad in ([-1], [1.5], ["3"]):
        with pytest.raises(ValueError, match="counts must be non-negative integers"):
            top_energies(np.ones(4, np.float32), bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="values must be float32 or float64"):
        top_energies(np.ones(4, np.int64), [1])
