"""What a training script passes to ``Client`` is checked before anything is created: a
``CommdError`` that is also a ``TypeError`` or ``ValueError``, naming the argument."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from commd_client import CommdError, CommdTypeError, CommdValueError
from commd_client.arguments import check_indices, check_layers
from commd_protocol.checks import MAX_NAME_CHARS

GOOD = [("w", 4, 0), ("b", 2, 0)]


@pytest.mark.parametrize(("layers", "kind", "words"), [
    ([("w", 1.5)], CommdTypeError, "size must be an int"),
    ([("w", True)], CommdTypeError, "size must be an int"),
    ([("w", "4")], CommdTypeError, "size must be an int"),
    ([("w", 0)], CommdValueError, "must be > 0"),
    ([("w", -3)], CommdValueError, "must be > 0"),
    ([("w", 4), ("w", 2)], CommdValueError, "used twice"),
    ([("", 4)], CommdValueError, "name must be a string"),
    ([(7, 4)], CommdValueError, "name must be a string"),
    ([("x" * (MAX_NAME_CHARS + 1), 4)], CommdValueError, "name must be a string"),
    ([("w", 4, 1)], CommdTypeError, "(name, size) or (name, shape) pair"),
    (["w4"], CommdTypeError, "(name, size) or (name, shape) pair"),
    ("w", CommdTypeError, "(name, size) or (name, shape) pairs"),
    (7, CommdTypeError, "(name, size) or (name, shape) pairs"),
    ([("w", 2**40 + 1)], CommdValueError, "at most 2**40"),
    # a layer given by its shape
    ([("w", ())], CommdValueError, "layers[0] ('w') shape is empty"),
    ([("w", [])], CommdValueError, "shape is empty"),
    ([("b", 2), ("w", (3, 0))], CommdValueError, "layers[1] ('w') shape[1] must be > 0, got 0"),
    ([("w", (-3, 4))], CommdValueError, "shape[0] must be > 0, got -3"),
    ([("w", (3, 4.0))], CommdTypeError, "shape[1] must be an int, got 4.0 (float)"),
    ([("w", (3, "4"))], CommdTypeError, "shape[1] must be an int"),
    ([("w", (True, 4))], CommdTypeError, "shape[0] must be an int, got True (bool)"),
    ([("w", (np.bool_(True), 4))], CommdTypeError, "shape[0] must be an int"),
    ([("w", [[3, 4]])], CommdTypeError, "shape[0] must be an int, got [3, 4] (list)"),
    ([("w", (3, None))], CommdTypeError, "shape[1] must be an int"),
    ([("w", (1,) * 9)], CommdValueError, "shape has 9 dimensions; at most 8"),
    ([("w", (2**20, 2**20, 2))], CommdValueError, "has over 2**40 elements"),
    ([("w", (2**64,) * 8)], CommdValueError, "has over 2**40 elements"),
    ([("w", np.array([3, 4]))], CommdTypeError, "size must be an int or a shape"),
    ([("w", {3: 4})], CommdTypeError, "size must be an int or a shape"),
    ([("w", (3, 4)), ("w", 12)], CommdValueError, "used twice"),
    ([], CommdValueError, "at least one layer"),
], ids=lambda value: repr(value)[:30])
def test_bad_layers_name_the_argument(layers: Any, kind: type[Exception], words: str) -> None:
    with pytest.raises(kind, match=r"^commd: .*" + re.escape(words)):
        check_layers(layers, "float32", "sum")


def test_errors_are_commd_errors_and_builtin_ones() -> None:
    assert issubclass(CommdTypeError, CommdError) and issubclass(CommdTypeError, TypeError)
    assert issubclass(CommdValueError, CommdError) and issubclass(CommdValueError, ValueError)


def test_good_layers_come_back_as_plain_triples() -> None:
    assert check_layers([("w", np.int64(4)), ["b", 2]], "float16", "avg") == GOOD


class Size(tuple[int, ...]):
    """Stands in for ``torch.Size``, a tuple subclass (tests/unit imports no torch)."""


def test_a_layer_given_by_its_shape_has_its_product_and_rows() -> None:
    """rows is shape[0] for 2 or more dimensions (the matrix view a low-rank compressor
    uses: ``tensor.view(shape[0], -1)``), 0 for a vector or a bare size."""
    layers = [("conv.weight", Size((64, 3, 7, 7))), ("fc.weight", [10, np.int32(13)]),
              ("bias", (10,)), ("scale", (1, 1)), ("plain", np.int64(5)),
              ("max", (2**20, 2**20))]
    checked = check_layers(layers, "float32", "avg")
    assert checked == [("conv.weight", 9408, 64), ("fc.weight", 130, 10), ("bias", 10, 0),
                       ("scale", 1, 1), ("plain", 5, 0), ("max", 2**40, 2**20)]
    assert all(type(v) is int for _, size, rows in checked for v in (size, rows))


@pytest.mark.parametrize(("layers", "kind"), [
    (True, CommdTypeError), (1.5, CommdTypeError), ("1", CommdTypeError),
    ([0, True], CommdTypeError), (None, CommdTypeError), ([0, 2], CommdValueError),
    (-1, CommdValueError),
], ids=repr)
def test_bad_ready_indices(layers: Any, kind: type[Exception]) -> None:
    with pytest.raises(kind, match=r"^commd: ready"):
        check_indices(layers, 2)


def test_good_ready_indices() -> None:
    assert check_indices(1, 2) == [1]
    assert check_indices(np.int32(0), 2) == [0]
    assert check_indices((1, 0), 2) == [1, 0]


@pytest.mark.parametrize("helper_of", ["job", ("job",), ("job", "1"), (1, 1), ["job", 1]])
def test_a_helper_of_that_is_no_job_and_epoch_is_refused_before_connecting(
        helper_of: object) -> None:
    from commd_client import Client

    with pytest.raises(CommdTypeError, match=r"helper_of must be \(job, epoch\)"):
        Client(job="j", rank=0, world_size=1, local_rank=0, local_world_size=1,
               coordinator="127.0.0.1:1", socket="/nonexistent/commd.sock",
               helper_of=helper_of)  # type: ignore[arg-type]
