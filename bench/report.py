"""docs/benchmarks.md, rendered from the benchmarks' results (bench/results/*.json).

    .venv/bin/python bench/report.py            # writes docs/benchmarks.md
    .venv/bin/python bench/report.py --check    # exits 1 when docs/benchmarks.md is not that

The prose is the template bench/report.md; each line ``{{name}}`` in it becomes what the
renderer of that name makes of bench/results/<name>.json: its tables (drawn by the bench's own
table function, the one that prints them), then the command, commit and machine that produced
them. A new run of a bench replaces its results file, and this replaces the numbers; the prose
around them says what does not change from run to run.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commd.cli.tables import markdown_table
from commd.testing.results import read_results

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "bench" / "report.md"
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"  # this checkout's, whichever commd is installed
COMMAND = ".venv/bin/python bench/report.py"
MARKER = re.compile(r"^\{\{([a-z0-9-]+)\}\}$")
RATES = {"1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s", "loopback": "loopback"}


def para(text: str) -> str:
    """A paragraph wrapped as the template's prose is (a link or a command stays whole)."""
    return textwrap.fill(text, width=95, break_on_hyphens=False, break_long_words=False)


def provenance(name: str, data: dict[str, Any]) -> str:
    """Where a results file's numbers came from, as one paragraph under its tables."""
    machine = data.get("machine") or {}
    facts = [f"{machine['cpus']} CPUs" if machine.get("cpus") else "",
             f"Python {machine['python']}" if machine.get("python") else "",
             machine.get("platform", "")]
    load = machine.get("loadavg")
    if load:
        facts.append(f"load average {load[0]:.1f}")
    return para(f"Command `{data.get('command') or '?'}`, commit `{data.get('commit') or '?'}`, "
                f"{', '.join(f for f in facts if f)}; every number: "
                f"[bench/results/{name}.json](../bench/results/{name}.json).")


def generated() -> str:
    text = (f"This file is generated: `{COMMAND}` renders it from the results each benchmark "
            "writes to `bench/results/<name>.json` (with the command, commit and machine that "
            "produced them) and from the prose of `bench/report.md`; edit those, not this "
            f"file. `{COMMAND} --check` exits 1 when this file is not what they render.")
    return para(text)


def time_to_loss(data: dict[str, Any]) -> str:
    """Per rate: the target (the best baseline's final loss) and the table, summarised again
    from every run's curves by the bench's own rule, so the page follows the rule, not the
    summary a run stored."""
    import time_to_loss as bench

    parts = []
    for rate, block in data["rates"].items():
        summary = bench.summarise(bench.outcomes_from_json(block["runs"]))
        failed = [textwrap.fill(line, width=95, subsequent_indent="  ", break_on_hyphens=False,
                                break_long_words=False) for line in bench.failures(summary)]
        split = bench.parts_table(summary)
        parts += [para(f"**{RATES.get(rate, rate)}** ({bench.headline(summary)}):"), "",
                  bench.table(summary), "",
                  *([para("Where a step goes (medians, ms; on 2 shared cores the ranks' and "
                          "the daemons' CPU together bound the step from below):"), "",
                     split, ""] if split else []),
                  *([*failed, ""] if failed else [])]
    return "\n".join(parts) + "\n" + provenance("time-to-loss", data)


def overhead(data: dict[str, Any]) -> str:
    import overhead as bench

    groups = {mode: data["summary"]["repeats"][0]["commd"][mode]["groups"]
              for mode in data["ready"]}
    intro = para(f"{data['model']}, planner {data['planner']} "
                 f"({', '.join(f'ready={m}: {g} group(s)' for m, g in groups.items())}), "
                 f"{data['warmup']} warm-up + {data['iterations']} measured iterations per "
                 f"repeat; milliseconds on rank 0, ratio = commd / raw Gloo (paired: the median "
                 f"of the per-iteration ratios); torch {data['torch']}, load average "
                 f"{data['loadavg_start'][0]:.1f} at the start, {data['loadavg_end'][0]:.1f} at "
                 f"the end:")
    return f"{intro}\n\n{bench.table(data)}\n\n{provenance('overhead', data)}"


def replay(data: dict[str, Any]) -> str:
    import replay as bench

    intro = para(f"{data['profile']}: {data['layers']} layers, {data['megabytes']:.1f} MB, "
                 f"backward {data['backward_s'] * 1e3:.1f} ms (× {data['time_scale']:g}); median "
                 f"of iterations {data['measure_from']}..{data['iterations'] - 1}:")
    return f"{intro}\n\n{bench.table(data)}\n\n{provenance('replay', data)}"


def planner_quality(data: dict[str, Any]) -> str:
    from commd.cli import quality
    from commd.plan.model_profiles import resolve_profile

    profiles = {name: resolve_profile(name) for name in data["profiles"]}
    text = quality.render(profiles, data["results"], data["googlenet_check"],
                          data["planning_time"])
    # the bench prints a document of its own: here its title goes and its sections go down one
    lines = [("#" + line if line.startswith("#") else line)
             for line in text.splitlines() if not line.startswith("# ")]
    return "\n".join(lines).strip() + "\n\n" + provenance("planner-quality", data)


def elastic(data: dict[str, Any]) -> str:
    import elastic as bench

    return f"{bench.table(data['summary'])}\n\n{provenance('elastic', data)}"


def fuzz_worst(data: dict[str, Any]) -> str:
    import fuzz as bench

    return (para(f"Daemons with `--max-layers {data['max_layers']}`, each frame timed over a "
                 f"{data['window_s']:g} s window:") + "\n\n"
            f"{bench.worst_tables(data['rows'], data['checks'])}\n\n"
            f"{provenance('fuzz-worst', data)}")


def faults(data: dict[str, Any]) -> str:
    import faults as bench

    return f"{bench.table(data['rows'])}\n\n{provenance('faults', data)}"


def hardening_overhead(data: dict[str, Any]) -> str:
    rows = [[run["side"], run["model"], f"`{run['command']}`", f"{run['ratio_all']:.3f}",
             f"{run['paired_all']:.3f}",
             f"{run['ratio_each']:.3f}" if "ratio_each" in run else "-"]
            for run in data["runs"]]
    return (para(f"{data['benchmark']}: base `{data['base_commit']}`, head "
                 f"`{data['head_commit']}`; {data['how']}.") + "\n\n"
            + markdown_table(["tree", "model", "command", "commd / raw, ready all at once",
                              "paired", "commd / raw, one ready() per layer"], rows, "lllrrr")
            + "\n\nEvery run's machine and load: [bench/results/hardening-overhead.json]"
              "(../bench/results/hardening-overhead.json).")


def compression(data: dict[str, Any]) -> str:
    import compression as bench

    return (f"{bench.render(data['rows'], data['live'], data['meta'])}\n\n"
            f"{provenance('compression', data)}")


def ddp_compare_compression(data: dict[str, Any]) -> str:
    import ddp_compare as bench

    parts = []
    for link, outcomes in bench.links_from_json(data["links"]).items():
        rate = link.removeprefix("tbf ")
        parts += [f"**{RATES.get(rate, rate)}**:", "", bench.variant_table(outcomes), ""]
    return "\n".join(parts) + "\n" + provenance("ddp-compare-compression", data)


def ddp_compare(data: dict[str, Any]) -> str:
    import ddp_compare as bench

    return (para("Medians of the alternating repeats; commd/torch below 1: commd's step is the "
                 "shorter. \"ranks agree\": both ranks end with the same parameters, as DDP "
                 "must.") + f"\n\n{bench.timing_table(data)}\n\n"
            f"{provenance('ddp-compare', data)}")


def topk_offline(data: dict[str, Any]) -> str:
    import topk_offline as bench

    warm_up = f" (the first {data['dense_steps']} dense)" if data["dense_steps"] else ""
    return (para(f"{data['steps']} steps on each of {data['streams']} data streams{warm_up}; "
                 f"the final loss is the mean of the last 10 steps, averaged over the streams; "
                 f"dense training ends at "
                 f"{data['dense_final_loss']:.3f}:") + f"\n\n{bench.table(data)}\n\n"
            f"{provenance('topk-offline', data)}")


def index(results: Path) -> str:
    """Every results file with the command and commit that wrote it."""
    rows = []
    for path in sorted(results.glob("*.json")):
        data = read_results(path)
        rows.append([f"[{path.name}](../bench/results/{path.name})",
                     f"`{data['command']}`" if data.get("command") else "per run, inside",
                     f"`{data['commit']}`" if data.get("commit") else "-"])
    return markdown_table(["results file", "command", "commit"], rows)


Renderer = Callable[[dict[str, Any]], str]
RENDERERS: dict[str, Renderer] = {
    "time-to-loss": time_to_loss, "overhead": overhead, "replay": replay,
    "planner-quality": planner_quality, "elastic": elastic, "fuzz-worst": fuzz_worst,
    "faults": faults, "hardening-overhead": hardening_overhead, "compression": compression,
    "ddp-compare": ddp_compare, "ddp-compare-compression": ddp_compare_compression,
    "topk-offline": topk_offline,
}
WITHOUT_RESULTS = ("generated", "index")  # the page's header, the list of results files


def render(template: Path = TEMPLATE, results: Path = RESULTS) -> str:
    out = []
    for line in template.read_text().splitlines():
        match = MARKER.match(line)
        if match is None:
            out.append(line)
            continue
        name = match.group(1)
        if name in WITHOUT_RESULTS:
            out.append(generated() if name == "generated" else index(results))
            continue
        if name not in RENDERERS:
            raise SystemExit(f"{template}: no renderer for {{{{{name}}}}}; "
                             f"known: {', '.join([*RENDERERS, *WITHOUT_RESULTS])}")
        path = results / f"{name}.json"
        if not path.exists():
            out.append(f"No results yet: `bench/results/{name}.json` is missing.")
            continue
        out.append(RENDERERS[name](read_results(path)))
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when docs/benchmarks.md differs")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    current = DOC.read_text() if DOC.exists() else ""
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(),
                                "docs/benchmarks.md", "rendered", lineterm="", n=1)
    print("\n".join(list(diff)[:60]), file=sys.stderr)
    print(f"docs/benchmarks.md is not what {COMMAND} renders from bench/results: run it",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
