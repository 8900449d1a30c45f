"""Driver for bench/extproc_overhead.sh (see there). Runs every variant against the same Envoy
bootstrap (manifests/envoy/envoy-local.yaml), the same backend and the same wrk load, interleaving
variants on each repeat, and reports medians."""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import urllib.request

import yaml

from benchlib import Stack, free_port, wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVEPP = os.path.join(ROOT, "target/release/kvepp")
FLOOR = os.path.join(ROOT, "target/release/examples/floor_epp")
TICK = os.sysconf("SC_CLK_TCK")


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def bootstrap(variant, mode, listen, admin, epp_port):
    with open(os.path.join(ROOT, "manifests/envoy/envoy-local.yaml")) as f:
        b = yaml.safe_load(f)
    b["admin"]["address"]["socket_address"]["port_value"] = admin
    lst = b["static_resources"]["listeners"][0]
    lst["address"]["socket_address"]["port_value"] = listen
    hcm = lst["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    if variant == "none":
        hcm["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    else:
        ext = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
        ext["typed_config"]["processing_mode"]["request_body_mode"] = mode
        for c in b["static_resources"]["clusters"]:
            if c["name"] == "kvepp":
                # The floor EPP speaks h2c, so both EPPs are measured over plaintext (kvepp runs
                # with --grpc-tls-mode off); TLS costs the same for any EPP.
                c.pop("transport_socket", None)
                sa = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
                sa["port_value"] = epp_port
    return b


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def parse_wrk(out):
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {}
    for pct, val, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M):
        lat[pct] = float(val) * UNITS[unit]
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if m:
        errors += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    total = int(re.search(r"(\d+) requests in", out).group(1))
    return rps, lat["50"], lat["99"], errors, total


def floor_stack(tmp, spawn, models=("bench-model",), kvepp_args=()):
    """The backend, the floor EPP and kvepp (serving `models` from a one-endpoint pool, plaintext
    ext_proc), once ready: {"backend": address, "backend_proc", "floor": (proc, port), "kvepp":
    (proc, port)}."""
    backend_port = free_port()
    backend = f"127.0.0.1:{backend_port}"
    backend_proc = spawn([FLOOR, "backend", "--listen", backend], "backend.log")
    floor_port = free_port()
    floor = spawn([FLOOR, "epp", "--listen", f"127.0.0.1:{floor_port}", "--endpoint", backend], "floor.log")
    mdir = pool_manifests(tmp, backend_port, models)
    kp = [free_port() for _ in range(3)]
    kvepp = spawn([KVEPP, "serve", *kvepp_args, "--pool-name", "bench", "--manifests-dir", mdir, "--bind-address", "127.0.0.1",
                   "--grpc-port", str(kp[0]), "--grpc-health-port", str(kp[1]), "--metrics-port", str(kp[2]),
                   "--grpc-tls-mode", "off", "--log-level", "warn"], "kvepp.log")
    wait("kvepp ready", lambda: http_ok(f"http://127.0.0.1:{kp[2]}/ready"))
    wait("backend", lambda: http_ok(f"http://{backend}/"))
    return {"backend": backend, "backend_proc": backend_proc, "floor": (floor, floor_port), "kvepp": (kvepp, kp[0]),
            "kvepp_metrics": f"http://127.0.0.1:{kp[2]}/metrics"}


def pool_manifests(tmp, backend_port, models):
    """Writes the pool `bench` (one endpoint, the backend at `backend_port`, serving `models`) into
    a manifests directory under `tmp`; returns its path."""
    mdir = os.path.join(tmp, "manifests")
    os.makedirs(mdir)
    docs = [f"""apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: bench}}
spec: {{targetPortNumber: {backend_port}, selector: {{app: bench}}}}
"""] + [f"""apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: {m}}}
spec: {{modelName: {m}, criticality: Standard, poolRef: {{name: bench}}}}
""" for m in models] + [f"""apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: bench, labels: {{kubernetes.io/service-name: bench}}}}
endpoints: [{{addresses: ["127.0.0.1"], targetRef: {{name: backend}}}}]
ports: [{{name: http, port: {backend_port}}}]
"""]
    with open(os.path.join(mdir, "pool.yaml"), "w") as f:
        f.write("---\n".join(docs))
    return mdir


def start_envoy(envoy_bin, tmp, boot, workers):
    """Envoy on `boot` with its listener and admin ports filled in (free ones), `workers` worker
    threads, once ready: (process, listener port). Stopped again if it never gets ready."""
    listen, admin = free_port(), free_port()
    boot["admin"]["address"]["socket_address"]["port_value"] = admin
    boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listen
    cfg = os.path.join(tmp, "envoy-bench.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump(boot, f)
    envoy = subprocess.Popen([envoy_bin, "-c", cfg, "--concurrency", str(workers), "--use-dynamic-base-id", "-l", os.environ.get("ENVOY_LOG_LEVEL", "error")],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "envoy.log"), "a"))
    try:
        wait("envoy ready", lambda: http_ok(f"http://127.0.0.1:{admin}/ready"))
    except BaseException:
        envoy.terminate()
        envoy.wait()
        raise
    return envoy, listen


def load_through_envoy(envoy_bin, tmp, boot, workers, wrk_args, path, connections, warmup, duration, measured, probe=None):
    """Envoy on `boot` (listener and admin ports filled in here) under wrk (`wrk_args`, e.g. a
    script) for a warm-up, then `duration` seconds; returns wrk's output and the CPU seconds of
    `measured` processes (Envoy where None) before and after the measured run, each list followed
    by `probe()`'s value at that moment where a probe is given."""
    envoy, listen = start_envoy(envoy_bin, tmp, boot, workers)
    pids = [p.pid if p else envoy.pid for p in measured]
    try:
        wrk = ["wrk", f"-t{workers}", f"-c{connections}", "--latency", *wrk_args, f"http://127.0.0.1:{listen}{path}"]
        subprocess.run(wrk[:2] + [f"-d{warmup}s"] + wrk[2:], check=True, capture_output=True)
        before = [cpu_seconds(p) for p in pids] + ([probe()] if probe else [])
        out = subprocess.run(wrk[:2] + [f"-d{duration}s"] + wrk[2:], check=True, capture_output=True, text=True).stdout
        after = [cpu_seconds(p) for p in pids] + ([probe()] if probe else [])
    finally:
        envoy.terminate()
        envoy.wait()
    return out, before, after


def main():
    global KVEPP
    ap = argparse.ArgumentParser()
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--kvepp-bin", default=KVEPP,
                    help="the kvepp binary measured (e.g. another build's, to compare two in one session)")
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="wrk connections")
    ap.add_argument("--envoy-workers", type=int, default=1,
                    help="Envoy --concurrency (worker threads); wrk gets as many threads (e.g. 4 with --concurrency 64)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mode", default="FULL_DUPLEX_STREAMED", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"])
    ap.add_argument("--sizes", default="4096,409600")
    args = ap.parse_args()
    KVEPP = args.kvepp_bin

    processes = Stack("kvepp-bench-")
    tmp, spawn = processes.work, processes.spawn

    try:
        stack = floor_stack(tmp, spawn)
        backend, backend_proc = stack["backend"], stack["backend_proc"]
        epps = {"none": (None, None), "floor": stack["floor"], "kvepp": stack["kvepp"]}

        results = {}  # (size, variant) -> list of (rps, p50, p99, cpu_us_per_req)
        for size in [int(s) for s in args.sizes.split(",")]:
            prompt = "x" * max(0, size - 40)
            body = json.dumps({"model": "bench-model", "prompt": prompt})
            script = os.path.join(tmp, f"post-{size}.lua")
            with open(script, "w") as f:
                f.write('wrk.method = "POST"\n')
                f.write(f"wrk.body = {json.dumps(body)}\n")
                f.write('wrk.headers["content-type"] = "application/json"\n')
                # Without ext_proc the client names the endpoint; with it, the EPP overwrites this.
                f.write(f'wrk.headers["x-gateway-destination-endpoint"] = "{backend}"\n')
            for rep in range(args.repeat):
                for variant in ["none", "floor", "kvepp"]:
                    proc, port = epps[variant]
                    out, (cpu0, env0, be0), (cpu1, env1, be1) = load_through_envoy(
                        args.envoy, tmp, bootstrap(variant, args.mode, 0, 0, port), args.envoy_workers,
                        ["-s", script], "/v1/completions", args.concurrency, args.warmup, args.duration,
                        [proc, None, backend_proc])
                    rps, p50, p99, errors, total = parse_wrk(out)
                    if errors:
                        sys.exit(f"bench: {variant} size {size}: {errors} errors\n{out}")
                    cpu_us = (cpu1 - cpu0) * 1e6 / total if proc else 0.0
                    env_us = (env1 - env0) * 1e6 / total
                    be_us = (be1 - be0) * 1e6 / total
                    results.setdefault((size, variant), []).append((rps, p50, p99, cpu_us, env_us, be_us))
                    print(f"  size={size} rep={rep} {variant:<6} rps={rps:9.0f} p50={p50:7.3f}ms p99={p99:7.3f}ms "
                          f"cpu/req: epp={cpu_us:6.1f}us envoy={env_us:6.1f}us backend={be_us:6.1f}us", file=sys.stderr)

        med = {k: tuple(statistics.median(x[i] for x in v) for i in range(6)) for k, v in results.items()}

        def paired(size, i):
            """Median over repeats of kvepp/floor measured back to back (cancels machine drift)."""
            return statistics.median(k[i] / f[i] for k, f in zip(results[(size, "kvepp")], results[(size, "floor")]))
        lines = [
            f"ext_proc hop, Envoy 1.40 --concurrency {args.envoy_workers}, request_body_mode {args.mode}, "
            f"wrk -t{args.envoy_workers} -c{args.concurrency} "
            f"-d{args.duration}s, median of {args.repeat} interleaved runs, {os.cpu_count()} cores",
            "",
            "| body | variant | req/s | p50 ms | p99 ms | EPP CPU µs/req | Envoy CPU µs/req | rps vs floor | p99 vs floor | EPP CPU vs floor |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for size in [int(s) for s in args.sizes.split(",")]:
            f_rps, _, f_p99, f_cpu, _, _ = med[(size, "floor")]
            for variant in ["none", "floor", "kvepp"]:
                rps, p50, p99, cpu, env, _ = med[(size, variant)]
                none = variant == "none"
                ratio = "—" if none else f"{rps / f_rps:.3f}×"
                pr = "—" if none else f"{p99 / f_p99:.3f}×"
                cr = "—" if none else f"{cpu / f_cpu:.3f}×"
                cpu_s = "—" if none else f"{cpu:.0f}"
                lines.append(f"| {size // 1024} KiB | {variant} | {rps:.0f} | {p50:.3f} | {p99:.3f} | {cpu_s} | {env:.0f} | {ratio} | {pr} | {cr} |")
        lines += ["", "Paired (kvepp ÷ the floor run just before it, median over repeats; the machine drifts between repeats):", "",
                  "| body | rps | p50 | p99 | EPP CPU/req |", "|---:|---:|---:|---:|---:|"]
        for size in [int(s) for s in args.sizes.split(",")]:
            lines.append(f"| {size // 1024} KiB | {paired(size, 0):.3f}× | {paired(size, 1):.3f}× | {paired(size, 2):.3f}× | {paired(size, 3):.3f}× |")
        report = "\n".join(lines)
        print(report)
        os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
        suffix = "" if args.envoy_workers == 1 else f"_{args.envoy_workers}w{args.concurrency}c"
        with open(os.path.join(ROOT, f"bench/out/extproc_overhead_{args.mode.lower()}{suffix}.md"), "w") as f:
            f.write(report + "\n")
    finally:
        processes.stop()


if __name__ == "__main__":
    main()
