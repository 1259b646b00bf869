#!/usr/bin/env bash
# What tracing costs (issue 22): output tok/s at 32 streams with tracing
# off and at 100 % sampling (every request's spans exported over OTLP/HTTP
# to a sink on loopback), same server flags, alternating, same run.
# Target, from docs/BENCHMARKS.md: tracing costs at most 2 % of output
# tok/s. Exits 1, after the report, when it is missed.
#   usage: tests/bench/trace-overhead.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-2}
FLOTILLA=target/release/flotilla
OUT=target/bench-trace
mkdir -p "$OUT"
grep -m1 'model name' /proc/cpuinfo
grep -o -w 'avx2\|avx512f\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
wait_up() {
  for _ in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "server at $1 did not start" >&2; exit 1
}
python3 tests/bench/otlp_sink.py 4319 >"$OUT/sink.log" 2>&1 &
sink=$!
trap 'kill $sink 2>/dev/null || true' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for mode in off on; do
    extra=()
    [ "$mode" = on ] && extra=(--otlp-endpoint http://127.0.0.1:4319 --otlp-sample-ratio 1)
    $FLOTILLA serve --no-auth --port 8417 --speculative off "${extra[@]}" >"$OUT/serve-$mode.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8417/ready
    $FLOTILLA bench --url http://127.0.0.1:8417 --concurrency 32 --requests 128 \
      --max-tokens 64 --prompt-len-min 32 --prompt-len-max 128 --quiet \
      --label "trace-$mode" --json "$OUT/$mode-$round.json" >/dev/null
    python3 - "$OUT/$mode-$round.json" "$mode" "$round" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"round {sys.argv[3]} tracing {sys.argv[2]:>3}: {r['output_tokens_per_s']:8.1f} output tok/s, "
      f"TPOT p50 {r['tpot_ms']['p50']:.1f} ms, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, failed {r['requests_failed']}")
PY
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done
kill $sink; wait $sink 2>/dev/null || true
cat "$OUT/sink.log"
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tp = lambda m: sum(json.load(open(f"{out}/{m}-{i}.json"))["output_tokens_per_s"] for i in range(1, rounds + 1)) / rounds
off, on = tp("off"), tp("on")
print(f"mean over {rounds} rounds: off {off:.1f} tok/s, on {on:.1f} tok/s, on/off {on / off:.4f} ({(1 - on / off) * 100:+.2f} % cost)")
print("target: at most 2 % cost")
# The target this script states: tracing costs at most 2 % of output tok/s.
# A miss fails the script (exit 1) once everything above is printed.
if 1 - on / off > 0.02:
    print(f"MISSED: tracing cost {(1 - on / off) * 100:.2f} % of output tok/s (target at most 2 %)")
    sys.exit(1)
PY
