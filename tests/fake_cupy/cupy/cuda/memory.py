"""Fake device memory: each allocation is a shared-memory segment mapped at a made-up address;
an "IPC handle" is the segment's name, so another process can map the same bytes."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

_PREFIX = "fakegpu-"
_addresses = itertools.count(1 << 36, 1 << 32)
_names = itertools.count()


@dataclass
class Mapping:
    name: str
    size: int
    map: mmap.mmap
    owner: bool


MAPPINGS: dict[int, Mapping] = {}


def _map(name: str, size: int | None, owner: bool) -> int:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
    try:
        if owner:
            os.ftruncate(fd, size or 1)
        length = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, length)
    finally:
        os.close(fd)
    base = next(_addresses)
    MAPPINGS[base] = Mapping(name, length, mapped, owner)
    return base


def allocate(size: int) -> int:
    return _map(f"{_PREFIX}{os.getpid()}-{next(_names)}", size, owner=True)


def open_handle(handle: bytes) -> int:
    return _map(handle.rstrip(b"\0").decode(), None, owner=False)


def handle_of(pointer: int) -> bytes:
    return MAPPINGS[pointer].name.encode().ljust(64, b"\0")


def release(pointer: int) -> None:
    mapping = MAPPINGS.pop(pointer)
    if mapping.owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{mapping.name}")
    with contextlib.suppress(BufferError):  # views still alive keep the mapping
        mapping.map.close()


def locate(pointer: int) -> tuple[Mapping, int]:
    for base, mapping in MAPPINGS.items():
        if base <= pointer < base + mapping.size:
            return mapping, pointer - base
    raise ValueError(f"fake cupy: {pointer:#x} is not in any allocation")


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
        self.ptr, self.size, self.owner = ptr, size, owner


class MemoryPointer:
    def __init__(self, memory: UnownedMemory, offset: int) -> None:
        self.mem, self.ptr = memory, memory.ptr + offset


def ndarray(shape: tuple[int, ...], dtype: Any, memptr: MemoryPointer) -> np.ndarray:
    mapping, offset = locate(memptr.ptr)
    count = int(np.prod(shape))
    return np.frombuffer(mapping.map, dtype=dtype, count=count, offset=offset).reshape(shape)
