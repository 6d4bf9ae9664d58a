"""The published MG-WFBP merge rule (Shi, Chu, Li: INFOCOM 2019; TPDS 2021)."""

from __future__ import annotations

from collections.abc import Sequence

from commd.plan.cost import LinearCost
from commd.plan.timeline import Groups, check_layers, ready_times

__all__ = ["mgwfbp"]


def mgwfbp(sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost) -> Groups:
    """Merge gradients with MG-WFBP's rule, exactly as the paper's Algorithm 1 states it.

    The paper (layers numbered 1..L there, 0..L-1 here) starts from WFBP, one all-reduce per
    layer, and with tau_c(l) the start of layer l's all-reduce computes

        tau_c(L-1) = ready(L-1),
        tau_c(l)   = max(tau_c(l+1) + t_c(l+1), ready(l)),  t_c(l) = a + b·p(l).

    It then walks l = L-1 down to 1 and merges layer l into layer l-1 when

        ready(l-1) - tau_c(l) < a,

    i.e. when layer l-1 is ready less than one start-up time ``a`` after layer l's all-reduce
    would start: waiting for it then costs less than paying ``a`` twice. Merging moves l's
    bytes into l-1 (p(l-1) += p(l); t_c(l) = 0; t_c(l-1) = a + b·p(l-1)) and recomputes every
    tau_c before the next test, so merges chain: a group grows downwards while the test holds.
    (The authors' code also tests ready(l-1) < tau_c(l) + t_c(l) first; as t_c(l) >= a that
    test is implied by the one above.)

    The full recomputation makes the paper's loop O(L²), but the test at layer l only reads
    tau_c(l), which depends on the decisions already taken above l: tau_c(l) = max(end of the
    last closed group, ready(l)). Carrying that end along gives the same groups in O(L)
    (tests/unit/test_planner.py checks this against a literal transcription).

    The rule is greedy and not always optimal; ``optimal`` is.
    """
    check_layers(sizes_bytes, backward_s)
    num_layers = len(sizes_bytes)
    if num_layers == 0:
        return []
    ready = ready_times(backward_s)
    groups: Groups = []
    top = num_layers - 1  # highest layer of the group being grown downwards
    nbytes = 0  # bytes of layers l+1..top, all already merged into the open group
    previous_end = 0.0  # end of the all-reduce of the last closed group
    for layer in range(num_layers - 1, 0, -1):
        nbytes += sizes_bytes[layer]
        start = max(previous_end, ready[layer])  # tau_c of the open group, lowest layer `layer`
        if ready[layer - 1] - start < cost.alpha_s:
            continue  # merge `layer` into `layer - 1`: the open group grows
        groups.append(list(range(layer, top + 1)))
        previous_end = start + cost(nbytes)
        top, nbytes = layer - 1, 0
    groups.append(list(range(0, top + 1)))
    return groups
