"""``commd keygen PATH``: make the cluster key every node's daemon needs to speak to the others."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commd.daemon.peer_security import generate_key

_EPILOG = """\
The key authenticates and encrypts the daemons' control channel (CurveZMQ): a daemon started
with --cluster-key accepts peers only if they hold the same file. Copy the file to every node
(e.g. /etc/commd/cluster.key, mode 0600, owned by the daemon's user) and keep it secret.

examples:
  commd keygen /etc/commd/cluster.key
  commd run --cluster-key /etc/commd/cluster.key          (or COMMD_CLUSTER_KEY, or cluster_key
                                                          in the TOML config)
"""


def register_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keygen",
        help="write a new cluster key file (mode 0600) for --cluster-key",
        description="Write a new cluster key to PATH, readable by its owner only. An "
        "existing file is never overwritten.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="where to write the key")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        generate_key(args.path)
    except FileExistsError:
        print(f"commd: {args.path} exists; a key is never overwritten: remove it first or "
              "choose another path", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"commd: cannot write {args.path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"commd: wrote a cluster key to {args.path} (mode 0600); copy it to every node and "
          f"run `commd run --cluster-key {args.path}`", file=sys.stderr)
    return 0
