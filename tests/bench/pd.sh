#!/usr/bin/env bash
# Disaggregated prefill/decode beside colocated serving, same machine, same
# build, same run. Colocated: cluster-configs/two-workers.toml (2 mixed
# workers); disaggregated: cluster-configs/pd-1p1d.toml (1 prefill + 1
# decode). Each engine node gets --threads $THREADS.
#  1. Low load: one stream at a time, 700-word prompts, 16 output
#     tokens: TTFT colocated vs disaggregated (the migration's added TTFT),
#     and the KV migration throughput from the prefill node's log.
#  2. Interference: 2 clients sending 1600-1800-word (2000+-token) prompts (8 output tokens)
#     while 8 clients stream 128 tokens from short prompts: p99 TPOT of the
#     streams.
# Bounded: every bench has a request count. Reports go to $OUT.
#   usage: tests/bench/pd.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-pd}; mkdir -p "$OUT"
THREADS=${THREADS:-1}
FLOTILLA=target/release/flotilla
[ -x "$FLOTILLA" ] || cargo build --release
URL=http://127.0.0.1:8000
KEY=sk-flotilla-paid-example
B="$FLOTILLA bench --url $URL --api-key $KEY --quiet"

all_up() {
  curl -sf $URL/ready 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); sys.exit(0 if r["nodes"] and all(n["up"] for n in r["nodes"]) else 1)' 2>/dev/null
}

run() { # name config
  FLOTILLA_LOG=warn,flotilla_cluster=debug $FLOTILLA cluster --config "$2" -- --threads "$THREADS" \
    --max-model-len 4096 2>"$OUT/$1.log" &
  local pid=$!
  for _ in $(seq 1 900); do all_up && break; sleep 0.2; done
  all_up || { echo "$1: cluster never came up (see $OUT/$1.log)" >&2; kill $pid; return 1; }
  $B --concurrency 1 --requests 8 --prompt-len-min 700 --prompt-len-max 700 --max-tokens 16 --seed 3 \
    --label "$1 low load" --json "$OUT/$1-low.json" >"$OUT/$1-low.txt"
  $B --concurrency 2 --requests 6 --prompt-len-min 1600 --prompt-len-max 1800 --max-tokens 8 --seed 5 \
    --label "$1 long prompts" --json "$OUT/$1-long.json" >"$OUT/$1-long.txt" &
  local long=$!
  sleep 1
  $B --concurrency 8 --requests 24 --prompt-len-min 16 --prompt-len-max 48 --max-tokens 128 --seed 9 \
    --label "$1 streams" --json "$OUT/$1-streams.json" >"$OUT/$1-streams.txt"
  wait $long
  # Load reports come with heartbeats: let the last ones arrive.
  sleep 2
  curl -s $URL/ready >"$OUT/$1-ready.json"
  kill $pid; wait $pid 2>/dev/null || true
  # The next cluster binds the same ports.
  for _ in $(seq 1 50); do curl -sf $URL/health >/dev/null 2>&1 || break; sleep 0.2; done
}

run colocated cluster-configs/two-workers.toml
run disaggregated cluster-configs/pd-1p1d.toml

python3 - "$OUT" <<'PY'
import json, re, sys
o = sys.argv[1]
j = lambda n: json.load(open(f"{o}/{n}.json"))
for k in ("p50", "p99"):
    c, d = j("colocated-low")["ttft_ms"][k], j("disaggregated-low")["ttft_ms"][k]
    print(f"low load TTFT {k}: colocated {c:.0f} ms, disaggregated {d:.0f} ms, added {d - c:+.0f} ms ({d / c:.2f}x)")
rates, sizes = [], []
for line in open(f"{o}/disaggregated.log"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.search(r"KV sent to node \d+: ([0-9.]+) GB/s.*bytes=(\d+)", line) or re.search(r"bytes=(\d+).*KV sent to node \d+: ([0-9.]+) GB/s", line)
    if m:
        a, b = m.groups()
        gbs, n = (float(a), int(b)) if "." in a else (float(b), int(a))
        rates.append(gbs); sizes.append(n)
def rate_line(what, pairs):
    if pairs:
        r = sorted(g for g, _ in pairs); n = [b for _, b in pairs]
        print(f"KV migration, {what}: {len(r)} transfers of {min(n)/1e6:.1f}-{max(n)/1e6:.1f} MB, "
              f"median {r[len(r)//2]:.2f} GB/s, best {r[-1]:.2f} GB/s")
pairs = list(zip(rates, sizes))
rate_line("all", pairs)
rate_line("10 MB and over", [p for p in pairs if p[1] >= 10e6])
for k in ("p50", "p99"):
    c, d = j("colocated-streams")["tpot_ms"][k], j("disaggregated-streams")["tpot_ms"][k]
    print(f"streams under long prompts, TPOT {k}: colocated {c:.1f} ms, disaggregated {d:.1f} ms ({d / c:.2f}x)")
for n in ("colocated", "disaggregated"):
    s, l = j(f"{n}-streams"), j(f"{n}-long")
    print(f"{n}: streams ok {s['requests_ok']}/{s['flags']['requests']}, long ok {l['requests_ok']}/{l['flags']['requests']}, "
          f"long TTFT p50 {l['ttft_ms']['p50']:.0f} ms")
    r = json.load(open(f"{o}/{n}-ready.json"))
    print(f"{n}: KV blocks used after the run: {r['kv_blocks']['used']}")
PY
