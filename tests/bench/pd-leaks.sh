#!/usr/bin/env bash
# Blocks leaked by disaggregated serving: 1,000 requests through
# cluster-configs/pd-2p2d.toml with 20% of the clients leaving mid-stream,
# and one prefill node killed halfway. Prints the KV blocks the surviving
# nodes hold once the load is over (target 0) and the request outcomes.
# Exits 1, after the report, when the target is missed.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-pd}; mkdir -p "$OUT"
FLOTILLA=target/release/flotilla
[ -x "$FLOTILLA" ] || cargo build --release
URL=http://127.0.0.1:8000
KEY=sk-flotilla-paid-example
$FLOTILLA cluster --config cluster-configs/pd-2p2d.toml -- --threads 1 2>"$OUT/leaks.log" &
PID=$!; trap 'kill $PID 2>/dev/null || true' EXIT
up() { curl -sf $URL/ready 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); sys.exit(0 if r["nodes"] and all(n["up"] for n in r["nodes"]) else 1)' 2>/dev/null; }
for _ in $(seq 1 900); do up && break; sleep 0.2; done
up || { echo "cluster never came up (see $OUT/leaks.log)" >&2; exit 1; }
$FLOTILLA bench --url $URL --api-key $KEY --quiet --concurrency 16 --requests 1000 --prompt-len-min 16 \
  --prompt-len-max 200 --max-tokens 24 --max-tokens-min 4 --cancel-fraction 0.2 --seed 13 \
  --label "pd-2p2d 1000 requests" --json "$OUT/leaks.json" >"$OUT/leaks.txt" &
BENCH=$!
sleep 25
VICTIM=$(grep -oE "started node prefill-1 \(prefill\) as process [0-9]+" "$OUT/leaks.log" | grep -oE "[0-9]+$")
kill -9 "$VICTIM"; echo "killed prefill-1 (process $VICTIM) at 25 s"
wait $BENCH || true
# Load reports come with heartbeats: let the last ones arrive.
sleep 3
curl -s $URL/ready >"$OUT/leaks-ready.json"
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
b = json.load(open(f"{o}/leaks.json")); r = json.load(open(f"{o}/leaks-ready.json"))
e = dict(b["errors"]); dropped = e.pop("dropped", 0)
print(f"requests: {b['requests_ok']} ok, {dropped} dropped by the client mid-stream, other failures {e or 'none'}")
print("nodes:", ", ".join(f"{n['name']} up={n['up']} routed={n['routed']} orphans={n.get('kv_orphans', 0)}" for n in r["nodes"]))
import re
log = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in open(f"{o}/leaks.log")]
print(f"requests re-run after the kill: {sum('re-running it on' in l for l in log)}")
print(f"KV blocks used on the nodes that are up, after the run: {r['kv_blocks']['used']} (total {r['kv_blocks']['total']})")
# The target this script states: no block leaked. A miss fails the script
# (exit 1) once everything above is printed.
if r["kv_blocks"]["used"] != 0:
    print(f"MISSED: leaked blocks {r['kv_blocks']['used']} (target 0)")
    sys.exit(1)
PY
