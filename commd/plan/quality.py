"""How far each merge planner is from the optimum: every planner's plan timed with the daemon's
own timeline (``evaluate``) as a ratio to the optimal plan's iteration time (optimal = 1.000),
with the optimum's scaling efficiency and groups; and the published MG-WFBP rule checked
against the optimum on the paper's GoogleNet trace under its authors' simulator model.

Pure computation, no I/O and no clock: ``commd simulate --quality`` prints it, and
``bench/planner_quality.py`` records it as results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from commd.plan.cost import MGWFBP_SIM, LinearCost, network_cost
from commd.plan.mgwfbp import mgwfbp
from commd.plan.model_profiles import Profile
from commd.plan.optimal import optimal
from commd.plan.registry import plan_with
from commd.plan.timeline import Groups, evaluate, ready_times

GOOGLENET = "googlenet_k80"  # the shipped MG-WFBP reference trace, commd/plan/profiles/
PLANNERS = ("wfbp", "syncea", "fixed-25MB", "ddp", "horovod", "mgwfbp", "optimal")
# The paper's real 8-node K80 10GbE runs (scaling efficiency), for context next to the model.
PAPER_8_NODES = {"mgwfbp": (0.92, 0.93), "wfbp": (0.76, 0.77), "syncea": (0.66, 0.68)}


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
