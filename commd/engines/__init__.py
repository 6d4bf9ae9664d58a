"""Collective engines, created by name through one factory with lazy imports."""

from __future__ import annotations

import importlib
import logging

from .base import Engine, EngineConfig, EngineError

__all__ = ["ENGINES", "Engine", "EngineConfig", "EngineError", "choose_backend", "create_engine"]

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


def choose_backend(requested: str) -> tuple[str, str]:
    """Resolve ``auto``/a name to a usable engine; raise EngineError saying why not.

    Returns (name, why it was chosen).
    """
    if requested != "auto":
        usable, reason = engine_class(requested).availability()
        if not usable:
            raise EngineError(f"commd: --backend {requested} cannot run here: {reason}")
        return requested, "requested"
    reasons: list[str] = []
    for name in ("nccl", "gloo"):  # the GPU first: it is the production path
        usable, reason = engine_class(name).availability()
        if usable:
            return name, "auto: " + ("; ".join(reasons) or f"{name} is usable")
        log.info("engine %s disabled because %s", name, reason)
        reasons.append(f"{name} disabled because {reason}")
    raise EngineError("commd: no collective engine can run here: " + "; ".join(reasons))
