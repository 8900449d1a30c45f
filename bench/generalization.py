#!/usr/bin/env python3
"""Summarises bench/generalization.sh's runs: per reuse structure, load and policy, the median
and the spread (min-max over seeds) of each figure.

usage: python3 bench/generalization.py bench/results/generalization
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUN = re.compile(r"^(?P<structure>.+)-s(?P<seed>\d+)-l(?P<load>[0-9.]+)$")


def figures(result, ceiling):
    p50, p90 = result["ttft_ms"][0], result["ttft_ms"][1]
    return {
        "hit % of ceiling": 100.0 * result["hit_ratio"] / ceiling if ceiling > 0 else 0.0,
        "TTFT p50 ms": p50,
        "TTFT p90 ms": p90,
        "imbalance": result["imbalance"],
        "failed": result["failed"],
    }


def main(root):
    table = defaultdict(lambda: defaultdict(list))
    for d in sorted(Path(root).iterdir()):
        m = RUN.match(d.name)
        f = d / "results.json"
        if not m or not f.exists():
            continue
        for workload in json.loads(f.read_text()):
            ceiling = workload["ceilings"]["capacity"]
            for r in workload["results"]:
                key = (m["structure"], float(m["load"]), r["policy"])
                for name, v in figures(r, ceiling).items():
                    table[key][name].append(v)
    if not table:
        sys.exit(f"no runs under {root}")
    names = ["hit % of ceiling", "TTFT p50 ms", "TTFT p90 ms", "imbalance", "failed"]
    print("| structure | load | policy | seeds | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for (structure, load, policy), figs in sorted(table.items()):
        cells = []
        for n in names:
            vs = figs[n]
            fmt = "{:.0f}" if "ms" in n or n == "failed" else "{:.2f}" if n == "imbalance" else "{:.0f}"
            med = fmt.format(statistics.median(vs))
            cells.append(f"{med} ({fmt.format(min(vs))}–{fmt.format(max(vs))})")
        seeds = len(figs[names[0]])
        print(f"| {structure} | {load:.0%} | {policy} | {seeds} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/generalization")
