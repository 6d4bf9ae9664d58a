"""The `commd` command: run the daemon, inspect it, and answer what-if questions.

One module per subcommand, each with ``register_command(subparsers)``; none imports this one.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from commd import __version__
from commd.cli import costs, keygen, profile, run, simulate, status, trace

# In the order `commd --help` lists them.
_COMMANDS = (run, status, trace, keygen, simulate, costs, profile)


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
    for command in _COMMANDS:
        command.register_command(subparsers)
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

