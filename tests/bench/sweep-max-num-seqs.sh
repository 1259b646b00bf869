#!/usr/bin/env bash
# A sweep over a server flag (issue 22): the same load (32 streams) against
# servers started with --max-num-seqs 4, 8, 16 and 32, gathered by
# `flotilla bench-report` into one report (table, JSON, HTML with plots).
#   usage: tests/bench/sweep-max-num-seqs.sh [REPEAT]
set -euo pipefail
cd "$(dirname "$0")/../.."
REPEAT=${1:-1}
FLOTILLA=target/release/flotilla
OUT=target/bench-sweep
mkdir -p "$OUT"
rm -f "$OUT"/seqs-*.json
grep -m1 'model name' /proc/cpuinfo
grep -o -w 'avx2\|avx512f\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
wait_up() {
  for _ in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "server at $1 did not start" >&2; exit 1
}
for n in 4 8 16 32; do
  $FLOTILLA serve --no-auth --port 8418 --speculative off --max-num-seqs "$n" >"$OUT/serve-$n.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8418/ready
  $FLOTILLA bench --url http://127.0.0.1:8418 --concurrency 32 --requests 96 --repeat "$REPEAT" \
    --max-tokens 64 --prompt-len-min 32 --prompt-len-max 256 --quiet \
    --label "max-num-seqs $n" --json "$OUT/seqs-$n.json" >/dev/null
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
$FLOTILLA bench-report "$OUT"/seqs-4.json "$OUT"/seqs-8.json "$OUT"/seqs-16.json "$OUT"/seqs-32.json \
  --html "$OUT/report.html" --json "$OUT/report.json"
echo "report: $OUT/report.html"
