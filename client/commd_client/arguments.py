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
from commd_protocol.limits import MAX_LAYER_ELEMENTS


def _is_index(value: Any) -> bool:
    """An int or a numpy integer; never a bool, float or string."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


MAX_DIMENSIONS = 8  # of a layer given by its shape; torch allows more, no gradient has them


def check_layers(layers: Any, dtype: str, op: str) -> list[tuple[str, int, int]]:
    """``register``'s layers, each ``(name, size)`` or ``(name, shape)``, as (name, size,
    rows) triples: rows is shape[0] for a shape of 2 or more dimensions (the layer's matrix
    view for low-rank compression), else 0. Raises naming the first bad one."""
    if dtype not in DTYPES:
        raise CommdValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if op not in OPS:
        raise CommdValueError(f"unsupported op {op!r}; use one of {', '.join(OPS)}")
    if isinstance(layers, str | bytes) or not isinstance(layers, Iterable):
        raise CommdTypeError(f"register(layers=...) takes (name, size) or (name, shape) pairs, "
                             f"not {type(layers).__name__}")
    triples: list[tuple[str, int, int]] = []
    names: set[str] = set()
    for index, layer in enumerate(layers):
        if not isinstance(layer, Sequence) or isinstance(layer, str | bytes) or len(layer) != 2:
            raise CommdTypeError(f"register(): layers[{index}] must be a (name, size) or "
                                 f"(name, shape) pair, got {layer!r:.100}")
        name, size = layer
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise CommdValueError(f"register(): layers[{index}] name must be a string of 1-"
                                  f"{MAX_NAME_CHARS} characters, got {name!r:.60}")
        where = f"register(): layers[{index}] ({name[:100]!r})"
        if isinstance(size, tuple | list):
            size, rows = _shape(size, where)
        else:
            _check_size(size, where)
            size, rows = int(size), 0
        if name in names:
            raise CommdValueError(f"register(): layer name {name!r} is used twice "
                                  f"(layers[{index}]); layer names must differ")
        names.add(name)
        triples.append((name, size, rows))
    if not triples:
        raise CommdValueError("register() needs at least one layer")
    return triples


def _check_size(size: Any, where: str) -> None:
    if not _is_index(size):
        raise CommdTypeError(f"{where} size must be an int or a shape (a tuple of ints), got "
                             f"{size!r:.60} ({type(size).__name__})")
    if not 0 < size <= MAX_LAYER_ELEMENTS:
        raise CommdValueError(f"{where} size must be > 0 and at most 2**40 elements, got {size}")


def _shape(shape: tuple[Any, ...] | list[Any], where: str) -> tuple[int, int]:
    """A layer's shape (a tuple or list of positive ints, a ``torch.Size``) as (size, rows)."""
    if not shape:
        raise CommdValueError(f"{where} shape is empty; give a scalar as (name, 1)")
    if len(shape) > MAX_DIMENSIONS:
        raise CommdValueError(f"{where} shape has {len(shape)} dimensions; at most "
                              f"{MAX_DIMENSIONS}")
    size = 1
    for axis, dim in enumerate(shape):
        if not _is_index(dim):
            raise CommdTypeError(f"{where} shape[{axis}] must be an int, got {dim!r:.60} "
                                 f"({type(dim).__name__})")
        if dim <= 0:
            raise CommdValueError(f"{where} shape[{axis}] must be > 0, got {dim}")
        size *= int(dim)
        if size > MAX_LAYER_ELEMENTS:  # before the product grows without bound
            raise CommdValueError(f"{where} shape {tuple(shape)!r:.200} has over 2**40 "
                                  "elements")
    return size, (int(shape[0]) if len(shape) >= 2 else 0)


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
