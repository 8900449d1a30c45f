#!/usr/bin/env python3
"""Summarises bench/generalization.sh's runs: per reuse structure, load and policy, the median
and the spread (min-max over seeds) of each figure, then the issue's targets for the default
policy, checked run by run.

Figures per run: hit ratio as a share of the capacity ceiling and of the clairvoyant placement's
(`clairvoyant`, when it ran), TTFT p50/p90, what the clairvoyant placement's TTFT is of the
policy's (100%: as low), p90 TTFT of round robin and of approximate prefix over the policy's
(how many times lower), imbalance, failures.

usage: python3 bench/generalization.py bench/results/generalization [DEFAULT_POLICY]
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUN = re.compile(r"^(?P<structure>.+)-s(?P<seed>\d+)-l(?P<load>[0-9.]+)$")
NAMES = [
    "hit % of ceiling",
    "hit % of clairvoyant",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "p50 % of clairvoyant",
    "p90 % of clairvoyant",
    "p90 × lower than round robin",
    "p90 × lower than approximate",
    "imbalance",
    "failed",
]


def ratio(a, b, scale=1.0):
    return scale * a / b if a and b else None


def figures(r, by_policy, ceiling):
    p50, p90 = r["ttft_ms"][0], r["ttft_ms"][1]
    c = by_policy.get("clairvoyant")
    rr = by_policy.get("round-robin")
    ap = by_policy.get("approximate-prefix")
    return {
        "hit % of ceiling": ratio(r["hit_ratio"], ceiling, 100.0),
        "hit % of clairvoyant": ratio(r["hit_ratio"], c and c["hit_ratio"], 100.0),
        "TTFT p50 ms": p50,
        "TTFT p90 ms": p90,
        "p50 % of clairvoyant": ratio(c and c["ttft_ms"][0], p50, 100.0),
        "p90 % of clairvoyant": ratio(c and c["ttft_ms"][1], p90, 100.0),
        "p90 × lower than round robin": ratio(rr and rr["ttft_ms"][1], p90),
        "p90 × lower than approximate": ratio(ap and ap["ttft_ms"][1], p90),
        "imbalance": r["imbalance"],
        "failed": r["failed"],
    }


def fmt(name, v):
    if "×" in name or name.startswith("imbalance"):
        return f"{v:.2f}"
    return f"{v:.0f}"


def check(default, runs):
    """The issue's targets for the default policy, run by run (50-90% load)."""
    lines, misses = [], 0
    for (structure, seed, load), (by_policy, ceilings) in sorted(runs.items()):
        r = by_policy.get(default)
        if r is None or load > 0.9:
            continue
        f = figures(r, by_policy, ceilings["capacity"])
        reusable = ceilings["infinite"]
        wants = [
            ("hit ≥ 85% of ceiling", f["hit % of ceiling"], lambda v: v >= 85),
            ("hit ≥ 90% of clairvoyant", f["hit % of clairvoyant"], lambda v: v >= 90),
            ("imbalance ≤ 1.3", f["imbalance"], lambda v: v <= 1.3),
        ]
        if reusable >= 0.25:
            wants += [
                ("p90 ≥ 2× lower than round robin", f["p90 × lower than round robin"], lambda v: v >= 2),
                ("p90 ≥ 1.2× lower than approximate", f["p90 × lower than approximate"], lambda v: v >= 1.2),
            ]
        bad = [f"{n} ({fmt(n, v) if v is not None else 'not run'})" for n, v, ok in wants if v is None or not ok(v)]
        misses += bool(bad)
        status = "met" if not bad else "missed: " + "; ".join(bad)
        lines.append(f"- {structure} seed {seed} load {load:.0%} (reusable {reusable:.0%}): {status}")
    return lines, misses


def main(root, default):
    table = defaultdict(lambda: defaultdict(list))
    runs = {}
    for d in sorted(Path(root).iterdir()):
        m = RUN.match(d.name)
        f = d / "results.json"
        if not m or not f.exists():
            continue
        for workload in json.loads(f.read_text()):
            ceilings = workload["ceilings"]
            by_policy = {r["policy"]: r for r in workload["results"]}
            runs[(m["structure"], int(m["seed"]), float(m["load"]))] = (by_policy, ceilings)
            for r in workload["results"]:
                key = (m["structure"], float(m["load"]), r["policy"])
                for name, v in figures(r, by_policy, ceilings["capacity"]).items():
                    if v is not None:
                        table[key][name].append(v)
    if not table:
        sys.exit(f"no runs under {root}")
    print("| structure | load | policy | seeds | " + " | ".join(NAMES) + " |")
    print("|---|---|---|---|" + "---|" * len(NAMES))
    for (structure, load, policy), figs in sorted(table.items()):
        cells = []
        for n in NAMES:
            vs = figs.get(n)
            if not vs:
                cells.append("-")
                continue
            cells.append(f"{fmt(n, statistics.median(vs))} ({fmt(n, min(vs))}–{fmt(n, max(vs))})")
        seeds = len(figs["TTFT p50 ms"])
        print(f"| {structure} | {load:.0%} | {policy} | {seeds} | " + " | ".join(cells) + " |")
    lines, misses = check(default, runs)
    if lines:
        print(f"\nTargets for `{default}` at 50-90% load, run by run ({misses} of {len(lines)} runs miss one):\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/generalization",
         sys.argv[2] if len(sys.argv) > 2 else "default")
