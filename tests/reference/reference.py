#!/usr/bin/env python3
"""Independent float64 numpy reference for SmolLM2-135M-Instruct (GGUF, llama arch).

Writes the golden fixtures that Flotilla's tests compare against:

  tokenizer_cases.json   text -> ids, ids from llama.cpp's `llama-tokenize`
  golden_logits.json     prompts, positions, top-5 per position
  golden/<name>.f32      little-endian f32 logits, len(positions) x vocab
  greedy.json            24-step greedy continuations + top1-top2 gaps

The forward pass is written from the model's definition, not from Flotilla's
code: weights are dequantized with `gguf.quants.dequantize` (exact: the engine
must produce bit-identical f32 weights) and everything after that is float64.

Token ids always come from llama.cpp (`llama-tokenize`), never from a Python
tokenizer. Without llama.cpp, `--reuse-ids` takes the ids from the fixtures
already in --out and only recomputes logits / greedy tokens.

usage:
  python3 tests/reference/reference.py --model PATH.gguf --out tests/fixtures \
      [--llama-bin ~/.cache/flotilla-peers/llama.cpp/build/bin] [--reuse-ids] \
      [--llama-cpp-compare] [--tolerance-study]
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

N_GREEDY = 24


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------

class Model:
    def __init__(self, path, dtype=np.float64):
        import gguf

        self.dtype = dtype
        r = gguf.GGUFReader(path)
        self.reader = r

        def field(name):
            return r.fields[name].contents()

        arch = field("general.architecture")
        assert arch == "llama", arch
        self.n_layer = int(field("llama.block_count"))
        self.d_model = int(field("llama.embedding_length"))
        self.n_head = int(field("llama.attention.head_count"))
        self.n_kv = int(field("llama.attention.head_count_kv"))
        self.d_ff = int(field("llama.feed_forward_length"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field("llama.rope.freq_base"))
        self.head_dim = self.d_model // self.n_head
        assert int(field("llama.rope.dimension_count")) == self.head_dim
        self.tokens = field("tokenizer.ggml.tokens")
        self.bos_id = int(field("tokenizer.ggml.bos_token_id"))
        self.eos_id = int(field("tokenizer.ggml.eos_token_id"))
        self.chat_template = field("tokenizer.chat_template")
        self.vocab = len(self.tokens)

        self.qtype = {}
        w = {}
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            # GGUF lists shapes innermost-first: [cols, rows] -> numpy (rows, cols)
            shape = [int(s) for s in t.shape][::-1]
            a = np.asarray(a, dtype=np.float32).reshape(shape)
            w[t.name] = a.astype(dtype)
            self.qtype[t.name] = t.tensor_type.name
        self.w = w
        self.tok_embd = w["token_embd.weight"]  # (vocab, d_model); also the output head
        assert self.tok_embd.shape == (self.vocab, self.d_model)
        assert "output.weight" not in w  # tied head
        hd = self.head_dim
        # inv_freq[i] = base^(-2i/hd), i in [0, hd/2)
        self.inv_freq = self.rope_base ** (-(np.arange(0, hd, 2, dtype=np.float64)) / hd)
        # optional activation-quantization emulation (tolerance study only)
        self.act_quant = False

    # --- pieces -------------------------------------------------------------

    def rmsnorm(self, x, weight):
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.eps) * weight

    def matmul(self, x, name):
        """x: (n, in) -> (n, out) with W of shape (out, in): y = x @ W^T."""
        if self.act_quant:
            x = q8_emulate(x)
        return x @ self.w[name].T

    def rope(self, x, positions):
        """x: (n, heads, hd); rotates adjacent pairs (x[2i], x[2i+1])
        by angle pos * base^(-2i/hd) (GGUF/llama.cpp 'normal' rope layout)."""
        ang = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        x0 = x[..., 0::2]
        x1 = x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def new_cache(self):
        return {"k": [None] * self.n_layer, "v": [None] * self.n_layer, "len": 0}

    # --- forward ------------------------------------------------------------

    def forward(self, ids, cache):
        """Feed `ids` after the cache's contents; returns logits (len(ids), vocab)."""
        ids = list(ids)
        n = len(ids)
        start = cache["len"]
        pos = np.arange(start, start + n)
        H, KV, hd = self.n_head, self.n_kv, self.head_dim
        group = H // KV
        scale = 1.0 / math.sqrt(hd)
        x = self.tok_embd[ids].copy()  # (n, d)
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rmsnorm(x, self.w[p + "attn_norm.weight"])
            q = self.matmul(h, p + "attn_q.weight").reshape(n, H, hd)
            k = self.matmul(h, p + "attn_k.weight").reshape(n, KV, hd)
            v = self.matmul(h, p + "attn_v.weight").reshape(n, KV, hd)
            q = self.rope(q, pos)
            k = self.rope(k, pos)
            if cache["k"][l] is None:
                K, V = k, v
            else:
                K = np.concatenate([cache["k"][l], k], axis=0)
                V = np.concatenate([cache["v"][l], v], axis=0)
            cache["k"][l], cache["v"][l] = K, V
            T = K.shape[0]
            # causal mask: query at absolute pos start+i sees keys 0..start+i
            mask = np.arange(T)[None, :] > pos[:, None]  # (n, T)
            attn = np.empty((n, H, hd), dtype=self.dtype)
            for hh in range(H):
                kv = hh // group
                s = (q[:, hh, :] @ K[:, kv, :].T) * scale  # (n, T)
                s = np.where(mask, -np.inf, s)
                s = s - s.max(axis=-1, keepdims=True)
                e = np.exp(s)
                pr = e / e.sum(axis=-1, keepdims=True)
                attn[:, hh, :] = pr @ V[:, kv, :]
            x = x + self.matmul(attn.reshape(n, H * hd), p + "attn_output.weight")
            h = self.rmsnorm(x, self.w[p + "ffn_norm.weight"])
            g = self.matmul(h, p + "ffn_gate.weight")
            u = self.matmul(h, p + "ffn_up.weight")
            a = g / (1.0 + np.exp(-g)) * u  # silu(gate) * up
            x = x + self.matmul(a, p + "ffn_down.weight")
        cache["len"] = start + n
        h = self.rmsnorm(x, self.w["output_norm.weight"])
        return self.matmul(h, "token_embd.weight")

    def logits(self, ids):
        return self.forward(ids, self.new_cache())

    def greedy(self, ids, n_new, keep_logprobs=False):
        """Greedy continuation (EOS is not a stop: always n_new tokens).
        Returns (tokens, gaps, logprobs) with gaps[i] = top1 - top2 logit at
        step i; logprobs[i] the step's log-softmax (only if keep_logprobs)."""
        cache = self.new_cache()
        lg = self.forward(ids, cache)[-1]
        toks, gaps, lps = [], [], []
        for i in range(n_new):
            order = np.argsort(-lg, kind="stable")
            t = int(order[0])
            toks.append(t)
            gaps.append(float(lg[order[0]] - lg[order[1]]))
            if keep_logprobs:
                lps.append(log_softmax(lg))
            if i + 1 < n_new:
                lg = self.forward([t], cache)[-1]
        return toks, gaps, lps

    def detok(self, ids):
        """Byte-level BPE detokenization (GPT-2 byte map); for human eyes only."""
        inv = _gpt2_byte_decoder()
        out = bytearray()
        for i in ids:
            s = self.tokens[i]
            if all(c in inv for c in s):
                out += bytes(inv[c] for c in s)
            else:
                out += s.encode()
        return out.decode("utf-8", errors="replace")


def q8_emulate(x):
    """Rough emulation of llama.cpp's Q8 activation quantization (blocks of 32,
    fp16 scale = amax/127, round-to-nearest). Tolerance study only."""
    shp = x.shape
    b = x.reshape(-1, 32)
    d = (np.abs(b).max(axis=1, keepdims=True) / 127.0).astype(np.float16).astype(np.float64)
    dd = np.where(d == 0, 1.0, d)
    q = np.clip(np.round(b / dd), -127, 127)
    return (q * d).reshape(shp).astype(x.dtype)


_BYTE_DEC = None


def _gpt2_byte_decoder():
    global _BYTE_DEC
    if _BYTE_DEC is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DEC = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DEC


# ----------------------------------------------------------------------------
# llama.cpp tokenizer
# ----------------------------------------------------------------------------

def llama_tokenize_cmd(bin_dir, model, path):
    return [os.path.join(bin_dir, "llama-tokenize"), "-m", model, "-f", path,
            "--ids", "--no-bos", "--no-escape", "--log-disable"]


def llama_tokenize(bin_dir, model, text):
    """Exact ids of `text` per llama.cpp: special tokens parsed, no BOS,
    no escape processing, text passed byte-exact through a file."""
    if text == "":
        return []
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        res = subprocess.run(llama_tokenize_cmd(bin_dir, model, path),
                             capture_output=True, check=True)
    finally:
        os.unlink(path)
    out = res.stdout.decode("utf-8", errors="replace").strip().splitlines()
    line = [s for s in out if s.startswith("[")][-1]
    return [int(v) for v in re.findall(r"-?\d+", line)]


def render_chat(template, user_text, bos, eos):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": user_text}],
        add_generation_prompt=True, bos_token=bos, eos_token=eos)


# ----------------------------------------------------------------------------
# fixture inputs
# ----------------------------------------------------------------------------

TOKENIZER_CASES = [
    ("ascii_prose", "The quick brown fox jumps over the lazy dog."),
    ("prose_punct", "Hello, world! How are you today? Fine; thanks: (really) [yes] {ok}."),
    ("digits_short", "12345"),
    ("pi", "3.14159"),
    ("date", "2026-12-02"),
    ("long_number", "The total was 1234567890123 dollars and 0.000042 cents, i.e. $1,234,567.89."),
    ("french", "Ça va très bien, merci ! L'été dernier, nous sommes allés à Besançon."),
    ("german", "Grüße aus München: Straße, Mädchen, Öl und Übermaß."),
    ("vietnamese", "Tiếng Việt có nhiều dấu: người, được, những, Hà Nội."),
    ("chinese", "我爱北京天安门，今天天气很好。"),
    ("japanese", "東京は日本の首都です。ひらがなとカタカナ、漢字。"),
    ("korean", "안녕하세요, 만나서 반갑습니다."),
    ("emoji_simple", "I love pizza 🍕 and cats 🐱!"),
    ("emoji_zwj", "Family: 👨‍👩‍👧‍👦, coder: 👩‍💻, rainbow flag: 🏳️‍🌈"),
    ("emoji_flags_skin", "Flags 🇫🇷🇯🇵🇺🇸 and waves 👋🏻👋🏽👋🏿"),
    ("python_code", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    ("rust_code", "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
                  "    println!(\"{:?}\", v);\n}\n"),
    ("backslashes", "path C:\\new\\table and printf(\"a\\tb\\n\");"),
    ("space_runs", "a  b   c    d         e"),
    ("tabs", "col1\tcol2\t\tcol3\n\tindented"),
    ("newlines", "line one\n\nline three\n\n\n\nline seven"),
    ("crlf", "first line\r\nsecond line\r\n\r\nfourth\r"),
    ("leading_trailing_spaces", "   leading and trailing   "),
    ("only_spaces", "     "),
    ("only_newline", "\n"),
    ("contractions", "I don't know, but I'll try. You're right, it's John's and we've seen they'd go."),
    ("special_inline", "<|im_start|>user\nhi<|im_end|>"),
    ("special_midtext", "before<|endoftext|>after <|im_end|> end"),
    ("mixed_case_caps", "HTTPServer and XMLHttpRequest parse JSON; UPPER lower MiXeD."),
    ("empty", ""),
]

GOLDEN_PROMPTS = [
    ("raw_english", False,
     "Once upon a time, in a small village at the edge of a great forest, there lived an "
     "old clockmaker who"),
    ("chat_capital", True, "What is the capital of France? Answer in one sentence."),
    ("code_python", False,
     "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n"
     "        return False\n    for i in range(2,"),
    ("multilingual", False,
     "English: Good morning, my friend.\nFrançais: Bonjour, mon ami.\nDeutsch: Guten Morgen, "
     "mein Freund.\n日本語:"),
]

GREEDY_PROMPTS = [
    ("raw_france", False, "The capital of France is"),
    ("raw_story", False, "Once upon a time, there was a little robot named"),
    ("raw_list", False, "Here are three tips for staying healthy:\n1."),
    ("raw_code", False, "def add(a, b):\n    return"),
    ("raw_science", False, "Water boils at a temperature of"),
    ("chat_math", True, "What is 2+2?"),
    ("chat_hello", True, "Hello! Who are you?"),
    ("chat_color", True, "What color is the sky on a clear day?"),
    ("chat_poem", True, "Write a short poem about the sea."),
    ("chat_python", True, "How do I reverse a list in Python?"),
    ("chat_planet", True, "What is the largest planet in our solar system?"),
]


# ----------------------------------------------------------------------------
# llama.cpp comparison (optional): llama-server, token ids in and out
# ----------------------------------------------------------------------------

class LlamaServer:
    """A llama-server on localhost; /completion with token-id prompts.
    Its logprobs come from softmax of llama.cpp's raw logits (n_probs with
    post_sampling_probs=false), so logprob(top1) - logprob(top2) is its logit gap."""

    def __init__(self, bin_dir, model, port=18089):
        self.cmd = [os.path.join(bin_dir, "llama-server"), "-m", model, "--port", str(port),
                    "-c", "2048", "-np", "1", "-t", str(os.cpu_count() or 2), "--no-warmup"]
        self.base = f"http://127.0.0.1:{port}"

    def __enter__(self):
        import urllib.request
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except Exception:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not come up")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def complete(self, ids, n_predict, n_probs=0, cache_prompt=False):
        import urllib.request
        body = {"prompt": list(ids), "n_predict": n_predict, "temperature": 0.0,
                "top_k": 1, "samplers": ["top_k"], "ignore_eos": False,
                "cache_prompt": cache_prompt, "return_tokens": True,
                "n_probs": n_probs, "post_sampling_probs": False}
        req = urllib.request.Request(self.base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())


def top_logprobs(resp, step=0):
    """[(id, logprob), ...] of llama.cpp's distribution at generated step `step`."""
    cp = resp["completion_probabilities"][step]
    return [(int(t["id"]), float(t["logprob"])) for t in cp["top_logprobs"]]


def log_softmax(x):
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def compare_llama_cpp(srv, m, greedy, gold, ref_logits):
    """Adds llama.cpp fields to the greedy / golden entries in place and prints a summary."""
    worst_lp = 0.0
    # golden: llama.cpp's top-5 logprobs at each golden position
    for e in gold:
        lc = []
        for k, p in enumerate(e["positions"]):
            tl = top_logprobs(srv.complete(e["ids"][:p + 1], 1, n_probs=5))
            lc.append([[i, lp] for i, lp in tl])
            ref_lp = log_softmax(ref_logits[e["name"]][k])
            d = max(abs(lp - ref_lp[i]) for i, lp in tl)
            worst_lp = max(worst_lp, d)
            print(f"llama.cpp golden {e['name']}@{p}: top1 {tl[0][0]} vs ref "
                  f"{e['top5'][k][0][0]}, max |dlogprob| over its top5 {d:.3f}", file=sys.stderr)
        e["llama_cpp_top5_logprobs"] = lc
    # greedy: free-running (stops at EOS) + teacher-forced along the reference path
    for e in greedy:
        r = srv.complete(e["prompt_ids"], N_GREEDY)
        lt = [int(t) for t in r.get("tokens") or []]
        e["llama_cpp_tokens"] = lt
        e["llama_cpp_text"] = r.get("content")
        div = next((i for i, (a, b) in enumerate(zip(lt, e["tokens"])) if a != b), None)
        if div is None and len(lt) < N_GREEDY and e["first_eos"] is not None \
                and len(lt) < e["first_eos"]:
            div = len(lt)  # llama.cpp stopped early without an EOS on the reference path
        e["llama_cpp_first_divergence"] = div
        tf_arg, tf_gap, flips = [], [], []
        ctx = list(e["prompt_ids"])
        for i in range(N_GREEDY):
            tl = top_logprobs(srv.complete(ctx, 1, n_probs=2, cache_prompt=True))
            tf_arg.append(tl[0][0])
            tf_gap.append(tl[0][1] - tl[1][1])
            ref_lp = e["_ref_logprobs"][i]
            worst_lp = max(worst_lp, max(abs(lp - ref_lp[t]) for t, lp in tl))
            if tl[0][0] != e["tokens"][i]:
                flips.append([i, round(e["gaps"][i], 4), round(tf_gap[-1], 4)])
            ctx.append(e["tokens"][i])
        e["llama_cpp_tf_argmax"] = tf_arg
        e["llama_cpp_tf_gaps"] = tf_gap
        e["llama_cpp_tf_disagreements"] = flips
        msg = "identical" if div is None else \
            f"diverges at step {div} (reference gap {e['gaps'][div]:.3f})"
        print(f"llama.cpp greedy {e['name']}: {msg}; teacher-forced disagreements "
              f"[step, ref gap, llama gap] {flips}  {r.get('content')!r}", file=sys.stderr)
    print(f"llama.cpp: max |logprob(llama) - logprob(ref)| over compared tokens "
          f"{worst_lp:.3f}", file=sys.stderr)


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-bin",
                    default=os.path.expanduser("~/.cache/flotilla-peers/llama.cpp/build/bin"))
    ap.add_argument("--reuse-ids", action="store_true",
                    help="take token ids from the existing fixtures in --out (no llama.cpp)")
    ap.add_argument("--llama-cpp-compare", action="store_true",
                    help="also record llama.cpp's greedy tokens / logprobs (via llama-server)")
    ap.add_argument("--tolerance-study", action="store_true",
                    help="print how far f32 compute / Q8-activation emulation move the logits")
    args = ap.parse_args()

    t0 = time.time()
    out = args.out
    os.makedirs(os.path.join(out, "golden"), exist_ok=True)
    m = Model(args.model)
    print(f"loaded + dequantized in {time.time() - t0:.1f}s", file=sys.stderr)

    old_tok = old_gold = old_greedy = None
    if args.reuse_ids:
        with open(os.path.join(out, "tokenizer_cases.json")) as f:
            old_tok = {c["text"]: c["ids"] for c in json.load(f)}
        with open(os.path.join(out, "golden_logits.json")) as f:
            old_gold = {e["name"]: e for e in json.load(f)}
        with open(os.path.join(out, "greedy.json")) as f:
            old_greedy = {e["name"]: e for e in json.load(f)}

    def tok(text):
        if old_tok is not None:
            return old_tok[text]
        return llama_tokenize(args.llama_bin, args.model, text)

    bos, eos = m.tokens[m.bos_id], m.tokens[m.eos_id]

    def prompt_ids(name, chat, text, old):
        rendered = render_chat(m.chat_template, text, bos, eos) if chat else text
        if old is not None:
            ids = old[name]["prompt_ids" if "prompt_ids" in old[name] else "ids"]
        else:
            ids = llama_tokenize(args.llama_bin, args.model, rendered)
        return rendered, ids

    # 1. tokenizer cases
    cases = [{"name": n, "text": t, "ids": tok(t)} for n, t in TOKENIZER_CASES]
    print(f"tokenizer cases: {len(cases)}", file=sys.stderr)

    # 2. golden logits
    gold, ref_logits = [], {}
    for name, chat, text in GOLDEN_PROMPTS:
        rendered, ids = prompt_ids(name, chat, text, old_gold)
        assert 10 <= len(ids) <= 60, (name, len(ids))
        positions = [len(ids) // 2, len(ids) - 1]
        t1 = time.time()
        rows = m.logits(ids)[positions]
        ref_logits[name] = rows
        fname = f"golden/{name}.f32"
        rows.astype("<f4").tofile(os.path.join(out, fname))
        top5 = []
        for r in rows:
            o = np.argsort(-r, kind="stable")[:5]
            top5.append([[int(i), float(r[i])] for i in o])
        e = {"name": name, "chat": chat, "text": text}
        if chat:
            e["rendered"] = rendered
        e.update({"ids": ids, "positions": positions, "file": fname, "top5": top5,
                  "logsumexp": [float(r.max() + np.log(np.exp(r - r.max()).sum()))
                                for r in rows]})
        gold.append(e)
        print(f"golden {name}: {len(ids)} tokens, {time.time() - t1:.1f}s, "
              f"next={m.detok([top5[-1][0][0]])!r}", file=sys.stderr)

    # 3. greedy
    greedy = []
    for name, chat, text in GREEDY_PROMPTS:
        rendered, ids = prompt_ids(name, chat, text, old_greedy)
        t1 = time.time()
        toks, gaps, lps = m.greedy(ids, N_GREEDY, keep_logprobs=args.llama_cpp_compare)
        e = {"name": name, "chat": chat, "text": text}
        if chat:
            e["rendered"] = rendered
        e.update({"prompt_ids": ids, "tokens": toks, "gaps": gaps,
                  "first_eos": toks.index(m.eos_id) if m.eos_id in toks else None,
                  "reference_text": m.detok(toks), "_ref_logprobs": lps})
        greedy.append(e)
        print(f"greedy {name}: {time.time() - t1:.1f}s  {m.detok(toks)!r}  "
              f"min gap {min(gaps):.3f}", file=sys.stderr)
    print(f"reference done in {time.time() - t0:.1f}s", file=sys.stderr)

    if args.llama_cpp_compare:
        with LlamaServer(args.llama_bin, args.model) as srv:
            compare_llama_cpp(srv, m, greedy, gold, ref_logits)
    elif old_greedy is not None or old_gold is not None:
        # keep earlier llama.cpp results when they were made for the same ids
        for lst, old, key in ((greedy, old_greedy, "prompt_ids"), (gold, old_gold, "ids")):
            for e in lst:
                o = (old or {}).get(e["name"], {})
                if o.get(key) == e[key]:
                    for k, v in o.items():
                        if k.startswith("llama_cpp"):
                            e[k] = v
    for e in greedy:
        del e["_ref_logprobs"]

    def dump(obj, fname):
        with open(os.path.join(out, fname), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
            f.write("\n")

    dump(cases, "tokenizer_cases.json")
    dump(gold, "golden_logits.json")
    dump(greedy, "greedy.json")

    if args.tolerance_study:
        tolerance_study(args.model, gold)

    print(f"total {time.time() - t0:.1f}s", file=sys.stderr)


def tolerance_study(model_path, gold):
    """How far realistic engine arithmetic moves the logits away from f64."""
    ref = Model(model_path)
    variants = [("f32 compute", Model(model_path, dtype=np.float32), False),
                ("f64 + Q8 activation emulation", ref, True)]
    for label, mm, aq in variants:
        worst = worst_top = 0.0
        flips = []
        for e in gold:
            ref.act_quant = False
            a = ref.logits(e["ids"])[e["positions"]]
            mm.act_quant = aq
            b = mm.logits(e["ids"])[e["positions"]].astype(np.float64)
            mm.act_quant = False
            worst = max(worst, float(np.abs(a - b).max()))
            for k in range(len(a)):
                top = np.argsort(-a[k])[:5]
                worst_top = max(worst_top, float(np.abs(a[k][top] - b[k][top]).max()))
                if a[k].argmax() != b[k].argmax():
                    s = np.sort(a[k])
                    flips.append((e["name"], e["positions"][k], round(float(s[-1] - s[-2]), 4)))
        print(f"tolerance: {label}: max |dlogit| all vocab {worst:.3e}, over ref top5 "
              f"{worst_top:.3e}, argmax flips (name, pos, ref gap) {flips}", file=sys.stderr)


if __name__ == "__main__":
    main()
