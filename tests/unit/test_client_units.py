"""commd_client's pieces that need no daemon: env defaults, layout, dtypes, failing fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from commd_client import CommdError, env
from commd_client.dtypes import numpy_dtype
from commd_protocol import DEFAULT_PEER_PORT, DEFAULT_SOCKET, DTYPES
from commd_protocol.dtypes import itemsize
from commd_protocol.layout import backward_offsets, group_span

ENV_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "COMMD_JOB", "COMMD_COORDINATOR", "COMMD_SOCKET",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- env ---------------------------------------------------------------------------------------


def test_env_defaults_without_a_launcher(clean_env: pytest.MonkeyPatch) -> None:
    assert (env.rank(), env.world_size(), env.local_rank(), env.local_world_size()) == (0, 1, 0, 1)
    assert env.job() == "default"
    assert env.coordinator() == f"127.0.0.1:{DEFAULT_PEER_PORT}"
    assert env.socket_path() == DEFAULT_SOCKET


def test_env_as_torchrun_sets_it(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "run-42"}.items():
        clean_env.setenv(name, value)
    assert (env.rank(), env.world_size(), env.local_rank(), env.local_world_size()) == (5, 8, 1, 4)
    assert env.job() == "run-42"
    assert env.coordinator() == f"node0:{DEFAULT_PEER_PORT}"
    assert env.socket_path() == DEFAULT_SOCKET


def test_commd_variables_override(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_ADDR", "node0")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "run-42")
    clean_env.setenv("COMMD_JOB", "mine")
    clean_env.setenv("COMMD_COORDINATOR", "10.0.0.9:1234")
    clean_env.setenv("COMMD_SOCKET", "/tmp/elsewhere.sock")
    assert env.job() == "mine"
    assert env.coordinator() == "10.0.0.9:1234"
    assert env.socket_path() == "/tmp/elsewhere.sock"


def test_job_falls_back_to_the_rendezvous_address(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's value when no id is given
    clean_env.setenv("MASTER_ADDR", "node0")
    clean_env.setenv("MASTER_PORT", "29500")
    assert env.job() == "node0-29500"
    clean_env.delenv("MASTER_PORT")
    assert env.job() == "node0-0"
    clean_env.setenv("COMMD_JOB", "")  # empty means unset
    assert env.job() == "node0-0"
    clean_env.delenv("MASTER_ADDR")
    assert env.job() == "default"


@pytest.mark.parametrize(
    ("name", "read"),
    [("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
     ("LOCAL_WORLD_SIZE", env.local_world_size)],
)
@pytest.mark.parametrize("value", ["abc", "", "1.5", "0x1"])
def test_non_integer_env_names_the_variable(
    clean_env: pytest.MonkeyPatch, name: str, read: object, value: str
) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(CommdError) as info:
        read()  # type: ignore[operator]
    assert str(info.value) == f"commd: {name}={value!r} is not an integer"


def test_client_with_a_bad_rank_fails_before_connecting(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from commd_client import Client

    clean_env.setenv("RANK", "first")
    with pytest.raises(CommdError, match="RANK='first' is not an integer"):
        Client(socket=str(tmp_path / "none.sock"), timeout=1)


# --- layout ------------------------------------------------------------------------------------


def test_backward_offsets_small() -> None:
    assert backward_offsets([]) == []
    assert backward_offsets([5]) == [0]
    assert backward_offsets([1, 2, 3]) == [5, 3, 0]
    assert backward_offsets([4, 0, 2]) == [2, 2, 0]


def random_sizes(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    sizes = rng.integers(1, 5000, size=count)
    sizes[rng.random(count) < 0.1] = 0  # a few empty layers too
    return [int(s) for s in sizes]


@pytest.mark.parametrize("seed", range(20))
def test_backward_offsets_put_the_last_layer_first(seed: int) -> None:
    sizes = random_sizes(seed)
    offsets = backward_offsets(sizes)
    assert offsets[-1] == 0
    for index in range(len(sizes) - 1):
        assert offsets[index] == offsets[index + 1] + sizes[index + 1]
    # every element belongs to exactly one layer
    owner = np.full(sum(sizes), -1)
    for index, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        assert (owner[offset:offset + size] == -1).all()
        owner[offset:offset + size] = index
    assert (owner >= 0).all()


@pytest.mark.parametrize("seed", range(20))
def test_every_adjacent_group_is_one_contiguous_span(seed: int) -> None:
    sizes = random_sizes(seed)
    offsets = backward_offsets(sizes)
    flat = np.arange(sum(sizes))
    views = [flat[o:o + n] for o, n in zip(offsets, sizes, strict=True)]
    for low in range(len(sizes)):
        for high in range(low, len(sizes)):
            group = list(range(low, high + 1))
            start, stop = group_span(group, sizes, offsets)
            assert stop - start == sum(sizes[low:high + 1])
            assert start == offsets[high]
            # the span is exactly the group's layers, last layer first
            joined = np.concatenate([views[i] for i in reversed(group)])
            assert np.array_equal(flat[start:stop], joined)
            # order of the group's indices does not matter
            assert group_span(group[::-1], sizes, offsets) == (start, stop)


def test_a_whole_model_is_the_whole_buffer() -> None:
    sizes = [3, 1, 4, 1, 5]
    offsets = backward_offsets(sizes)
    assert group_span(range(len(sizes)), sizes, offsets) == (0, sum(sizes))
    assert group_span([2], sizes, offsets) == (offsets[2], offsets[2] + 4)


# --- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected", "size"),
    [("float32", np.float32, 4), ("float64", np.float64, 8), ("float16", np.float16, 2),
     ("bfloat16", np.uint16, 2)],
)
def test_numpy_dtype(dtype: str, expected: type, size: int) -> None:
    assert numpy_dtype(dtype) == np.dtype(expected)
    assert itemsize(dtype) == size


def test_every_protocol_dtype_has_a_numpy_dtype() -> None:
    for dtype in DTYPES:
        assert isinstance(numpy_dtype(dtype), np.dtype)


@pytest.mark.parametrize("bad", ["int8", "bf16", "Float32", "", "float"])
def test_bad_dtype(bad: str) -> None:
    with pytest.raises(CommdError) as info:
        numpy_dtype(bad)
    message = str(info.value)
    assert message.startswith(f"commd: unsupported dtype {bad!r}")
    for dtype in DTYPES:
        assert dtype in message
