"""The exact optimum over all plans of adjacent groups, in O(L) for a linear cost."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from commd.plan.cost import LinearCost
from commd.plan.timeline import Groups, check_layers, ready_times

__all__ = ["optimal"]


def optimal(sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost) -> Groups:
    """The plan with the earliest end of communication, hence the shortest iteration.

    Number layers in backward order, j = 0..L-1 (j-th is forward layer L-1-j), with r[j] its
    ready time and S[j] the bytes of the first j of them. F[j] is the earliest time at which
    the first j layers can all have been all-reduced:

        F[0] = 0,  F[j] = min over i < j of  max(F[i], r[j-1]) + a + b·(S[j] - S[i]).

    Why minimising each prefix is enough: a group starts at max(previous end, its ready time)
    and ends a fixed cost later, so every later end is a nondecreasing function of the previous
    end. In an optimal plan whose last group is i..L-1, replacing the plan of the first i layers
    by one ending at F[i] therefore ends no later. The last group starts after backward has
    finished, so the iteration is forward + F[L]: minimising F[L] minimises it.

    Speed. F is nondecreasing (dropping the last layer of a plan for j+1 layers gives a plan
    for j layers that ends no later, because a, b >= 0), and r is nondecreasing. So for each j
    the candidates split at p = #{i : F[i] <= r[j-1]}, and p only grows with j:
      * i < p: the term is r[j-1] - b·S[i] + const, smallest for the largest S[i], i.e. i = p-1;
      * p <= i < j: the term is F[i] - b·S[i] + const, a minimum over a window whose both ends
        only move right: a monotone deque gives it in amortised O(1).

    Ties are broken towards fewer groups: every candidate is compared on (end time, number of
    groups); among the i < p that tie (equal b·S[i], e.g. empty layers or b = 0) the one with
    the fewest groups is tracked as well. The choice is deterministic; it is the fewest groups
    among plans with the same prefix end, not always among all optimal plans.

    One function on purpose: the deque, the split point p and the two candidates share their
    state within one pass over the layers, and a call per layer would cost more than the rest.
    """
    check_layers(sizes_bytes, backward_s)
    num_layers = len(sizes_bytes)
    ready = ready_times(backward_s)
    b = cost.beta_s_per_byte  # a is the same for every candidate: only b·S enters the keys
    r = [ready[num_layers - 1 - j] for j in range(num_layers)]
    prefix = [0] * (num_layers + 1)  # S
    for j in range(num_layers):
        prefix[j + 1] = prefix[j] + int(sizes_bytes[num_layers - 1 - j])
    bs = [b * s for s in prefix]

    end = [0.0] * (num_layers + 1)  # F
    ngroups = [0] * (num_layers + 1)
    choice = [0] * (num_layers + 1)  # the i that F[j] uses: last group is i..j-1
    # run_best[i]: among the indices k <= i with bs[k] == bs[i], the one with fewest groups.
    run_best = [0] * (num_layers + 1)
    window: deque[int] = deque()  # indices with increasing (F[i] - bs[i], ngroups[i])
    p = 0
    for j in range(1, num_layers + 1):
        ready_j = r[j - 1]
        newest = j - 1  # F[j-1] is known now: it joins the window
        key_new = (end[newest] - bs[newest], ngroups[newest])
        while window and (end[window[-1]] - bs[window[-1]], ngroups[window[-1]]) >= key_new:
            window.pop()
        window.append(newest)
        while p < j and end[p] <= ready_j:
            p += 1
        while window and window[0] < p:
            window.popleft()

        best = run_best[p - 1]  # p >= 1 because F[0] = 0 <= every ready time
        best_key = (ready_j - bs[p - 1], ngroups[best])
        if window:
            i = window[0]
            key = (end[i] - bs[i], ngroups[i])
            if key < best_key:
                best, best_key = i, key
        # Recompute the end the way evaluate() does, so predictions match it exactly.
        end[j] = max(end[best], ready_j) + cost(prefix[j] - prefix[best])
        ngroups[j] = ngroups[best] + 1
        choice[j] = best
        keep = run_best[j - 1]
        same_run = bs[j] == bs[j - 1] and ngroups[keep] <= ngroups[j]
        run_best[j] = keep if same_run else j

    groups: Groups = []
    j = num_layers
    while j > 0:
        i = choice[j]
        # Backward positions i..j-1 are forward layers L-j..L-1-i.
        groups.append(list(range(num_layers - j, num_layers - i)))
        j = i
    groups.reverse()
    return groups
