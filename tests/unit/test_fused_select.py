"""add_and_select (E = S + R and its top-k in one pass) against the two calls it replaces, on
every loop variant: the same residual, velocity, cleared sum and indices, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from commd.compression import kernels
from commd.compression.fused import add_and_select
from commd.compression.kernels import add_and_energy
from commd.compression.topk import TopkScratch, TopkTuning, select_topk

from loop_variants import loops  # noqa: F401

pytestmark = pytest.mark.usefixtures("loops")  # every test on every loop variant

RISKY = TopkTuning(sample_size=16, dense_below=0, spread=0.0, candidates_factor=1.0,
                   candidates_extra=8)  # the sample misses often: both fallbacks run


def buffers(size: int, dtype: type, seed: int, ties: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if ties:
        return [rng.integers(-2, 3, size).astype(dtype) for _ in range(3)]
    return [rng.standard_normal(size).astype(dtype) for _ in range(3)]


def two_calls(residual: np.ndarray, update: np.ndarray, velocity: np.ndarray | None, k: int,
              momentum: float, tuning: TopkTuning) -> tuple[float, np.ndarray, str]:
    energy = add_and_energy(residual, update, True, velocity, momentum)
    scratch = TopkScratch(residual.size, residual.dtype)
    chosen = select_topk(residual, k, scratch, tuning=tuning)
    return energy, chosen, scratch.last_path


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("tuning", [TopkTuning(), RISKY], ids=["default", "risky"])
def test_the_same_as_the_two_calls(dtype: type, momentum: float, tuning: TopkTuning) -> None:
    for size, k, ties in ((70_000, 700, False), (200_003, 1, False), (200_003, 20_000, False),
                          (131_072 * 2 + 5, 3000, True), (1000, 10, False)):
        residual, update, velocity = buffers(size, dtype, size + k, ties)
        mine = [b.copy() for b in (residual, update, velocity)]
        use_velocity = velocity if momentum else None
        energy, chosen, path = two_calls(residual, update, use_velocity, k, momentum, tuning)
        scratch = TopkScratch(size, dtype)
        fused_energy, fused, select_s = add_and_select(
            mine[0], mine[1], k, scratch, clear=True, velocity=mine[2] if momentum else None,
            momentum=momentum, tuning=tuning)
        np.testing.assert_array_equal(fused, chosen)
        for theirs, ours in zip((residual, update, velocity), mine, strict=True):
            np.testing.assert_array_equal(ours, theirs)
        assert not update.any()  # cleared
        assert fused_energy == pytest.approx(energy, rel=1e-5)
        assert select_s > 0
        if size >= tuning.dense_below:
            assert scratch.last_path == path  # the same path, fallbacks included


def test_nan_and_inf_rank_first() -> None:
    residual, update, _ = buffers(100_000, np.float32, 4)
    update[[5, 500, 99_999]] = [np.nan, -np.inf, np.inf]
    _, chosen, _ = add_and_select(residual, update, 2)
    assert chosen.tolist() == [5, 500]


def test_refuses_bad_arguments_before_writing() -> None:
    residual, update, velocity = buffers(100_000, np.float32, 5)
    before = residual.copy()
    with pytest.raises(ValueError, match="k must be positive"):
        add_and_select(residual, update, 0)
    with pytest.raises(TypeError, match="k must be an integer"):
        add_and_select(residual, update, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="momentum"):
        add_and_select(residual, update, 5, velocity=velocity, momentum=1.5)
    with pytest.raises(ValueError, match="update has 10 elements"):
        add_and_select(residual, update[:10], 5)
    with pytest.raises(TypeError, match="velocity is float64"):
        add_and_select(residual, update, 5, velocity=velocity.astype(np.float64), momentum=0.5)
    scratch = TopkScratch(10, np.float32)
    with pytest.raises(ValueError, match="scratch capacity"):
        add_and_select(residual, update, 5, scratch)
    np.testing.assert_array_equal(residual, before)


def test_split_kernels_take_the_two_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels split buffers over threads, the fused pass (one thread) is not used;
    the answer is the same either way."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN", 1000)
    residual, update, _ = buffers(300_000, np.float32, 6)
    expected = two_calls(residual.copy(), update.copy(), None, 3000, 0.0, TopkTuning())
    _, chosen, _ = add_and_select(residual, update, 3000)
    np.testing.assert_array_equal(chosen, expected[1])
