#!/usr/bin/env bash
# `flotilla plan`'s prediction against a real cluster on this machine:
# the highest request rate a two-worker cluster and a 1P1D cluster (loopback,
# --threads $THREADS per engine node) serve within an SLO, predicted by
# `flotilla plan` from `bench-model --fit` figures of this machine, and
# measured with `flotilla bench --rate R --slo ...` (open-loop Poisson
# arrivals) by the same search the plan makes: double or halve from a start
# until the answer changes, then bisect to --precision. Prints predicted,
# measured and predicted/measured for each (target: within +-10%); exits 1
# after the table where one is outside.
#   Workload: 150-word prompts, 64 output tokens (ignore_eos), paid tier;
#   engine nodes with --speculative off (as the simulated ones).
#   SLO: $SLO (default ttft_p90=2s,tpot_p90=100ms); lost requests <= 1%.
#   Each measured run: $SECS s of arrivals (at most $MAX_REQ requests);
#   each simulated run $PLAN_SECS s. A p90 over fewer requests moves by
#   tens of percent from run to run.
#   usage: tests/bench/plan-vs-bench.sh        (reports in $OUT)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-plan}; mkdir -p "$OUT"
THREADS=${THREADS:-1}
SLO=${SLO:-ttft_p90=2s,tpot_p90=100ms}
SECS=${SECS:-120}         # seconds of arrivals per measured run
PLAN_SECS=${PLAN_SECS:-240}  # seconds of arrivals per simulated run
MAX_REQ=${MAX_REQ:-400}
export OUT SLO SECS MAX_REQ
export FLOTILLA=target/release/flotilla
[ -x "$FLOTILLA" ] || cargo build --release
MODEL=$($FLOTILLA fetch-model)
export URL=http://127.0.0.1:8000
export KEY=sk-flotilla-paid-example
grep -m1 "model name" /proc/cpuinfo | tee "$OUT/cpu.txt"
echo "threads per engine node $THREADS; SLO $SLO; $SECS s of arrivals per measured run" | tee -a "$OUT/cpu.txt"

# 1. This machine's figures at these threads (REFIT=0 keeps an earlier fit).
if [ "${REFIT:-1}" != 0 ] || [ ! -s "$OUT/cpu-fit.toml" ]; then
  $FLOTILLA bench-model --model "$MODEL" --threads "$THREADS" --fit "$OUT/cpu-fit.toml" | tee "$OUT/fit.txt"
fi

all_up() {
  curl -sf $URL/ready 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); sys.exit(0 if r["nodes"] and all(n["up"] for n in r["nodes"]) else 1)' 2>/dev/null
}
PID=
stop() { [ -n "$PID" ] && { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }; PID=
  for _ in $(seq 1 50); do curl -sf $URL/health >/dev/null 2>&1 || break; sleep 0.2; done; }
trap stop EXIT
up() { # name config
  # Speculation off: the simulated workload has none (the nodes' default,
  # n-gram lookup, would shorten TPOT wherever an output repeats itself).
  FLOTILLA_LOG=warn $FLOTILLA cluster --config "$2" -- --threads "$THREADS" --max-model-len 4096 \
    --speculative off 2>"$OUT/$1.log" &
  PID=$!
  for _ in $(seq 1 900); do all_up && break; sleep 0.2; done
  all_up || { echo "$1: cluster never came up (see $OUT/$1.log)" >&2; exit 1; }
}

# 2. The workload in tokens: what the server counts for the bench's prompts.
up calibrate cluster-configs/two-workers.toml
$FLOTILLA bench --url $URL --api-key $KEY --quiet --concurrency 1 --requests 8 \
  --prompt-len-min 150 --prompt-len-max 150 --max-tokens 64 --seed 11 --json "$OUT/calibrate.json" >/dev/null
stop
P=$(python3 -c "import json; r = json.load(open('$OUT/calibrate.json')); print(round(r['prompt_tokens'] / r['requests_ok']))")
# The shipped workload, with the prompt the server counted.
sed "s/^prompt = { kind = \"fixed\", tokens = [0-9]* }/prompt = { kind = \"fixed\", tokens = $P }/" \
  simulations/plan-cpu-loopback.toml >"$OUT/workload.toml"
grep -q "tokens = $P }" "$OUT/workload.toml" || { echo "could not set the prompt length" >&2; exit 1; }

# 3. Each cluster: the plan's prediction, then the measured search.
: >"$OUT/results.txt"
for spec in "two-workers cluster-configs/two-workers.toml 0" "1p1d cluster-configs/pd-1p1d.toml 0.5"; do
  set -- $spec
  name=$1 config=$2 share=$3
  $FLOTILLA plan "$OUT/workload.toml" --gpu "$OUT/cpu-fit.toml" --nodes 2 --prefill-shares "$share" \
    --max-num-seqs 32 --kv-dtypes f16 --slo "paid:$SLO" --duration-s "$PLAN_SECS" --seed 1 --out "$OUT/plan-$name" | tee "$OUT/plan-$name.txt"
  predicted=$(python3 -c "import csv; r = list(csv.DictReader(open('$OUT/plan-$name/pareto.csv'))); print(r[0]['rate_per_s'])")
  up "$name" "$config"
  # Warm the nodes (first requests pay for lazy set-up), then search.
  $FLOTILLA bench --url $URL --api-key $KEY --quiet --concurrency 1 --requests 4 \
    --prompt-len-min 150 --prompt-len-max 150 --max-tokens 64 --seed 99 --json "$OUT/$name-warm.json" >/dev/null
  measured=$(python3 - "$predicted" "$name" <<'PY'
import json, subprocess, sys, os
start, name = float(sys.argv[1]), sys.argv[2]
out, secs, cap = os.environ["OUT"], float(os.environ["SECS"]), int(os.environ["MAX_REQ"])
prec, runs = 0.05, []
# Each run its own prompts (its own seed): a prompt seen before would be
# served from the prefix cache, which the simulated traffic never is.
def met(rate):
    n = max(40, min(cap, round(rate * secs)))
    j = f"{out}/{name}-r{rate:.3f}.json"
    subprocess.run([os.environ["FLOTILLA"], "bench", "--url", os.environ["URL"], "--api-key",
                    os.environ["KEY"], "--quiet", "--rate", f"{rate:.4f}", "--requests", str(n),
                    "--prompt-len-min", "150", "--prompt-len-max", "150", "--max-tokens", "64",
                    "--seed", str(100 + len(runs)), "--slo", os.environ["SLO"], "--json", j],
                   check=True, stdout=subprocess.DEVNULL)
    v = json.load(open(j))["slo"]
    figs = ", ".join(f"{c['objective']} {c['measured_ms']}" for c in v["objectives"])
    print(f"  measured {rate:.3f} req/s ({n} requests): {'met' if v['met'] else 'missed'}; lost {v['lost']:.3f}; {figs}", file=sys.stderr)
    runs.append((rate, v["met"]))
    return v["met"]
lo, hi = None, None
r = start
if met(r):
    lo = r
    while hi is None and len(runs) < 8:
        r *= 2
        if met(r): lo = r
        else: hi = r
else:
    hi = r
    while lo is None and len(runs) < 8:
        r /= 2
        if met(r): lo = r
        else: hi = r
while lo is not None and hi is not None and hi - lo > prec * lo and len(runs) < 12:
    mid = (lo + hi) / 2
    if met(mid): lo = mid
    else: hi = mid
print(lo if lo is not None else 0.0)
PY
)
  stop
  echo "$name $predicted $measured" >>"$OUT/results.txt"
done

python3 - "$OUT" <<'PY'
import sys
o = sys.argv[1]
print(f"{'cluster':<14}{'predicted req/s':>17}{'measured req/s':>16}{'predicted/measured':>20}")
missed = []
for line in open(f"{o}/results.txt"):
    name, p, m = line.split(); p, m = float(p), float(m)
    ratio = p / m if m > 0 else float("inf")
    flag = "ok" if abs(ratio - 1) <= 0.10 else "outside +-10%"
    print(f"{name:<14}{p:>17.3f}{m:>16.3f}{ratio:>19.2f}x  {flag}")
    if flag != "ok":
        missed.append(f"{name}: predicted {p:.3f}, measured {m:.3f} req/s ({ratio:.2f}x; target within +-10%)")
for m in missed:
    print(f"MISSED: {m}")
sys.exit(1 if missed else 0)
PY
