#!/usr/bin/env python3
"""Summarises bench/overload.sh's runs: per load, flow control off against on (the median and
the spread over seeds): the share of requests admitted (answered 200), TTFT p50/p90 of the
admitted, the share of the admitted within the TTFT objective, goodput (requests/s within it),
goodput on over off, and the median time to a refusal (429/503) with its statuses.

usage: python3 bench/overload.py bench/results/overload [OBJECTIVE_MS]
"""
import csv
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

RUN = re.compile(r"^(?P<structure>.+)-s(?P<seed>\d+)-l(?P<load>[0-9.]+)-(?P<mode>off|on)$")


def run_figures(d, objective):
    [workload] = json.loads((d / "results.json").read_text())
    [r] = workload["results"]
    rows = list(csv.DictReader((d / "requests.csv").open()))
    ok = [x for x in rows if x["status"] == "200" and x["ttft_ms"]]
    refused = [x for x in rows if x["status"] in ("429", "503")]
    ttfts = sorted(float(x["ttft_ms"]) for x in ok)
    within = sum(t <= objective for t in ttfts)
    refusal_ms = [float(x["e2e_ms"]) for x in refused if x["e2e_ms"]]
    pct = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else 0.0
    return {
        "admitted %": 100.0 * len(ok) / len(rows) if rows else 0.0,
        "TTFT p50 ms (admitted)": pct(0.5),
        "TTFT p90 ms (admitted)": pct(0.9),
        "admitted within objective %": 100.0 * within / len(ok) if ok else 0.0,
        "goodput req/s": r["goodput_rps"],
        "refused after ms (median)": statistics.median(refusal_ms) if refusal_ms else None,
        "statuses": Counter(x["status"] for x in rows),
    }


def main(root, objective):
    runs = defaultdict(dict)
    for d in sorted(Path(root).iterdir()):
        m = RUN.match(d.name)
        if m and (d / "results.json").exists():
            runs[(m["structure"], float(m["load"]), int(m["seed"]))][m["mode"]] = run_figures(d, objective)
    if not runs:
        sys.exit(f"no runs under {root}")
    names = ["admitted %", "TTFT p50 ms (admitted)", "TTFT p90 ms (admitted)",
             "admitted within objective %", "goodput req/s", "refused after ms (median)"]
    table = defaultdict(lambda: defaultdict(list))
    ratios = defaultdict(list)
    statuses = defaultdict(Counter)
    for (structure, load, seed), modes in runs.items():
        for mode, f in modes.items():
            for n in names:
                if f[n] is not None:
                    table[(structure, load, mode)][n].append(f[n])
            statuses[(structure, load, mode)].update(f["statuses"])
        if "on" in modes and "off" in modes and modes["off"]["goodput req/s"] > 0:
            ratios[(structure, load)].append(modes["on"]["goodput req/s"] / modes["off"]["goodput req/s"])
    print(f"TTFT objective {objective:.0f} ms\n")
    print("| structure | load | flow control | seeds | " + " | ".join(names) + " | statuses | goodput on / off |")
    print("|---|---|---|---|" + "---|" * (len(names) + 2))
    for (structure, load, mode), figs in sorted(table.items()):
        cells = []
        for n in names:
            vs = figs.get(n)
            f = "{:.2f}" if "goodput" in n else "{:.0f}"
            cells.append(f"{f.format(statistics.median(vs))} ({f.format(min(vs))}–{f.format(max(vs))})" if vs else "-")
        st = ", ".join(f"{k}: {v}" for k, v in sorted(statuses[(structure, load, mode)].items()))
        rs = ratios.get((structure, load), [])
        ratio = f"{statistics.median(rs):.2f}× ({min(rs):.2f}–{max(rs):.2f})" if mode == "on" and rs else ""
        seeds = len(figs["admitted %"])
        print(f"| {structure} | {load:.0%} | {mode} | {seeds} | " + " | ".join(cells) + f" | {st} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/overload",
         float(sys.argv[2]) if len(sys.argv) > 2 else 1000.0)
