#!/usr/bin/env bash
# The same workload (32 streams; each request's max_tokens drawn from
# 8..=128, seeded; seeded prompts) against `--batching continuous` and
# `--batching static` on the same build, twice, interleaved (this machine's
# speed drifts). Mixed output lengths are where whole-batch scheduling loses.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-serve}; mkdir -p "$OUT"
FLOTILLA=target/release/flotilla
[ -x "$FLOTILLA" ] || cargo build --release
for run in 1 2; do for mode in continuous static; do
  $FLOTILLA serve --port 8416 --batching $mode 2>"$OUT/$mode-serve.log" &
  PID=$!
  for _ in $(seq 1 600); do curl -sf http://127.0.0.1:8416/ready >/dev/null && break; sleep 0.2; done
  $FLOTILLA bench --url http://127.0.0.1:8416 --api-key sk-flotilla-paid-example --concurrency 32 --requests 96 \
    --max-tokens 128 --max-tokens-min 8 --ignore-eos true --seed 7 --quiet --label "$mode" --json "$OUT/batching-$mode-$run.json" >"$OUT/batching-$mode-$run.txt"
  kill $PID; wait $PID 2>/dev/null || true
done; done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
for run in (1, 2):
  c = json.load(open(f"{o}/batching-continuous-{run}.json")); s = json.load(open(f"{o}/batching-static-{run}.json"))
  print(f"-- run {run}")
  print(f"output tok/s: continuous {c['output_tokens_per_s']:.1f}, static {s['output_tokens_per_s']:.1f}, ratio {c['output_tokens_per_s']/s['output_tokens_per_s']:.2f}x")
  for k in ("p50", "p99"):
    print(f"TTFT {k}: continuous {c['ttft_ms'][k]:.0f} ms, static {s['ttft_ms'][k]:.0f} ms, ratio {c['ttft_ms'][k]/s['ttft_ms'][k]:.2f}x")
    print(f"TPOT {k}: continuous {c['tpot_ms'][k]:.1f} ms, static {s['tpot_ms'][k]:.1f} ms")
PY
