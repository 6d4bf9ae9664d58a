"""commd's own keywords on a framework's class (Lightning's strategy, Accelerate's Accelerator).

Both integrations take the same six: ``compression``, ``planner``, ``socket``,
``coordinator``, ``job`` and ``commd_timeout`` (seconds for every wait on the daemon, named
apart from the frameworks' own ``timeout``, which is the process group's). They are checked
for their kind here, before the framework sets anything up, so a misconfigured script fails
on every rank alike and at once; what a string means (a compression spec, a planner name) is
the daemon's to judge, at registration, as for ``commd_client.torch.DistributedDataParallel``.
"""

from __future__ import annotations

from typing import Any

from commd_protocol import CommdError, CommdTypeError, CommdValueError

from . import env


def commd_keywords(owner: str, *, compression: Any, planner: Any, socket: Any,
                   coordinator: Any, job: Any, commd_timeout: Any) -> dict[str, Any]:
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
    return given
