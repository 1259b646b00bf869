#!/usr/bin/env python3
"""Multi-turn chat benchmark (KV offload tier): SESSIONS chat sessions of
TURNS turns each, every turn adding a ~ADD-token user message to the
session's growing history (greedy, MAX_TOKENS answer tokens, streamed).
Turns go round-robin over the sessions (turn 1 of every session, then turn
2, ...) with at most CONC requests at once, so a session's history must
survive every other session's turn to be reused. Reports TTFT p50/p99 of
turns >= 2 (and of turn 1), output tokens/s (first request sent to last
token), and a Flotilla server's offload counters from /ready.

  multiturn.py URL SESSIONS TURNS CONC [ADD] [MAX_TOKENS]

With TURNS = 1 and CONC = SESSIONS it is the overload case instead: all
sessions' single turns at once (preemption when the KV cache is short)."""
import json, sys, threading, time, urllib.request

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import model_id, stream_chat

url = sys.argv[1]
sessions, turns, conc = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
add = int(sys.argv[5]) if len(sys.argv) > 5 else 400
max_tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 32
here = __file__.rsplit("/", 1)[0]
WORDS = open(f"{here}/../../docs/ARCHITECTURE.md").read().split()

MODEL = model_id(url)

def user_text(s, t):
    # About `add` tokens, distinct per session and turn. The words of
    # ARCHITECTURE.md (paths, code, punctuation) are ~1.9 tokens each with
    # the default model's tokenizer (measured from /metrics' prompt tokens:
    # 300 words gave ~570 tokens), not the ~1.3 of plain English prose.
    n = int(add / 1.9)
    start = (s * 7919 + t * 104729) % (len(WORDS) - n)
    return f"Session {s}, note {t}: " + " ".join(WORDS[start:start + n]) + \
        "\nSummarise the note above in one sentence."

history = [[] for _ in range(sessions)]
# (session, turn) in round-robin order; a turn waits for its session's last.
order = [(s, t) for t in range(turns) for s in range(sessions)]
done_turn = [-1] * sessions
results, lock = [], threading.Condition()

def run_turn(s, t):
    msgs = history[s] + [{"role": "user", "content": user_text(s, t)}]
    # The overload case runs every stream to its length.
    t0, first, t1, n, text = stream_chat(url, {
        "model": MODEL, "stream": True, "temperature": 0, "max_tokens": max_tokens,
        "ignore_eos": turns == 1, "messages": msgs})
    history[s] = msgs + [{"role": "assistant", "content": text}]
    return t0, first, t1, n

def worker():
    while True:
        with lock:
            while True:
                if not order:
                    return
                pick = next((i for i, (s, t) in enumerate(order) if done_turn[s] == t - 1
                             and not busy[s]), None)
                if pick is not None:
                    s, t = order.pop(pick)
                    busy[s] = True
                    break
                lock.wait()
        r = run_turn(s, t)
        with lock:
            results.append((t,) + r)
            done_turn[s] = t
            busy[s] = False
            lock.notify_all()

def ready():
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as r:
            return json.load(r)
    except Exception:
        return None

busy = [False] * sessions
before = ready()
start = time.time()
ts = [threading.Thread(target=worker) for _ in range(conc)]
for th in ts: th.start()
for th in ts: th.join()
end = time.time()
after = ready()

def pct(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None

later = [r[2] - r[1] for r in results if r[0] >= 1]
firsts = [r[2] - r[1] for r in results if r[0] == 0]
out = sum(r[4] for r in results)
report = {"sessions": sessions, "turns": turns, "concurrency": conc, "add_tokens": add,
          "max_tokens": max_tokens, "requests": len(results), "wall_s": round(end - start, 1),
          "output_tok_per_s": round(out / (end - start), 2),
          "ttft_ms_turn1_p50": pct(firsts, 0.5), "ttft_ms_turn1_p99": pct(firsts, 0.99),
          "ttft_ms_later_p50": pct(later, 0.5), "ttft_ms_later_p99": pct(later, 0.99)}
if before and after and "kv_offload" in after:
    o, b = after["kv_offload"], before["kv_offload"]
    report["offload"] = {k: o[k] - b[k] for k in ("spilled", "restored", "dropped", "lookups", "hits")}
    report["preemptions"] = after["preemptions"] - before["preemptions"]
print(json.dumps(report))
