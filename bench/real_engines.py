"""Routing policies in front of real vLLM engines (the CPU build, the tiny random-weight model), each
policy judged by what users and engines see: the engines' own prefix-cache hit ratio
(`vllm:prefix_cache_hits_total / prefix_cache_queries_total` over the run), time to first token
and completion time at the client (p50/p90), inter-token latency (p50/p90 of each request's mean
gap between streamed tokens) and the engines' preemptions.

    python bench/real_engines.py --kvepp target/release/kvepp --agent target/release/kvepp-agent \\
        --envoy .venv/bin/envoy [--engines N] [--workloads shared-prefix,multi-turn] [--out DIR]

Run by bench/real_engines.sh with the vLLM venv's python (aiohttp, PyYAML). Engines start once
(each bound to one core; `--engines` defaults to what the machine's cores allow, at least 2);
every policy runs each workload with its own prompts (a fresh salt), so no policy profits from
another's cache. kvepp runs as shipped except for the picker and, for Dynamo's cost, the cost model.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types

import aiohttp
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = {
    "round-robin": {"picker": "round-robin"},
    "least-loaded": {"picker": "least-loaded"},
    "approximate": {"picker": "approximate-prefix"},
    "dynamo-cost": {"picker": "kv-aware", "kv_events": True, "router": {"cost_model": "dynamo"}},
    "default": {"picker": "kv-aware", "kv_events": True},
}
WORDS = ("the cache router engine prefix token block request model pod latency first second stream "
         "decode prefill queue batch memory envoy cluster policy score load adapter session topology "
         "zone metric event index hash of and to in with for on from").split()


def free_port():
    """A port free now, below the kernel's ephemeral range: an engine binds its ports a minute
    after they are chosen, and its own processes take ephemeral ports meanwhile."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue


def text(seed, words):
    x = (seed * 0x9E3779B97F4A7C15 | 1) & (2 ** 64 - 1)
    out = []
    for i in range(words):
        x ^= (x << 13) & (2 ** 64 - 1)
        x ^= x >> 7
        x ^= (x << 17) & (2 ** 64 - 1)
        out.append(WORDS[x % len(WORDS)] + (f" {x % 1000}" if i % 11 == 0 else ""))
    return " ".join(out)


def metric_sum(page, name):
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def wait_http(session, url, deadline, proc=None, ok=lambda status: status == 200):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if ok(r.status):
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url}: not ready within {deadline}s")


class Engine:
    def __init__(self, i, model, logs, cpu, kv_bytes):
        self.name = f"vllm-{i}"
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts/vllm_engine.py"), "--model", model,
             "--port", str(self.port), "--kv-events-port", str(self.events),
             "--kv-events-replay-port", str(self.replay), "--cpu", str(cpu),
             "--kv-cache-bytes", kv_bytes, "--max-num-seqs", "8",
             "--log", os.path.join(logs, f"{self.name}.log")],
            stdin=subprocess.PIPE)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"



class SimFleet:
    """`kvepp-sim fleet` with calibrated parameters: the simulated engines the same workloads run on."""

    def __init__(self, args, n, params, logs):
        self.dir = tempfile.mkdtemp(prefix="kvepp-sim-")
        log = open(os.path.join(logs, "sim.log"), "ab")
        self.proc = subprocess.Popen(
            [args.sim, "fleet", "--engines", str(n), "--params", params, "--tokenizer", args.model,
             "--manifests-dir", self.dir, "--pool-name", "pool"], stdout=subprocess.PIPE, stderr=log, text=True)
        self.urls = []
        for line in self.proc.stdout:
            if "http://" in line:
                self.urls.append(line.split("http://")[1].split()[0])
            if line.startswith("run:"):
                break
        self.engines = [types.SimpleNamespace(port=0, url="http://" + u) for u in self.urls]

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


async def counters_of(session, url):
    async with session.get(url + "/metrics") as r:
        page = await r.text()
    return (metric_sum(page, "vllm:prefix_cache_hits_total"),
            metric_sum(page, "vllm:prefix_cache_queries_total"),
            metric_sum(page, "vllm:num_preemptions_total"))


async def kvepp_lists(session, metrics, proc, addrs, count):
    """Waits until kvepp (metrics port `metrics`, process `proc`) is ready and its
    `/debug/endpoints` lists at least `count` endpoints, among them every one of `addrs`."""
    await wait_http(session, f"http://127.0.0.1:{metrics}/ready", 60, proc)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        async with session.get(f"http://127.0.0.1:{metrics}/debug/endpoints") as r:
            listed = {e["addr"] for e in (await r.json()).get("endpoints", [])}
        if len(listed) >= count and all(a in listed for a in addrs):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"kvepp did not list every engine ({sorted(addrs)})")


def start_envoy(envoy_bin, grpc, work, log):
    """Envoy on the local bootstrap (TLS to the EPP, as shipped) with its ext_proc cluster at
    127.0.0.1:`grpc`, its config in `work`, its output to `log`: (process, listener port)."""
    with open(os.path.join(ROOT, "manifests/envoy/envoy-local.yaml")) as f:
        b = yaml.safe_load(f)
    listen, admin = free_port(), free_port()
    b["admin"]["address"]["socket_address"]["port_value"] = admin
    b["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listen
    for c in b["static_resources"]["clusters"]:
        if c["name"] == "kvepp":
            sa = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
            sa["address"], sa["port_value"] = "127.0.0.1", grpc
    path = os.path.join(work, f"envoy-{listen}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(b, f)
    proc = subprocess.Popen([envoy_bin, "-c", path, "--log-level", "error", "--base-id", str(free_port())],
                            stdout=log, stderr=log)
    return proc, listen


class Router:
    """kvepp (its own manifests directory, one worker-agent per engine) and Envoy in front."""

    def __init__(self, args, engines, policy, logs, manifests=None):
        self.dir = manifests or tempfile.mkdtemp(prefix="kvepp-real-")
        if manifests is None:
          with open(os.path.join(self.dir, "pool.yaml"), "w") as f:
            f.write("apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n"
                    "metadata: {name: pool}\nspec: {targetPortNumber: 8000, selector: {app: vllm}}\n---\n"
                    "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\n"
                    "metadata: {name: m}\nspec: {modelName: m, criticality: Standard, poolRef: {name: pool}}\n")
        self.grpc, self.health, self.metrics = free_port(), free_port(), free_port()
        cfg = {"pool_name": "pool", "manifests_dir": self.dir, "bind_address": "127.0.0.1",
               "grpc_port": self.grpc, "grpc_health_port": self.health, "metrics_port": self.metrics,
               "log_level": "warn", "picker": policy["picker"], "shutdown_delay_ms": 0,
               "kv_events": {"enabled": bool(policy.get("kv_events"))}}
        if "router" in policy:
            cfg["router"] = policy["router"]
        if policy.get("kv_events") or policy["picker"] == "kv-aware":
            cfg["tokenizers"] = {"m": args.model}
        path = os.path.join(tempfile.mkdtemp(prefix="kvepp-cfg-"), "kvepp.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        log = open(os.path.join(logs, "kvepp.log"), "ab")
        self.procs = [subprocess.Popen([args.kvepp, "serve", "--config", path], stdout=log, stderr=log)]
        for e in engines if manifests is None else []:
            self.procs.append(subprocess.Popen(
                [args.agent, "--component", "pool", "--registry", "manifests", "--manifests-dir", self.dir,
                 "--listen", f"127.0.0.1:{free_port()}", "--engine-health-url", e.url + "/health",
                 "--engine-port", str(e.port), "--model-name", "m", "--kv-events-port", str(e.events),
                 "--kv-events-replay-port", str(e.replay), "--pod-name", e.name, "--pod-ip", "127.0.0.1",
                 "--check-interval-ms", "200"], stdout=log, stderr=log))
        envoy, self.listen = start_envoy(args.envoy, self.grpc, os.path.dirname(path), log)
        self.procs.append(envoy)

    async def ready(self, session, engines):
        await kvepp_lists(session, self.metrics, self.procs[0],
                          [f"127.0.0.1:{e.port}" for e in engines if e.port], len(engines))
        # Envoy routes through kvepp: any answer but its own 5xx (an engine may not serve the path).
        await wait_http(session, f"http://127.0.0.1:{self.listen}/v1/models", 60, ok=lambda status: status < 500)

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


async def stream(session, url, path, body):
    """One streamed request: (status, ttft, e2e, mean inter-token gap, completion text)."""
    body = dict(body, stream=True, ignore_eos=True, temperature=0)
    start = time.monotonic()
    first, last, gaps, chunks = None, None, [], []
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            await r.read()
            return r.status, None, None, None, ""
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            choice = json.loads(line[5:])["choices"][0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if not piece:
                continue
            chunks.append(piece)
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    end = time.monotonic()
    return 200, (first or end) - start, end - start, (statistics.mean(gaps) if gaps else None), "".join(chunks)


def shared_prefix(salt, groups=5, repeats=6, words=520):
    """Groups sharing long prefixes, taking turns (an odd count, so taking turns spreads each group)."""
    work = []
    for r in range(repeats):
        for g in range(groups):
            prompt = text(salt * 1000 + g, words) + "\n" + text(salt * 1000 + 500 + g * repeats + r, 24)
            work.append(("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 24}))
    return [work]


def multi_turn(salt, conversations=6, turns=4):
    """Conversations with a shared system prompt; each turn appends the engine's answer and a new
    question (one client per conversation, so turns of one conversation never overlap)."""
    system = text(salt * 7, 250)
    convs = []
    for c in range(conversations):
        convs.append([("chat", system, text(salt * 1000 + c * 10 + t, 60)) for t in range(turns)])
    return convs


async def run_client(session, url, items, results):
    history = []
    for item in items:
        if item[0] == "chat":
            _, system, question = item
            if not history:
                history = [{"role": "system", "content": system}]
            history.append({"role": "user", "content": question})
            status, ttft, e2e, itl, answer = await stream(
                session, url, "/v1/chat/completions", {"model": "m", "messages": history, "max_tokens": 32})
            history.append({"role": "assistant", "content": answer})
        else:
            status, ttft, e2e, itl, _ = await stream(session, url, item[0], item[1])
        results.append((status, ttft, e2e, itl))


async def run_workload(session, url, clients):
    results = []
    await asyncio.gather(*(run_client(session, url, c, results) for c in clients))
    return results


def split(work, n):
    """One list of items across n closed-loop clients, in order (client i takes items i, i+n, ...)."""
    if len(work) > 1:
        return work
    return [work[0][i::n] for i in range(n)]


def summary(kind, workload, policy, res, before, after, wall):
    """One row of the table: the client's figures over `res` and the engines' counters' growth from
    `before` to `after`."""
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    ok = [r for r in res if r[0] == 200]
    ttft = [r[1] * 1000 for r in ok]
    e2e = [r[2] * 1000 for r in ok]
    itl = [r[3] * 1000 for r in ok if r[3] is not None]
    return {"engines": kind, "workload": workload, "policy": policy, "requests": len(res), "ok": len(ok),
            "hit_ratio": hits / queries if queries else 0.0,
            "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9),
            "e2e_p50": pct(e2e, 0.5), "e2e_p90": pct(e2e, 0.9),
            "itl_p50": pct(itl, 0.5), "itl_p90": pct(itl, 0.9),
            "preemptions": sum(a[2] - b[2] for a, b in zip(after, before)), "wall_s": wall}


async def run_policies(session, args, engines, logs, kind, manifests=None):
    """Every workload under every policy through kvepp and Envoy to `engines`; a row each."""
    rows, salt = [], 1
    for workload in args.workloads.split(","):
        for name in args.policies.split(","):
            salt += 1
            work = shared_prefix(salt) if workload == "shared-prefix" else multi_turn(salt)
            router = Router(args, engines, POLICIES[name], logs, manifests)
            try:
                await router.ready(session, engines)
                before = [await counters_of(session, e.url) for e in engines]
                started = time.monotonic()
                res = await run_workload(session, f"http://127.0.0.1:{router.listen}", split(work, args.clients))
                wall = time.monotonic() - started
                after = [await counters_of(session, e.url) for e in engines]
            finally:
                router.stop()
            row = summary(kind, workload, name, res, before, after, wall)
            rows.append(row)
            print(f"real_engines: {kind} {workload} {name}: {json.dumps(row)}", file=sys.stderr)
    return rows


def table(rows, title):
    lines = [title, "",
             "| workload | policy | requests ok | engine hit ratio | TTFT p50 / p90 ms | e2e p50 / p90 ms "
             "| inter-token p50 / p90 ms | preemptions |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['policy']} | {r['ok']}/{r['requests']} | {r['hit_ratio']:.3f} "
                     f"| {r['ttft_p50']:.0f} / {r['ttft_p90']:.0f} | {r['e2e_p50']:.0f} / {r['e2e_p90']:.0f} "
                     f"| {r['itl_p50']:.1f} / {r['itl_p90']:.1f} | {r['preemptions']:.0f} |")
    return lines


def error_table(real, sim):
    """The simulator's error per figure: (sim - real) / real."""
    lines = ["", "Simulator (calibrated) against the real engines, (sim − real) ÷ real:", "",
             "| workload | policy | hit ratio | TTFT p50 | TTFT p90 | e2e p50 | e2e p90 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    simmed = {(r["workload"], r["policy"]): r for r in sim}
    for r in real:
        s = simmed.get((r["workload"], r["policy"]))
        if s is None:
            continue
        err = lambda k: f"{100 * (s[k] - r[k]) / r[k]:+.0f}%" if r[k] else "n/a"
        lines.append(f"| {r['workload']} | {r['policy']} | {err('hit_ratio')} | {err('ttft_p50')} | "
                     f"{err('ttft_p90')} | {err('e2e_p50')} | {err('e2e_p90')} |")
    return lines


async def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvepp", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--envoy", required=True)
    p.add_argument("--sim", help="kvepp-sim: calibrate it on the first engine and run the same workloads on it")
    p.add_argument("--model", default=os.path.join(ROOT, ".venv/tiny-model"))
    p.add_argument("--engines", type=int, default=max(2, (os.cpu_count() or 2)))
    p.add_argument("--kv-cache-bytes", default="12M")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/real_engines"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="kvepp-real-logs-")
    cores = os.cpu_count() or 1
    t0 = time.monotonic()
    engines = [Engine(i, args.model, logs, i % cores, args.kv_cache_bytes) for i in range(args.engines)]
    timeout = aiohttp.ClientTimeout(total=600)
    params = os.path.join(args.out, "sim-params.yaml")
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            for e in engines:
                await wait_http(session, e.url + "/health", 900, e.proc)
            print(f"real_engines: {len(engines)} engines healthy in {time.monotonic() - t0:.0f}s (logs {logs})",
                  file=sys.stderr)
            if args.sim:
                subprocess.run([args.sim, "calibrate", "--engine", f"127.0.0.1:{engines[0].port}",
                                "--max-num-seqs", "8", "--out", params], check=True)
            rows = await run_policies(session, args, engines, logs, "vllm")
        finally:
            for e in engines:
                e.proc.stdin.close()
            for e in engines:
                e.proc.wait()
        sim_rows = []
        if args.sim:
            fleet = SimFleet(args, args.engines, params, logs)
            try:
                sim_rows = await run_policies(session, args, fleet.engines, logs, "sim", fleet.dir)
            finally:
                fleet.stop()
    lines = table(rows, f"{len(engines)} vLLM CPU engines (tiny random-weight Llama, 32-token blocks, "
                        f"KV cache {args.kv_cache_bytes} each), {args.clients} closed-loop clients:")
    if sim_rows:
        lines += [""] + table(sim_rows, f"The same on {args.engines} simulated engines calibrated on the first "
                                        f"(`kvepp-sim calibrate`, parameters in sim-params.yaml):")
        lines += error_table(rows, sim_rows)
    text_out = "\n".join(lines)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text_out + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows + sim_rows, f, indent=1)
    print(text_out)
    return 1 if any(r["ok"] < r["requests"] for r in rows + sim_rows) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
