#!/usr/bin/env bash
# Speculative decoding, same machine, same run: flotilla with --speculative
# off and ngram, llama-server without speculation and with its n-gram
# lookup (--spec-type ngram-simple, and ngram-map-k), on the default model's
# GGUF file. Tasks (tests/bench/speculation.py): `copy` (repeat a ~1,000-token
# text), `natural` (short essays) and `json` (a record returned under a JSON
# Schema), greedy, at 1, 8 and 32 streams.
# Target, from docs/BENCHMARKS.md: copy at 1 stream >= 1.5x the decode
# tok/s without speculation (flotilla ngram / off, the median stream's
# decode). Exits 1, after the report, when it is missed.
#   usage: tests/bench/speculation.sh [LLAMA_BIN_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
LLAMA_BIN=${1:-$HOME/.cache/flotilla-peers/llama.cpp/build/bin}
FLOTILLA=target/release/flotilla
THREADS=$(nproc)
MODEL=$($FLOTILLA fetch-model)
OUT=target/bench-spec
mkdir -p "$OUT"
grep -m1 'model name' /proc/cpuinfo
grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|avx512_fp16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

levels() {
  local name=$1 url=$2
  for spec in "copy 1 3 256" "natural 1 3 256" "json 1 4 256" "copy 2 4 256" "natural 2 6 256" "natural 4 8 256" "copy 8 16 128" "natural 8 16 128" "natural 32 32 128"; do
    set -- $spec
    printf '%-22s ' "$name"
    python3 tests/bench/speculation.py "$url" "$1" "$2" "$3" "$4" | tee -a "$OUT/$name.jsonl"
  done
}
wait_up() {
  for _ in $(seq 1 120); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "server at $1 did not start" >&2; exit 1
}
rm -f "$OUT"/*.jsonl
for mode in off ngram; do
  $FLOTILLA serve --no-auth --port 8413 --speculative "$mode" >"$OUT/flotilla-$mode.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8413/ready
  levels "flotilla-$mode" http://127.0.0.1:8413
  curl -s http://127.0.0.1:8413/metrics | grep -E '^flotilla_spec_' || true
  kill $pid; wait $pid 2>/dev/null || true
done
# llama-server at one stream (one slot): its speculation is per slot.
for mode in none ngram-simple ngram-map-k; do
  "$LLAMA_BIN/llama-server" -m "$MODEL" -t "$THREADS" -np 1 -c 4096 --port 8414 \
    --spec-type "$mode" >"$OUT/llama-$mode.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8414/health
  for task in copy natural json; do
    printf '%-22s ' "llama-$mode"
    python3 tests/bench/speculation.py http://127.0.0.1:8414 "$task" 1 3 256 | tee -a "$OUT/llama-$mode.jsonl"
  done
  kill $pid; wait $pid 2>/dev/null || true
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
def decode(mode):
    rows = [json.loads(l) for l in open(f"{o}/flotilla-{mode}.jsonl")]
    return next(r for r in rows if r["task"] == "copy" and r["concurrency"] == 1)["stream_decode_chunks_per_s_p50"]
off, ngram = decode("off"), decode("ngram")
# No decode measured (None) reads as 0.
ratio = ngram / off if off and ngram else 0.0
print(f"copy, 1 stream, flotilla decode tok/s: off {off}, ngram {ngram}, ngram / off {ratio:.2f}x")
print("target: ngram / off >= 1.5x")
# The target this script states: copy at 1 stream >= 1.5x without
# speculation. A miss fails the script (exit 1) once everything above is
# printed.
if ratio < 1.5:
    print(f"MISSED: copy at 1 stream, decode ngram / off {ratio:.3f}x (target >= 1.5x)")
    sys.exit(1)
PY
