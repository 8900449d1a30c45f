"""kvepp beside the real peers: kvepp's default and the Gateway API Inference Extension's reference
EPP, each discovering the same pool from the same real API server, behind the same Envoy
bootstrap, in front of the same engines, with the same arrivals, in one run.

    python bench/peers.py --kvepp BIN --agent BIN --sim BIN --kube-cluster BIN --reference-epp BIN \\
        --envoy BIN [--phases vllm,sim,cpu] [--out DIR]

Run by bench/peers.sh inside a network namespace of its own where the pod network 10.244.0.0/16
is local (a real API server refuses loopback addresses in EndpointSlices, and the reference EPP
sends each request to its Pod's IP on the pool's one target port): every engine is a pod with an
address of its own, port 8000. No controller or kubelet runs: this driver writes the Pods, their
Ready status and the EndpointSlices as those would.

Phases:
- vllm: two real vLLM CPU engines (the real-engine benchmark's engines and workloads), each with
  the worker agent beside it (kvepp reads the engine's KV events through it); per router the
  engines' own prefix-cache hit ratio, TTFT / completion / inter-token latency at the client and
  the engines' preemptions.
- sim: the simulated fleet on the routing report's workloads (`kvepp-bench bench-routing
  --external`), four engines at pod addresses.
- cpu: each EPP's CPU per request and the latency through Envoy at ~100k-token prompts (the CPU
  benchmark's bodies, wrk through one Envoy, the same plaintext ext_proc for both), a backend
  per pod.

Each router runs as its project ships it: kvepp with its defaults plus the KV events and
tokenizer its manifests configure; the reference EPP with its defaults (round robin over the
pool's ready pods is its only policy at the pinned version) and production logging.
"""

import argparse
import asyncio
import base64
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp
import yaml

import cpu_per_request
import real_engines as engines_bench
from benchlib import free_port, wait
from extproc_overhead import bootstrap, load_through_envoy, parse_wrk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POD_PORT = 8000
AGENT_PORT = 8090
ROUTERS = ("kvepp", "reference-epp")
SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIM_WORKLOADS = "shared-prefix,mooncake,multi-turn"


def pod_ip(n):
    """Pod n's address, as the suite's pod network numbers them."""
    return f"10.244.{n // 250}.{n % 250 + 2}"


class Kube:
    """The API server through the admin kubeconfig: server-side apply and status patches."""

    def __init__(self, kubeconfig):
        with open(kubeconfig) as f:
            cfg = yaml.safe_load(f)
        cluster = cfg["clusters"][0]["cluster"]
        self.server = cluster["server"]
        self.token = cfg["users"][0]["user"]["token"]
        self.tls = ssl.create_default_context(
            cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())

    def _send(self, method, path, body, content_type):
        req = urllib.request.Request(self.server + path, method=method, data=json.dumps(body).encode(),
                                     headers={"authorization": f"Bearer {self.token}",
                                              "content-type": content_type})
        with urllib.request.urlopen(req, context=self.tls, timeout=30) as r:
            return json.loads(r.read())

    def apply(self, collection, obj):
        name = obj["metadata"]["name"]
        return self._send("PATCH", f"{collection}/{name}?fieldManager=kvepp-bench&force=true", obj,
                          "application/apply-patch+yaml")

    def delete(self, collection, name):
        req = urllib.request.Request(f"{self.server}{collection}/{name}", method="DELETE",
                                     headers={"authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, context=self.tls, timeout=30) as r:
            r.read()

    def status(self, collection, name, status):
        return self._send("PATCH", f"{collection}/{name}/status", {"status": status},
                          "application/merge-patch+json")


PODS = "/api/v1/namespaces/default/pods"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
MODELS = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodels"


def register_pool(kube, pods, metadata_port, models):
    """InferencePool `pool` (v1: Pods labelled `kvepp.io/component: pool`, target port 8000), an
    InferenceModel per served model, and per (name, address) a Ready Pod and the EndpointSlice the
    endpoints controller writes for Service `pool` (ports http 8000 and, where the pod serves
    kvepp's /metadata, metadata). Returns a function that deletes the pods and their slices."""
    kube.apply(POOLS, {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                       "metadata": {"name": "pool"},
                       "spec": {"selector": {"matchLabels": {"kvepp.io/component": "pool"}},
                                "targetPorts": [{"number": POD_PORT}],
                                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}})
    for i, model in enumerate(models):
        kube.apply(MODELS, {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceModel",
                            "metadata": {"name": f"model-{i}"},
                            "spec": {"modelName": model, "criticality": "Standard", "poolRef": {"name": "pool"}}})
    for name, ip in pods:
        kube.apply(PODS, {"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": name, "labels": {"kvepp.io/component": "pool", "app": "model"}},
                          "spec": {"containers": [{"name": "engine", "image": "engine"}]}})
        kube.status(PODS, name, {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                                 "conditions": [{"type": "Ready", "status": "True"}]})
        kube.apply(SLICES, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                            "metadata": {"name": f"pool-{name}", "labels": {"kubernetes.io/service-name": "pool"}},
                            "addressType": "IPv4",
                            "endpoints": [{"addresses": [ip], "conditions": {"ready": True},
                                           "targetRef": {"kind": "Pod", "name": name}}],
                            "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"}] + (
                                [{"name": "metadata", "port": metadata_port, "protocol": "TCP"}]
                                if metadata_port else [])})

    def gone():
        for name, _ in pods:
            kube.delete(SLICES, f"pool-{name}")
            kube.delete(PODS, name)
    return gone


class Epp:
    """One router's process, discovering pool `pool` through `kubeconfig`, on loopback ports."""

    def __init__(self, args, which, kubeconfig, logs, tls=True, tokenizer=None):
        self.which = which
        self.grpc, self.health, self.metrics = free_port(), free_port(), free_port()
        log = open(os.path.join(logs, f"{which}.log"), "ab")
        if which == "kvepp":
            cfg = {"pool_name": "pool", "kubeconfig": kubeconfig, "bind_address": "127.0.0.1",
                   "grpc_port": self.grpc, "grpc_health_port": self.health, "metrics_port": self.metrics,
                   "log_level": "warn", "shutdown_delay_ms": 0, "kv_events": {"enabled": True}}
            if tokenizer:
                cfg["tokenizers"] = {"m": tokenizer}
            if not tls:
                cfg["grpc_tls"] = {"mode": "off"}
            path = os.path.join(logs, f"kvepp-{self.grpc}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(cfg, f)
            cmd = [args.kvepp, "serve", "--config", path]
        else:
            cmd = [args.reference_epp, "--pool-name", "pool", "--pool-namespace", "default",
                   "--kubeconfig", kubeconfig, "--grpc-port", str(self.grpc),
                   "--grpc-health-port", str(self.health), "--metrics-port", str(self.metrics),
                   "--zap-devel=false", "--zap-log-level", "error", f"--secure-serving={str(tls).lower()}"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Envoy:
    """Envoy on the local bootstrap (TLS to the EPP, as shipped), its ext_proc cluster at `grpc`."""

    def __init__(self, args, grpc, logs):
        self.proc, self.listen = engines_bench.start_envoy(
            args.envoy, grpc, logs, open(os.path.join(logs, "envoy.log"), "ab"))

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def start_cluster(args, logs):
    """The suite's API server (`kube-cluster`): its process and the admin kubeconfig's path."""
    proc = subprocess.Popen([args.kube_cluster, os.path.join(logs, "kube")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=open(os.path.join(logs, "kube-cluster.log"), "ab"),
                            text=True)
    line = proc.stdout.readline()
    if not line.startswith("KUBECONFIG="):
        raise RuntimeError(f"kube-cluster did not start (see {logs}/kube-cluster.log)")
    return proc, line.strip().split("=", 1)[1]


# --- vLLM engines -------------------------------------------------------------------------------

class PodEngine:
    """A real vLLM engine at pod address `ip`:8000 and the worker agent beside it on :8090, as the
    shipped pod template runs them. vLLM binds its KV-event publisher on every address (it
    connects, not binds, to a named one), and these pods share one network namespace: engine i
    publishes on 5557 + 10·i (replay one above), which its agent advertises."""

    def __init__(self, args, i, logs):
        self.name, self.ip = f"vllm-{i}", pod_ip(i)
        self.url = f"http://{self.ip}:{POD_PORT}"
        events, replay = str(5557 + 10 * i), str(5558 + 10 * i)
        cores = os.cpu_count() or 1
        self.proc = subprocess.Popen(
            [args.python, os.path.join(ROOT, "scripts/vllm_engine.py"), "--model", args.model, "--host", self.ip,
             "--port", str(POD_PORT), "--kv-events-port", events, "--kv-events-replay-port", replay,
             "--cpu", str(i % cores), "--kv-cache-bytes", args.kv_cache_bytes, "--max-num-seqs", "8",
             "--log", os.path.join(logs, f"{self.name}.log")], stdin=subprocess.PIPE)
        labels = os.path.join(logs, f"{self.name}.labels")
        with open(labels, "w") as f:
            f.write('app="model"\nkvepp.io/component="pool"\n')
        log = open(os.path.join(logs, f"{self.name}-agent.log"), "ab")
        self.agent = subprocess.Popen(
            [args.agent, "--component", "pool", "--namespace", "default", "--pod-name", self.name, "--pod-ip", self.ip,
             "--labels-file", labels, "--listen", f"{self.ip}:{AGENT_PORT}",
             "--engine-health-url", f"{self.url}/health", "--model-name", "m", "--block-size", "32",
             "--kv-events-port", events, "--kv-events-replay-port", replay, "--check-interval-ms", "200",
             "--drain-seconds", "0"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def stop(self):
        self.agent.terminate()
        self.proc.stdin.close()
        self.proc.wait()
        self.agent.wait()


async def router_ready(session, which, epp, listen, pods):
    """kvepp: ready and listing every pod; any router: a completion answered through Envoy."""
    if which == "kvepp":
        await engines_bench.kvepp_lists(session, epp.metrics, epp.proc,
                                        [f"{ip}:{POD_PORT}" for _, ip in pods], len(pods))
    end = time.monotonic() + 90
    while time.monotonic() < end:
        if epp.proc.poll() is not None:
            raise RuntimeError(f"{which} exited ({epp.proc.returncode})")
        try:
            async with session.post(f"http://127.0.0.1:{listen}/v1/completions",
                                    json={"model": "m", "prompt": "ready?", "max_tokens": 1},
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{which}: no request answered through Envoy within 90 s")


async def keep_pages(session, epp, logs, run):
    """kvepp's /metrics and /debug/endpoints at the end of a run, beside the logs; a run in which
    kvepp read no KV event is no run of its default and stops the benchmark."""
    if epp.which != "kvepp":
        return
    for page in ("metrics", "debug/endpoints"):
        async with session.get(f"http://127.0.0.1:{epp.metrics}/{page}") as r:
            text = await r.text()
        with open(os.path.join(logs, f"{run}-kvepp-{page.replace('/', '-')}.txt"), "w") as f:
            f.write(text)
        if page == "metrics" and not engines_bench.metric_sum(text, "kvepp_kv_event_blocks_stored_total"):
            raise RuntimeError(f"{run}: kvepp read no KV event from the engines (its pages in {logs})")


async def vllm_phase(args, kube, logs):
    engines = [PodEngine(args, i, logs) for i in range(args.engines)]
    pods = [(e.name, e.ip) for e in engines]
    rows = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            t0 = time.monotonic()
            for e in engines:
                await engines_bench.wait_http(session, e.url + "/health", 900, e.proc)
            print(f"peers: {len(engines)} vLLM engines healthy in {time.monotonic() - t0:.0f}s", file=sys.stderr)
            gone = register_pool(kube, pods, AGENT_PORT, ["m"])
            salt = 100
            for workload in args.workloads.split(","):
                for which in args.routers.split(","):
                    salt += 1
                    work = (engines_bench.shared_prefix(salt) if workload == "shared-prefix"
                            else engines_bench.multi_turn(salt))
                    epp = Epp(args, which, args.kubeconfig, logs, tokenizer=args.model)
                    envoy = Envoy(args, epp.grpc, logs)
                    try:
                        await router_ready(session, which, epp, envoy.listen, pods)
                        before = [await engines_bench.counters_of(session, e.url) for e in engines]
                        started = time.monotonic()
                        res = await engines_bench.run_workload(
                            session, f"http://127.0.0.1:{envoy.listen}", engines_bench.split(work, args.clients))
                        wall = time.monotonic() - started
                        after = [await engines_bench.counters_of(session, e.url) for e in engines]
                        await keep_pages(session, epp, logs, f"vllm-{workload}")
                    finally:
                        envoy.stop()
                        epp.stop()
                    rows.append(engines_bench.summary("vllm", workload, which, res, before, after, wall))
                    print(f"peers: vllm {workload} {which}: {json.dumps(rows[-1])}", file=sys.stderr)
            gone()
        finally:
            for e in engines:
                e.stop()
    return rows


# --- the simulated fleet ------------------------------------------------------------------------

def sim_phase(args, kube, logs):
    """`kvepp-bench bench-routing --external` per router (a fresh router per workload, a fresh fleet
    per run): the routing report's workloads at the same arrivals for both."""
    n = args.sim_engines
    pods = [(f"sim-engine-{i}", pod_ip(10 + i)) for i in range(n)]
    gone = register_pool(kube, pods, POD_PORT, [SIM_MODEL])
    results = {}
    for workload in args.sim_workloads.split(","):
        for which in args.routers.split(","):
            epp = Epp(args, which, args.kubeconfig, logs)
            out = os.path.join(args.out, "sim", f"{workload}-{which}")
            try:
                wait(f"{which} serving", lambda: epp.proc.poll() is None and port_open(epp.grpc), 60)
                cmd = [args.bench, "bench-routing", "--envoy", args.envoy, "--external", f"{which}=127.0.0.1:{epp.grpc}",
                       "--addresses", ",".join(ip for _, ip in pods), "--port", str(POD_PORT),
                       "--engines", str(n), "--trace-engines", str(n), "--workload", workload,
                       "--duration", str(args.sim_duration), "--trace-requests", str(args.trace_requests),
                       "--speed", "1", "--out", out]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                               stderr=open(os.path.join(logs, "bench-routing.log"), "ab"))
            finally:
                epp.stop()
            with open(os.path.join(out, "results.json")) as f:
                (entry,) = json.load(f)
            results.setdefault(workload, {"title": entry["title"], "ceilings": entry["ceilings"], "rows": []})
            results[workload]["rows"] += entry["results"]
            r = entry["results"][0]
            print(f"peers: sim {workload} {which}: p90 TTFT {r['ttft_ms'][1]:.0f} ms, hit {r['hit_ratio']:.3f}, "
                  f"failed {r['failed']}", file=sys.stderr)
    gone()
    return results


def port_open(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --- CPU per request ----------------------------------------------------------------------------

def cpu_phase(args, kube, logs):
    """Each EPP in turn behind the same Envoy (plaintext ext_proc for both, FULL_DUPLEX_STREAMED as
    shipped), wrk sending the CPU benchmark's ~100k-token bodies; the EPP's CPU per request and
    the latency percentiles through Envoy. Interleaved repeats, medians."""
    n = 2
    pods = [(f"backend-{i}", pod_ip(20 + i)) for i in range(n)]
    backends = [subprocess.Popen([args.sim, "echo-backend", "--listen", f"{ip}:{POD_PORT}", "--name", name],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, ip in pods]
    gone = register_pool(kube, pods, None, ["text-model", "ids-model"])
    epps = {}
    results = {}
    try:
        for which in args.routers.split(","):
            epps[which] = Epp(args, which, args.kubeconfig, logs, tls=False)
            wait(f"{which} serving", lambda: port_open(epps[which].grpc), 60)
        for mode in args.cpu_modes.split(","):
            script, size = cpu_per_request.wrk_script(mode, logs, {})
            for rep in range(args.repeat):
                for which in args.routers.split(","):
                    epp = epps[which]
                    out, (c0,), (c1,) = load_through_envoy(
                        args.envoy, logs, bootstrap("kvepp", "FULL_DUPLEX_STREAMED", 0, 0, epp.grpc), 1,
                        ["-s", script], "", args.concurrency, args.warmup, args.duration, [epp.proc])
                    rps, p50, p99, errors, total = parse_wrk(out)
                    if errors:
                        raise RuntimeError(f"cpu {mode} {which}: {errors} errors of {total}\n{out}")
                    cpu_us = (c1 - c0) * 1e6 / total
                    results.setdefault((mode, which), []).append((cpu_us, rps, p50, p99))
                    print(f"peers: cpu {mode} rep={rep} {which}: {cpu_us:.0f} µs/req, {rps:.0f} req/s, "
                          f"p50 {p50:.2f} ms, p99 {p99:.2f} ms", file=sys.stderr)
            results[(mode, "size")] = size
    finally:
        for e in epps.values():
            e.stop()
        for b in backends:
            b.terminate()
            b.wait()
    gone()
    return results


# --- the report ---------------------------------------------------------------------------------

def report(args, vllm_rows, sim, cpu):
    versions = (f"kvepp {args.kvepp_version}; the Gateway API Inference Extension's reference EPP "
                f"(`sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp@{args.reference_version}`, round robin, "
                f"its only policy at that version); llm-d's router: not built here (see docs/performance.md)")
    lines = [f"Beside the real peers, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores. {versions}.", ""]
    if vllm_rows:
        lines += engines_bench.table(
            vllm_rows, f"{args.engines} vLLM CPU engines (tiny random-weight Llama, 32-token blocks, KV cache "
                       f"{args.kv_cache_bytes} each) as pods, {args.clients} closed-loop clients:")
        lines.append("")
    for workload, entry in sim.items():
        lines += [f"Simulated fleet, {entry['title']}:", "",
                  "| router | requests | failed | TTFT p50 / p90 ms | e2e p50 / p90 ms | TTFT ≤ 1 s | hit ratio | imbalance |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in entry["rows"]:
            lines.append(f"| {r['policy']} | {r['requests']} | {r['failed']} | {r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} "
                         f"| {r['e2e_ms'][0]:.0f} / {r['e2e_ms'][1]:.0f} | {100 * r['slo_met']:.0f}% | {r['hit_ratio']:.3f} "
                         f"| {r['imbalance']:.2f} |")
        lines.append("")
    if cpu:
        lines += [f"EPP CPU per request at ~100k-token prompts (the CPU benchmark's bodies), Envoy --concurrency 1, "
                  f"plaintext ext_proc, FULL_DUPLEX_STREAMED, wrk -c{args.concurrency} -d{args.duration}s, "
                  f"median of {args.repeat} interleaved runs:", "",
                  "| mode | body | router | EPP CPU µs/req | req/s | p50 / p99 ms through Envoy |",
                  "|---|---:|---|---:|---:|---:|"]
        for mode in args.cpu_modes.split(","):
            for which in args.routers.split(","):
                m = [statistics.median(x[i] for x in cpu[(mode, which)]) for i in range(4)]
                lines.append(f"| {mode} | {cpu[(mode, 'size')] // 1024} KiB | {which} | {m[0]:.0f} | {m[1]:.0f} "
                             f"| {m[2]:.2f} / {m[3]:.2f} |")
        lines.append("")
    return "\n".join(lines)


async def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--kvepp", "--agent", "--sim", "--bench", "--kube-cluster", "--reference-epp", "--envoy"):
        p.add_argument(flag, required=True)
    p.add_argument("--python", default=sys.executable, help="the vLLM venv's python")
    p.add_argument("--model", default=os.path.join(ROOT, ".venv/tiny-model"))
    p.add_argument("--phases", default="vllm,sim,cpu")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kv-cache-bytes", default="12M")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument("--sim-engines", type=int, default=4)
    p.add_argument("--sim-workloads", default=SIM_WORKLOADS)
    p.add_argument("--sim-duration", type=float, default=30)
    p.add_argument("--trace-requests", type=int, default=300)
    p.add_argument("--cpu-modes", default="approximate,token_ids")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--duration", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--reference-version", default="unknown")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/peers"))
    args = p.parse_args()
    args.kvepp_version = subprocess.run([args.kvepp, "--version"], capture_output=True, text=True).stdout.split()[-2:]
    args.kvepp_version = " ".join(args.kvepp_version)
    os.makedirs(args.out, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="kvepp-peers-")
    print(f"peers: logs in {logs}", file=sys.stderr)
    phases = args.phases.split(",")
    cluster, args.kubeconfig = start_cluster(args, logs)
    kube = Kube(args.kubeconfig)
    vllm_rows, sim, cpu = [], {}, {}
    try:
        if "vllm" in phases:
            vllm_rows = await vllm_phase(args, kube, logs)
        if "sim" in phases:
            sim = sim_phase(args, kube, logs)
        if "cpu" in phases:
            cpu = cpu_phase(args, kube, logs)
    finally:
        cluster.stdin.close()
        cluster.wait()
    text = report(args, vllm_rows, sim, cpu)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"vllm": vllm_rows, "sim": sim,
                   "cpu": {f"{k[0]}/{k[1]}": v for k, v in cpu.items()}}, f, indent=1)
    print(text)
    failed = any(r["ok"] < r["requests"] for r in vllm_rows) or any(
        r["failed"] for e in sim.values() for r in e["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
