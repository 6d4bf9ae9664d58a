"""Momentum correction (``topk:...:momentum=M``): the node keeps the velocity u = m·u + S and
sparsifies R + u, in compressed and dense rounds alike; exact against a numpy model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from commd.compression.exchange import GroupExchange
from commd.compression.kernels import add_and_energy
from commd.compression.momentum import add_momentum
from commd.compression.topk import CompressionSpec, parse_compression
from commd.job.compressed import NodeCompression
from commd.job.measurements import WireClock

from loop_variants import loops  # noqa: F401

DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize(("text", "spec"), [
    ("topk:auto:momentum=0.9", CompressionSpec(None, "auto", 0.9)),
    ("topk:0.01:allgather:momentum=0.5", CompressionSpec(0.01, "allgather", 0.5)),
    ("topk:0.1:momentum=0", CompressionSpec(0.1, "auto", 0.0)),
])
def test_parse_momentum(text: str, spec: CompressionSpec) -> None:
    assert parse_compression(text) == spec
    assert parse_compression(str(spec)) == spec  # what status shows parses back


@pytest.mark.parametrize(("bad", "words"), [
    ("topk:auto:momentum=1", "momentum must be in [0, 1)"),
    ("topk:auto:momentum=-0.1", "momentum must be in [0, 1)"),
    ("topk:auto:momentum=1e400", "momentum must be finite"),
    ("topk:auto:momentum=nan", "not understood"),
    ("topk:auto:momentum=", "not understood"),
    ("topk:auto:momentum=0.9:allgather", "not understood"),  # out of order
    ("topk:auto:momentum=0.9:momentum=0.9", "not understood"),
    ("topk:auto:momentum=0.9.9", "momentum '0.9.9' is not a number"),
    ("topk:0.1:momentum=0." + "9" * 200, "not understood"),  # oversized
])
def test_parse_refuses_bad_momentum(bad: str, words: str) -> None:
    with pytest.raises(ValueError, match="compression") as caught:
        parse_compression(bad)
    assert words in str(caught.value)
    assert len(str(caught.value)) < 400  # an oversized spec is not echoed whole


@pytest.mark.usefixtures("loops")  # numpy's loops and the compiled ones
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernels_equal_plain_numpy(dtype: type) -> None:
    rng = np.random.default_rng(3)
    momentum = 0.9
    for size in (0, 1, 999, 300_000):  # the last spans several chunks
        residual, update, velocity = (rng.standard_normal(size).astype(dtype)
                                      for _ in range(3))
        want_velocity = velocity * dtype(momentum) + update
        want_residual = residual + want_velocity
        energy = add_and_energy(residual, update, True, velocity, momentum)
        np.testing.assert_array_equal(velocity, want_velocity)
        np.testing.assert_array_equal(residual, want_residual)
        assert not update.any()  # cleared for the write-back
        assert energy == pytest.approx(float(np.sum(want_residual.astype(np.float64) ** 2)),
                                       rel=1e-5)
        total = rng.standard_normal(size).astype(dtype)
        want_velocity = velocity * dtype(momentum) + total
        want_total = residual * dtype(1 - momentum) + want_velocity
        want_residual = residual * dtype(momentum)
        add_momentum(total, residual, velocity, momentum)
        np.testing.assert_array_equal(velocity, want_velocity)
        np.testing.assert_array_equal(total, want_total)
        np.testing.assert_array_equal(residual, want_residual)  # the rest in later rounds
        # The last round of the release sends the rest; then the residual is left out.
        total = rng.standard_normal(size).astype(dtype)
        want_velocity = velocity * dtype(momentum) + total
        want_total = residual * dtype(1) + want_velocity
        add_momentum(total, residual, velocity, momentum, release_all=True)
        np.testing.assert_array_equal(total, want_total)
        assert not residual.any()
        total = rng.standard_normal(size).astype(dtype)
        want_velocity = velocity * dtype(momentum) + total
        add_momentum(total, None, velocity, momentum)
        np.testing.assert_array_equal(velocity, want_velocity)
        np.testing.assert_array_equal(total, want_velocity)


@pytest.mark.usefixtures("loops")
def test_hostile_kernel_arguments_raise_before_writing() -> None:
    residual, update = np.ones(10, np.float32), np.ones(10, np.float32)
    for momentum in (1.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="momentum must be in"):
            add_and_energy(residual, update, True, np.ones(10, np.float32), momentum)
        with pytest.raises(ValueError, match="momentum must be in"):
            add_momentum(update, residual, np.ones(10, np.float32), momentum)
    with pytest.raises(ValueError, match="velocity has 9 elements"):
        add_and_energy(residual, update, True, np.ones(9, np.float32), 0.9)
    with pytest.raises(TypeError, match="velocity is float64"):
        add_momentum(update, residual, np.ones(10), 0.9)
    with pytest.raises(ValueError, match="total has 3 elements"):
        add_momentum(np.ones(3, np.float32), residual, np.ones(10, np.float32), 0.9)
    with pytest.raises(ValueError, match="total has 3 elements, velocity 10"):
        add_momentum(np.ones(3, np.float32), None, np.ones(10, np.float32), 0.9)
    with pytest.raises(TypeError, match="velocity must be float32 or float64"):
        add_momentum(update, None, np.ones(10, np.int32), 0.9)
    np.testing.assert_array_equal(residual, np.ones(10, np.float32))
    np.testing.assert_array_equal(update, np.ones(10, np.float32))


def node_compression(momentum: float, size: int) -> NodeCompression:
    with ThreadPoolExecutor(1) as unused:  # dense rounds' work runs on the caller's thread
        exchange_ = GroupExchange(None, unused, 0, 1, "float32", WireClock(), momentum)
    return NodeCompression(np.zeros(size, np.float32), exchange_)


def test_dense_rounds_carry_the_velocity_and_release_the_residual_gradually() -> None:
    """A momentum job that runs dense sends u = m·u + S plus (1 − m) of what top-k held back,
    keeping m of it: spread as momentum spreads a gradient; after ``release_iterations``
    dense iterations the rest goes at once and the residual is left out from then on."""
    node = node_compression(0.5, 6)
    assert node.dense_work  # even before any compressed round
    assert node.release_iterations == 10  # 0.5^10 < 1e-3
    node.residual[:] = [8, 0, 0, 0, 0, 16]
    node.pending, node.release_left = True, node.release_iterations  # as after top-k rounds
    sums = [np.array([2, 2, 2, 2, 2, 2], np.float32), np.array([4, 0, 0, 0, 0, 0], np.float32)]
    sent = []
    for total in sums:
        node.flush(total, 0, 6)
        node.end_iteration(["dense"])
        sent.append(total.copy())
    np.testing.assert_array_equal(sent[0], [6, 2, 2, 2, 2, 10])  # u = S, plus R/2
    np.testing.assert_array_equal(sent[1], [7, 1, 1, 1, 1, 5])  # u = 0.5·u + S, plus R/2
    np.testing.assert_array_equal(node.residual, [2, 0, 0, 0, 0, 4])
    released = 0.0
    for _ in range(node.release_iterations - 2):  # with nothing new, the rest goes out
        assert node.pending
        total = np.zeros(6, np.float32)
        velocity_before = node.velocity.copy()
        node.flush(total, 0, 6)
        node.end_iteration(["dense"])
        released += float(total[0] - 0.5 * velocity_before[0])
    assert released == 2.0 and not node.residual.any() and not node.pending
    node.residual[:] = np.nan  # never read again until top-k runs: only the velocity goes
    total = np.ones(6, np.float32)
    node.flush(total, 0, 6)
    assert np.isfinite(total).all() and total[0] == 0.5 * velocity_before[0] * 0.5 + 1
    plain = node_compression(0.0, 6)
    assert plain.velocity is None and not plain.dense_work  # no momentum: nothing to do
