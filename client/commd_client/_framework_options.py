"""commd's own keywords on a framework's class (Lightning's strategy, Accelerate's Accelerator).

Both integrations take the same six: ``compression``, ``planner``, ``socket``,
``coordinator``, ``job`` and ``commd_timeout`` (seconds for every wait on the daemon, named
apart from the frameworks' own ``timeout``, which is the process group's). They are checked
for their kind here, before the framework sets anything up, so a misconfigured script fails
on every rank alike and at once; what a string means (a compression spec, a planner name) is
the daemon's to judge, at registration, as for ``commd_client.torch.DistributedDataParallel``.
``fault_tolerance="continue"`` is refused here (also from COMMD_FAULT_TOLERANCE): the
frameworks' own collectives run on torch.distributed's process group, which a lost rank stops.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from commd_protocol import CommdError, CommdTypeError, CommdValueError

from . import env


def commd_keywords(owner: str, *, compression: Any, planner: Any, socket: Any,
                   coordinator: Any, job: Any, commd_timeout: Any,
                   fault_tolerance: Any = None, min_world_size: Any = None) -> dict[str, Any]:
    """The keywords to hand to commd's wrapper: only those given (the wrapper's defaults, from
    the environment, stay its own), ``commd_timeout`` as the wrapper's ``timeout``. ``owner``
    names the class in errors (``"Accelerator"``)."""
    texts = {"compression": compression, "planner": planner, "socket": socket,
             "coordinator": coordinator, "job": job}
    given: dict[str, Any] = {}
    for name, value in texts.items():
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise CommdTypeError(
                f"commd: {owner}({name}={value!r:.60}): {name} must be a non-empty string, "
                f"not {type(value).__name__}"
            )
        given[name] = value
    if commd_timeout is not None:
        try:
            given["timeout"] = env.timeout(commd_timeout)
        except CommdError as error:
            raise CommdValueError(
                f"commd: {owner}(commd_timeout={commd_timeout!r:.40}): "
                f"{str(error).removeprefix('commd: ')}"
            ) from None
    if _owned(owner, env.fault_tolerance, fault_tolerance) == "continue":
        # The framework's own collectives (barriers, metric syncs, checkpoint broadcasts) run
        # on torch.distributed's process group, which a lost rank stops for every rank.
        raise CommdValueError(
            f'commd: {owner}: fault_tolerance="continue" (or COMMD_FAULT_TOLERANCE=continue) '
            "is not available here: the framework's own collectives run on torch.distributed's "
            "process group, which a lost rank stops; use commd_client.torch."
            "DistributedDataParallel in a plain training loop (docs/fault-tolerance.md)")
    if min_world_size is not None:
        given["min_world_size"] = _owned(owner, _positive_int, min_world_size)
    return given


def _positive_int(value: Any) -> int:
    """``min_world_size`` before the world size is known: an int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CommdTypeError(f"commd: min_world_size must be an int, got "
                             f"{type(value).__name__} {value!r:.40}")
    if value < 1:
        raise CommdValueError(f"commd: min_world_size={value} must be at least 1")
    return int(value)


def _owned(owner: str, check: Callable[[Any], Any], value: Any) -> Any:
    """``check(value)``, its typed error prefixed with the class the keyword was given to."""
    try:
        return check(value)
    except CommdError as error:
        raise type(error)(f"commd: {owner}: {str(error).removeprefix('commd: ')}") from None
