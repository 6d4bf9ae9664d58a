"""The `commd` command: run the daemon, inspect it, and answer what-if questions."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, NoReturn

from . import __version__, settings

# Subcommands that live in their own modules, imported only when they exist in this build.
_COMMAND_MODULES = ("commd.status", "commd.simulate", "commd.costs", "commd.profile_cmd")


def _add_run(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the daemon for this node",
        description=(
            "Run the commd daemon: training processes on this node connect to --socket, peer "
            "daemons to --listen. Options come from defaults, then --config (TOML), then "
            "COMMD_* environment variables, then the command line."
        ),
        epilog=(
            "examples:\n"
            "  commd run --socket /tmp/commd.sock --listen 127.0.0.1:29600\n"
            "  COMMD_BACKEND=gloo commd run --config /etc/commd/commd.toml"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(parser)
    parser.set_defaults(func=_run_daemon)


def _run_daemon(args: argparse.Namespace) -> int:
    from .server import Daemon, StartupError  # keeps `commd status` quick to start

    try:
        config = settings.load(args)
    except settings.SettingsError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings.log_once(config, logging.getLogger("commd"))
    import uvloop

    try:
        uvloop.run(Daemon(config).run())
    except StartupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `commd: ` line (subcommand parsers inherit this class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"commd: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="commd",
        description="commd: a per-node gradient communication daemon for data-parallel training",
    )
    parser.add_argument("--version", action="version", version=f"commd {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(subparsers)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result: int = args.func(args)
    except BrokenPipeError:  # `commd simulate ... | head`: the reader left, that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return result


if __name__ == "__main__":
    sys.exit(main())
