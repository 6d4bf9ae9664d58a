"""Measured against predicted: two daemons, ranks replaying a profile, one run per planner.

Each rank sleeps every layer's backward time (scaled by --time-scale) before marking it
ready, so the daemons see a realistic backward pass without a model. After the first
re-plan (iteration 12, once the profile and the network were measured), the median iteration
is compared with what the planner's timeline model predicts for the plan in use, using the
a and b the daemons fitted (`commd status`).

    python bench/replay.py --profile resnet50 --time-scale 0.05 --iterations 40

The results, with the command, commit and machine, go to bench/results/replay.json
(``--results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commd.cli.status import query
from commd.cli.tables import markdown_table
from commd.plan import LinearCost, evaluate
from commd.plan.model_profiles import resolve_profile
from commd.testing.daemons import LocalDaemon
from commd.testing.processes import finish, kill_all, start_json_worker
from commd.testing.results import add_results_option, write_results

PLANNERS = ("wfbp", "syncea", "fixed-25MB", "mgwfbp", "optimal")
MEASURE_FROM = 15  # after the first informed plan (iteration 12) has settled
RANKS_TIMEOUT_S = 600.0  # a planner's ranks must have exited this long after it was observed


def replay_rank(spec: dict[str, Any]) -> None:
    """One rank, in a process of its own (``replay.py _rank '<json spec>'``): prints its
    iteration times as one JSON line."""
    from commd_client import Client

    layers = [(name, size) for name, size in spec["layers"]]
    backward = spec["backward"]
    with Client(job=spec["job"], rank=spec["rank"], world_size=2, local_rank=0,
                local_world_size=1, coordinator=spec["coordinator"], socket=spec["socket"],
                timeout=120) as client:
        client.register(layers, dtype="float32", op="avg", planner=spec["planner"])
        times = []
        for _ in range(spec["iterations"]):
            began = due = time.perf_counter()
            for index in reversed(range(len(layers))):
                # Sleep to each layer's ready time on the profile's schedule, so that the
                # oversleeping of 161 short sleeps does not add up.
                due += backward[index]
                time.sleep(max(0.0, due - time.perf_counter()))
                client.ready(index)
            client.wait()
            times.append(time.perf_counter() - began)
        print(json.dumps({"rank": spec["rank"], "times": times,
                          "plan_version": client.plan_version}), flush=True)


def run_planner(daemons: list[LocalDaemon], planner: str, layers: list[tuple[str, int]],
                backward: list[float], iterations: int) -> dict[str, Any]:
    job = f"replay-{planner}"
    ranks = [start_json_worker([sys.executable, str(Path(__file__).resolve()), "_rank"], {
        "rank": rank, "socket": daemons[rank].socket, "coordinator": daemons[0].address,
        "job": job, "layers": layers, "backward": backward, "planner": planner,
        "iterations": iterations}) for rank in range(2)]
    status = None
    try:
        # Catch the job's model while it runs (the job is gone once the ranks close).
        while status is None and any(process.poll() is None for process in ranks):
            jobs = query(daemons[0].socket)["jobs"]
            if jobs and jobs[0]["iteration"] >= MEASURE_FROM:
                status = jobs[0]
            else:
                time.sleep(0.02)
        finished = finish(ranks, RANKS_TIMEOUT_S)
    finally:
        kill_all(ranks)
    results = [done.last_json() for done in finished]
    for done, result in zip(finished, results, strict=True):
        if "times" not in result:
            raise RuntimeError(f"a rank of {job} failed (exit code {done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
    assert status is not None, "the job finished before it could be observed"
    times = results[0]["times"][MEASURE_FROM:]
    sizes = [n * 4 for _, n in layers]
    cost = LinearCost(status["alpha_s"], status["beta_s_per_byte"])
    predicted = evaluate(status["groups"], sizes, backward, cost).iteration_s
    return {"planner": planner, "groups": len(status["groups"]),
            "exposed_measured_s": status["measured_comm_s"],
            "exposed_predicted_s": status["predicted_comm_s"],
            "measured_s": statistics.median(times), "predicted_s": predicted,
            "alpha_s": cost.alpha_s, "beta_s_per_byte": cost.beta_s_per_byte}


def table(results: dict[str, Any]) -> str:
    """The measured-against-predicted table of a run's results (what main writes)."""
    rows = [[row["planner"], row["groups"], f"{row['measured_s'] * 1e3:.1f}",
             f"{row['predicted_s'] * 1e3:.1f}", f"{row['measured_s'] / row['predicted_s']:.2f}",
             f"{row['exposed_measured_s'] * 1e3:.1f}", f"{row['exposed_predicted_s'] * 1e3:.1f}"]
            for row in results["rows"]]
    fitted = results["rows"][-1]
    return (markdown_table(["planner", "groups", "iteration measured ms", "predicted ms",
                            "measured/predicted", "exposed comm measured ms", "predicted ms"],
                           rows, "lrrrrrr")
            + f"\n\nFitted: a = {fitted['alpha_s'] * 1e6:.0f} µs, "
              f"b = {fitted['beta_s_per_byte'] * 1e9:.3f} ns/B.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="resnet50")
    parser.add_argument("--time-scale", type=float, default=0.05,
                        help="multiply the profile's backward times (CPU profiles are slow)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--planners", default=",".join(PLANNERS))
    parser.add_argument("--json", action="store_true")
    add_results_option(parser, "replay")
    args = parser.parse_args(argv)
    profile = resolve_profile(args.profile)
    layers = [(name, size // 4) for name, size in zip(profile.layer_names, profile.sizes_bytes,
                                                        strict=True)]
    backward = [t * args.time_scale for t in profile.backward_s]
    workdir = Path(tempfile.mkdtemp(prefix="commd-replay-"))
    daemons = [LocalDaemon(workdir, "a"), LocalDaemon(workdir, "b")]
    rows = []
    try:
        for planner in args.planners.split(","):
            rows.append(run_planner(daemons, planner, layers, backward, args.iterations))
    finally:
        for daemon in daemons:
            daemon.stop()
    results = {"profile": profile.name, "layers": len(layers),
               "megabytes": sum(profile.sizes_bytes) / 1e6, "time_scale": args.time_scale,
               "backward_s": sum(backward), "measure_from": MEASURE_FROM,
               "iterations": args.iterations, "rows": rows}
    write_results("replay", results, args.results)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"profile {profile.name}: {len(layers)} layers, {sum(profile.sizes_bytes) / 1e6:.1f} MB,"
          f" backward {sum(backward) * 1e3:.1f} ms (x{args.time_scale:g}); 2 daemons x 1 rank,"
          f" loopback; median of iterations {MEASURE_FROM}..{args.iterations - 1}")
    print(table(results))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_rank"]:
        replay_rank(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
