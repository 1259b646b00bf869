#!/usr/bin/env bash
# The Router's CPU per generated token: a router and two workers
# (cluster-configs/two-workers.toml, three processes on this machine), 32
# streams at once; the router process's user+system CPU time over the
# measured run divided by the tokens the clients received. Compares two
# builds side by side when OLD names another binary.
#   usage: tests/bench/router-cpu.sh            (this build)
#          OLD=/path/to/flotilla tests/bench/router-cpu.sh
# Bounded: REQUESTS requests of MAX_TOKENS tokens each. Reports go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-router-cpu}; mkdir -p "$OUT"
THREADS=${THREADS:-1}
REQUESTS=${REQUESTS:-256}
MAX_TOKENS=${MAX_TOKENS:-64}
NEW=${NEW:-target/release/flotilla}
[ -x "$NEW" ] || cargo build --release
URL=http://127.0.0.1:8000
KEY=sk-flotilla-paid-example
CONFIG=cluster-configs/two-workers.toml

all_up() {
  curl -sf $URL/ready 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); sys.exit(0 if r["nodes"] and all(n["up"] for n in r["nodes"]) else 1)' 2>/dev/null
}

cpu_ticks() { # pid: utime + stime, clock ticks
  awk '{print $14 + $15}' "/proc/$1/stat"
}

run() { # name binary
  local name=$1 bin=$2
  $bin cluster --config $CONFIG -- --threads "$THREADS" 2>"$OUT/$name.log" &
  local pid=$!
  for _ in $(seq 1 900); do all_up && break; sleep 0.2; done
  all_up || { echo "$name: cluster never came up (see $OUT/$name.log)" >&2; kill $pid; return 1; }
  local router
  router=$(pgrep -f -- "--config $CONFIG --name router" | head -1)
  local B="$bin bench --url $URL --api-key $KEY --quiet --concurrency 32 --prompt-len-min 16 --prompt-len-max 48"
  $B --requests 32 --max-tokens 8 --seed 1 --label warmup >/dev/null
  local t0
  t0=$(cpu_ticks "$router")
  $B --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --seed 2 --label "$name" \
    --json "$OUT/$name.json" >"$OUT/$name.txt"
  local t1
  t1=$(cpu_ticks "$router")
  echo $((t1 - t0)) >"$OUT/$name.ticks"
  kill $pid; wait $pid 2>/dev/null || true
  for _ in $(seq 1 50); do curl -sf $URL/health >/dev/null 2>&1 || break; sleep 0.2; done
}

run new "$NEW"
[ -n "${OLD:-}" ] && run old "$OLD"

python3 - "$OUT" "$(getconf CLK_TCK)" <<'PY'
import json, os, sys
o, hz = sys.argv[1], int(sys.argv[2])
rows = {}
for name in ("old", "new"):
    if not os.path.exists(f"{o}/{name}.json"):
        continue
    r = json.load(open(f"{o}/{name}.json"))
    ticks = int(open(f"{o}/{name}.ticks").read())
    us = ticks * 1e6 / hz / max(r["output_tokens"], 1)
    rows[name] = us
    print(f"{name}: router CPU {ticks / hz:.2f} s for {r['output_tokens']} tokens = {us:.1f} us/token; "
          f"{r['output_tokens_per_s']:.1f} tok/s, {r['requests_ok']} ok, {r['requests_failed']} failed")
if "old" in rows:
    print(f"router CPU per token, new/old: {rows['new'] / rows['old']:.2f}x")
PY
