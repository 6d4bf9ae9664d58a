"""``commd run``: the daemon for this node, with its settings from every layer."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from commd.daemon import settings


def register_command(subparsers: Any) -> None:
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
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The daemon (zmq.asyncio, uvloop) is imported here, not at the top: `commd status`
    # and `commd simulate` start without it.
    from commd.daemon.server import Daemon, StartupError

    try:
        config = settings.load(args)
    except settings.SettingsError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    exposed = config.exposure_problem()  # refused before anything is logged or bound
    if exposed:
        print(exposed, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings.log_once(config, logging.getLogger("commd"))
    import uvloop

    daemon = Daemon(config)
    try:
        uvloop.run(daemon.run())
    except StartupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if daemon.stuck_collectives():
        # A Gloo group whose collective waits for a stopped peer would block the
        # interpreter's exit in its destructor: everything is cleaned up, so leave now.
        logging.shutdown()
        os._exit(0)
    return 0
