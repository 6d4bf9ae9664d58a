"""Collective engines, created by name through one factory with lazy imports."""

from __future__ import annotations

import functools
import importlib
import logging

from commd.engines.base import Engine, EngineConfig, EngineError

__all__ = [
    "ENGINES",
    "Engine",
    "EngineConfig",
    "EngineError",
    "choose_backend",
    "create_engine",
    "engine_for_buffers",
]

log = logging.getLogger("commd.engines")

# name -> "module:Class"; modules import their libraries only when used.
ENGINES = {"gloo": "commd.engines.gloo:GlooEngine", "nccl": "commd.engines.nccl:NcclEngine"}


def engine_class(name: str) -> type[Engine]:
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown engine {name!r}; valid engines: {', '.join(sorted(ENGINES))}"
        ) from None
    module_name, class_name = target.split(":")
    engine: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return engine


def create_engine(name: str) -> Engine:
    return engine_class(name)()


@functools.cache
def _availability(name: str) -> tuple[bool, str]:
    return engine_class(name).availability()


def choose_backend(requested: str) -> tuple[str, str]:
    """Resolve ``auto``/a name to a usable engine; raise EngineError saying why not.

    Returns (name, why it was chosen).
    """
    if requested != "auto":
        usable, reason = _availability(requested)
        if not usable:
            raise EngineError(f"commd: --backend {requested} cannot run here: {reason}")
        return requested, f"requested ({reason})" if reason else "requested"
    reasons: list[str] = []
    for name in ("nccl", "gloo"):  # the GPU first: it is the production path
        usable, reason = _availability(name)
        if usable:
            found = f"{name} ({reason})" if reason else name
            return name, "auto: " + "; ".join([*reasons, f"chose {found}"])
        log.info("engine %s disabled because %s", name, reason)
        reasons.append(f"{name} disabled because {reason}")
    raise EngineError("commd: no collective engine can run here: " + "; ".join(reasons))


def engine_for_buffers(kind: str, requested: str, chosen: str) -> str:
    """The engine a multi-node job whose buffers live in ``kind`` memory uses.

    The daemon's engine when it takes such buffers; with ``--backend auto`` another usable
    one that does (a host-memory job on a GPU node goes through Gloo). ValueError otherwise.
    """
    if kind in engine_class(chosen).buffer_kinds:
        return chosen
    if requested == "auto":
        for name in ENGINES:
            if kind in engine_class(name).buffer_kinds and _availability(name)[0]:
                return name
    takers = [n for n in sorted(ENGINES) if kind in engine_class(n).buffer_kinds]
    raise ValueError(
        f"this daemon runs the {chosen} engine, which cannot reduce {kind} buffers across "
        f"nodes; run the daemons with --backend {' or '.join(takers) or 'auto'}"
        + (" or register device buffers (device='cuda')" if kind == "cpu" else "")
    )
