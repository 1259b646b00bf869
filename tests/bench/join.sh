#!/usr/bin/env bash
# A worker that joins under load (issue 47): a router and one worker (the
# cluster of cluster-configs/two-workers.toml without worker-2, in its own
# certificates directory) serve STREAMS streams, each asking one request
# after another (MAX_TOKENS output tokens each, greedy, no speculation,
# f16 KV; lengths MAX_TOKENS +-25% so they do not finish in waves) and a
# probe (4 tokens, asked again 100 ms after each answer), for PHASE_S
# seconds; then worker-9, which is in no config file, is given a certificate (`flotilla certs issue`) and started with
# `flotilla node --join router`. The script reports when the router saw it
# up (its first heartbeat), when the router placed its first request there,
# both against the heartbeat interval, and the cluster's output tok/s over
# PHASE_S before the join and over PHASE_S after it.
# One worker before, two after: this machine has 2 cores, each node runs
# --threads 1, so a third would have no core of its own.
#   usage: tests/bench/join.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-join}; rm -rf "$OUT"; mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STREAMS=${STREAMS:-16}
PHASE_S=${PHASE_S:-20}
MAX_TOKENS=${MAX_TOKENS:-64}
BIN=target/release/flotilla
[ -x "$BIN" ] || cargo build --release
CONFIG=$OUT/join.toml
python3 - "$CONFIG" "$OUT/certs" <<'PY'
import re, sys
text = open("cluster-configs/two-workers.toml").read()
text = re.sub(r'certs_dir = "[^"]*"', 'certs_dir = "%s"' % sys.argv[2], text)
# Drop worker-2's table: worker-9 joins in its place.
text = re.sub(r'\[\[nodes\]\]\nname = "worker-2"\n(?:[a-z_]+ = .*\n)*', "", text)
assert 'name = "worker-2"' not in text
open(sys.argv[1], "w").write(text)
PY
"$BIN" cluster --config "$CONFIG" -- --threads 1 > "$OUT/cluster.log" 2>&1 &
CL=$!
J=""
trap 'kill $CL 2>/dev/null || true; [ -n "$J" ] && kill $J 2>/dev/null; wait 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -sf http://127.0.0.1:8000/ready 2>/dev/null | grep -q '"up":true' && break; sleep 1
done
"$BIN" certs issue --dir "$OUT/certs" --node worker-9 --role worker
grep -m1 "model name" /proc/cpuinfo
grep -m1 "^flags" /proc/cpuinfo | tr ' ' '\n' | grep -E "^(avx2|avx512f|avx512_vnni|amx_tile)$" | tr '\n' ' '; echo
STREAMS=$STREAMS PHASE_S=$PHASE_S MAX_TOKENS=$MAX_TOKENS BIN=$BIN CONFIG=$CONFIG OUT=$OUT python3 - <<'PY'
import json, os, re, subprocess, threading, time, urllib.request

STREAMS = int(os.environ["STREAMS"]); PHASE_S = float(os.environ["PHASE_S"])
MAX_TOKENS = int(os.environ["MAX_TOKENS"])
R = "http://127.0.0.1:8000"
KEY = "sk-flotilla-paid-example"

def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)

tokens = [0]; errors = [0]; lock = threading.Lock(); stop = threading.Event()

def stream(k, probe=False):
    i = 0
    while not stop.is_set():
        # Lengths vary (MAX_TOKENS +-25%), so the streams do not finish
        # in waves; the probe asks 4 tokens, 100 ms after each answer.
        n = 4 if probe else MAX_TOKENS * 3 // 4 + (k * 7 + i * 13) % (MAX_TOKENS // 2 + 1)
        if probe:
            time.sleep(0.1)
        body = {"prompt": "Client %d, request %d: tell a story about a harbour." % (k, i),
                "max_tokens": n, "stream": True, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(R + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json",
                                      "Authorization": "Bearer " + KEY})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        if b'"error"' in line:
                            with lock: errors[0] += 1
                        else:
                            with lock: tokens[0] += 1
        except Exception:
            with lock: errors[0] += 1
        i += 1

hb = int(re.search(r'heartbeat_interval_ms = (\d+)', open(os.environ["CONFIG"]).read()).group(1))
ts = [threading.Thread(target=stream, args=(k,)) for k in range(STREAMS)]
ts.append(threading.Thread(target=stream, args=(STREAMS, True)))
for t in ts: t.start()
time.sleep(3)  # warm-up
t0, n0 = time.time(), tokens[0]
time.sleep(PHASE_S)
before = (tokens[0] - n0) / (time.time() - t0)
print("one worker, %d streams and a probe: %.1f output tok/s over %.0f s" % (STREAMS, before, PHASE_S))

log = open(os.path.join(os.environ["OUT"], "worker-9.log"), "w")
started = time.time()
p = subprocess.Popen([os.environ["BIN"], "node", "--config", os.environ["CONFIG"], "--name", "worker-9",
                      "--join", "router", "--listen", "127.0.0.1:7409", "--metrics-addr", "127.0.0.1:9409",
                      "--threads", "1"], stderr=log, stdout=log)
open(os.path.join(os.environ["OUT"], "worker-9.pid"), "w").write(str(p.pid))
up_at = routed_at = None
while time.time() - started < 120 and routed_at is None:
    try:
        nodes = {n["name"]: n for n in get(R + "/ready")["nodes"]}
    except Exception:
        nodes = {}
    w = nodes.get("worker-9")
    now = time.time()
    if w and w["up"] and up_at is None:
        up_at = now
    if w and w["routed"] >= 1 and routed_at is None:
        routed_at = now
    time.sleep(0.005)
print("worker-9: up at the router %.2f s after its process started (model load included); "
      "first request placed there %.0f ms after it was up (heartbeat %d ms)"
      % (up_at - started, 1000 * (routed_at - up_at), hb))
t1, n1 = time.time(), tokens[0]
time.sleep(PHASE_S)
after = (tokens[0] - n1) / (time.time() - t1)
nodes = {n["name"]: n for n in get(R + "/ready")["nodes"]}
print("two workers (worker-9 joined), %d streams and a probe: %.1f output tok/s over %.0f s (%.2fx); "
      "placed: worker-1 %d, worker-9 %d"
      % (STREAMS, after, PHASE_S, after / before, nodes["worker-1"]["routed"], nodes["worker-9"]["routed"]))
stop.set()
for t in ts: t.join()
print("errors on the streams: %d" % errors[0])
p.terminate(); p.wait(timeout=60)
PY
