#!/usr/bin/env python3
"""Speculative decoding benchmark: streams chat requests at a fixed
concurrency to an OpenAI-compatible server and reports output tokens/s
(all streams together, first request sent to last token) and per-stream
decode speed (tokens after the first over the time after the first).

  speculation.py URL TASK CONCURRENCY REQUESTS [MAX_TOKENS]

TASK is `copy` (repeat a ~1,000-token text given in the prompt: a
copy-heavy edit task), `natural` (open questions), `code` (programming
tasks, one a line of tests/bench/code-tasks.txt) or `json` (a record
given as text, returned as JSON under a JSON Schema: structured output,
whose keys the grammar forces and whose values the prompt holds). Greedy,
no ignore_eos: each answer is what the model says."""
import json, sys, threading, time, urllib.request

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import model_id, stream_chat

url, task, conc, nreq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
max_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 256
here = __file__.rsplit("/", 1)[0]
SOURCE = open(f"{here}/../../docs/ARCHITECTURE.md").read().split()
CODE = [l.strip() for l in open(f"{here}/code-tasks.txt") if l.strip()]

FIELDS = ["name", "port", "captain", "cargo", "tonnage", "built", "flag", "destination", "notes"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": FIELDS,
          "properties": {f: {"type": "integer"} if f in ("tonnage", "built") else
                         {"type": "string", "maxLength": 80} for f in FIELDS}}

def record(i):
    names = ["Harbour Queen", "North Star", "Grey Gull", "Morning Tide", "Iron Duke",
             "Silver Fern", "Blue Heron", "Cape Wind"]
    ports = ["Bristol", "Hamburg", "Lisbon", "Gdansk", "Antwerp", "Cork", "Bergen", "Genoa"]
    return {"name": names[i % 8], "port": ports[i % 8], "captain": ["Ada Ward", "Tom Hale", "Rui Costa", "Lena Berg"][i % 4],
            "cargo": ["timber and coal", "grain", "salted fish", "machine parts"][i % 4],
            "tonnage": 1200 + 37 * i, "built": 1961 + i, "flag": ["Norway", "Portugal", "Ireland"][i % 3],
            "destination": ports[(i + 5) % 8],
            "notes": ["Hull repainted in the spring; radar replaced after the storm.",
                      "Crew of twelve; the galley stove needs a new burner.",
                      "Carries two lifeboats and a spare anchor chain."][i % 3]}

def prompt(i):
    if task == "json":
        r = record(i)
        lines = "\n".join(f"{k}: {v}" for k, v in r.items())
        return ("Here is a ship's record:\n\n" + lines + "\n\nReturn it as a JSON object with the keys " +
                ", ".join(FIELDS) + ", copying each value exactly.")
    if task == "copy":
        text = " ".join(SOURCE[200 + 40 * i: 900 + 40 * i])
        return ("Here is a text:\n\n" + text +
                "\n\nRepeat the text above word for word, fixing nothing.")
    if task == "code":
        return CODE[i % len(CODE)]
    topics = ["the history of bread", "how rivers form", "why the sky is blue",
              "the rules of chess", "how vaccines work", "the life of bees",
              "what makes a good story", "how computers add numbers"]
    return f"Write a short essay about {topics[i % len(topics)]}."

MODEL = model_id(url)

results, lock = [], threading.Lock()
queue = list(range(nreq))

def worker():
    while True:
        with lock:
            if not queue:
                return
            i = queue.pop(0)
        body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": prompt(i)}]}
        if task == "json":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "ship", "schema": SCHEMA, "strict": True}}
        usage = {}
        t0, first, t1, n, text = stream_chat(url, body, timeout=600, usage=usage)
        # Tokens, where the server counts them (a chunk may carry several).
        n = usage.get("completion_tokens", n)
        valid = None
        if task == "json":
            try:
                valid = isinstance(json.loads(text), dict)
            except ValueError:
                valid = False
        with lock:
            results.append((t0, first, t1, n, valid))

def spec_counts():
    """(drafted, accepted) from a Flotilla server's /metrics; None elsewhere."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:
        return None
    got = {"draft": 0.0, "accepted": 0.0}
    for line in text.splitlines():
        for k in got:
            if line.startswith(f"flotilla_spec_{k}_tokens_total"):
                got[k] += float(line.rsplit(" ", 1)[1])
    return got["draft"], got["accepted"]

before = spec_counts()
start = time.time()
ts = [threading.Thread(target=worker) for _ in range(conc)]
for t in ts: t.start()
for t in ts: t.join()
end = time.time()
chunks = sum(r[3] for r in results)
decode = [(r[3] - 1) / (r[2] - r[1]) for r in results if r[3] > 1 and r[2] > r[1]]
decode.sort()
after = spec_counts()
acceptance = None
if before and after and after[0] > before[0]:
    acceptance = {"drafted": int(after[0] - before[0]), "accepted": int(after[1] - before[1]),
                  "rate": round((after[1] - before[1]) / (after[0] - before[0]), 3)}
valid = [r[4] for r in results if r[4] is not None]
print(json.dumps({"task": task, "concurrency": conc, "requests": len(results),
                  **({"valid_json": sum(valid)} if valid else {}),
                  "chunks": chunks, "wall_s": round(end - start, 2),
                  "chunks_per_s": round(chunks / (end - start), 1),
                  "stream_decode_chunks_per_s_p50": round(decode[len(decode) // 2], 1) if decode else None,
                  "speculation": acceptance}))
