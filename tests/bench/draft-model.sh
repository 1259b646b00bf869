#!/usr/bin/env bash
# Speculative decoding with a draft model, same machine, same run:
# Qwen2.5-Coder-1.5B (Q4_K_M) as the target and -0.5B as the draft.
# flotilla with --speculative off, ngram and draft; llama-server without
# speculation and with -md (draft-simple, 3 and 8 draft tokens). Tasks
# (tests/bench/speculation.py): `code` (tests/bench/code-tasks.txt, greedy,
# 256 tokens) at 1 stream, then code at 4 and 16 streams and prose
# (`natural`) at 1 stream, where the draft must never make it slower.
# The draft's cost sum (its measured acceptance, draft length and
# predicted gain, from /metrics) is printed beside the measured gain.
#   usage: tests/bench/draft-model.sh [LLAMA_BIN_DIR] [REQUESTS_AT_ONE_STREAM]
set -euo pipefail
cd "$(dirname "$0")/../.."
LLAMA_BIN=${1:-$HOME/.cache/flotilla-peers/llama.cpp/build/bin}
N1=${2:-6}
FLOTILLA=target/release/flotilla
THREADS=$(nproc)
TARGET=$($FLOTILLA fetch-model --model qwen2.5-coder-1.5b)
DRAFT=$($FLOTILLA fetch-model --model qwen2.5-coder-0.5b)
OUT=target/bench-draft
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
grep -m1 'model name' /proc/cpuinfo
grep -o -w 'avx2\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
echo "threads $THREADS, greedy, f16 KV, --num-speculative-tokens 4 (flotilla's most)"

wait_up() {
  for _ in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "server at $1 did not start" >&2; exit 1
}
run() { # name url task streams requests tokens
  printf '%-16s ' "$1"
  python3 tests/bench/speculation.py "$2" "$3" "$4" "$5" "$6" | tee -a "$OUT/$1.jsonl"
}
for mode in off ngram draft; do
  extra=()
  [ "$mode" = draft ] && extra=(--draft-model "$DRAFT")
  $FLOTILLA serve --no-auth --port 8415 --model "$TARGET" --speculative "$mode" "${extra[@]}" \
    >"$OUT/flotilla-$mode.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8415/ready
  run "flotilla-$mode" http://127.0.0.1:8415 code 1 "$N1" 256
  # The draft's cost sum as it stood after the one-stream code run.
  curl -s http://127.0.0.1:8415/metrics | grep -E '^flotilla_spec_(draft_model|verify|accepted|draft_tokens)|^flotilla_step_cost' \
    >"$OUT/flotilla-$mode.metrics" || true
  if [ "$mode" != ngram ]; then
    run "flotilla-$mode" http://127.0.0.1:8415 code 4 8 128
    run "flotilla-$mode" http://127.0.0.1:8415 code 16 16 64
    run "flotilla-$mode" http://127.0.0.1:8415 natural 1 3 256
  fi
  kill $pid; wait $pid 2>/dev/null || true
done
# llama-server at one stream (one slot): its draft runs per slot.
for mode in none md3 md8; do
  case $mode in
    none) spec=(--spec-type none) ;;
    md3) spec=(-md "$DRAFT" --spec-type draft-simple --spec-draft-n-max 3) ;;
    md8) spec=(-md "$DRAFT" --spec-type draft-simple --spec-draft-n-max 8) ;;
  esac
  "$LLAMA_BIN/llama-server" -m "$TARGET" -t "$THREADS" -np 1 -c 4096 --port 8416 "${spec[@]}" \
    >"$OUT/llama-$mode.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8416/health
  run "llama-$mode" http://127.0.0.1:8416 code 1 "$N1" 256
  kill $pid; wait $pid 2>/dev/null || true
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open(f"{o}/{name}.jsonl")]
def pick(name, task, conc):
    for r in rows(name):
        if r["task"] == task and r["concurrency"] == conc:
            return r
def tps(name, task, conc):
    r = pick(name, task, conc)
    return r["chunks_per_s"] if r else None
off, ngram, draft = (tps(f"flotilla-{m}", "code", 1) for m in ("off", "ngram", "draft"))
peer = max(tps("llama-md3", "code", 1), tps("llama-md8", "code", 1))
print()
print("| setting | code 1 stream tok/s | ratio to off |")
print("|---|---:|---:|")
for name in ("flotilla-off", "flotilla-ngram", "flotilla-draft", "llama-none", "llama-md3", "llama-md8"):
    v = tps(name, "code", 1)
    print(f"| {name} | {v} | {v / off:.2f}x |")
plan = {}
for line in open(f"{o}/flotilla-draft.metrics"):
    if line.startswith("flotilla_spec_draft_model_plan"):
        part = line.split('part="')[1].split('"')[0]
        plan[part] = float(line.rsplit(" ", 1)[1])
print()
print(f"draft vs off, 1 stream: {draft / off:.2f}x (target >= 1.15x); n-gram only: {ngram / off:.2f}x")
if plan:
    print(f"cost sum after the one-stream code run: acceptance {plan['acceptance']:.3f}, draft length "
          f"{plan['draft_len']:.0f}, predicted gain {plan['predicted_gain']:.2f}x; measured {draft / off:.2f}x")
print(f"draft vs llama-server -md (best of 3 and 8): {draft / peer:.2f}x (target >= 1.8x)")
for task, conc in (("code", 4), ("code", 16), ("natural", 1)):
    a, b = tps("flotilla-off", task, conc), tps("flotilla-draft", task, conc)
    print(f"{task} at {conc} streams: off {a}, draft {b} tok/s: {b / a:.2f}x (never below 1.0 by more than noise)")
PY
