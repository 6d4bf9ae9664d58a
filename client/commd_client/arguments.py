"""Checks of what a training script passes to ``Client``, before anything is created.

Each failure is a ``CommdError`` that is also a ``TypeError`` (wrong kind of value) or a
``ValueError`` (wrong value), naming the argument, so that generic handlers work too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from commd_protocol import DTYPES, OPS, CommdTypeError, CommdValueError
from commd_protocol.checks import MAX_NAME_CHARS


def _is_index(value: Any) -> bool:
    """An int or a numpy integer; never a bool, float or string."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_layers(layers: Any, dtype: str, op: str) -> list[tuple[str, int]]:
    """``register``'s layers as (name, size) pairs; raises naming the first bad one."""
    if dtype not in DTYPES:
        raise CommdValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if op not in OPS:
        raise CommdValueError(f"unsupported op {op!r}; use one of {', '.join(OPS)}")
    if isinstance(layers, str | bytes) or not isinstance(layers, Iterable):
        raise CommdTypeError(f"register(layers=...) takes (name, size) pairs, not "
                             f"{type(layers).__name__}")
    pairs: list[tuple[str, int]] = []
    names: set[str] = set()
    for index, layer in enumerate(layers):
        if not isinstance(layer, Sequence) or isinstance(layer, str | bytes) or len(layer) != 2:
            raise CommdTypeError(f"register(): layers[{index}] must be a (name, size) pair, "
                                 f"got {layer!r}")
        name, size = layer
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise CommdValueError(f"register(): layers[{index}] name must be a string of 1-"
                                  f"{MAX_NAME_CHARS} characters, got {name!r:.60}")
        if not _is_index(size):
            raise CommdTypeError(f"register(): layers[{index}] ({name!r}) size must be an "
                                 f"int, got {size!r} ({type(size).__name__})")
        if size <= 0:
            raise CommdValueError(f"register(): layers[{index}] ({name!r}) size must be > 0, "
                                  f"got {size}")
        if name in names:
            raise CommdValueError(f"register(): layer name {name!r} is used twice "
                                  f"(layers[{index}]); layer names must differ")
        names.add(name)
        pairs.append((name, int(size)))
    if not pairs:
        raise CommdValueError("register() needs at least one layer")
    return pairs


def check_indices(layers: Any, count: int) -> list[int]:
    """``ready``'s argument as layer indices: ints in 0..count-1."""
    values = [layers] if _is_index(layers) else layers
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise CommdTypeError(f"ready() takes a layer index or a list of them, not "
                             f"{type(layers).__name__} {layers!r:.40}")
    indices = []
    for value in values:
        if not _is_index(value):
            raise CommdTypeError(f"ready({value!r}): a layer index is an int, not "
                                 f"{type(value).__name__}")
        if not 0 <= value < count:
            raise CommdValueError(f"ready({value}): no such layer; registered layers are "
                                  f"0..{count - 1}")
        indices.append(int(value))
    return indices


def check_fits(nbytes: int) -> None:
    """A host buffer of ``nbytes`` must fit in this machine's memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > memory:
        raise CommdValueError(f"register(): the layers need {nbytes} bytes, more than this "
                              f"machine's {memory} bytes of memory")
