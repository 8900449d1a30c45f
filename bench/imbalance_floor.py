#!/usr/bin/env python3
"""How even can request counts be kept on this workload, whatever the router knows?

Reads `requests.csv` from a `kvepp-bench bench-routing` run (one row per request: when it was
sent, how long it ran, where it went) and, per policy, places the same requests again offline,
each keeping the duration it had in the run (as if it did not depend on where it ran):

- `as run`: where the policy put them (the report's imbalance, recomputed);
- `fewest at pick`: on the engine holding the fewest requests when it is sent (ties to the lowest
  index), what any router that balances counts at pick time reaches without knowing when
  requests will end;
- `knows durations`: on the engine where the busiest instant of its own lifetime holds the fewest
  requests (ties: the least request-time over its lifetime), a router told every request's
  duration in advance (no real router is: outputs end at end of sequence).

Imbalance is the report's: the busiest engine's active requests over the mean rounded up,
sampled every 50 ms while any request is active, time-averaged.

    python3 bench/imbalance_floor.py bench/results/routing/requests.csv [--workload mooncake]
"""

import argparse
import csv
import math
from collections import defaultdict


def imbalance(spans, engines):
    """spans: (start, end, engine index) in seconds."""
    if not spans:
        return 1.0
    end = max(e for _, e, _ in spans)
    total, n, t = 0.0, 0, 0.0
    while t <= end:
        active = [0] * engines
        for s, e, i in spans:
            if s <= t < e:
                active[i] += 1
        busy = sum(active)
        if busy:
            total += max(active) / math.ceil(busy / engines)
            n += 1
        t += 0.05
    return total / n if n else 1.0


def place(requests, engines, knows_durations):
    spans = []
    for s, d in sorted(requests):
        e = s + d
        live = [x for x in spans if x[1] > s]

        def score(i):
            mine = [x for x in live if x[2] == i]
            if not knows_durations:
                return (len(mine), i)
            # The busiest instant of [s, e) on engine i is at s or at a later start there.
            points = [s] + [x[0] for x in mine if s < x[0] < e]
            peak = max(sum(1 for x in mine if x[0] <= p < x[1]) for p in points)
            overlap = sum(min(e, x[1]) - max(s, x[0]) for x in mine)
            return (peak, overlap, i)

        spans.append((s, e, min(range(engines), key=score)))
    return spans


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--workload", help="only this workload (default: every one in the file)")
    ap.add_argument("--engines", type=int, help="fleet size (default: engines seen in the file)")
    args = ap.parse_args()
    runs = defaultdict(list)
    names = defaultdict(set)
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            if args.workload and row["workload"] != args.workload:
                continue
            if row["status"] != "200" or not row["e2e_ms"] or not row["engine"]:
                continue
            key = (row["workload"], row["policy"])
            runs[key].append(
                (float(row["sent_ms"]) / 1000, float(row["e2e_ms"]) / 1000, row["engine"])
            )
            names[row["workload"]].add(row["engine"])
    if not runs:
        raise SystemExit("no completed requests in " + args.csv)
    print("| workload | policy | requests | as run | fewest at pick | knows durations |")
    print("|---|---|---:|---:|---:|---:|")
    for (workload, policy), rows in sorted(runs.items()):
        engine_names = sorted(names[workload])
        engines = args.engines or len(engine_names)
        index = {n: i for i, n in enumerate(engine_names)}
        as_run = [(s, s + d, index[n]) for s, d, n in rows]
        requests = [(s, d) for s, d, _ in rows]
        print(
            f"| {workload} | {policy} | {len(rows)} | {imbalance(as_run, engines):.2f} "
            f"| {imbalance(place(requests, engines, False), engines):.2f} "
            f"| {imbalance(place(requests, engines, True), engines):.2f} |"
        )


if __name__ == "__main__":
    main()
