#!/usr/bin/env bash
# Local demo on embedded defaults: two tiny HTTP model-server stand-ins, kvepp reading
# examples/local, and a real Envoy; sends a few requests and shows who served each and why.
# Ports: Envoy 8081 (admin 9901), kvepp 9002/9003/9090, backends 18001/18002.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

for port in 8081 9901 9002 9003 9090 18001 18002; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "demo: port $port is already in use; stop whatever listens there and retry" >&2; exit 1
  fi
done

echo "== building kvepp and installing Envoy (first run takes a few minutes)"
cargo build --locked --quiet --workspace --bins
envoy=$(scripts/install-envoy.sh)
kvepp="$root/target/debug/kvepp"
sim="$root/target/debug/kvepp-sim"

"$sim" echo-backend --listen 127.0.0.1:18001 --name model-server-a & pids+=($!)
"$sim" echo-backend --listen 127.0.0.1:18002 --name model-server-b & pids+=($!)
"$kvepp" serve --manifests-dir examples/local --pool-name demo-pool --bind-address 127.0.0.1 \
  --log-level kvepp=debug 2>"$work/kvepp.log" & pids+=($!)
"$envoy" -c manifests/envoy/envoy-local.yaml --concurrency 1 -l warning 2>"$work/envoy.log" & pids+=($!)

wait_http() { # url what
  for _ in $(seq 1 200); do curl -fs -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "demo: $2 did not come up; logs in $work" >&2; cat "$work"/*.log >&2; exit 1
}
wait_http http://127.0.0.1:9090/ready "kvepp"
wait_http http://127.0.0.1:9901/ready "Envoy"
wait_http http://127.0.0.1:18001/ "backend a"
wait_http http://127.0.0.1:18002/ "backend b"

echo "== pool: examples/local (model-server-a :18001, model-server-b :18002 ready; model-server-c :18003 not ready)"
printf '%-4s %-40s %-6s %-16s %-22s %s\n' "#" "request" "status" "served by" "model at the server" "why (kvepp's decision)"
n=0
send() { # description body [method path [extra header]]
  n=$((n+1))
  local method=${3:-POST} path=${4:-/v1/completions} extra=${5:-x-demo: 1} before out status
  before=$(wc -l <"$work/kvepp.log")
  if [ "$method" = GET ]; then
    out=$(curl -s -w '\n%{http_code}' -H "$extra" "http://127.0.0.1:8081$path")
  else
    out=$(curl -s -w '\n%{http_code}' -H 'content-type: application/json' -H "$extra" -d "$2" "http://127.0.0.1:8081$path")
  fi
  status=$(tail -n1 <<<"$out")
  # kvepp logs its decision before answering Envoy; wait (bounded) until the line is in the file.
  for _ in $(seq 1 50); do [ "$(wc -l <"$work/kvepp.log")" -gt "$before" ] && break; sleep 0.02; done
  python3 - "$n" "$1" "$status" "$(head -n -1 <<<"$out")" "$(tail -n +"$((before+1))" "$work/kvepp.log")" <<'PY'
import json, re, sys
n, desc, status, body, log = sys.argv[1:6]
try:
    j = json.loads(body)
except Exception:
    j = {}
log = re.sub(r'\x1b\[[0-9;]*m', '', log)
why = ""
m = re.search(r'picked: (.*?) model=(\S*) target=(\S*) endpoint=(\S+) addr=(\S+) in_flight=(\d+)(?: fallback=(\S+))? candidates=(\d+) criticality=(\S+)', log)
kv = re.search(r'mode=(\S+) kv=Some\(KvDecision \{.*?device: (\d+).*?cost: ([0-9.e+-]+)', log)
if m and kv:
    why = f"KV-aware ({kv.group(1)} prefix: {kv.group(2)} cached blocks, cost {float(kv.group(3)):.1f}) of {m.group(8)} ready, {m.group(9)}"
    if m.group(7):
        why += f", fallback {m.group(7)}"
elif m:
    why = f"least loaded of {m.group(8)} ready ({m.group(4)} had {m.group(6)} in flight), {m.group(9)}"
    if m.group(7):
        why += f", fallback {m.group(7)}"
elif "error" in j:
    why = j["error"]["message"]
served = j.get("backend", "-")
model = j.get("model") or "-"
print(f"{n:<4} {desc:<40} {status:<6} {served:<16} {model:<22} {why}")
PY
}
send "llama chat (Critical)"             '{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"hi"}]}' POST /v1/chat/completions
send "llama completion"                  '{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"Once upon"}'
for i in 1 2 3 4; do
  send "food-review #$i (90/10 LoRA split)" '{"model":"food-review","prompt":"Rate this taco"}'
done
send "batch-summaries (Sheddable)"       '{"model":"batch-summaries","prompt":"summarise"}'
SYS="You are a meticulous assistant for a food delivery company. Answer in two sentences, cite the menu, never invent prices. "
SYS="$SYS$SYS$SYS$SYS"
send "long conversation, turn 1"         "{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"messages\":[{\"role\":\"system\",\"content\":\"$SYS\"},{\"role\":\"user\",\"content\":\"What is vegan?\"}]}" POST /v1/chat/completions
send "same conversation, turn 2"         "{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"messages\":[{\"role\":\"system\",\"content\":\"$SYS\"},{\"role\":\"user\",\"content\":\"What is vegan?\"},{\"role\":\"assistant\",\"content\":\"Plants only.\"},{\"role\":\"user\",\"content\":\"And vegetarian?\"}]}" POST /v1/chat/completions
send "GET /v1/models (no body)"          '' GET /v1/models
send "unknown model"                     '{"model":"gpt-5","prompt":"x"}'
send "malformed JSON"                    '{"model": "food-review", "prompt": '
send "client sets its own destination"   '{"model":"food-review","prompt":"x"}' POST /v1/completions 'x-gateway-destination-endpoint: 10.0.0.99:80'
echo
echo "== kvepp metrics (http://127.0.0.1:9090/metrics)"
curl -s http://127.0.0.1:9090/metrics | grep -E '^kvepp_(requests_total|ready_endpoints|rejected_requests_total|in_flight)' | sort
echo
echo "Edit examples/local/*.yaml while kvepp runs and changes apply within a second."
