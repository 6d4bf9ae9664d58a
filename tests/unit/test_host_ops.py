"""Node-local arithmetic: sums, scaling and copies, bit-exact against references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from commd.engines.host_ops import copy_to, scale, sum_into

FLOATS: dict[str, Any] = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
INT_VIEW: dict[Any, Any] = {np.float16: np.int16, np.float32: np.int32, np.float64: np.int64}


def random_floats(rng: np.random.Generator, dtype: Any, n: int) -> np.ndarray:
    """Values of many magnitudes and both signs, plus zeros and exact ties."""
    finfo = np.finfo(dtype)
    exponents = rng.uniform(np.log2(float(finfo.tiny)) / 2, np.log2(float(finfo.max)) / 4, n)
    values = rng.choice([-1.0, 1.0], n) * rng.uniform(1, 2, n) * np.exp2(exponents)
    values[:: 17] = 0.0
    values[1:: 23] = -0.0
    return values.astype(dtype)


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in units in the last place (sign-magnitude ordered)."""
    ints = INT_VIEW[a.dtype.type]

    def ordered(x: np.ndarray) -> np.ndarray:
        bits = x.view(ints).astype(np.int64)
        return np.where(bits < 0, np.iinfo(ints).min - bits, bits)

    return np.abs(ordered(a) - ordered(b))


# --- float32 / float64 / float16 ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(FLOATS))
def test_sum_of_two_matches_float64(name: str) -> None:
    dtype = FLOATS[name]
    rng = np.random.default_rng(1)
    a, b = random_floats(rng, dtype, 50_000), random_floats(rng, dtype, 50_000)
    # near-cancellations and same-magnitude pairs, where rounding matters most
    b[:1000] = -a[:1000] * dtype(1 + np.finfo(dtype).eps)
    b[1000:2000] = a[1000:2000]
    target = a.copy()
    sum_into(target, [b], name)
    expected = (a.astype(np.float64) + b.astype(np.float64)).astype(dtype)
    assert np.array_equal(target.view(INT_VIEW[dtype]), expected.view(INT_VIEW[dtype]))


@pytest.mark.parametrize("name", list(FLOATS))
@pytest.mark.parametrize("count", [0, 2, 3, 7])
def test_sum_of_many_is_the_sequential_sum(name: str, count: int) -> None:
    dtype = FLOATS[name]
    rng = np.random.default_rng(count)
    target = (rng.standard_normal(10_000) * 10).astype(dtype)
    sources = [(rng.standard_normal(10_000) * 10).astype(dtype) for _ in range(count)]
    expected = target.astype(np.float64)
    for source in sources:  # each step rounded to the dtype, as a running sum does
        expected = (expected + source.astype(np.float64)).astype(dtype).astype(np.float64)
    exact = target.astype(np.float64) + sum(s.astype(np.float64) for s in sources)
    out = target.copy()
    sum_into(out, sources, name)
    assert out.dtype == dtype
    assert np.array_equal(out, expected.astype(dtype))
    tolerance = 8 * count * np.finfo(dtype).eps * (np.abs(target) + sum(np.abs(s) for s in
                                                                     sources) + 1e-3)
    assert np.all(np.abs(out.astype(np.float64) - exact) <= tolerance)


@pytest.mark.parametrize("count", [1, 3])
def test_float16_sum_is_torchs_running_sum(count: int) -> None:
    """Each addition rounded to float16 exactly as torch's (and Gloo's) float16 add rounds
    it, over every finite bit pattern's magnitude (subnormals and overflow included)."""
    rng = np.random.default_rng(20 + count)
    words = rng.integers(0, 1 << 16, 500_000, dtype=np.uint32).astype(np.uint16)
    words = words[(words & 0x7C00) != 0x7C00][: 100_000 * (count + 1)]
    target, *sources = np.split(words.view(np.float16), count + 1)
    out = target.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        sum_into(out, sources, "float16")
    total = torch.from_numpy(target.copy())
    for source in sources:
        total = total + torch.from_numpy(source)
    assert np.array_equal(out.view(np.uint16), total.numpy().view(np.uint16))


@pytest.mark.parametrize("name", list(FLOATS))
def test_sum_into_views_of_a_flat_buffer(name: str) -> None:
    dtype = FLOATS[name]
    flat = np.arange(100, dtype=dtype)
    other = np.full(100, 0.5, dtype=dtype)
    sum_into(flat[10:20], [other[30:40]], name)
    sum_into(flat[50::5], [other[::10]], name)  # strided too
    expected = np.arange(100, dtype=np.float64)
    expected[10:20] += 0.5
    expected[50::5] += 0.5
    assert np.array_equal(flat, expected.astype(dtype))


@pytest.mark.parametrize("name", list(FLOATS))
def test_special_values(name: str) -> None:
    dtype = FLOATS[name]
    a = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, -0.0, np.finfo(dtype).max], dtype)
    b = np.array([1.0, 1.0, 1.0, -0.0, -0.0, 0.0, np.finfo(dtype).max], dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = (a.astype(np.float64) + b.astype(np.float64)).astype(dtype)
        out = a.copy()
        sum_into(out, [b], name)
    assert np.array_equal(out, expected, equal_nan=True)
    assert np.array_equal(np.signbit(out[:-2]), np.signbit(expected[:-2]))  # NaN sign: any
    assert out[-1] == np.inf


@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0, 2.0, 1 / 8])
@pytest.mark.parametrize("name", list(FLOATS))
def test_scale_by_a_power_of_two_is_exact(name: str, factor: float) -> None:
    dtype = FLOATS[name]
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(10_000) * 100).astype(dtype)
    out = values.copy()
    scale(out, factor, name)
    assert out.dtype == dtype
    assert np.array_equal(out, (values.astype(np.float64) * factor).astype(dtype))


@pytest.mark.parametrize("factor", [1 / 3, 1 / 5, 1 / 6, 1 / 7, 0.1])
@pytest.mark.parametrize("name", list(FLOATS))
def test_scale_is_within_one_ulp_of_float64(name: str, factor: float) -> None:
    dtype = FLOATS[name]
    rng = np.random.default_rng(4)
    values = (rng.standard_normal(20_000) * 100).astype(dtype)
    out = values.copy()
    scale(out, factor, name)
    expected = (values.astype(np.float64) * factor).astype(dtype)
    assert ulps(out, expected).max() <= 1
    if name == "float64":
        assert np.array_equal(out, expected)


@pytest.mark.parametrize("name", ["float32", "float64"])
@pytest.mark.parametrize("factor", [1 / 3, 1 / 7, 0.1])
def test_scale_matches_torch_mul(name: str, factor: float) -> None:
    dtype = FLOATS[name]
    values = (np.random.default_rng(5).standard_normal(20_000) * 100).astype(dtype)
    out = values.copy()
    scale(out, factor, name)
    assert np.array_equal(out, torch.from_numpy(values).mul(factor).numpy())


@pytest.mark.parametrize("factor", [1 / 3, 0.1])
def test_float16_scale_matches_torch_mul(factor: float) -> None:
    values = (np.random.default_rng(6).standard_normal(20_000) * 100).astype(np.float16)
    out = values.copy()
    scale(out, factor, "float16")
    assert np.array_equal(out, torch.from_numpy(values).mul(factor).numpy())


@pytest.mark.parametrize("name", [*FLOATS, "bfloat16"])
def test_copy_to_every_target_bit_for_bit(name: str) -> None:
    dtype = FLOATS.get(name, np.uint16)
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2 ** (8 * np.dtype(dtype).itemsize), 1000, dtype=np.uint64)
    source = words.astype(INT_VIEW.get(dtype, np.uint16)).view(dtype)  # NaN payloads, -0 too
    flat = np.zeros(3000, dtype=dtype)
    targets = [flat[0:1000], flat[1000:2000], flat[2000:3000]]
    copy_to(targets, source)
    for target in targets:
        assert target.tobytes() == source.tobytes()
    copy_to([], source)  # nothing to do


# --- bfloat16 as raw uint16 words, against torch --------------------------------------------------


def as_torch(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.copy()).view(torch.bfloat16)


def as_words(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.uint16).numpy()


def random_words(rng: np.random.Generator, n: int) -> np.ndarray:
    """Every finite bfloat16 pattern is possible, incl. subnormals, zeros and the largest."""
    words = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    finite = (words & 0x7F80) != 0x7F80
    return words[finite]


def close_pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Operands of nearby magnitude: their exact sums often need rounding, incl. ties."""
    a = rng.integers(0x3000, 0x5000, n, dtype=np.uint32)
    shift = rng.integers(0, 10, n, dtype=np.uint32) << 7  # 0..9 binades apart
    b = (a - np.minimum(shift, a - 0x80) + rng.integers(0, 128, n, dtype=np.uint32)) & 0x7FFF
    sign = (rng.integers(0, 2, n, dtype=np.uint32) << 15)
    return a.astype(np.uint16), (b | sign).astype(np.uint16)


def torch_sum(words: list[np.ndarray]) -> np.ndarray:
    total = as_torch(words[0]).float()
    for w in words[1:]:
        total = total + as_torch(w).float()
    return as_words(total.bfloat16())


def ties() -> tuple[np.ndarray, np.ndarray]:
    """Exact halfway cases: 1 + 2^-8 (to even: down), (1 + 2^-7) + 2^-8 (to even: up), …"""
    one, one_ulp, half_ulp = 0x3F80, 0x3F81, 0x3B80  # 1.0, 1 + 2^-7, 2^-8
    a = np.array([one, one_ulp, 0xBF80, 0xBF81, 0x4000, 0x7F7F, 0x7F7F, 0x0001, 0x8001, 0x0080],
                 np.uint16)
    b = np.array([half_ulp, half_ulp, 0xBB80, 0xBB80, 0x3C00, 0x7B80, 0x7B00, 0x0001, 0x0001,
                  0x8001], np.uint16)
    return a, b


def test_bfloat16_ties_round_to_even_like_torch() -> None:
    a, b = ties()
    out = a.copy()
    with np.errstate(over="ignore"):
        sum_into(out, [b], "bfloat16")
    expected = torch_sum([a, b])
    assert [hex(w) for w in out] == [hex(w) for w in expected]
    assert out[0] == 0x3F80 and out[1] == 0x3F82  # to even, both ways
    assert out[5] == 0x7F80  # the largest finite bfloat16 plus an ulp overflows to inf
    assert out[6] == 0x7F80  # … and so does plus half an ulp (a tie; 0x7F7F is odd)


@pytest.mark.parametrize("seed", range(4))
def test_bfloat16_sum_of_two_is_bit_identical_to_torch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pairs = random_words(rng, 120_000)
    half = len(pairs) // 2
    a, b = pairs[:half], pairs[half : 2 * half]
    near_a, near_b = close_pairs(rng, 60_000)
    a, b = np.concatenate([a, near_a]), np.concatenate([b, near_b])
    target = a.copy()
    with np.errstate(over="ignore"):
        sum_into(target, [b], "bfloat16")
    expected = torch_sum([a, b])
    mismatch = np.flatnonzero(target != expected)
    assert mismatch.size == 0, [(hex(a[i]), hex(b[i]), hex(target[i]), hex(expected[i]))
                                for i in mismatch[:5]]
    # and the rounding really mattered in many of these
    widened = as_torch(a).float() + as_torch(b).float()
    assert (widened.view(torch.int32).numpy() & 0xFFFF != 0).mean() > 0.3


def torch_running_sum(words: list[np.ndarray]) -> np.ndarray:
    """torch's bfloat16 additions one after another: each one rounded to bfloat16, as Gloo's
    and NCCL's bfloat16 sums are (``c10::BFloat16`` adds in float32 and rounds)."""
    total = as_torch(words[0])
    for w in words[1:]:
        total = total + as_torch(w)
    return as_words(total)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5])
def test_bfloat16_sum_of_many_is_the_running_bfloat16_sum(count: int) -> None:
    """Several local ranks: every addition rounded to bfloat16, in rank order, not a float32
    sum rounded once (which differs from what a collective's own additions give)."""
    rng = np.random.default_rng(100 + count)
    n = 30_000
    target = as_words((torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 4).bfloat16())
    sources = [as_words(torch.from_numpy(rng.standard_normal(n).astype(np.float32)).bfloat16())
               for _ in range(count)]
    out = target.copy()
    sum_into(out, sources, "bfloat16")
    assert out.dtype == np.uint16
    assert np.array_equal(out, torch_running_sum([target, *sources]))
    if count >= 2:  # the rounding of the running sum really mattered here
        assert not np.array_equal(out, torch_sum([target, *sources]))


def test_bfloat16_into_views_of_a_flat_buffer() -> None:
    rng = np.random.default_rng(9)
    flat = random_words(rng, 5000)[:4000].copy()
    other = random_words(rng, 5000)[:4000].copy()
    before = flat.copy()
    sum_into(flat[100:600], [other[1000:1500]], "bfloat16")
    sum_into(flat[2000::7], [other[:: 10][: len(flat[2000::7])]], "bfloat16")
    expected = before.copy()
    expected[100:600] = torch_sum([before[100:600], other[1000:1500]])
    expected[2000::7] = torch_sum([before[2000::7], other[::10][: len(before[2000::7])]])
    assert np.array_equal(flat, expected)


def test_bfloat16_special_values() -> None:
    inf, ninf, one, zero, nzero = 0x7F80, 0xFF80, 0x3F80, 0x0000, 0x8000
    a = np.array([inf, inf, ninf, zero, nzero, nzero, 0x7F7F, 0x7FC1, 0x7F81], np.uint16)
    b = np.array([one, ninf, one, nzero, nzero, zero, 0x7F7F, one, zero], np.uint16)
    out = a.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        sum_into(out, [b], "bfloat16")
    got = as_torch(out).float().numpy()
    want = (as_torch(a).float() + as_torch(b).float()).numpy()
    # NaN stays NaN (torch's own NaN bit patterns differ between code paths; any NaN will do)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(out[finite], torch_sum([a, b])[finite])
    assert np.isnan(got[[1, 7, 8]]).all()  # inf + -inf, and NaN inputs
    assert list(out[[0, 2, 3, 4, 5, 6]]) == [inf, ninf, zero, nzero, zero, inf]


@pytest.mark.parametrize("factor", [0.5, 1 / 3, 1 / 6, 0.1, 3.0])
def test_bfloat16_scale_is_bit_identical_to_torch(factor: float) -> None:
    rng = np.random.default_rng(11)
    words = random_words(rng, 60_000)
    out = words.copy()
    with np.errstate(over="ignore"):
        scale(out, factor, "bfloat16")
    assert np.array_equal(out, as_words(as_torch(words).float().mul(factor).bfloat16()))
    assert np.array_equal(out, as_words(as_torch(words).mul(factor)))
