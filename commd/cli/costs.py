"""``commd costs``: which exchange of top-k compressed gradients is cheaper on a network.

The cost models are the daemon's own (``commd.compression.costs``, Table I of Tyagi & Swany,
IEEE BigData 2023); this module only reads the options and prints a table or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any, TypeVar

from commd.compression.costs import ExchangeCosts, exchange_costs
from commd.plan import parse_bandwidth, parse_duration
from commd.plan.units import format_seconds, parse_nodes

__all__ = ["JSON_KEYS", "register_command", "run"]

# What --json prints for one combination; a sweep prints a list of these plus the inputs.
JSON_KEYS = ("allgather_s", "allreduce_ring_s", "allreduce_tree_s", "dense_allreduce_s", "choice")
_ParserT = TypeVar("_ParserT", bound=argparse.ArgumentParser)
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Case:
    """One combination of the swept inputs, with the text the user wrote for display."""

    nodes: int
    latency: str
    alpha_s: float
    bandwidth: str
    beta_s_per_byte: float
    ratio: float
    costs: ExchangeCosts


# ----------------------------------------------------------------------------- options


def _items(text: str, option: str, parse: Callable[[str], _T]) -> list[tuple[str, _T]]:
    """ "a,b" -> [("a", parse("a")), ("b", parse("b"))], without repeats, in the order given."""
    parts = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not parts:
        raise ValueError(f"{option} needs a value")
    return [(part, parse(part)) for part in parts]


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"cannot read ratio {text!r} in --ratio: expected e.g. 0.01") from None
    if not 0 < value <= 1:
        raise ValueError(f"ratio {text!r} in --ratio must be in (0, 1]")
    return value


def _elements(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"cannot read --elements {text!r}: expected a whole number") from None
    if value < 1:
        raise ValueError(f"--elements must be at least 1, not {value}")
    return value


def _beta(text: str) -> float:
    return 1.0 / parse_bandwidth(text)  # seconds per byte; "10Gbps" -> 0.8 ns/B


def _cases(args: argparse.Namespace) -> tuple[int, list[_Case]]:
    missing = [
        f"--{name}"
        for name in ("nodes", "latency", "bandwidth", "elements", "ratio")
        if getattr(args, name) is None
    ]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}; e.g. commd costs {_EXAMPLE}")
    elements = _elements(args.elements)
    nodes = parse_nodes(args.nodes)
    latencies = _items(args.latency, "--latency", parse_duration)
    bandwidths = _items(args.bandwidth, "--bandwidth", _beta)
    ratios = [value for _, value in _items(args.ratio, "--ratio", _ratio)]
    cases = [
        _Case(n, lat, alpha, bw, beta, r, exchange_costs(n, alpha, beta, elements, r))
        for n, (lat, alpha), (bw, beta), r in product(nodes, latencies, bandwidths, ratios)
    ]
    return elements, cases


# ----------------------------------------------------------------------------- output


def _json_case(case: _Case, with_inputs: bool) -> dict[str, Any]:
    costs = case.costs
    out: dict[str, Any] = {}
    if with_inputs:
        out.update(
            nodes=case.nodes,
            alpha_s=case.alpha_s,
            beta_s_per_byte=case.beta_s_per_byte,
            ratio=case.ratio,
            k=costs.k,
            allreduce_algorithm=costs.allreduce_algorithm,
        )
    out.update({key: getattr(costs, key) for key in JSON_KEYS})
    return out


def _table(elements: int, cases: list[_Case]) -> str:
    lines = [
        f"top-k exchange of {elements:,} float32 values ({elements * 4 / 1e6:.1f} MB dense), "
        "k = max(1, int(ratio x elements))",
        "allgather: values + int32 indices; allreduce: broadcast leader's indices, "
        "then allreduce the values",
    ]
    header = (
        "nodes",
        "latency",
        "bandwidth",
        "ratio",
        "k",
        "allgather",
        "AR ring",
        "AR tree",
        "dense AR",
        "choice",
    )
    rows = [header] + [
        (
            str(case.nodes),
            case.latency,
            case.bandwidth,
            f"{case.ratio:g}",
            f"{case.costs.k:,}",
            format_seconds(case.costs.allgather_s),
            format_seconds(case.costs.allreduce_ring_s),
            format_seconds(case.costs.allreduce_tree_s),
            format_seconds(case.costs.dense_allreduce_s),
            case.costs.choice
            + (f" ({case.costs.allreduce_algorithm})" if case.costs.choice == "allreduce" else ""),
        )
        for case in cases
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        cells = [cell.rjust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line

_EXAMPLE = "--nodes 8 --latency 1ms --bandwidth 10Gbps --elements 11689512 --ratio 0.1"
_EPILOG = f"""\
Cost models (Tyagi & Swany, IEEE BigData 2023, Table I; log = log2, alpha = --latency,
beta = 1/--bandwidth seconds per byte, M = 4k bytes: the k float32 values kept by top-k):
  allgather  log N*alpha + (N-1)*2M*beta           every node sends k values + k int32 indices
  AR ring    bcast(M) + 2(N-1)*alpha + 2(N-1)/N*M*beta
  AR tree    bcast(M) + 2 log N*alpha + 2 log N*M*beta
             bcast(M) = log N*alpha + log N*M*beta: the leader's k indices
  dense AR   ring allreduce of all 4*elements bytes (the uncompressed reference)
choice is the cheaper EXCHANGE: allgather or allreduce (the cheaper of ring and tree).

--nodes: 8, a list 2,4,8 or a doubling range 2..1024; --latency, --bandwidth and --ratio take
comma-separated lists too: every combination is a row. Units: durations s, ms, us, ns;
bandwidths bps, Kbps, Mbps, Gbps (bits/s, also the bare number) or MB/s, GB/s (bytes/s).
--json prints one object for one combination:
  {{{", ".join(JSON_KEYS)}}}
and for several a list of such objects that also name their inputs (nodes, alpha_s,
beta_s_per_byte, ratio, k, allreduce_algorithm).

examples:
  commd costs {_EXAMPLE}
  commd costs {_EXAMPLE} --json
  commd costs --nodes 8 --latency 1ms --bandwidth 1Gbps,10Gbps --elements 11689512 \\
      --ratio 0.001,0.01,0.1
  commd costs --nodes 2..1024 --latency 50us --bandwidth 100Gbps --elements 25557032 --ratio 0.01
"""


def register_command(subparsers: argparse._SubParsersAction[_ParserT]) -> None:
    """Add ``costs`` to the ``commd`` command line."""
    parser = subparsers.add_parser(
        "costs",
        help="cost of exchanging top-k compressed gradients: allgather vs allreduce",
        description="Compare the time to exchange a top-k compressed tensor by Allgather and by "
        "the Allreduce-compatible top-k (ring or tree), against a dense ring allreduce, and "
        "say which exchange is cheaper.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Values stay strings here and are checked in run(): every mistake is one "commd: " line.
    add = parser.add_argument
    add("--nodes", metavar="N[,N...|A..B]", help="node count(s)")
    add("--latency", metavar="TIME[,...]", help="per-message latency alpha, e.g. 1ms")
    add("--bandwidth", metavar="RATE[,...]", help="link bandwidth, e.g. 10Gbps")
    add("--elements", metavar="COUNT", help="float32 values in the tensor, e.g. 11689512")
    add("--ratio", metavar="R[,...]", help="top-k ratio k/elements in (0, 1], e.g. 0.01")
    add("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``commd costs``; 0 on success, 2 (with one "commd: " line) on bad input."""
    try:
        elements, cases = _cases(args)
    except ValueError as exc:
        print(f"commd: {exc}", file=sys.stderr)
        return 2
    if args.json:
        if len(cases) == 1:
            print(json.dumps(_json_case(cases[0], with_inputs=False)))
        else:
            print(json.dumps([_json_case(case, with_inputs=True) for case in cases]))
    else:
        print(_table(elements, cases))
    return 0
