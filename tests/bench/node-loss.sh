#!/usr/bin/env bash
# A node lost under load (issue 21): the disaggregated cluster of
# cluster-configs/pd-2p2d.toml as five processes on this machine, the load
# test of the issue's report (16 streams, 300 requests of 48 tokens, a fifth
# of the clients dropping after 1-8 chunks), and after AFTER_S seconds
# decode-1 is sent SIGNAL: KILL (dies) or TERM (drains). Prints the bench
# report (refusals and stream errors would show under "failed" beside the
# client's own drops) and each node's line from /ready (downs, moved_away)
# with the KV blocks still used.
# GRACE_S is the nodes' --drain-grace-s (30): how long a drained node lets
# its requests finish before they move (0: they move at once, with their KV).
# KV_BYTES sets every node's --kv-cache-bytes (default: a tenth of free
# memory), MAX_MODEL_LEN their --max-model-len (8192; a node needs the
# blocks of one such sequence). KV_BYTES=73728000 MAX_MODEL_LEN=2048 (200
# blocks) is the small-pool case of simulations/pd-kill-cancel-small-kv.toml,
# where the decode node left is short of blocks (kv_short in the report).
#   usage: tests/bench/node-loss.sh            (kill -9)
#          SIGNAL=TERM tests/bench/node-loss.sh
#          SIGNAL=TERM GRACE_S=0 tests/bench/node-loss.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-node-loss}; mkdir -p "$OUT"
SIGNAL=${SIGNAL:-KILL}
AFTER_S=${AFTER_S:-25}
SEED=${SEED:-3}
GRACE_S=${GRACE_S:-30}
KV_ARGS=()
[ -n "${KV_BYTES:-}" ] && KV_ARGS+=(--kv-cache-bytes "$KV_BYTES")
[ -n "${MAX_MODEL_LEN:-}" ] && KV_ARGS+=(--max-model-len "$MAX_MODEL_LEN")
BIN=target/release/flotilla
[ -x "$BIN" ] || cargo build --release
URL=http://127.0.0.1:8000
CONFIG=cluster-configs/pd-2p2d.toml
"$BIN" cluster --config "$CONFIG" -- --threads 1 --drain-grace-s "$GRACE_S" "${KV_ARGS[@]}" > "$OUT/cluster.log" 2>&1 &
CL=$!
trap 'kill $CL 2>/dev/null || true; wait $CL 2>/dev/null || true' EXIT
up() {
  curl -sf "$URL/ready" 2>/dev/null | python3 -c \
    'import json,sys; d=json.load(sys.stdin); sys.exit(0 if all(n["up"] for n in d["nodes"]) else 1)'
}
for _ in $(seq 1 180); do up 2>/dev/null && break; sleep 1; done
up || { echo "the cluster did not come up; see $OUT/cluster.log"; exit 1; }
timeout 600 "$BIN" bench --url "$URL" --concurrency 16 --requests 300 --max-tokens 48 \
  --cancel-fraction 0.2 --seed "$SEED" --api-key sk-flotilla-paid-example --quiet \
  --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1 &
B=$!
sleep "$AFTER_S"
D1=$(pgrep -f -- "--config $CONFIG --name decode-1")
echo "sending SIG$SIGNAL to decode-1 (pid $D1) after $AFTER_S s"
kill -s "$SIGNAL" "$D1"
wait $B || true
cat "$OUT/bench.txt"
sleep 3
curl -s "$URL/ready" | python3 -c '
import json, sys
d = json.load(sys.stdin)
for n in d["nodes"]:
    print("{name:10} up {up!s:5} downs {downs} moved_away {moved_away} moved_by_kv {moved_by_kv} kv_short {kv_short} kv_orphans {kv_orphans} kv_blocks {kv_blocks}".format(**n))
print("KV blocks used on the nodes up:", d["kv_blocks"]["used"])'
