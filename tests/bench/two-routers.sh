#!/usr/bin/env bash
# Two routers under load, one SIGKILLed and restarted (issue 47): the
# cluster of cluster-configs/two-routers.toml (router-a on :8000, router-b on
# :8001, two workers) as four processes on this machine. A shared-prefix
# workload (8 long "documents", each asked several questions) of STREAMS
# streams per router runs for PHASE_S seconds; then router-a is killed
# (SIGKILL) while both routers' streams run, and the script reports the
# errors on router-b's streams, when the workers' running batches dropped
# router-a's requests (each worker's /ready), and the blocks still used.
# router-a is started again and takes the same workload for PHASE_S
# seconds: its routing counts (placements, those with a cache candidate,
# prompt blocks matched) in that window are printed beside router-b's
# before the kill.
#   usage: tests/bench/two-routers.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-two-routers}; mkdir -p "$OUT"
STREAMS=${STREAMS:-16}
PHASE_S=${PHASE_S:-10}
BIN=target/release/flotilla
[ -x "$BIN" ] || cargo build --release
CONFIG=cluster-configs/two-routers.toml
"$BIN" cluster --config "$CONFIG" -- --threads 1 > "$OUT/cluster.log" 2>&1 &
CL=$!
RA=""
trap 'kill $CL 2>/dev/null || true; [ -n "$RA" ] && kill $RA 2>/dev/null; wait 2>/dev/null || true' EXIT
up() {
  curl -sf "$1/ready" 2>/dev/null | python3 -c \
    'import json,sys; d=json.load(sys.stdin); sys.exit(0 if all(n["up"] for n in d["nodes"]) else 1)' 2>/dev/null
}
for _ in $(seq 1 240); do up http://127.0.0.1:8000 && up http://127.0.0.1:8001 && break; sleep 1; done
up http://127.0.0.1:8001 || { echo "the cluster did not come up; see $OUT/cluster.log"; exit 1; }
grep -m1 "model name" /proc/cpuinfo
STREAMS=$STREAMS PHASE_S=$PHASE_S BIN=$BIN CONFIG=$CONFIG OUT=$OUT python3 - <<'PY'
import json, os, subprocess, threading, time, urllib.request

STREAMS = int(os.environ["STREAMS"]); PHASE_S = float(os.environ["PHASE_S"])
A, B = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
WORKERS = ["http://127.0.0.1:9411", "http://127.0.0.1:9412"]
KEY = "sk-flotilla-paid-example"
DOCS = [("Document %d. " % d) + " ".join(
    "The %s harbour of town %d keeps its boats, nets and lanterns in row %d." % (w, d, i)
    for i, w in enumerate(["north", "south", "east", "west", "old", "new"])) for d in range(8)]

def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)

def one(base, prompt, max_tokens, stats, stop):
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer " + KEY})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            done = False
            for line in r:
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: ") and b'"error"' in line:
                    stats["errors"] += 1
                    return False
            stats["ok" if done else "broken"] += 1
            return done
    except Exception:
        stats["broken"] += 1
    return False

def load(base, seconds, stats, stop, tag, max_tokens=32):
    def worker(k):
        i = 0
        end = time.time() + seconds
        while time.time() < end and not stop.is_set():
            d = DOCS[(k + i) % len(DOCS)]
            if not one(base, "%s Question %s-%d-%d: what is in row 3?" % (d, tag, k, i), max_tokens, stats, stop):
                # Its front died (or refused): this client stops.
                return
            i += 1
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(STREAMS)]
    for t in ts: t.start()
    return ts

def routing(base):
    return get(base + "/ready")["routing"]

def running():
    return [get(w + "/ready")["running"] for w in WORKERS]

# Phase 1: both routers under the shared-prefix load.
sa, sb = {"ok": 0, "broken": 0, "errors": 0}, {"ok": 0, "broken": 0, "errors": 0}
stop = threading.Event()
ta = load(A, 3600, sa, stop, "a", max_tokens=400)
tb = load(B, PHASE_S + 30, sb, threading.Event(), "b")
time.sleep(PHASE_S)
rb_before = routing(B)
print("before the kill: workers running", running(), "; router-b routing", rb_before)
# Kill router-a.
pid = subprocess.check_output(["pgrep", "-f", "--", "--config %s --name router-a" % os.environ["CONFIG"]]).split()[0]
before = running()
subprocess.run(["kill", "-9", pid])
killed = time.time()
gone_at = None
while time.time() - killed < 30:
    r = running()
    # router-b's streams alone: at most STREAMS run.
    if sum(r) <= STREAMS:
        gone_at = time.time() - killed
        break
    time.sleep(0.05)
stop.set()
print("router-a SIGKILLed: workers running %s before, %s after %.2f s (router-b's %d streams go on)"
      % (before, running(), gone_at or -1, STREAMS))
for t in tb: t.join()
for t in ta: t.join()
print("router-b's streams: %(ok)d whole, %(broken)d broken, %(errors)d errors" % sb)
print("router-a's streams: %(ok)d whole before the kill, %(broken)d broken off by it" % sa)
blocks = [get(w + "/ready")["kv_blocks"]["used"] for w in WORKERS]
print("KV blocks used on the workers with no load:", blocks)
# Restart router-a and give it the same workload.
log = open(os.path.join(os.environ["OUT"], "router-a-2.log"), "w")
p = subprocess.Popen([os.environ["BIN"], "node", "--config", os.environ["CONFIG"], "--name", "router-a", "--threads", "1"],
                     stderr=log, stdout=log)
open(os.path.join(os.environ["OUT"], "router-a.pid"), "w").write(str(p.pid))
t0 = time.time()
while True:
    try:
        if all(n["up"] for n in get(A + "/ready")["nodes"]):
            break
    except Exception:
        pass
    time.sleep(0.05)
ready_s = time.time() - t0
r0 = routing(A)
sa2 = {"ok": 0, "broken": 0, "errors": 0}
for t in load(A, PHASE_S, sa2, threading.Event(), "a2"): t.join()
r1 = routing(A)
pl = r1["placements"] - r0["placements"]; cand = r1["cache_candidate"] - r0["cache_candidate"]
pb = r1["prompt_blocks"] - r0["prompt_blocks"]; mb = r1["matched_blocks"] - r0["matched_blocks"]
print("router-a restarted: serving %.1f s after start (%d prefix snapshots at that moment)" % (ready_s, r0["prefix_snapshots"]))
print("router-a's first %.0f s: %d placements, %d without a cache candidate (%.2f%%), prompt blocks matched %d of %d (%.1f%%); streams %s"
      % (PHASE_S, pl, pl - cand, 100.0 * (pl - cand) / max(pl, 1), mb, pb, 100.0 * mb / max(pb, 1), sa2))
print("router-b before the kill: %d placements, %d with a cache candidate, prompt blocks matched %d of %d"
      % (rb_before["placements"], rb_before["cache_candidate"], rb_before["matched_blocks"], rb_before["prompt_blocks"]))
p.kill()
PY
