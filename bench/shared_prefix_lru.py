"""How many shared-prefix requests must miss their group's prefix even under perfect routing.

Replays the shared-prefix workload's arrival process (`kvepp-bench bench-routing --workload
shared-prefix`: Poisson at 24 req/s, 48 equally likely groups of a 4,096-token system prompt, a
512-token question, 32-128 output tokens, 16-token blocks) against the best static placement:
each group pinned to one of 4 engines (12 each), each engine an LRU cache of 4,096 blocks that
keeps a request's prompt and generated blocks, as vLLM does. Processing time and pinning of running
requests are ignored (both only add misses). Prints the share of requests that find their group's
prefix evicted after its first use, the compulsory share (each group's first request) and the
block hit ratio.

Usage: python3 bench/shared_prefix_lru.py [--duration 30 60]
"""

import argparse
import collections
import math
import random

GROUPS, PREFIX_BLOCKS, QUESTION_BLOCKS, RATE = 48, 4096 // 16, 512 // 16, 24.0


def replay(duration, engines=4, capacity=4096, seed=42):
    rng = random.Random(seed)
    t, requests = 0.0, []
    while True:
        t += -math.log(1.0 - rng.random()) / RATE
        if t >= duration:
            break
        requests.append((rng.randrange(GROUPS), rng.randint(32, 128)))
    caches = [collections.OrderedDict() for _ in range(engines)]
    evicted = missed = 0
    seen = set()
    for n, (group, output) in enumerate(requests):
        cache = caches[group % engines]
        prefix = [("prefix", group, i) for i in range(PREFIX_BLOCKS)]
        hit = next((i for i, b in enumerate(prefix) if b not in cache), PREFIX_BLOCKS)
        if hit < PREFIX_BLOCKS and group in seen:
            evicted += 1
        seen.add(group)
        missed += PREFIX_BLOCKS + QUESTION_BLOCKS - hit
        for b in prefix + [("own", n, i) for i in range(QUESTION_BLOCKS + output // 16)]:
            cache[b] = True
            cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    total = len(requests) * (PREFIX_BLOCKS + QUESTION_BLOCKS)
    return len(requests), evicted / len(requests), len(seen) / len(requests), 1 - missed / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, nargs="+", default=[30.0, 60.0])
    for d in ap.parse_args().duration:
        n, evicted, compulsory, hit = replay(d)
        print(f"{d:.0f} s, {n} requests, groups partitioned 12 per engine: {evicted:.1%} find their "
              f"prefix evicted, {compulsory:.1%} are a group's first, block hit ratio {hit:.1%}")


if __name__ == "__main__":
    main()
