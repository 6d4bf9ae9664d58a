"""What a training script passes to ``Client`` is checked before anything is created: a
``CommdError`` that is also a ``TypeError`` or ``ValueError``, naming the argument."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from commd_client import CommdError, CommdTypeError, CommdValueError
from commd_client.arguments import check_indices, check_layers
from commd_protocol.checks import MAX_NAME_CHARS

GOOD = [("w", 4), ("b", 2)]


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
    ([("w", 4, 1)], CommdTypeError, "(name, size) pair"),
    (["w4"], CommdTypeError, "(name, size) pair"),
    ("w", CommdTypeError, "(name, size) pairs"),
    (7, CommdTypeError, "(name, size) pairs"),
    ([], CommdValueError, "at least one layer"),
], ids=lambda value: repr(value)[:30])
def test_bad_layers_name_the_argument(layers: Any, kind: type[Exception], words: str) -> None:
    with pytest.raises(kind, match=r"^commd: .*" + words.replace("(", r"\(").replace(")", r"\)")):
        check_layers(layers, "float32", "sum")


def test_errors_are_commd_errors_and_builtin_ones() -> None:
    assert issubclass(CommdTypeError, CommdError) and issubclass(CommdTypeError, TypeError)
    assert issubclass(CommdValueError, CommdError) and issubclass(CommdValueError, ValueError)


def test_good_layers_come_back_as_plain_pairs() -> None:
    assert check_layers([("w", np.int64(4)), ["b", 2]], "float16", "avg") == GOOD


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
