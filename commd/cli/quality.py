"""``commd simulate --quality``: how far each merge planner is from the optimum, on every
shipped profile (or those given), for each node count and network, with the published
MG-WFBP rule checked against the paper and the optimum's planning time. The computation is
``commd.plan.quality``'s; this module picks the profiles, times the planning and prints
tables (``bench/planner_quality.py`` records the same report as results)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from commd.cli.tables import markdown_table
from commd.plan import MGWFBP_SIM, NETWORK_PRESETS, mgwfbp, network_cost, optimal
from commd.plan.model_profiles import Profile, resolve_profile, shipped_profile_names
from commd.plan.quality import (
    GOOGLENET,
    PLANNERS,
    googlenet_check,
    quadratic_optimum,
    quality_rows,
)
from commd.plan.units import format_seconds, parse_nodes

ALIASES = {"googlenet": GOOGLENET}
DEFAULT_NODES = "4,8,16,32,64"
DEFAULT_NETWORKS = ("10gbe", "100gbe")
TIMING_LAYERS = 2000


def report(profiles: dict[str, Profile], nodes: Sequence[int],
           networks: Sequence[str]) -> dict[str, Any]:
    """Every planner against the optimum for ``profiles`` × ``networks`` × ``nodes``, the
    GoogleNet check where its trace is among them, and the planning time: one JSON object."""
    rows = quality_rows(profiles, nodes, networks)
    return {
        "planners": list(PLANNERS),
        "nodes": list(nodes),
        "networks": list(networks),
        "profiles": [p.name for p in profiles.values()],
        "results": rows,
        "googlenet_check": googlenet_check(profiles[GOOGLENET]) if GOOGLENET in profiles
        else None,
        "planning_time": planning_time(),
    }


def parse_networks(spec: str | None) -> list[str]:
    """``--network`` in quality mode: comma-separated presets (default 10gbe,100gbe);
    ValueError naming the valid ones."""
    networks = list(dict.fromkeys(
        n.strip() for n in (spec or ",".join(DEFAULT_NETWORKS)).split(",") if n.strip()))
    if not networks:
        raise ValueError("--network needs at least one preset")
    for network in networks:
        network_cost(network, 2)  # an unknown name fails here, listing the valid ones
    return networks


def planning_time(num_layers: int = TIMING_LAYERS, repeats: int = 5) -> dict[str, Any]:
    """Median wall time to plan a synthetic model of ``num_layers`` layers (10gbe, 64 nodes)."""
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.lognormal(np.log(2e5), 2.0, num_layers).astype(np.int64)]
    backward = [float(s) for s in rng.uniform(20e-6, 2e-3, num_layers)]
    cost = network_cost("10gbe", 64)

    def median_s(fn: Any) -> float:
        fn(sizes, backward, cost)  # warm-up
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn(sizes, backward, cost)
            runs.append(time.perf_counter() - started)
        return float(np.median(runs))

    return {
        "layers": num_layers,
        "network": "10gbe",
        "nodes": 64,
        "optimal_s": median_s(optimal),
        "mgwfbp_s": median_s(mgwfbp),
        "quadratic_numpy_s": median_s(quadratic_optimum),
    }


def _seconds(value: float) -> str:
    return format_seconds(value, micro="µs")


def _markdown(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    return markdown_table(header, rows, "r" * len(header)).splitlines()


def _network_label(network: str) -> str:
    if network == MGWFBP_SIM:
        return "MG-WFBP simulator model (a = 2n·45.25 µs; K80 cluster, 10GbE)"
    preset = NETWORK_PRESETS[network]
    return f"{network}, ring all-reduce ({preset.description})"


def render(
    profiles: dict[str, Profile],
    rows: list[dict[str, Any]],
    check: dict[str, Any] | None,
    timing: dict[str, Any],
) -> str:
    out = ["# Planner quality: iteration time / optimal iteration time", ""]
    header = ["nodes", "a", "b (ns/B)", *PLANNERS, "opt. efficiency", "opt. groups"]
    for profile in profiles.values():
        out.append(
            f"## {profile.name}: {len(profile.sizes_bytes)} layers, "
            f"{sum(profile.sizes_bytes) / 1e6:.1f} MB, forward {_seconds(profile.forward_s)}, "
            f"backward {_seconds(sum(profile.backward_s))}"
        )
        for network in dict.fromkeys(r["network"] for r in rows if r["profile"] == profile.name):
            body = []
            for r in rows:
                if r["profile"] != profile.name or r["network"] != network:
                    continue
                p = r["planners"]
                body.append(
                    [
                        str(r["nodes"]),
                        _seconds(r["alpha_s"]),
                        f"{r['beta_s_per_byte'] * 1e9:.3g}",
                        *(f"{p[name]['ratio_to_optimal']:.3f}" for name in PLANNERS),
                        f"{p['optimal']['scaling_efficiency']:.1%}",
                        str(p["optimal"]["num_groups"]),
                    ]
                )
            out += ["", f"{_network_label(network)}:", "", *_markdown(header, body)]
        out.append("")
    if check is not None:
        out += [f"## MG-WFBP on {check['profile']}: published rule vs optimum ({MGWFBP_SIM})", ""]
        body = []
        for n, c in check["nodes"].items():
            eff = c["scaling_efficiency"]
            body.append(
                [
                    n,
                    f"{c['mgwfbp_slower_than_optimal']:+.1%}",
                    f"{c['mgwfbp_slower_without_forward']:+.1%}",
                    f"{c['without_recompute_slower_than_optimal']:+.1%}",
                    " ".join(str(k) for k in c["group_sizes"]["mgwfbp"]),
                    " ".join(str(k) for k in c["group_sizes"]["optimal"]),
                    *(f"{eff[k]:.1%}" for k in ("mgwfbp", "wfbp", "syncea", "optimal")),
                ]
            )
        head = [
            "nodes",
            "MG-WFBP vs optimal",
            "same, forward left out",
            "without recomputing starts",
            "MG-WFBP group sizes (top first)",
            "optimal group sizes (top first)",
            "eff. MG-WFBP",
            "eff. WFBP",
            "eff. SyncEASGD",
            "eff. optimal",
        ]
        out += _markdown(head, body)
        paper = check["paper_8_nodes_scaling_efficiency"]
        out += [
            "",
            "Paper, real 8-node K80 10GbE runs: "
            + ", ".join(
                f"{name} {lo * 100:.0f}–{hi * 100:.0f} %"
                for name, (lo, hi) in (
                    ("MG-WFBP", paper["mgwfbp"]),
                    ("WFBP", paper["wfbp"]),
                    ("SyncEASGD", paper["syncea"]),
                )
            )
            + ".",
            "",
        ]
    out += [
        f"Planning time, {timing['layers']} synthetic layers ({timing['network']}, "
        f"{timing['nodes']} nodes), median: optimal {_seconds(timing['optimal_s'])}, "
        f"mgwfbp {_seconds(timing['mgwfbp_s'])}, plain O(L²) programme in numpy "
        f"{_seconds(timing['quadratic_numpy_s'])}."
    ]
    return "\n".join(out)


def load_profiles(spec: str | None) -> dict[str, Profile]:
    """``None``: every shipped profile, the GoogleNet reference (``googlenet_k80``) included."""
    if spec is None:
        keys = shipped_profile_names()
        if GOOGLENET not in keys:
            raise ValueError(f"the shipped profile {GOOGLENET!r} is missing (broken install?)")
        keys = [*(k for k in keys if k != GOOGLENET), GOOGLENET]  # last, next to its check
    else:
        keys = [ALIASES.get(k.strip(), k.strip()) for k in spec.split(",") if k.strip()]
        keys = list(dict.fromkeys(keys))
        if not keys:
            raise ValueError("--profiles needs at least one profile")
    return {key: resolve_profile(key) for key in keys}


def run(args: argparse.Namespace) -> int:
    """``commd simulate --quality``; 0, or 2 with one "commd: " line on bad input."""
    try:
        given = [option for option, value in (
            ("--alpha", args.alpha), ("--beta", args.beta), ("--latency", args.latency),
            ("--bandwidth", args.bandwidth), ("--planners", args.planners),
            ("--plot", args.plot)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: not for --quality, which times every "
                             "planner on preset networks (use --network)")
        nodes = parse_nodes(args.nodes or DEFAULT_NODES)
        networks = parse_networks(args.network)
        profiles = load_profiles(args.profile)
    except ValueError as exc:
        print(f"commd: {exc}", file=sys.stderr)
        return 2
    data = report(profiles, nodes, networks)
    if args.json:
        print(json.dumps(data))
    else:
        print(render(profiles, data["results"], data["googlenet_check"], data["planning_time"]))
    return 0
