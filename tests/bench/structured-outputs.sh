#!/usr/bin/env bash
# Structured outputs under load: `flotilla serve` and llama.cpp's
# `llama-server` on the same GGUF file, same machine, same run, each at 32
# streams twice, each on a fresh server: every request constrained to
# tests/bench/bench-schema.json (`response_format` json_schema; llama-server
# turns it into a grammar; the answer ends when the JSON is complete), and
# the same load unconstrained (ignore_eos, to max_tokens). Prints output tok/s, TTFT and TPOT of each,
# the constrained/unconstrained ratio per server, and flotilla's mask
# computation time per token (crates/grammar's mask_time example). A
# constrained answer ends when its JSON does, so it is shorter than an
# unconstrained one run to max_tokens; flotilla also runs the unconstrained
# load at the constrained run's mean output length (flotilla-plain-matched),
# the same work per request, and that ratio is printed too.
# Target, from docs/BENCHMARKS.md: flotilla's constrained / unconstrained
# output tok/s >= 0.9x. Exits 1, after the report, when it is missed.
#   usage: tests/bench/structured-outputs.sh [LLAMA_BIN_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
LLAMA_BIN=${1:-$HOME/.cache/flotilla-peers/llama.cpp/build/bin}
OUT=${OUT:-target/bench-structured}
THREADS=${THREADS:-$(nproc)}
C=${C:-32}
N=${N:-32}
MAX_TOKENS=${MAX_TOKENS:-256}
mkdir -p "$OUT"
FLOTILLA=target/release/flotilla
cargo build --release -p flotilla 2>&1 | tail -1
cargo build --release -p flotilla-grammar --example mask_time 2>&1 | tail -1
MODEL=$($FLOTILLA fetch-model)
SCHEMA=tests/bench/bench-schema.json

wait_ready() { for _ in $(seq 1 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "server at $1 never became ready" >&2; return 1; }
run() { # name url extra...
  local name=$1 url=$2
  shift 2
  $FLOTILLA bench --url "$url" --chat --concurrency "$C" --requests "$N" --max-tokens "$MAX_TOKENS" --seed 7 \
    --quiet --label "$name" --json "$OUT/$name.json" "$@" >"$OUT/$name.txt"
  grep -E "requests|output tok/s|TTFT|TPOT" "$OUT/$name.txt" | sed "s/^/[$name] /"
}

# Each run on a fresh server, so neither rides on the other's prefix cache.
flotilla_up() {
  $FLOTILLA serve --model "$MODEL" --threads "$THREADS" --no-auth --port 8421 \
    --max-num-seqs "$C" ${FLOTILLA_ARGS:-} 2>>"$OUT/flotilla-serve.log" &
  PID=$!
  wait_ready http://127.0.0.1:8421/ready
}
llama_up() {
  "$LLAMA_BIN/llama-server" -m "$MODEL" -t "$THREADS" -np "$C" -cb -c $((C * 768)) --port 8422 \
    >>"$OUT/llama-server.log" 2>&1 &
  PID=$!
  wait_ready http://127.0.0.1:8422/health
}
down() { kill "$PID"; wait "$PID" 2>/dev/null || true; }
trap 'kill $PID 2>/dev/null || true' EXIT
flotilla_up; run flotilla-plain http://127.0.0.1:8421; down
flotilla_up; run flotilla-schema http://127.0.0.1:8421 --json-schema "$SCHEMA" --ignore-eos false; down
MEAN=$(python3 -c "import json; r = json.load(open('$OUT/flotilla-schema.json')); print(round(r['output_tokens'] / max(r['requests_ok'], 1)))")
flotilla_up; MAX_TOKENS=$MEAN run flotilla-plain-matched http://127.0.0.1:8421; down
llama_up; run llama-plain http://127.0.0.1:8422; down
llama_up; run llama-schema http://127.0.0.1:8422 --json-schema "$SCHEMA" --ignore-eos false; down
trap - EXIT

echo
target/release/examples/mask_time --model "$MODEL"
echo
python3 - "$OUT" "$SCHEMA" <<'PY'
import json, sys
out, schema_path = sys.argv[1], sys.argv[2]
r = {n: json.load(open(f"{out}/{n}.json")) for n in
     ["flotilla-plain", "flotilla-schema", "flotilla-plain-matched", "llama-plain", "llama-schema"]}
tps = {n: v["output_tokens_per_s"] for n, v in r.items()}
for n, v in r.items():
    print(f"{n:16} {tps[n]:8.1f} output tok/s, ok {v['requests_ok']}, failed {v['requests_failed']}")
print(f"constrained / unconstrained: flotilla {tps['flotilla-schema'] / tps['flotilla-plain']:.2f}x, "
      f"llama-server {tps['llama-schema'] / tps['llama-plain']:.2f}x")
print("target: flotilla constrained / unconstrained output tok/s >= 0.9x")
print(f"flotilla constrained / unconstrained at the same mean length: "
      f"{tps['flotilla-schema'] / tps['flotilla-plain-matched']:.2f}x")
print(f"flotilla / llama-server, constrained: {tps['flotilla-schema'] / tps['llama-schema']:.2f}x")
# The target this script states: flotilla's constrained / unconstrained
# output tok/s >= 0.9x. A miss fails the script (exit 1) once everything
# above is printed.
ratio = tps["flotilla-schema"] / tps["flotilla-plain"]
if ratio < 0.9:
    print(f"MISSED: flotilla constrained / unconstrained output tok/s {ratio:.3f}x (target >= 0.9x)")
    sys.exit(1)
PY
