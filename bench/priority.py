"""Driver for bench/priority.sh (see there): a burst that saturates a simulated fleet, with
high-priority (InferenceObjective priority 10) and sheddable (priority -1) requests, once with flow
control and once with immediate shedding. Prints and writes the p50/p99 TTFT per priority and the
share of requests served."""

import argparse
import asyncio
import json
import os
import random
import subprocess
import time

import yaml

from benchlib import Stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVEPP = os.path.join(ROOT, "target/release/kvepp")
SIM = os.path.join(ROOT, "target/release/kvepp-sim")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OBJECTIVES = """---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: interactive}
spec: {priority: 10, poolRef: {name: sim-pool}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: sim-pool}}
"""


async def one(port, objective, body, results):
    """A streamed completion: TTFT is the time to the first `data:` chunk."""
    start = time.monotonic()
    ttft = None
    status = 0
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((
            f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"x-llm-d-inference-objective: {objective}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body)
        await writer.drain()
        buf = b""
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=120)
            if not chunk:
                break
            buf += chunk
            if not status and b"\r\n" in buf:
                status = int(buf.split(b" ", 2)[1])
            if ttft is None and status == 200 and b"data:" in buf:
                ttft = time.monotonic() - start
        writer.close()
    except Exception:  # noqa: BLE001 - counted as not served
        status = 0
    results.append({"objective": objective, "status": status, "ttft": ttft,
                    "e2e": time.monotonic() - start})


async def burst(port, n, rate, high_share, max_tokens, seed):
    rng = random.Random(seed)
    results, tasks = [], []
    start = time.monotonic()
    for i in range(n):
        due = start + i / rate
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        objective = "interactive" if rng.random() < high_share else "batch"
        body = json.dumps({"model": MODEL, "prompt": f"request {i} {rng.random()} " + "text " * 200,
                           "max_tokens": max_tokens, "stream": True}).encode()
        tasks.append(asyncio.create_task(one(port, objective, body, results)))
    await asyncio.gather(*tasks)
    return results


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def run(args, flow_control):
    stack = Stack("kvepp-priority-")
    try:
        mdir = stack.fleet(SIM, args.engines, {"max_num_seqs": args.max_num_seqs})
        with open(os.path.join(mdir, "objectives.yaml"), "w") as f:
            f.write(OBJECTIVES)
        kcfg = os.path.join(stack.work, "kvepp.yaml")
        with open(kcfg, "w") as f:
            yaml.safe_dump({
                "max_in_flight_per_endpoint": args.max_num_seqs,
                "flow_control": {"enabled": flow_control, "max_wait_ms": 25000},
                "grpc_tls": {"mode": "off"},
            }, f)
        _, grpc, _ = stack.kvepp(KVEPP, kcfg, mdir)
        # The generated bootstrap for this pool (FailClose), with a message timeout above the wait.
        out = subprocess.run([KVEPP, "envoy-config", "--config", kcfg, "--pool-name", "sim-pool",
                              "--manifests-dir", mdir, "--grpc-port", str(grpc)],
                             check=True, capture_output=True, text=True).stdout
        b = yaml.safe_load(out)
        hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][0]["typed_config"]["message_timeout"] = "30s"
        listen = stack.envoy(args.envoy, b)
        return asyncio.run(burst(listen, args.requests, args.rate, args.high_share, args.max_tokens, 11))
    finally:
        stack.stop()


def summarize(results):
    out = {}
    for objective in ["interactive", "batch"]:
        rs = [r for r in results if r["objective"] == objective]
        ok = [r for r in rs if r["status"] == 200 and r["ttft"] is not None]
        codes = {}
        for r in rs:
            codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
        out[objective] = {
            "requests": len(rs), "served": len(ok), "served_share": round(len(ok) / max(1, len(rs)), 3),
            "ttft_p50_ms": round(pct([r["ttft"] for r in ok], 0.5) * 1000, 1),
            "ttft_p99_ms": round(pct([r["ttft"] for r in ok], 0.99) * 1000, 1),
            "codes": codes,
        }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=150, help="arrivals per second during the burst")
    ap.add_argument("--high-share", type=float, default=0.25)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="engine batch limit; also kvepp's max_in_flight_per_endpoint")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/priority"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("envoy", "out")}}
    for name, fc in [("flow_control", True), ("immediate_shedding", False)]:
        report[name] = summarize(run(args, fc))
        print(name, json.dumps(report[name]), flush=True)
    fc, sh = report["flow_control"], report["immediate_shedding"]
    lines = [
        "| policy | interactive served | interactive TTFT p50 / p99 (ms) | batch served | batch TTFT p50 / p99 (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in [("flow control", fc), ("immediate shedding", sh)]:
        i, b = r["interactive"], r["batch"]
        lines.append(f"| {name} | {i['served']}/{i['requests']} | {i['ttft_p50_ms']} / {i['ttft_p99_ms']} "
                     f"| {b['served']}/{b['requests']} | {b['ttft_p50_ms']} / {b['ttft_p99_ms']} |")
    ratio = sh["interactive"]["ttft_p99_ms"] / max(1e-9, fc["interactive"]["ttft_p99_ms"])
    total = lambda r: (r["interactive"]["served"] + r["batch"]["served"]) / max(  # noqa: E731
        1, r["interactive"]["requests"] + r["batch"]["requests"])
    lines.append("")
    lines.append(f"interactive p99 TTFT, immediate shedding ÷ flow control: {ratio:.2f}×; "
                 f"served overall: flow control {total(fc):.1%}, immediate shedding {total(sh):.1%}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
