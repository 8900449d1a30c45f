#!/usr/bin/env python3
"""Summarises bench/generalization.sh's runs: per reuse structure, load and policy, the median
and the spread (min-max over seeds) of each figure, then the targets for the default policy,
checked run by run.

Figures per run: hit ratio as a share of the capacity ceiling and of the best reference
placement's (`clairvoyant`, `clairvoyant-completion`, whichever ran), TTFT p50/p90, e2e p90, ITL
p90, the best reference's TTFT p90 and e2e p90 as a share of the policy's (100%: as low),
imbalance (load-weighted), failures.

Targets for the default (every run, 50-120% load): no other policy or reference has a TTFT p90
more than 10% lower, or an e2e p90 more than 5% lower, and its hit ratio is at least 85% of the
capacity ceiling.

usage: python3 bench/generalization.py bench/results/generalization [DEFAULT_POLICY]
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUN = re.compile(r"^(?P<structure>.+)-s(?P<seed>\d+)-l(?P<load>[0-9.]+)$")
REFERENCES = ("clairvoyant", "clairvoyant-completion")
NAMES = [
    "hit % of ceiling",
    "hit % of best reference",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "e2e p90 ms",
    "ITL p90 ms",
    "TTFT p90 % of best reference",
    "e2e p90 % of best reference",
    "imbalance",
    "failed",
]


def ratio(a, b, scale=1.0):
    return scale * a / b if a and b else None


def best(by_policy, value, higher=False):
    vs = [value(r) for name, r in by_policy.items() if name in REFERENCES and value(r)]
    return (max(vs) if higher else min(vs)) if vs else None


def figures(r, by_policy, ceiling):
    p90 = r["ttft_ms"][1]
    e2e = r["e2e_ms"][1]
    itl = r.get("itl_ms", [0, 0, 0])[1]
    return {
        "hit % of ceiling": ratio(r["hit_ratio"], ceiling, 100.0),
        "hit % of best reference": ratio(r["hit_ratio"], best(by_policy, lambda c: c["hit_ratio"], True), 100.0),
        "TTFT p50 ms": r["ttft_ms"][0],
        "TTFT p90 ms": p90,
        "e2e p90 ms": e2e,
        "ITL p90 ms": itl or None,
        "TTFT p90 % of best reference": ratio(best(by_policy, lambda c: c["ttft_ms"][1]), p90, 100.0),
        "e2e p90 % of best reference": ratio(best(by_policy, lambda c: c["e2e_ms"][1]), e2e, 100.0),
        "imbalance": r["imbalance"],
        "failed": r["failed"],
    }


def fmt(name, v):
    if "×" in name or name.startswith("imbalance") or name.startswith("ITL"):
        return f"{v:.2f}"
    return f"{v:.0f}"


def check(default, runs):
    """The targets for the default policy, run by run."""
    lines, misses = [], 0
    for (structure, seed, load), (by_policy, ceilings) in sorted(runs.items()):
        r = by_policy.get(default)
        if r is None:
            continue
        bad = []
        hit = ratio(r["hit_ratio"], ceilings["capacity"], 100.0)
        if hit is None or hit < 85:
            bad.append(f"hit {hit or 0:.0f}% of the capacity ceiling (< 85%)")
        for name, o in sorted(by_policy.items()):
            if name == default:
                continue
            if o["ttft_ms"][1] and o["ttft_ms"][1] < r["ttft_ms"][1] / 1.10:
                bad.append(f"{name}'s TTFT p90 {o['ttft_ms'][1]:.0f} ms vs {r['ttft_ms'][1]:.0f} ms")
            if o["e2e_ms"][1] and o["e2e_ms"][1] < r["e2e_ms"][1] / 1.05:
                bad.append(f"{name}'s e2e p90 {o['e2e_ms'][1]:.0f} ms vs {r['e2e_ms'][1]:.0f} ms")
        misses += bool(bad)
        status = "met" if not bad else "missed: " + "; ".join(bad)
        lines.append(f"- {structure} seed {seed} load {load:.0%} (reusable {ceilings['infinite']:.0%}): {status}")
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
        print(f"\nTargets for `{default}`, run by run ({misses} of {len(lines)} runs miss one):\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/generalization",
         sys.argv[2] if len(sys.argv) > 2 else "default")
