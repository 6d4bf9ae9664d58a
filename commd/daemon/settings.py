"""One typed settings object: defaults ← config file ← COMMD_* environment ← command line.

Every option is declared once, as a field of ``Settings`` with its type, default and help;
``OPTIONS``, argparse flags, environment variables and TOML keys are derived from the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from commd_protocol import DEFAULT_PEER_PORT, DEFAULT_SOCKET
from commd_protocol.address import split_host_port as split_address
from commd_protocol.limits import MAX_LAYERS

BACKENDS = ("auto", "gloo", "nccl")
LOG_LEVELS = ("debug", "info", "warning", "error")


class SettingsError(ValueError):
    """A bad option value, naming where it came from."""


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A settings field: its default, its help line and its valid values, said once."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Settings:
    """Every option of the daemon, typed, as resolved from the defaults, the config file, the
    environment and the command line; each field's metadata holds its help line and valid
    values."""

    socket: str = _option(DEFAULT_SOCKET, "ipc socket path for this node's training processes")
    listen: str = _option("", f"HOST:PORT for peer daemons ('': 0.0.0.0:{DEFAULT_PEER_PORT} "
                          f"with a cluster key, else 127.0.0.1:{DEFAULT_PEER_PORT})")
    cluster_key: str = _option("", "cluster key file (`commd keygen PATH`), the same on every "
                               "node: peers must hold it. Without it only loopback is served, "
                               "keyed with the local key cluster.key beside --socket (made if "
                               "absent, mode 0640), shared by daemons whose sockets are there")
    insecure: bool = _option(False, "no key at all: serve peers (also beyond loopback) to "
                             "anyone who reaches the port; no protection (only on a network "
                             "and host where everyone is trusted)")
    backend: str = _option("auto", "collective engine (auto: nccl with a GPU, else gloo)",
                           BACKENDS)
    advertise: str = _option("", "address peers reach this node's engine at (default: the "
                             "local address that routes to the coordinator)")
    timeout_s: float = _option(300.0, "engine set-up and collective timeout in seconds; also "
                               "how long a job may take to form before it fails")
    peer_timeout_s: float = _option(10.0, "a job's node (or its coordinator) silent this long "
                                    "fails the job on every rank, naming it")
    watchdog_factor: float = _option(10.0, "a collective running longer than this many times "
                                     "its predicted time, plus watchdog_floor_s, fails the job")
    watchdog_floor_s: float = _option(15.0, "seconds added to every collective's time limit "
                                      "(above peer_timeout_s: a silent node is named first)")
    stall_warn_s: float = _option(60.0, "ranks that have not marked a group others have, for "
                                  "this long, are named in a warning (log, status, clients)")
    stall_timeout_s: float = _option(0.0, "a stall this long fails the job (0: never)")
    max_layers: int = _option(65536, "layers one job may register")
    max_job_bytes: int = _option(_memory_bytes() // 2, "bytes of gradients one job may "
                                 "register on this node (default: half of its memory)")
    planner: str = _option("optimal", "default merge planner for jobs that do not name one")
    log_level: str = _option("info", "log level", LOG_LEVELS)
    metrics_listen: str = _option("", "HOST:PORT to serve Prometheus metrics on, at /metrics "
                                  "(port 0: any free port; '': off; docs/metrics.md)")

    @property
    def peer_listen(self) -> str:
        """``listen``, or its default: every interface with a cluster key, else loopback."""
        if self.listen:
            return self.listen
        return f"{'0.0.0.0' if self.cluster_key else '127.0.0.1'}:{DEFAULT_PEER_PORT}"

    @property
    def listen_host(self) -> str:
        return split_host_port(self.peer_listen, "listen")[0]

    @property
    def listen_port(self) -> int:
        return split_host_port(self.peer_listen, "listen")[1]

    def exposure_problem(self) -> str:
        """'' unless peers would be served beyond loopback without a cluster key."""
        if self.cluster_key or self.insecure or _loopback(self.listen_host):
            return ""
        return (f"commd: --listen {self.peer_listen} is reachable from other hosts, but there is "
                "no cluster key: anyone who reaches it could join, read or abort jobs. Pass "
                "--cluster-key FILE (make one with `commd keygen FILE`), or --insecure on a "
                "network where every host is trusted")


@dataclass(frozen=True)
class Option:
    """One option as flags, environment variables and TOML keys are made from it: a field of
    ``Settings``."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


_TYPES = {"str": str, "float": float, "bool": bool, "int": int}  # annotations, as strings

# Every option, derived from the fields of Settings: flags, env names and TOML keys come from it.
OPTIONS: tuple[Option, ...] = tuple(
    Option(f.name, _TYPES[str(f.type)], f.default, f.metadata["help"], f.metadata["choices"])
    for f in dataclasses.fields(Settings)
)


def split_host_port(value: str, what: str) -> tuple[str, int]:
    try:
        host, port = split_address(value)
    except ValueError:
        host, port = "", -1
    if not 0 <= port < 65536:
        raise SettingsError(f"commd: {what} must be HOST:PORT, got {value!r}")
    return host, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option; unset flags stay None so lower layers show through."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with the options below (env COMMD_CONFIG)"
    )
    for option in OPTIONS:
        switch = {"nargs": "?", "const": True} if option.type is bool else {}  # --insecure
        parser.add_argument(
            "--" + option.name.replace("_", "-"),
            dest=option.name,
            type=_boolean if option.type is bool else option.type,
            choices=option.choices,
            default=None,
            help=f"{option.help} (default {option.default!r}; env COMMD_{option.name.upper()})",
            **switch,  # type: ignore[arg-type]
        )


def load(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {o.name: o.default for o in OPTIONS}
    config = getattr(args, "config", None) or environ.get("COMMD_CONFIG")
    if config:
        values.update(_from_file(config))
    for option in OPTIONS:
        raw = environ.get(f"COMMD_{option.name.upper()}")
        if raw is not None:
            values[option.name] = _convert(option, raw, f"COMMD_{option.name.upper()}")
    for option in OPTIONS:
        given = getattr(args, option.name, None) if args is not None else None
        if given is not None:
            values[option.name] = given
    settings = Settings(**values)
    _validate(settings)
    return settings


def _from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"commd: cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"commd: config file {path} is not valid TOML: {exc}") from None
    known = {o.name: o for o in OPTIONS}
    values = {}
    for key, raw in data.items():
        option = known.get(key.replace("-", "_"))
        if option is None:
            raise SettingsError(
                f"commd: unknown key {key!r} in {path}; known keys: {', '.join(known)}"
            )
        if (option.type is str and not isinstance(raw, str)) or (option.type is float and (
            isinstance(raw, bool) or not isinstance(raw, int | float)
        )) or (option.type is bool and not isinstance(raw, bool)) or (
            option.type is int and (isinstance(raw, bool) or not isinstance(raw, int))
        ):
            raise SettingsError(
                f"commd: {key} in {path} must be {_kind(option)}, got {raw!r}"
            )
        values[option.name] = _convert(option, raw, f"{key} in {path}")
    return values


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _boolean(raw: str | bool) -> bool:
    if isinstance(raw, bool):
        return raw
    word = raw.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(raw)
    return word in _TRUE


def _convert(option: Option, raw: Any, where: str) -> Any:
    try:
        value = _boolean(raw) if option.type is bool else option.type(raw)
    except (TypeError, ValueError):
        raise SettingsError(
            f"commd: {where} must be {_kind(option)}, got {raw!r}"
        ) from None
    if option.choices and value not in option.choices:
        raise SettingsError(f"commd: {where} must be one of {', '.join(option.choices)}")
    return value


def _validate(settings: Settings) -> None:
    split_host_port(settings.peer_listen, "listen")
    if not math.isfinite(settings.timeout_s) or settings.timeout_s <= 0:
        raise SettingsError(f"commd: timeout_s must be positive, got {settings.timeout_s}")
    for name in ("peer_timeout_s", "watchdog_factor", "watchdog_floor_s", "stall_warn_s"):
        value = getattr(settings, name)
        if not math.isfinite(value) or value <= 0:
            raise SettingsError(f"commd: {name} must be positive, got {value}")
    if not math.isfinite(settings.stall_timeout_s) or settings.stall_timeout_s < 0:
        raise SettingsError(f"commd: stall_timeout_s must be >= 0 (0: never), got "
                            f"{settings.stall_timeout_s}")
    for name in ("max_layers", "max_job_bytes"):
        if getattr(settings, name) < 1:
            raise SettingsError(f"commd: {name} must be at least 1, got {getattr(settings, name)}")
    if settings.max_layers > MAX_LAYERS:  # the protocol's own bound on a ready's layers
        raise SettingsError(f"commd: max_layers must be at most {MAX_LAYERS} (2**20), got "
                            f"{settings.max_layers}")
    from commd.plan import get_planner  # pure and light; validates the planner name

    try:
        get_planner(settings.planner)
    except ValueError as exc:
        raise SettingsError(f"commd: planner: {exc}") from None
    if settings.backend not in BACKENDS:
        raise SettingsError(f"commd: backend must be one of {', '.join(BACKENDS)}")
    if settings.metrics_listen:
        split_host_port(settings.metrics_listen, "metrics_listen")


def log_once(settings: Settings, logger: logging.Logger) -> None:
    fields = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(settings).items())
    logger.info("settings: %s", fields)


def _kind(option: Option) -> str:
    name = option.type.__name__
    return f"an {name}" if name == "int" else f"a {name}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
