"""Runs one vLLM engine (the CPU build) on the tiny model, as the real-engine tests and benchmarks
deploy it, until its standard input closes or it is sent SIGTERM/SIGINT.

    python scripts/vllm_engine.py --model DIR --port P --kv-events-port E [--cpu N] [...]

The engine serves the model as `m` on 127.0.0.1:P (`--host` another address, such as a pod's)
with `--load-format dummy` (random weights), block size 32 (the smallest the CPU attention backend
accepts), prefix caching, a KV cache of `--kv-cache-bytes` (small, so a working set spread over two
engines evicts), KV events over its own ZMQ publisher on tcp://*:E (with its replay ROUTER on
`--kv-events-replay-port`), and LoRA with `--max-loras` slot(s) for the adapters under DIR/lora.
Its stdout and stderr go to `--log`.

Why a launcher: a test binary cannot run code when it exits, so the engine must not outlive the
process that started it. This one holds the engine in its own process group and kills the whole group
when its standard input reaches end of file, which happens when
its parent exits for any reason.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1", help="the address it serves on (a pod's own, say)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-events-port", type=int, required=True)
    p.add_argument("--kv-events-replay-port", type=int, default=None,
                   help="the publisher's replay ROUTER (tcp://*:PORT)")
    p.add_argument("--cpu", type=int, default=None, help="the one core the engine's threads run on")
    p.add_argument("--kv-cache-bytes", default="12M")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--log", required=True)
    p.add_argument("extra", nargs="*", help="more `vllm serve` arguments (after --)")
    a = p.parse_args()

    bindir = os.path.dirname(sys.executable)
    adapters_dir = os.path.join(a.model, "lora")
    adapters = sorted(os.listdir(adapters_dir)) if os.path.isdir(adapters_dir) else []
    cmd = [
        os.path.join(bindir, "vllm"), "serve", a.model,
        "--served-model-name", "m",
        "--host", a.host,
        "--port", str(a.port),
        "--load-format", "dummy",
        "--dtype", "float32",
        "--block-size", "32",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", a.kv_cache_bytes,
        "--max-num-seqs", str(a.max_num_seqs),
        "--max-model-len", str(a.max_model_len),
        "--enforce-eager",
    ]
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{a.kv_events_port}",
        "topic": "kv-events",
    }
    if a.kv_events_replay_port:
        events["replay_endpoint"] = f"tcp://*:{a.kv_events_replay_port}"
    cmd += ["--kv-events-config", json.dumps(events)]
    if adapters:
        cmd += ["--enable-lora", "--max-loras", str(a.max_loras), "--max-lora-rank", "8",
                "--lora-modules"] + [f"{n}={os.path.join(adapters_dir, n)}" for n in adapters]
    cmd += a.extra
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_HOST_IP": a.host,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    if a.cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(a.cpu)
    log = open(a.log, "ab")
    engine = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env, start_new_session=True)
    done = threading.Event()

    def stop(*_):
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def watch_stdin():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except OSError:
            pass
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    threading.Thread(target=lambda: (engine.wait(), done.set()), daemon=True).start()
    done.wait()
    # At once, the whole group: a test's engine holds nothing worth a graceful stop, and an engine
    # still shutting down would take CPU from whatever runs next.
    try:
        os.killpg(engine.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    engine.wait()
    return engine.returncode if engine.returncode and engine.returncode > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
