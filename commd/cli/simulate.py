"""``commd simulate``: which merge plan wins, and how it scales, from a profile; no cluster needed.

The planners and the timeline are the daemon's own (commd.plan); this module only reads
the profile, derives the all-reduce cost per node count and prints tables, JSON or a plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from commd.cli import quality
from commd.cli._pyplot import pyplot
from commd.plan import (
    MGWFBP_SIM,
    NETWORK_PRESETS,
    PLANNER_NAMES,
    Groups,
    LinearCost,
    PlanTiming,
    evaluate,
    get_planner,
    network_cost,
    parse_bandwidth,
    parse_duration,
    parse_nodes,
    plan_with,
    ring_allreduce_cost,
)
from commd.plan.model_profiles import Profile, load_profile, resolve_profile
from commd.plan.units import format_seconds

__all__ = [
    "DEFAULT_PLANNERS",
    "Profile",
    "load_profile",
    "register_command",
    "run",
    "simulate",
]

DEFAULT_PLANNERS = ("wfbp", "syncea", "ddp", "horovod", "fixed-25MB", "mgwfbp", "optimal")
_ParserT = TypeVar("_ParserT", bound=argparse.ArgumentParser)


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _CostModel:
    """How to get an all-reduce cost for a node count, and how to describe it."""

    label: str
    fixed: LinearCost | None = None  # --alpha/--beta: one measured cluster
    network: str | None = None  # --network PRESET
    latency_s: float = 0.0  # --latency/--bandwidth: ring model
    bandwidth_bytes_per_s: float = 0.0

    def at(self, nodes: int | None) -> LinearCost:
        if self.fixed is not None:
            return self.fixed
        assert nodes is not None  # checked by _cost_model
        if self.network is not None:
            return network_cost(self.network, nodes)
        return ring_allreduce_cost(nodes, self.latency_s, self.bandwidth_bytes_per_s)


def _cost_model(args: argparse.Namespace, nodes: list[int]) -> _CostModel:
    direct = args.alpha is not None or args.beta is not None
    ring = args.latency is not None or args.bandwidth is not None
    chosen = [direct, args.network is not None, ring]
    if sum(chosen) != 1:
        problem = "choose one cost model" if sum(chosen) else "say what an all-reduce costs"
        raise ValueError(
            f"{problem}: --alpha and --beta, or --network PRESET, or --latency and --bandwidth"
        )
    if direct:
        if args.alpha is None or args.beta is None:
            raise ValueError("--alpha and --beta go together")
        if len(nodes) > 1:
            raise ValueError(
                "--alpha/--beta describe one cluster size; sweep --nodes with --network or "
                "--latency/--bandwidth"
            )
        cost = LinearCost(parse_duration(args.alpha), parse_duration(args.beta))
        return _CostModel("measured alpha/beta", fixed=cost)
    if not nodes:
        raise ValueError("--nodes is needed with --network or --latency/--bandwidth, e.g. 2..64")
    if args.network is not None:
        network_cost(args.network, 2)  # unknown names fail here, listing the valid ones
        if args.network == MGWFBP_SIM:
            return _CostModel("MG-WFBP simulator model", network=args.network)
        return _CostModel(f"ring all-reduce, {args.network} preset", network=args.network)
    if args.latency is None or args.bandwidth is None:
        raise ValueError("--latency and --bandwidth go together")
    latency, bandwidth = parse_duration(args.latency), parse_bandwidth(args.bandwidth)
    label = f"ring all-reduce, {args.latency} latency, {args.bandwidth}"
    return _CostModel(label, latency_s=latency, bandwidth_bytes_per_s=bandwidth)


def _planner_names(text: str) -> list[str]:
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise ValueError("--planners needs at least one planner name")
    for name in names:
        get_planner(name)  # fails early, listing the valid names
    return names


# ----------------------------------------------------------------------------- simulation


def simulate(
    profile: Profile, cost: LinearCost, planners: Sequence[str]
) -> dict[str, tuple[Groups, PlanTiming]]:
    """Plan ``profile`` with each named planner and time one iteration of each plan."""
    results: dict[str, tuple[Groups, PlanTiming]] = {}
    for name in planners:
        groups = plan_with(name, profile.sizes_bytes, profile.backward_s, cost)
        timing = evaluate(groups, profile.sizes_bytes, profile.backward_s, cost, profile.forward_s)
        results[name] = (groups, timing)
    return results


def _report(
    profile: Profile, nodes: int | None, model: _CostModel, planners: list[str]
) -> dict[str, Any]:
    """One node count's results as the JSON object that --json prints."""
    cost = model.at(nodes)
    results = simulate(profile, cost, planners)
    # The speedup column is relative to WFBP even when WFBP was not asked for.
    baseline = simulate(profile, cost, ["wfbp"])["wfbp"][1].iteration_s
    return {
        "profile": profile.name,
        "nodes": nodes,
        "alpha_s": cost.alpha_s,
        "beta_s_per_byte": cost.beta_s_per_byte,
        "cost_model": model.label,
        "forward_s": profile.forward_s,
        "backward_s": sum(profile.backward_s),
        "planners": {
            name: {
                "iteration_s": timing.iteration_s,
                "exposed_comm_s": timing.exposed_comm_s,
                "scaling_efficiency": profile.single_node_s / timing.iteration_s,
                "speedup_vs_wfbp": baseline / timing.iteration_s,
                "num_groups": timing.num_groups,
                "groups": groups,
            }
            for name, (groups, timing) in results.items()
        },
    }


def _table(report: dict[str, Any]) -> str:
    nodes = report["nodes"]
    title = f"{nodes} nodes" if nodes is not None else "measured cluster"
    lines = [
        f"{title}: all-reduce of M bytes = {format_seconds(report['alpha_s'])} + "
        f"{report['beta_s_per_byte'] * 1e9:.4g} ns/B x M ({report['cost_model']})"
    ]
    header = ("planner", "iteration", "exposed comm", "groups", "vs wfbp", "efficiency")
    rows = [header] + [
        (
            name,
            format_seconds(r["iteration_s"]),
            format_seconds(r["exposed_comm_s"]),
            str(r["num_groups"]),
            f"{r['speedup_vs_wfbp']:.2f}x",
            f"{r['scaling_efficiency']:.1%}",
        )
        for name, r in report["planners"].items()
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _plot(plt: Any, reports: list[dict[str, Any]], path: str) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    nodes = [r["nodes"] for r in reports]
    for name in reports[0]["planners"]:
        efficiency = [r["planners"][name]["scaling_efficiency"] for r in reports]
        axes.plot(nodes, efficiency, marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("nodes")
    axes.set_ylabel("scaling efficiency (single node / iteration)")
    axes.set_ylim(0, 1.05)
    axes.set_title(f"{reports[0]['profile']}: {reports[0]['cost_model']}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as exc:
        raise ValueError(f"cannot write plot {path!r}: {exc}") from None
    finally:
        plt.close(figure)


# ----------------------------------------------------------------------------- command line

_EPILOG = """\
The cost of one all-reduce of M bytes is alpha + beta*M. Give it as
  --alpha/--beta           measured for one cluster (e.g. by the daemon), or
  --network PRESET         a ring all-reduce over a preset network, per node count, or
  --latency/--bandwidth    a ring all-reduce: alpha = 2(N-1)*latency, beta = 2(N-1)/N/bandwidth.
Presets: {presets}; {sim} is the MG-WFBP authors' simulator model.
Units: durations s, ms, us, ns (bare number: seconds); bandwidths bps, Kbps, Mbps, Gbps
(bits/s, also the bare number) or MB/s, GB/s, GiB/s (bytes/s).
--nodes: 8, or a list 2,4,8, or a doubling range 2..1024 (2, 4, 8, ..., 1024).
--json prints one object for one node count and a list of objects for several.

examples:
  commd simulate --profile small_cnn --network 10gbe --nodes 8   (a shipped profile)
  commd simulate --profile model.json --latency 50us --bandwidth 10Gbps --nodes 2..1024 \\
      --plot scaling.png
  commd simulate --profile model.json --alpha 0.5ms --beta 0.8ns --json
  the MG-WFBP paper's GoogleNet trace (shipped) under the authors' simulator model:
  commd simulate --profile googlenet_k80 --network mgwfbp-sim --nodes 8..64
  every planner against the optimum, every shipped profile (a few seconds):
  commd simulate --quality
  commd simulate --quality --profile googlenet,resnet50 --nodes 8,64 --json
"""


def register_command(subparsers: argparse._SubParsersAction[_ParserT]) -> None:
    """Add ``simulate`` to the ``commd`` command line."""
    parser = subparsers.add_parser(
        "simulate",
        help="compare merge plans and their scaling from a profile (no cluster needed)",
        description="Plan a model's gradient all-reduces with each planner and simulate one "
        "training iteration: iteration time, exposed communication and scaling efficiency.",
        epilog=_EPILOG.format(presets=", ".join(NETWORK_PRESETS), sim=MGWFBP_SIM),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Values stay strings here and are checked in run(), so every mistake gets one
    # "commd: ..." line and exit code 2.
    add = parser.add_argument
    add("--profile", metavar="FILE|NAME", help="profile JSON file, or a shipped profile name")
    add("--nodes", metavar="N[,N...|A..B]", help="node count(s) to simulate")
    add("--alpha", metavar="SECONDS", help="all-reduce start-up time, e.g. 0.5ms")
    add("--beta", metavar="SECONDS_PER_BYTE", help="all-reduce time per byte, e.g. 0.8ns")
    add("--network", metavar="PRESET", help=f"one of {', '.join([*NETWORK_PRESETS, MGWFBP_SIM])}")
    add("--latency", metavar="TIME", help="per-message latency for the ring model, e.g. 50us")
    add("--bandwidth", metavar="RATE", help="link bandwidth for the ring model, e.g. 10Gbps")
    add(
        "--planners",
        metavar="LIST",
        help=f"comma-separated planners (default: {','.join(DEFAULT_PLANNERS)}); known: "
        f"{', '.join(PLANNER_NAMES)}, fixed:SIZE",
    )
    add("--json", action="store_true", help="print JSON instead of tables")
    add("--plot", metavar="FILE.png", help="draw scaling efficiency vs nodes (needs matplotlib)")
    add("--quality", action="store_true",
        help="every planner's iteration time over the optimum's, for each profile (--profile: "
        "a comma-separated list, default every shipped one), node count (default "
        f"{quality.DEFAULT_NODES}) and network (--network: a list, default "
        f"{','.join(quality.DEFAULT_NETWORKS)}), with MG-WFBP checked against its paper")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``commd simulate``; 0 on success, 2 (with one "commd: " line) on bad input."""
    if args.quality:
        return quality.run(args)
    try:
        if not args.profile:
            raise ValueError("--profile FILE (or a shipped profile name) is needed")
        nodes = parse_nodes(args.nodes) if args.nodes else []
        model = _cost_model(args, nodes)
        planners = _planner_names(",".join(DEFAULT_PLANNERS) if args.planners is None
                                  else args.planners)
        plt = pyplot() if args.plot else None  # fail before any output
        profile = resolve_profile(args.profile)
        counts: list[int | None] = list(nodes) if nodes else [None]
        reports = [_report(profile, n, model, planners) for n in counts]
        if plt is not None:
            _plot(plt, reports, args.plot)
    except ValueError as exc:
        print(f"commd: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports))
    else:
        total_mb = sum(profile.sizes_bytes) / 1e6
        print(
            f"{profile.name}: {len(profile.sizes_bytes)} layers, {total_mb:.1f} MB, "
            f"forward {format_seconds(profile.forward_s)}, "
            f"backward {format_seconds(sum(profile.backward_s))}"
        )
        for report in reports:
            print()
            print(_table(report))
    if args.plot:
        print(f"scaling efficiency plotted to {args.plot}", file=sys.stderr)
    return 0
