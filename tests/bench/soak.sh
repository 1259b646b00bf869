#!/usr/bin/env bash
# Soak: 10,000 streamed requests, 20% dropped mid-stream by the client.
# Prints the server's RSS and /ready KV figures before and after.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-serve}; mkdir -p "$OUT"
FLOTILLA=target/release/flotilla
[ -x "$FLOTILLA" ] || cargo build --release
URL=http://127.0.0.1:8415
REQUESTS=${REQUESTS:-10000}
$FLOTILLA serve --port 8415 2>"$OUT/soak-serve.log" &
PID=$!; trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do curl -sf $URL/ready >/dev/null && break; sleep 0.2; done
# Warm every code path once so the 'before' RSS is not a cold start.
$FLOTILLA bench --url $URL --api-key sk-flotilla-paid-example --concurrency 32 --requests 64 --max-tokens 16 --quiet >/dev/null
rss() { awk '/VmRSS/ {print $2 " kB"}' /proc/$PID/status; }
echo "before: RSS $(rss); /ready $(curl -s $URL/ready)"
$FLOTILLA bench --url $URL --api-key sk-flotilla-paid-example --concurrency 32 --requests "$REQUESTS" \
  --max-tokens 16 --prompt-len-min 8 --prompt-len-max 64 --cancel-fraction 0.2 --seed 3 --quiet \
  --label soak --json "$OUT/soak.json" | tee "$OUT/soak.txt" | grep -E "requests|throughput"
sleep 1
echo "after:  RSS $(rss); /ready $(curl -s $URL/ready)"
curl -s $URL/metrics | grep -E '^flotilla_requests_total' 
