#!/usr/bin/env bash
# Chunks sized from the measured step cost: `flotilla serve` at 32 streams
# without a step time target and with --step-time-max-ms 60 and 100, two
# rounds interleaved; prints throughput, TTFT and TPOT per run and keeps
# each run's step-time histogram and fitted step cost under $OUT. Bounded:
# 64 requests of 128 tokens per run.
#   usage: tests/bench/step-time-target.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
F=target/release/flotilla
[ -x "$F" ] || cargo build --release
MODEL=$($F fetch-model)
OUT=${OUT:-target/bench-serve/step-time}; mkdir -p "$OUT"
PORT=${PORT:-8431}
for round in 1 2; do
  for arm in off 60 100; do
    extra=(); [ "$arm" != off ] && extra=(--step-time-max-ms "$arm")
    $F serve --model "$MODEL" --no-auth --port "$PORT" "${extra[@]}" 2>"$OUT/serve-$arm.log" &
    PID=$!; trap 'kill $PID 2>/dev/null || true' EXIT
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 0.2; done
    $F bench --url "http://127.0.0.1:$PORT" --concurrency 32 --requests 64 --max-tokens 128 --seed 7 \
      --quiet --label "$arm" --json "$OUT/$arm-$round.json" >"$OUT/$arm-$round.txt"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^flotilla_step_time|^flotilla_step_cost" >"$OUT/$arm-$round.metrics"
    kill $PID; wait $PID 2>/dev/null || true
    python3 - "$OUT/$arm-$round.json" "$arm" "$round" "$OUT/$arm-$round.metrics" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
buckets = {}
for line in open(sys.argv[4]):
    if line.startswith("flotilla_step_time_seconds_bucket"):
        le = line.split('le="')[1].split('"')[0]
        buckets[le] = int(float(line.rsplit(" ", 1)[1]))
n = buckets.get("+Inf", 0)
over = lambda le: n - buckets.get(le, n)
print(f"target {sys.argv[2]:>4} round {sys.argv[3]}: out tok/s {d['output_tokens_per_s']:.1f}, "
      f"TTFT p50/p99 {d['ttft_ms']['p50']:.0f}/{d['ttft_ms']['p99']:.0f} ms, "
      f"TPOT p50/p99 {d['tpot_ms']['p50']:.1f}/{d['tpot_ms']['p99']:.1f} ms, "
      f"steps {n}, > 100 ms {over('0.1')}, > 300 ms {over('0.3')}")
PY
  done
done
