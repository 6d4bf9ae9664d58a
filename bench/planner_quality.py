"""How far each merge planner is from the optimum, on real profiles and node counts.

For every profile, network and node count, each planner's plan is timed with the daemon's own
timeline (``commd.plan.evaluate``) and reported as a ratio to the optimal plan's iteration
time (optimal = 1.000), with the optimum's scaling efficiency (single node / iteration) and
number of groups.

Networks: ring all-reduce over a preset, a = 2(N-1)·latency, b = 2(N-1)/N / bandwidth
(``10gbe``: 25 µs, 1.25 GB/s; ``100gbe``: 5 µs, 12.5 GB/s). The GoogleNet reference trace is
also run under the MG-WFBP authors' simulator cost model (``mgwfbp-sim``), and a section
checks the published MG-WFBP rule against the paper at 8 and 64 nodes.

    .venv/bin/python bench/planner_quality.py                    # every shipped profile
    .venv/bin/python bench/planner_quality.py --profiles googlenet_k80,resnet50 --nodes 8,64
    .venv/bin/python bench/planner_quality.py --json

Profiles: shipped names (commd/plan/profiles/NAME.json) or profile files. The GoogleNet
reference trace ships as ``googlenet_k80`` (``googlenet`` is an alias); it also gets the
``mgwfbp-sim`` network and the check against the paper. Pure computation: runs in seconds.

The report is ``commd simulate --quality``'s (``commd.cli.quality``, computed by
``commd.plan.quality``); this script records it as results (bench/results/planner-quality.json)
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from commd.cli import quality
from commd.plan import MGWFBP_SIM
from commd.plan.units import parse_nodes
from commd.testing.results import add_results_option, write_results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Planner quality: each planner's iteration time as a ratio to the optimum.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--profiles",
        metavar="LIST",
        help="comma-separated shipped names or files; 'googlenet' = googlenet_k80 (default: "
        "every shipped profile, googlenet_k80 included)",
    )
    parser.add_argument(
        "--nodes",
        default=quality.DEFAULT_NODES,
        help="node counts: 8 | 4,8,16 | 2..64 (default %(default)s)",
    )
    parser.add_argument(
        "--networks",
        default=",".join(quality.DEFAULT_NETWORKS),
        help=f"networks (default %(default)s; googlenet_k80 also gets {MGWFBP_SIM})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_results_option(parser, "planner-quality")
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        networks = quality.parse_networks(args.networks)
        profiles = quality.load_profiles(args.profiles)
    except ValueError as exc:
        print(f"planner_quality: {exc}", file=sys.stderr)
        return 2
    results = quality.report(profiles, nodes, networks)
    write_results("planner-quality", results, args.results)
    if args.json:
        print(json.dumps(results))
    else:
        print(quality.render(profiles, results["results"], results["googlenet_check"],
                             results["planning_time"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
