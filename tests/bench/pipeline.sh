#!/usr/bin/env bash
# A pipeline group of two stages, each pinned to one core with one thread,
# beside one node pinned to one core (one thread) and one node on both
# cores (two threads), same model file, same run. Streams 16 at a time
# (128 output tokens each, ignore_eos) and one at a time, prompts of 16..256
# words (seeded), speculation off everywhere (its gain would hide the
# hop's cost). Prints output tok/s and TPOT for each and the ratios the
# pipeline issue targets, and each process's peak RSS:
#   group / one-core node at 16 streams (target >= 1.7x)
#   group / two-thread node at 16 streams (target >= 0.85x)
#   group TPOT / one-core node TPOT at 1 stream (target <= 1.15x)
#   each stage's RSS / one-core node's (target <= 0.6x)
# With DELAY_MS set (e.g. 2), the group runs again with that much added to
# each hop's round trip (the transport's delay hook; the kernel here has
# no netem) and its 16-stream figure is reported too (target >= 1.5x).
# With llama.cpp's ggml-rpc-server in LLAMA_BIN (../shared/tools/build-llama-cpp
# builds it), its RPC split runs too: two one-thread rpc servers pinned
# as the stages are, under llama-server --rpc (-ngl 99, -np 16), and the
# group's 16-stream figure is compared with it (target >= 2x).
# MODEL_NAME picks the model (default qwen2.5-coder-1.5b); ACT picks the
# rows' type between stages (f16 or f32; default f16).
#   usage: tests/bench/pipeline.sh [LLAMA_BIN_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-pipeline}
LLAMA_BIN=${1:-$HOME/.cache/flotilla-peers/llama.cpp/build/bin}
MODEL_NAME=${MODEL_NAME:-qwen2.5-coder-1.5b}
ACT=${ACT:-f16}
mkdir -p "$OUT"
FLOTILLA=$PWD/target/release/flotilla
[ -x "$FLOTILLA" ] || cargo build --release
MODEL=$($FLOTILLA fetch-model --model "$MODEL_NAME")
KEY=sk-flotilla-paid-example
COMMON=(--model "$MODEL" --threads 1 --speculative off --max-num-seqs 32)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_ready() { for _ in $(seq 1 900); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "server at $1 never became ready" >&2; return 1; }
rss_mb() { awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

# name url [key]: 16 streams then 1 stream
load() {
  local key=${3-$KEY}
  $FLOTILLA bench --url "$2" ${key:+--api-key "$key"} --concurrency 16 --requests 32 --max-tokens 128 \
    --seed 7 --quiet --label "$1 c=16" --json "$OUT/$1-c16.json" >"$OUT/$1-c16.txt"
  $FLOTILLA bench --url "$2" ${key:+--api-key "$key"} --concurrency 1 --requests 6 --max-tokens 128 \
    --seed 7 --quiet --label "$1 c=1" --json "$OUT/$1-c1.json" >"$OUT/$1-c1.txt"
  for c in 16 1; do grep -E "output tok/s|TPOT" "$OUT/$1-c$c.txt" | sed "s/^/[$1 c=$c] /"; done
}

stop() { kill "$1"; wait "$1" 2>/dev/null || true; }

# One node, one core, one thread.
taskset -c 0 $FLOTILLA serve "${COMMON[@]}" --port 8431 2>"$OUT/one-core.log" &
P=$!; PIDS+=($P)
wait_ready http://127.0.0.1:8431/ready
load one-core http://127.0.0.1:8431
echo "one-core $(rss_mb $P)" >"$OUT/rss.txt"
stop $P

# One node, both cores, two threads.
$FLOTILLA serve --model "$MODEL" --threads 2 --speculative off --max-num-seqs 32 --port 8432 2>"$OUT/two-thread.log" &
P=$!; PIDS+=($P)
wait_ready http://127.0.0.1:8432/ready
load two-thread http://127.0.0.1:8432
echo "two-thread $(rss_mb $P)" >>"$OUT/rss.txt"
stop $P

# The group: the Router and stage 0 on core 0, stage 1 on core 1.
CONF=$OUT/pipeline.toml
CERTS=$OUT/certs
cat >"$CONF" <<TOML
[cluster]
certs_dir = "certs"
pipeline_activations = "$ACT"
[[nodes]]
name = "router"
role = "router"
addr = "127.0.0.1:7430"
http = "127.0.0.1:8433"
[[nodes]]
name = "stage-0"
role = "worker"
addr = "127.0.0.1:7431"
pipeline = "g"
[[nodes]]
name = "stage-1"
role = "worker"
addr = "127.0.0.1:7432"
pipeline = "g"
[[tiers]]
name = "paid"
[[tenants]]
name = "paid-example"
tier = "paid"
api_keys = ["$KEY"]
TOML
if [ ! -f "$CERTS/ca.pem" ]; then
  $FLOTILLA certs init --dir "$CERTS"
  for n in router stage-0 stage-1; do
    role=worker; [ $n = router ] && role=router
    $FLOTILLA certs issue --dir "$CERTS" --node $n --role $role
  done
fi

group() { # label [extra stage-0 args]
  local label=$1; shift
  taskset -c 1 $FLOTILLA node --config "$CONF" --name stage-1 "${COMMON[@]}" 2>"$OUT/$label-stage-1.log" &
  local s1=$!; PIDS+=($s1)
  taskset -c 0 $FLOTILLA node --config "$CONF" --name stage-0 "${COMMON[@]}" "$@" 2>"$OUT/$label-stage-0.log" &
  local s0=$!; PIDS+=($s0)
  taskset -c 0 $FLOTILLA node --config "$CONF" --name router --model "$MODEL" 2>"$OUT/$label-router.log" &
  local r=$!; PIDS+=($r)
  wait_ready http://127.0.0.1:8433/ready
  grep -h "pipeline of" "$OUT/$label-stage-0.log" || true
  load "$label" http://127.0.0.1:8433
  echo "$label-stage-0 $(rss_mb $s0)" >>"$OUT/rss.txt"
  echo "$label-stage-1 $(rss_mb $s1)" >>"$OUT/rss.txt"
  stop $r; stop $s0; stop $s1
}
group group
if [ -n "${DELAY_MS:-}" ]; then
  group group-delay --fault-delay-ms "$DELAY_MS"
fi
# llama.cpp's RPC split over the same two cores.
RPC=""
if [ -x "$LLAMA_BIN/ggml-rpc-server" ]; then
  RPC=1
  taskset -c 0 "$LLAMA_BIN/ggml-rpc-server" -H 127.0.0.1 -p 50152 -t 1 >"$OUT/rpc-0.log" 2>&1 &
  R0=$!; PIDS+=($R0)
  taskset -c 1 "$LLAMA_BIN/ggml-rpc-server" -H 127.0.0.1 -p 50153 -t 1 >"$OUT/rpc-1.log" 2>&1 &
  R1=$!; PIDS+=($R1)
  sleep 1
  taskset -c 0 "$LLAMA_BIN/llama-server" -m "$MODEL" --rpc 127.0.0.1:50152,127.0.0.1:50153 -ngl 99 \
    -t 1 -np 16 -cb -c 16384 --port 8434 >"$OUT/rpc-llama-server.log" 2>&1 &
  L=$!; PIDS+=($L)
  wait_ready http://127.0.0.1:8434/health
  load rpc-split http://127.0.0.1:8434 ""
  echo "rpc-llama-server $(rss_mb $L)" >>"$OUT/rss.txt"
  echo "rpc-server-0 $(rss_mb $R0)" >>"$OUT/rss.txt"
  echo "rpc-server-1 $(rss_mb $R1)" >>"$OUT/rss.txt"
  stop $L; stop $R0; stop $R1
else
  echo "llama.cpp's RPC split: not run (no $LLAMA_BIN/ggml-rpc-server)"
fi
trap - EXIT

echo
echo "== pipeline group (2 stages, one core each) vs one node (same run; rows in $ACT, speculation off) =="
python3 - "$OUT" "${DELAY_MS:-}" "$RPC" <<'PY'
import json, sys, os
out, delay, rpc = sys.argv[1], sys.argv[2], sys.argv[3]
def r(name, c):
    return json.load(open(os.path.join(out, f"{name}-c{c}.json")))
def tps(name, c): return r(name, c)["output_tokens_per_s"]
def tpot(name, c, q="p50"): return (r(name, c)["tpot_ms"] or {}).get(q)
rss = dict(l.split() for l in open(os.path.join(out, "rss.txt")))
rows = [
    ("16 streams, output tok/s", "one-core", tps("one-core", 16), "two-thread", tps("two-thread", 16), "group", tps("group", 16)),
    ("1 stream, output tok/s", "one-core", tps("one-core", 1), "two-thread", tps("two-thread", 1), "group", tps("group", 1)),
    ("1 stream, TPOT p50 ms", "one-core", tpot("one-core", 1), "two-thread", tpot("two-thread", 1), "group", tpot("group", 1)),
    ("16 streams, TPOT p50 ms", "one-core", tpot("one-core", 16), "two-thread", tpot("two-thread", 16), "group", tpot("group", 16)),
]
for row in rows:
    print(f"{row[0]:28} one-core {row[2]:8.1f}  two-thread {row[4]:8.1f}  group {row[6]:8.1f}")
g16, o16, t16 = tps("group", 16), tps("one-core", 16), tps("two-thread", 16)
print(f"group / one-core at 16 streams:   {g16 / o16:.2f}x (target >= 1.7x)")
print(f"group / two-thread at 16 streams: {g16 / t16:.2f}x (target >= 0.85x)")
print(f"group / one-core TPOT, 1 stream:  {tpot('group', 1) / tpot('one-core', 1):.2f}x (target <= 1.15x)")
one = float(rss["one-core"])
for s in ("group-stage-0", "group-stage-1"):
    print(f"{s} peak RSS {rss[s]} MB = {float(rss[s]) / one:.2f}x the one-core node's {one:.0f} MB (target <= 0.6x)")
print(f"two-thread node peak RSS {rss['two-thread']} MB")
if rpc:
    r16 = tps("rpc-split", 16)
    print(f"llama.cpp RPC split (2 one-thread rpc servers): 16 streams {r16:.1f} tok/s, 1 stream TPOT p50 {tpot('rpc-split', 1):.1f} ms")
    print(f"group / llama.cpp RPC split at 16 streams: {g16 / r16:.2f}x (target >= 2x)")
if delay:
    d16 = tps("group-delay", 16)
    print(f"group with {delay} ms more a hop / one-core at 16 streams: {d16 / o16:.2f}x (target >= 1.5x); 1 stream TPOT p50 {tpot('group-delay', 1):.1f} ms")
PY
