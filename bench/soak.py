"""Driver for bench/soak.sh (see there): the full stack (simulated fleet, kvepp, Envoy) under a fixed
request rate for a configurable time, sampling kvepp's RSS, open file descriptors, threads and
runtime tasks every second. Writes soak.csv and soak.png, prints a summary, exits 1 on any error."""

import argparse
import asyncio
import csv
import json
import os
import random
import sys
import time

import yaml

from benchlib import Stack, get

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVEPP = os.path.join(ROOT, "target/release/kvepp")
SIM = os.path.join(ROOT, "target/release/kvepp-sim")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def sample_metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


class Counters:
    def __init__(self):
        self.sent = self.ok = self.errors = 0
        self.latencies = []
        self.error_samples = []


async def one_request(host, port, body, counters):
    """One HTTP/1.1 request on its own connection (Envoy keeps its upstream pools warm)."""
    start = time.monotonic()
    counters.sent += 1
    try:
        reader, writer = await asyncio.open_connection(host, port)
        req = (
            f"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        writer.write(req)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=60)
        writer.close()
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    except Exception as e:  # noqa: BLE001 - every failure is an error of the run
        status = 0
        if len(counters.error_samples) < 5:
            counters.error_samples.append(repr(e))
    if status == 200:
        counters.ok += 1
        counters.latencies.append(time.monotonic() - start)
    else:
        counters.errors += 1
        if status and len(counters.error_samples) < 5:
            counters.error_samples.append(f"HTTP {status}")


async def load(host, port, rate, seconds, counters, prefixes):
    """Open-loop arrivals at `rate` per second for `seconds`."""
    rng = random.Random(7)
    tasks = set()
    start = time.monotonic()
    i = 0
    while True:
        due = start + i / rate
        now = time.monotonic()
        if now - start >= seconds:
            break
        if due > now:
            await asyncio.sleep(due - now)
        prefix = rng.choice(prefixes)
        body = json.dumps(
            {"model": MODEL, "prompt": f"{prefix} question {i}: {rng.random()}", "max_tokens": 4}
        ).encode()
        t = asyncio.create_task(one_request(host, port, body, counters))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.wait(tasks, timeout=90)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rate", type=float, default=100, help="requests per second")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--kvepp-config", default=os.path.join(ROOT, "bench/soak.yaml"))
    ap.add_argument(
        "--kv-blocks", type=int, default=4096,
        help="KV cache blocks per simulated engine (small: the caches fill and evict within minutes)",
    )
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/soak"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stack = Stack("kvepp-soak-")
    work = stack.work

    try:
        mdir = stack.fleet(SIM, args.engines, {"total_kv_blocks": args.kv_blocks})
        kvepp, grpc, metrics = stack.kvepp(KVEPP, args.kvepp_config, mdir)
        with open(os.path.join(ROOT, "manifests/envoy/envoy-local.yaml")) as f:
            b = yaml.safe_load(f)
        for c in b["static_resources"]["clusters"]:
            if c["name"] == "kvepp":
                c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
                    "socket_address"]["port_value"] = grpc
        listen = stack.envoy(args.envoy, b)

        counters = Counters()
        rows = []
        prefixes = [f"system prompt {k}: " + "you are a helpful assistant. " * 40 for k in range(16)]
        seconds = args.minutes * 60

        async def sampler():
            t0 = time.monotonic()
            last_sent = last_ok = last_err = 0
            while True:
                await asyncio.sleep(1)
                st = proc_status(kvepp.pid)
                try:
                    text = get(metrics + "/metrics")[1]
                except OSError:
                    text = ""
                lat = sorted(counters.latencies)
                counters.latencies.clear()
                rows.append({
                    "t_s": round(time.monotonic() - t0, 1),
                    "rss_mib": round(int(st["VmRSS"].split()[0]) / 1024, 2),
                    "fds": len(os.listdir(f"/proc/{kvepp.pid}/fd")),
                    "threads": int(st["Threads"]),
                    "tasks": sample_metric(text, "kvepp_runtime_alive_tasks"),
                    "in_flight": sample_metric(text, "kvepp_in_flight_requests"),
                    "kv_index_blocks": sample_metric(text, "kvepp_kv_index_blocks"),
                    "sent_per_s": counters.sent - last_sent,
                    "ok_per_s": counters.ok - last_ok,
                    "errors": counters.errors - last_err,
                    "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1000, 1) if lat else float("nan"),
                })
                last_sent, last_ok, last_err = counters.sent, counters.ok, counters.errors

        async def run():
            s = asyncio.create_task(sampler())
            await load("127.0.0.1", listen, args.rate, seconds, counters, prefixes)
            await asyncio.sleep(1.5)
            s.cancel()

        asyncio.run(run())
        if kvepp.poll() is not None:
            with open(os.path.join(work, "kvepp.log")) as f:
                tail = f.read()[-4000:]
            sys.exit(f"soak: kvepp exited ({kvepp.returncode}); its log ends:\n{tail}")
    finally:
        stack.stop()

    csv_path = os.path.join(args.out, "soak.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    minute = max(1, min(60, len(rows) // 4))
    first, last = rows[:minute], rows[-minute:]
    avg = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    summary = {
        "minutes": args.minutes,
        "rate": args.rate,
        "engines": args.engines,
        "kv_blocks_per_engine": args.kv_blocks,
        "kv_index_blocks_max": max(r["kv_index_blocks"] for r in rows),
        "requests": counters.sent,
        "ok": counters.ok,
        "errors": counters.errors,
        "error_samples": counters.error_samples,
        "rss_mib_first": round(avg(first, "rss_mib"), 1),
        "rss_mib_last": round(avg(last, "rss_mib"), 1),
        "rss_mib_max": max(r["rss_mib"] for r in rows),
        "fds_first_last": [first[0]["fds"], last[-1]["fds"]],
        "threads_first_last": [first[0]["threads"], last[-1]["threads"]],
        "tasks_first_last": [first[0]["tasks"], last[-1]["tasks"]],
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(rows, os.path.join(args.out, "soak.png"), summary)
    print(json.dumps(summary, indent=1))
    print(f"soak: {csv_path} and soak.png in {args.out}")
    sys.exit(1 if counters.errors or counters.sent == 0 else 0)


def plot(rows, path, summary):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    fig, ax = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax[0].plot(t, [r["rss_mib"] for r in rows], color="tab:blue")
    ax[0].set_ylabel("kvepp RSS (MiB)")
    ax[0].set_ylim(0, max(r["rss_mib"] for r in rows) * 1.2)
    ax[0].set_title(
        f"kvepp soak: {summary['requests']} requests at {summary['rate']:g}/s, {summary['errors']} errors"
    )
    for k, c in [("fds", "tab:orange"), ("threads", "tab:green"), ("tasks", "tab:red")]:
        ax[1].plot(t, [r[k] for r in rows], label=k, color=c)
    ax[1].set_ylabel("count")
    ax[1].set_ylim(bottom=0)
    ax[1].legend(loc="upper left")
    ax[2].plot(t, [r["ok_per_s"] for r in rows], label="ok/s", color="tab:blue")
    ax[2].plot(t, [r["errors"] for r in rows], label="errors/s", color="tab:red")
    ax[2].set_ylabel("requests/s")
    ax[2].set_xlabel("minutes")
    ax[2].legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
