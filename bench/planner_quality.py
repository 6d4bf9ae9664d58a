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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from commd.plan import (
    MGWFBP_SIM,
    NETWORK_PRESETS,
    Groups,
    LinearCost,
    evaluate,
    mgwfbp,
    network_cost,
    optimal,
    plan_with,
    ready_times,
)
from commd.plan.model_profiles import Profile, resolve_profile, shipped_profile_names
from commd.plan.units import format_seconds, parse_nodes
from commd.testing.results import add_results_option, write_results
from commd.testing.tables import markdown_table

GOOGLENET = "googlenet_k80"  # the shipped MG-WFBP reference trace, commd/plan/profiles/
ALIASES = {"googlenet": GOOGLENET}
PLANNERS = ("wfbp", "syncea", "fixed-25MB", "ddp", "horovod", "mgwfbp", "optimal")
DEFAULT_NODES = "4,8,16,32,64"
DEFAULT_NETWORKS = ("10gbe", "100gbe")
# The paper's real 8-node K80 10GbE runs (scaling efficiency), for context next to the model.
PAPER_8_NODES = {"mgwfbp": (0.92, 0.93), "wfbp": (0.76, 0.77), "syncea": (0.66, 0.68)}
TIMING_LAYERS = 2000


# --- the computation -----------------------------------------------------------------------------


def quadratic_optimum(
    sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost
) -> float:
    """The plain O(L²) programme, vectorised: F[j] = min_i max(F[i], r[j-1]) + a + b(S[j]-S[i]).

    An independent check of ``optimal`` (its plan must end exactly here) and the baseline for
    the planning-time comparison.
    """
    num_layers = len(sizes_bytes)
    r = np.asarray(ready_times(backward_s)[::-1], dtype=np.float64)  # backward order
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(sizes_bytes[::-1], dtype=np.float64))))
    end = np.zeros(num_layers + 1)
    for j in range(1, num_layers + 1):
        starts = np.maximum(end[:j], r[j - 1])
        end[j] = np.min(starts + cost.alpha_s + cost.beta_s_per_byte * (prefix[j] - prefix[:j]))
    return float(end[num_layers])


def mgwfbp_without_recompute(
    sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost
) -> Groups:
    """A misreading of the published rule, kept for the check: start times taken from WFBP once.

    tau_c(l) = max(tau_c(l+1) + a + b·p(l+1), ready(l)) is computed for the per-layer plan and
    never updated, then layer l is merged into l-1 when ready(l-1) - tau_c(l) < a.
    """
    num_layers = len(sizes_bytes)
    ready = ready_times(backward_s)
    tau = [0.0] * num_layers
    tau[-1] = ready[-1]
    for layer in range(num_layers - 2, -1, -1):
        tau[layer] = max(tau[layer + 1] + cost(sizes_bytes[layer + 1]), ready[layer])
    groups: Groups = []
    top = num_layers - 1
    for layer in range(num_layers - 1, 0, -1):
        if ready[layer - 1] - tau[layer] >= cost.alpha_s:
            groups.append(list(range(layer, top + 1)))
            top = layer - 1
    groups.append(list(range(0, top + 1)))
    return groups


def compare(profile: Profile, cost: LinearCost, planners: Sequence[str]) -> dict[str, Any]:
    """Each planner's iteration time, ratio to the optimum, efficiency and number of groups."""
    sizes, backward = profile.sizes_bytes, profile.backward_s
    timings = {
        name: evaluate(
            plan_with(name, sizes, backward, cost), sizes, backward, cost, profile.forward_s
        )
        for name in dict.fromkeys([*planners, "optimal"])
    }
    best = timings["optimal"]
    reference = quadratic_optimum(sizes, backward, cost)
    if not np.isclose(best.comm_end_s, reference, rtol=1e-9, atol=1e-15):
        raise AssertionError(
            f"optimal ends at {best.comm_end_s!r}, the O(L²) programme at {reference!r}"
        )
    return {
        name: {
            "iteration_s": t.iteration_s,
            "ratio_to_optimal": t.iteration_s / best.iteration_s,
            "scaling_efficiency": profile.single_node_s / t.iteration_s,
            "num_groups": t.num_groups,
        }
        for name, t in timings.items()
        if name in planners
    }


def quality_rows(
    profiles: dict[str, Profile], nodes: Sequence[int], networks: Sequence[str]
) -> list[dict[str, Any]]:
    rows = []
    for key, profile in profiles.items():
        nets = list(networks)
        if key == GOOGLENET and MGWFBP_SIM not in nets:
            nets.append(MGWFBP_SIM)
        for network in nets:
            for n in nodes:
                cost = network_cost(network, n)
                rows.append(
                    {
                        "profile": profile.name,
                        "network": network,
                        "nodes": n,
                        "alpha_s": cost.alpha_s,
                        "beta_s_per_byte": cost.beta_s_per_byte,
                        "single_node_s": profile.single_node_s,
                        "planners": compare(profile, cost, PLANNERS),
                    }
                )
    return rows


def googlenet_check(profile: Profile) -> dict[str, Any]:
    """The published rule vs the optimum under the paper's simulator model, and 8-node context."""
    sizes, backward, forward = profile.sizes_bytes, profile.backward_s, profile.forward_s
    check: dict[str, Any] = {"profile": profile.name, "cost_model": MGWFBP_SIM, "nodes": {}}
    for n in (8, 64):
        cost = network_cost(MGWFBP_SIM, n)
        plans = {
            "mgwfbp": mgwfbp(sizes, backward, cost),
            "mgwfbp_without_recompute": mgwfbp_without_recompute(sizes, backward, cost),
            "optimal": optimal(sizes, backward, cost),
            "wfbp": plan_with("wfbp", sizes, backward, cost),
            "syncea": plan_with("syncea", sizes, backward, cost),
        }
        t = {k: evaluate(g, sizes, backward, cost, forward).iteration_s for k, g in plans.items()}
        best = t["optimal"]
        check["nodes"][str(n)] = {
            "alpha_s": cost.alpha_s,
            "beta_s_per_byte": cost.beta_s_per_byte,
            "mgwfbp_slower_than_optimal": t["mgwfbp"] / best - 1,
            # The same comparison with forward left out of both iterations.
            "mgwfbp_slower_without_forward": (t["mgwfbp"] - forward) / (best - forward) - 1,
            "without_recompute_slower_than_optimal": t["mgwfbp_without_recompute"] / best - 1,
            "group_sizes": {k: [len(g) for g in v] for k, v in plans.items()},
            "scaling_efficiency": {k: profile.single_node_s / v for k, v in t.items()},
        }
    check["paper_8_nodes_scaling_efficiency"] = {k: list(v) for k, v in PAPER_8_NODES.items()}
    return check


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


# --- output --------------------------------------------------------------------------------------


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


# --- command line --------------------------------------------------------------------------------


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
        default=DEFAULT_NODES,
        help="node counts: 8 | 4,8,16 | 2..64 (default %(default)s)",
    )
    parser.add_argument(
        "--networks",
        default=",".join(DEFAULT_NETWORKS),
        help=f"networks (default %(default)s; googlenet_k80 also gets {MGWFBP_SIM})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_results_option(parser, "planner-quality")
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        networks = list(dict.fromkeys(n.strip() for n in args.networks.split(",") if n.strip()))
        for network in networks:
            network_cost(network, 2)  # unknown names fail here, listing the valid ones
        profiles = load_profiles(args.profiles)
    except ValueError as exc:
        print(f"planner_quality: {exc}", file=sys.stderr)
        return 2
    rows = quality_rows(profiles, nodes, networks)
    check = googlenet_check(profiles[GOOGLENET]) if GOOGLENET in profiles else None
    timing = planning_time()
    results = {
        "planners": list(PLANNERS),
        "nodes": nodes,
        "networks": networks,
        "profiles": [p.name for p in profiles.values()],
        "results": rows,
        "googlenet_check": check,
        "planning_time": timing,
    }
    write_results("planner-quality", results, args.results)
    if args.json:
        print(json.dumps(results))
    else:
        print(render(profiles, rows, check, timing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
