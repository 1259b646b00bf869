"""What the Python benchmark scripts share: the served model's id and one
streamed chat completion with its timings."""
import json, time, urllib.request


def model_id(url):
    """The first model the server lists (`/v1/models`)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def stream_chat(url, body, timeout=1200, usage=None):
    """POSTs `body` (a chat completion with "stream": true) and reads the
    stream: (sent, first content chunk, end, content chunks, text). With a
    dict `usage` (and `stream_options.include_usage` in the body), the
    stream's usage chunk is copied into it."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time(); first = None; n = 0; text = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            d = json.loads(line[6:])
            if usage is not None and d.get("usage"):
                usage.update(d["usage"])
            if d.get("choices") and d["choices"][0]["delta"].get("content"):
                n += 1
                text.append(d["choices"][0]["delta"]["content"])
                if first is None:
                    first = time.time()
    t1 = time.time()
    return t0, first or t1, t1, n, "".join(text)
