#!/usr/bin/env python3
"""Independent float64 numpy reference for Gemma 3 270M (GGUF arch `gemma3`).

Writes the golden fixtures under tests/fixtures/gemma3/ that Flotilla's tests
compare against:

  tokenizer_cases.json            text -> ids (llama.cpp's `llama-tokenize`)
  golden_logits.json              prompts, positions, logsumexp, top-64 per row
  golden/<name>.f32               little-endian f32, len(positions) x 4096:
                                  logits at the strided ids 0, 64, 128, ...
  greedy.json                     24-step greedy continuations + top1-top2 gaps
  llama_cpp_teacher_forced.json   llama.cpp's top-20 logprobs at every position
                                  of a ~512-token text, plus the reference's
                                  top-1 and gap there

The forward pass is written from the model definition (checked against
llama.cpp's src/models/gemma3.cpp), not from Flotilla's code: weights are
dequantized with `gguf.quants.dequantize` (exact) and everything after that
is float64. Token ids always come from llama.cpp, never from a Python
tokenizer. `--reuse-ids` takes ids (and llama.cpp results) from the fixtures
already in --out and needs no llama.cpp.

usage:
  python3 tests/reference/gemma3.py --model gemma-3-270m-q4_k_m.gguf \
      --out tests/fixtures/gemma3 [--llama-bin DIR] [--reuse-ids] \
      [--llama-cpp-compare] [--skip-teacher-forced] [--tolerance-study]
"""

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import TOKENIZER_CASES as SMOL_TOKENIZER_CASES  # noqa: E402  same texts

N_GREEDY = 24
TOPK_GOLDEN = 64
STRIDE = 64          # strided logits: ids 0, 64, 128, ..., vocab-64
TOPK_LLAMA = 20
EOG_IDS = (1, 106, 212)  # <eos>, <end_of_turn>, </s>: llama.cpp's EOG set for this GGUF

CHAT_TURN = "<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------

def load_weights(path):
    """Dequantized f32 weights (exact), GGUF metadata, per-tensor quant type."""
    import gguf

    r = gguf.GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            meta[k] = f.contents()
        elif k.startswith("tokenizer.ggml.scores") or k.startswith("GGUF."):
            continue
        else:
            meta[k] = f.contents()
    w, qtype = {}, {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists shapes innermost-first: [cols, rows] -> numpy (rows, cols)
        shape = [int(s) for s in t.shape][::-1]
        w[t.name] = np.asarray(a, dtype=np.float32).reshape(shape)
        qtype[t.name] = t.tensor_type.name
    return meta, w, qtype


class Gemma3:
    """Gemma 3 forward pass. `dtype` is the compute dtype (f64 reference, f32 for
    the tolerance study). `emulate` (tolerance study only):
      None     plain arithmetic
      "q8_32"  activations quantized Q8_0-style per 32-block before every weight matmul
      "llama"  rough llama.cpp CPU emulation: Q8_0 activations for Q5_0/Q8_0 weights,
               Q8_K (256-blocks) for Q4_K/Q6_K weights, f16 K/V cache, f16 Q and
               attention probabilities, GELU through an f16 table."""

    def __init__(self, meta, w32, qtype, dtype=np.float64):
        self.dtype = dtype
        self.emulate = None
        self.swa_enabled = True
        a = meta["general.architecture"]
        assert a == "gemma3", a
        g = lambda k: meta["gemma3." + k]  # noqa: E731
        self.n_layer = int(g("block_count"))
        self.d_model = int(g("embedding_length"))
        self.n_head = int(g("attention.head_count"))
        self.n_kv = int(g("attention.head_count_kv"))
        self.head_dim = int(g("attention.key_length"))
        assert int(g("attention.value_length")) == self.head_dim
        self.d_ff = int(g("feed_forward_length"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))  # f32 1e-6
        self.rope_base_global = float(g("rope.freq_base"))      # 1e6
        self.rope_base_local = 10000.0      # llama.cpp: rope_freq_base_train_swa default
        self.window = int(g("attention.sliding_window"))         # 512
        assert "gemma3.rope.dimension_count" not in meta  # n_rot = head_dim
        assert "gemma3.attention.sliding_window_pattern" not in meta  # default period 6
        assert "gemma3.final_logit_softcapping" not in meta          # no soft-capping
        assert "gemma3.rope.scaling.type" not in meta                # no rope scaling
        # f_attention_scale: 1/sqrt(n_embd_head_k) for every size but 27B
        self.attn_scale = 1.0 / math.sqrt(self.head_dim)
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.token_type = meta["tokenizer.ggml.token_type"]
        self.bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        self.eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        self.vocab = len(self.tokens)
        self.qtype = qtype
        self.w = {k: v.astype(dtype) for k, v in w32.items()}
        self.tok_embd = self.w["token_embd.weight"]  # (vocab, d); also the output head
        assert self.tok_embd.shape == (self.vocab, self.d_model)
        assert "output.weight" not in self.w          # tied head
        hd = self.head_dim
        i = np.arange(0, hd, 2, dtype=np.float64)
        self.inv_freq = {False: self.rope_base_global ** (-i / hd),
                         True: self.rope_base_local ** (-i / hd)}

    def is_swa(self, il):
        # llama_hparams::set_swa_pattern(6): is_swa = il % 6 < 5
        return il % 6 < 5

    # --- pieces -------------------------------------------------------------

    def rmsnorm(self, x, weight):
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.eps) * weight

    def matmul(self, x, name):
        """x: (n, in) -> (n, out) with W (out, in): y = x @ W^T."""
        if self.emulate == "q8_32":
            x = q8_0_emulate(x)
        elif self.emulate == "llama":
            x = q8_K_emulate(x) if self.qtype[name] in ("Q4_K", "Q6_K") else q8_0_emulate(x)
        return x @ self.w[name].T

    def gelu(self, x):
        if self.emulate == "llama":
            # ggml CPU: y = table_f16[f16(x)] for -10 < x < 10, 0 below, x above
            xh = x.astype(np.float16).astype(np.float64)
            y = gelu_tanh(xh).astype(np.float16).astype(self.dtype)
            return np.where(x <= -10, 0, np.where(x >= 10, x, y)).astype(self.dtype)
        return gelu_tanh(x)

    def rope(self, x, positions, local):
        """NEOX layout: rotates (x[i], x[i + hd/2]) by pos * base^(-2i/hd)."""
        ang = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[local][None, :]
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        h = x.shape[-1] // 2
        x0, x1 = x[..., :h], x[..., h:]
        return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)

    def new_cache(self):
        return {"k": [None] * self.n_layer, "v": [None] * self.n_layer, "len": 0}

    # --- forward ------------------------------------------------------------

    def forward(self, ids, cache):
        """Feed `ids` after the cache's contents; returns the final-normed hidden
        states (len(ids), d_model). Use head() for logits."""
        ids = list(ids)
        n = len(ids)
        start = cache["len"]
        pos = np.arange(start, start + n)
        H, KV, hd = self.n_head, self.n_kv, self.head_dim
        group = H // KV
        f16 = self.emulate == "llama"
        x = self.tok_embd[ids] * self.dtype(math.sqrt(self.d_model))  # (n, d)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            local = self.is_swa(il)
            h = self.rmsnorm(x, self.w[p + "attn_norm.weight"])
            q = self.matmul(h, p + "attn_q.weight").reshape(n, H, hd)
            k = self.matmul(h, p + "attn_k.weight").reshape(n, KV, hd)
            v = self.matmul(h, p + "attn_v.weight").reshape(n, KV, hd)
            q = self.rmsnorm(q, self.w[p + "attn_q_norm.weight"])  # per head over hd
            k = self.rmsnorm(k, self.w[p + "attn_k_norm.weight"])
            q = self.rope(q, pos, local) * self.dtype(self.attn_scale)
            k = self.rope(k, pos, local)
            if f16:
                q = q.astype(np.float16).astype(self.dtype)
                k = k.astype(np.float16).astype(self.dtype)
                v = v.astype(np.float16).astype(self.dtype)
            if cache["k"][il] is None:
                K, V = k, v
            else:
                K = np.concatenate([cache["k"][il], k], axis=0)
                V = np.concatenate([cache["v"][il], v], axis=0)
            cache["k"][il], cache["v"][il] = K, V
            T = K.shape[0]
            kpos = np.arange(T)
            # causal: key pos p0 visible to query pos p1 iff p0 <= p1;
            # sliding layers also need p1 - p0 < window (llama.cpp is_masked_swa)
            mask = kpos[None, :] > pos[:, None]
            if local and self.swa_enabled:
                mask |= (pos[:, None] - kpos[None, :]) >= self.window
            attn = np.empty((n, H, hd), dtype=self.dtype)
            for hh in range(H):
                kv = hh // group
                s = q[:, hh, :] @ K[:, kv, :].T  # (n, T); scale already in q
                s = np.where(mask, -np.inf, s)
                s = s - s.max(axis=-1, keepdims=True)
                e = np.exp(s)
                pr = e / e.sum(axis=-1, keepdims=True)
                if f16:
                    pr = pr.astype(np.float16).astype(self.dtype)
                attn[:, hh, :] = pr @ V[:, kv, :]
            o = self.matmul(attn.reshape(n, H * hd), p + "attn_output.weight")
            x = x + self.rmsnorm(o, self.w[p + "post_attention_norm.weight"])
            h = self.rmsnorm(x, self.w[p + "ffn_norm.weight"])
            gt = self.matmul(h, p + "ffn_gate.weight")
            up = self.matmul(h, p + "ffn_up.weight")
            f = self.matmul(self.gelu(gt) * up, p + "ffn_down.weight")
            x = x + self.rmsnorm(f, self.w[p + "post_ffw_norm.weight"])
        cache["len"] = start + n
        return self.rmsnorm(x, self.w["output_norm.weight"])

    def head(self, h):
        """Tied output head: logits = h @ token_embd^T (no soft-capping)."""
        return self.matmul(np.atleast_2d(h), "token_embd.weight")

    def logits_at(self, ids, positions):
        h = self.forward(ids, self.new_cache())
        return self.head(h[positions])

    def greedy(self, ids, n_new):
        """Greedy continuation (EOS is not a stop: always n_new tokens): prefill,
        then one token at a time through the KV cache. Returns (tokens, gaps)."""
        cache = self.new_cache()
        lg = self.head(self.forward(ids, cache)[-1])[0]
        toks, gaps = [], []
        for i in range(n_new):
            t, gap = top1_gap(lg)
            toks.append(t)
            gaps.append(gap)
            if i + 1 < n_new:
                lg = self.head(self.forward([t], cache)[-1])[0]
        return toks, gaps

    def detok(self, ids):
        """SentencePiece detokenization (for human eyes only): '▁' -> ' ',
        <0xXX> byte tokens -> bytes, control tokens verbatim."""
        out = bytearray()
        for i in ids:
            s = self.tokens[i]
            if self.token_type[i] == 6 and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", s):
                out.append(int(s[3:5], 16))
            else:
                out += s.replace("\u2581", " ").encode()
        return out.decode("utf-8", errors="replace")


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def q8_0_emulate(x):
    """llama.cpp Q8_0 activation quantization: blocks of 32, d = amax/127
    (stored as fp16), q = round(x/d). Tolerance study only."""
    shp = x.shape
    b = x.reshape(-1, 32).astype(np.float64)
    d = np.abs(b).max(axis=1, keepdims=True) / 127.0
    q = np.round(b / np.where(d == 0, 1.0, d))
    dh = d.astype(np.float16).astype(np.float64)
    return (q * dh).reshape(shp).astype(x.dtype)


def q8_K_emulate(x):
    """llama.cpp Q8_K (activations for K-quant weights): blocks of 256,
    iscale = -127/max (max = the signed value of largest magnitude),
    q = min(127, round(iscale*x)), d = 1/iscale in f32."""
    shp = x.shape
    b = x.reshape(-1, 256).astype(np.float64)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), idx][:, None]
    iscale = np.where(mx == 0, 0.0, -127.0 / np.where(mx == 0, 1.0, mx))
    q = np.minimum(127, np.round(iscale * b))
    d = np.where(iscale == 0, 0.0, 1.0 / np.where(iscale == 0, 1.0, iscale))
    d = d.astype(np.float32).astype(np.float64)
    return (q * d).reshape(shp).astype(x.dtype)


def top1_gap(lg):
    o = np.argpartition(-lg, 2)[:2]
    o = o[np.argsort(-lg[o], kind="stable")]
    # ties: lowest id first
    t = int(np.flatnonzero(lg == lg[o[0]])[0])
    return t, float(lg[o[0]] - lg[o[1]])


def logsumexp(r):
    m = r.max()
    return float(m + np.log(np.exp(r - m).sum()))


def topk(r, k):
    o = np.argpartition(-r, k)[:k]
    o = o[np.lexsort((o, -r[o]))]  # by logit desc, then id asc
    return o


# ----------------------------------------------------------------------------
# llama.cpp: tokenizer and server
# ----------------------------------------------------------------------------

def llama_tokenize(bin_dir, model, text, bos=False, parse_special=True):
    """Exact ids of `text` per llama.cpp: no escape processing, text passed
    byte-exact through a file. bos=True lets llama-tokenize add BOS
    (tokenizer.ggml.add_bos_token is true for Gemma)."""
    if text == "" and not bos:
        return []
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    cmd = [os.path.join(bin_dir, "llama-tokenize"), "-m", model, "-f", path,
           "--ids", "--no-escape", "--log-disable"]
    if not bos:
        cmd.append("--no-bos")
    if not parse_special:
        cmd.append("--no-parse-special")
    try:
        res = subprocess.run(cmd, capture_output=True, check=True)
    finally:
        os.unlink(path)
    out = res.stdout.decode("utf-8", errors="replace").strip().splitlines()
    line = [s for s in out if s.startswith("[")][-1]
    return [int(v) for v in re.findall(r"-?\d+", line)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on 127.0.0.1; /completion with token-id prompts. With
    n_probs and post_sampling_probs=false, `top_logprobs` are log-softmax values
    of llama.cpp's raw logits over the whole vocabulary."""

    def __init__(self, bin_dir, model, threads=2):
        self.port = free_port()
        self.cmd = [os.path.join(bin_dir, "llama-server"), "-m", model, "--host", "127.0.0.1",
                    "--port", str(self.port), "-c", "2048", "-np", "1", "-t", str(threads),
                    "--temp", "0", "--no-warmup", "--swa-full"]
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import urllib.request
        self.log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError("llama-server exited; log in " + self.log.name)
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
        self.log.close()
        if exc[0] is None:
            os.unlink(self.log.name)

    def request_body(self, ids, n_probs):
        return {"prompt": list(ids), "n_predict": 1, "n_probs": n_probs,
                "temperature": 0.0, "samplers": ["top_k"], "top_k": 1,
                "cache_prompt": True, "post_sampling_probs": False,
                "return_tokens": True}

    def complete(self, ids, n_probs):
        import urllib.request
        req = urllib.request.Request(self.base + "/completion",
                                     data=json.dumps(self.request_body(ids, n_probs)).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def props(self):
        import urllib.request
        try:
            with urllib.request.urlopen(self.base + "/props", timeout=10) as r:
                return json.loads(r.read())
        except Exception:
            return {}


def llama_top_logprobs(resp):
    cp = resp["completion_probabilities"][0]
    return [[int(t["id"]), float(t["logprob"])] for t in cp["top_logprobs"]]


# ----------------------------------------------------------------------------
# fixture inputs
# ----------------------------------------------------------------------------

# (name, text, parse_special)
GEMMA_TOKENIZER_CASES = [
    ("gemma_turn_inline", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", True),
    ("gemma_turn_no_parse_special",
     "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", False),
    ("gemma_bos_eos_midtext", "hello <bos> world<eos>again <bos><eos>", True),
    ("gemma_bos_eos_no_parse_special", "hello <bos> world<eos>again", False),
    ("gemma_chat_rendered",
     CHAT_TURN.format(text="What is the capital of France? Answer in one sentence."), True),
    ("gemma_chat_multiturn",
     "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello! How can I help?"
     "<end_of_turn>\n<start_of_turn>user\nTell me a joke.<end_of_turn>\n"
     "<start_of_turn>model\n", True),
    ("gemma_html_user_defined", "<table><tr><td>1</td></tr></table> <b>bold</b> <s>x</s>", True),
    ("gemma_html_no_parse_special", "<table><tr><td>1</td></tr></table> <b>bold</b> <s>x</s>",
     False),
    ("gemma_image_markers", "see <start_of_image> and <end_of_image> [multimodal] <mask>", True),
    ("gemma_unused_tokens", "a<unused0>b<unused99>c", True),
    ("byte_fallback_cjk_ext", "古文字 𠀀𠀁𠀂 and 𪚥", True),
    ("byte_fallback_rare_scripts", "ꙮ 𓀀𓀁 𝕏𝔘 ᚠᛇᚻ", True),
    ("byte_fallback_emoji", "new emoji: 🦩🪿🫎 and 🫠", True),
    ("byte_fallback_controls", "ctrl\x01\x02\x03\x7f\x1b[0m bell\x07 nul-less", True),
    ("unicode_spaces", "nbsp\u00a0here, ideographic\u3000space, line\u2028sep, zwsp\u200bx", True),
    ("literal_sentencepiece_marker", "a\u2581b \u2581\u2581c", True),
    ("leading_space_1", " hello", True),
    ("leading_space_2", "  hello", True),
    ("leading_space_3_newline", "   \nhello", True),
    ("multiple_spaces", "a b  c   d    e     f      g       h", True),
    ("long_space_run", "x" + " " * 40 + "y", True),
    ("trailing_spaces", "end   ", True),
    ("newline_runs", "a\nb\n\nc\n\n\nd\n\n\n\n\n\ne", True),
    ("long_newline_run", "top" + "\n" * 40 + "bottom", True),
    ("tab_runs", "\tone\t\ttwo\t\t\tthree", True),
    ("space_newline_mix", "a \n b  \n\n  c \t d", True),
    ("markdown", "# Title\n\n* item **bold** and `code`\n\n| a | b |\n|---|---|\n", True),
    ("numbers_gemma", "3.14159 2026 1,000,000 0x1F 1e-6 -42", True),
]

GOLDEN_PROMPTS = [
    # (name, chat, text)
    ("raw_english", False,
     "Once upon a time, in a small village at the edge of a great forest, there lived an "
     "old clockmaker who"),
    ("code_python", False,
     "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n"
     "        return False\n    for i in range(2,"),
    ("multilingual", False,
     "English: Good morning, my friend.\nFrançais: Bonjour, mon ami.\nDeutsch: Guten Morgen, "
     "mein Freund.\nEspañol: Buenos días, mi amigo.\n日本語:"),
    ("chat_capital", True, "What is the capital of France? Answer in one sentence."),
    ("long_swa", False, None),  # LONG_TEXT; > 512 tokens so the sliding window masks
]

LONG_TEXT = """The Lighthouse Keeper's Logbook

Entry, March 3rd. The wind came round to the north-east before dawn and has not let up since. I climbed the one hundred and twelve steps at six o'clock to trim the wick, and found a gull sheltering on the gallery, too tired to be frightened of me. The barometer reads 29.1 inches and falling. Supply boat due Thursday; I doubt it will come.

Entry, March 4th. No boat. Spent the morning repairing the rain gauge, which had cracked in the frost. Inventory of stores, for the record:
- paraffin: 14 gallons
- flour: 2 sacks, one damp
- tea: enough for a month if I am careful, which I never am
- candles: 36
- tinned peaches: 9

Entry, March 6th. Calm at last. The sea lay flat as a slate and the fog sat on it like wool. I heard the foghorn from the point answering ours, two long and one short, every ninety seconds. My father kept this light for thirty-one years and claimed he could tell the state of the tide by the sound alone. I have been here eleven and still cannot.

A note on the mechanism, for whoever comes after me. The lens turns on a bath of mercury, which is why it moves so easily; a child could push it with one finger. The clockwork must be wound every four hours. If the weight reaches the bottom of the tower the lens stops, and a stopped light is worse than no light, because a captain will take it for a different station and steer by the wrong chart.

def wind_hours(start, end):
    # the clock needs winding every four hours
    hours = []
    t = start
    while t < end:
        hours.append(t % 24)
        t += 4
    return hours

Entry, March 9th. The boat came. Young Tomas brought the post, a crate of oranges, and news: the Board intends to automate the station within two years. An electric lamp, a battery house, a man to visit once a month. I asked him who would talk to the gulls. He laughed, but I was not joking.

Entry, March 12th. Clear night, no moon. Counted the ships passing the reef between midnight and four: seven, of which two were steamers, four were fishing boats running home, and one I could not identify, a tall three-master showing no lights at all. I signalled her with the lamp and got no answer. By four she had gone behind the headland.

Entry, March 15th. Wrote to my sister in Lisbon. Querida Ana, the winter has been long, but the light has not failed once. The oranges were sweet. I think often of the house on the hill and of our mother's garden, the lemon tree, the blue door. When they close the station, perhaps I will come south at last and learn to sleep through the night.

Entry, March 16th. Wind rising again from the west. Barometer 29.4 and steady. Wound the clock at"""

GREEDY_PROMPTS = [
    ("raw_france", False, "The capital of France is"),
    ("raw_story", False, "Once upon a time, there was a little robot named"),
    ("raw_list", False, "Here are three tips for staying healthy:\n1."),
    ("raw_code", False, "def add(a, b):\n    return"),
    ("raw_science", False, "Water boils at a temperature of"),
    ("raw_history", False, "The first person to walk on the Moon was"),
    ("raw_json", False, "{\"name\": \"Alice\", \"age\": 30, \"city\":"),
    ("raw_french", False, "Le chat est assis sur"),
    ("raw_count", False, "1, 2, 3, 4, 5,"),
    ("chat_france", True, "What is the capital of France?"),
    ("chat_hello", True, "Hello! Who are you?"),
    ("chat_poem", True, "Write a short poem about the sea."),
]

TEACHER_FORCED_TEXT = """The history of the bicycle is a story of many small improvements rather than a single invention. In 1817 a German civil servant named Karl Drais built a wooden machine with two wheels and no pedals. The rider sat on a saddle between the wheels and pushed along the ground with both feet, gliding for short distances on the downhill stretches. Drais hoped his "running machine" would replace the horse, which had become expensive after a series of failed harvests. It did not, but for a few years it was fashionable in the parks of Paris and London, where young men raced each other and occasionally collided with pedestrians.

Pedals arrived in the 1860s, attached directly to the front wheel. Because one turn of the pedals produced exactly one turn of the wheel, the only way to go faster was to make the wheel bigger. This logic led to the high-wheeler, sometimes called the penny-farthing, whose front wheel could be taller than a grown man. It was fast and elegant on a smooth road, and terrifying on a rough one. A stone or a rut could stop the wheel dead and throw the rider forward over the handlebars, an accident so common that it had its own name: a "header."

The solution was the chain. By connecting the pedals to the rear wheel through a chain and two sprockets of different sizes, engineers could gear the machine up without making any wheel enormous. The so-called safety bicycle of the 1880s had two wheels of equal size, a diamond-shaped frame, and a rider seated low enough to put a foot on the ground. When the Scottish veterinarian John Boyd Dunlop introduced the pneumatic tyre a few years later, the ride became smooth as well as safe, and sales exploded.

The consequences went far beyond transport. Bicycles gave ordinary workers a way to travel to jobs outside their own neighbourhoods, and they gave young women a degree of independence that alarmed many of their elders. Dress reformers argued for shorter skirts and divided garments suitable for cycling. Road surfaces improved because cyclists organised and campaigned for them, years before the motor car arrived to take the credit. Several of the first aeroplane builders, including the Wright brothers, began their careers repairing and selling bicycles, and they carried the habits of careful, lightweight construction into the air.

Today there are more than a billion bicycles in the world, roughly twice the number of cars. They remain one of the most efficient machines ever made: a person on a bicycle uses less energy per kilometre than a person walking, and far less than any motor vehicle. It is a remarkable record for a device whose basic shape has hardly changed in a hundred and thirty years."""


def golden_positions(name, n):
    if name == "raw_english":
        return [0, n // 2, n - 1]
    if name == "long_swa":
        assert n > 560, n
        return [100, 511, 512, 513, 540, 600, n - 1]
    return [n // 2, n - 1]


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
                    help="take token ids (and llama.cpp results) from the fixtures in --out")
    ap.add_argument("--llama-cpp-compare", action="store_true",
                    help="also record llama.cpp's greedy tokens (free-running and teacher-forced "
                         "along the reference path) and its top-5 logprobs at the golden rows")
    ap.add_argument("--skip-teacher-forced", action="store_true",
                    help="do not (re)write llama_cpp_teacher_forced.json")
    ap.add_argument("--tolerance-study", action="store_true",
                    help="print how far f32 / Q8-activation / llama.cpp-like arithmetic "
                         "move the golden logits")
    args = ap.parse_args()

    t0 = time.time()
    out = args.out
    os.makedirs(os.path.join(out, "golden"), exist_ok=True)
    meta, w32, qtype = load_weights(args.model)
    m = Gemma3(meta, w32, qtype)
    if not args.tolerance_study:
        del w32
        w32 = None
    print(f"loaded + dequantized in {time.time() - t0:.1f}s", file=sys.stderr)

    def load_old(fname, key="name"):
        with open(os.path.join(out, fname)) as f:
            obj = json.load(f)
        return {e[key]: e for e in obj} if isinstance(obj, list) else obj

    old_tok = old_gold = old_greedy = old_tf = None
    if args.reuse_ids:
        old_tok = load_old("tokenizer_cases.json")
        old_gold = load_old("golden_logits.json")
        old_greedy = load_old("greedy.json")
        if os.path.exists(os.path.join(out, "llama_cpp_teacher_forced.json")):
            old_tf = load_old("llama_cpp_teacher_forced.json")

    def tok(text, bos=False, parse_special=True):
        return llama_tokenize(args.llama_bin, args.model, text, bos=bos,
                              parse_special=parse_special)

    # 1. tokenizer cases (no BOS)
    cases = []
    all_cases = [(n, t, True) for n, t in SMOL_TOKENIZER_CASES] + GEMMA_TOKENIZER_CASES
    for name, text, ps in all_cases:
        ids = old_tok[name]["ids"] if old_tok is not None else tok(text, parse_special=ps)
        cases.append({"name": name, "text": text, "parse_special": ps, "ids": ids})
    print(f"tokenizer cases: {len(cases)}", file=sys.stderr)

    def prompt_ids(name, chat, text, old, key):
        rendered = CHAT_TURN.format(text=text) if chat else text
        if old is not None:
            ids = old[name][key]
        else:
            ids = tok(rendered, bos=True)
        assert ids[0] == m.bos_id, (name, ids[:3])
        return rendered, ids

    # 2. golden logits
    gold = []
    stride_ids = np.arange(0, m.vocab, STRIDE)
    gold_rows = {}
    for name, chat, text in GOLDEN_PROMPTS:
        if text is None:
            text = LONG_TEXT
        rendered, ids = prompt_ids(name, chat, text, old_gold, "ids")
        positions = golden_positions(name, len(ids))
        t1 = time.time()
        rows = m.logits_at(ids, positions)
        gold_rows[name] = rows
        fname = f"golden/{name}.f32"
        rows[:, stride_ids].astype("<f4").tofile(os.path.join(out, fname))
        e = {"name": name, "chat": chat, "text": text}
        if chat:
            e["rendered"] = rendered
        e.update({"ids": ids, "positions": positions, "file": fname,
                  "strided_ids": {"start": 0, "step": STRIDE, "count": len(stride_ids)},
                  "logsumexp": [logsumexp(r) for r in rows],
                  "top1_gap": [top1_gap(r)[1] for r in rows],
                  "top64": [[[int(i), float(r[i])] for i in topk(r, TOPK_GOLDEN)]
                            for r in rows]})
        gold.append(e)
        print(f"golden {name}: {len(ids)} tokens, {time.time() - t1:.1f}s, next="
              f"{[m.detok([t[0][0]]) for t in e['top64']]!r} gaps "
              f"{[round(g, 3) for g in e['top1_gap']]}", file=sys.stderr)

    # 2b. consistency checks on the long prompt: prefill-all vs incremental decode,
    # and that the sliding window matters there
    long_e = gold[-1]
    ids = long_e["ids"]
    t1 = time.time()
    cache = m.new_cache()
    hs = [m.forward(ids[:500], cache)]
    for i in range(500, 530):
        hs.append(m.forward([ids[i]], cache))
    hs.append(m.forward(ids[530:600], cache))
    hs.append(m.forward(ids[600:], cache))
    h_inc = np.concatenate(hs, axis=0)
    ps = long_e["positions"]
    inc = m.head(h_inc[ps])
    d_inc = float(np.abs(inc - gold_rows["long_swa"]).max())
    m.swa_enabled = False
    noswa = m.logits_at(ids, ps)
    m.swa_enabled = True
    d_noswa = [float(np.abs(noswa[k] - gold_rows["long_swa"][k]).max()) for k in range(len(ps))]
    print(f"check: incremental (500 + 30x1 + 70 + rest) vs prefill-all, long_swa rows: "
          f"max |dlogit| {d_inc:.2e} ({time.time() - t1:.1f}s)", file=sys.stderr)
    print(f"check: sliding window off vs on, long_swa rows {ps}: max |dlogit| "
          f"{[round(d, 4) for d in d_noswa]}", file=sys.stderr)
    assert d_inc < 1e-9, d_inc

    # 3. greedy
    greedy = []
    for name, chat, text in GREEDY_PROMPTS:
        rendered, ids = prompt_ids(name, chat, text, old_greedy, "prompt_ids")
        t1 = time.time()
        toks, gaps = m.greedy(ids, N_GREEDY)
        e = {"name": name, "chat": chat, "text": text}
        if chat:
            e["rendered"] = rendered
        e.update({"prompt_ids": ids, "tokens": toks, "gaps": gaps,
                  "first_eos": toks.index(m.eos_id) if m.eos_id in toks else None,
                  "first_eog": next((i for i, t in enumerate(toks) if t in EOG_IDS), None),
                  "reference_text": m.detok(toks)})
        greedy.append(e)
        print(f"greedy {name}: {time.time() - t1:.1f}s  {m.detok(toks)!r}  "
              f"min gap {min(gaps):.3f} at step {int(np.argmin(gaps))}", file=sys.stderr)

    if args.llama_cpp_compare:
        with LlamaServer(args.llama_bin, args.model) as srv:
            compare_llama_cpp(srv, m, greedy, gold, gold_rows)
    elif old_greedy is not None or old_gold is not None:
        # keep earlier llama.cpp results when they were made for the same ids
        for lst, old, key in ((greedy, old_greedy, "prompt_ids"), (gold, old_gold, "ids")):
            for e in lst:
                o = (old or {}).get(e["name"], {})
                if o.get(key) == e[key] and o.get("positions", None) == e.get("positions"):
                    for k, v in o.items():
                        if k.startswith("llama_cpp"):
                            e[k] = v

    def dump(obj, fname):
        with open(os.path.join(out, fname), "w", encoding="utf-8") as f:
            f.write(to_json(obj))
            f.write("\n")

    dump(cases, "tokenizer_cases.json")
    dump(gold, "golden_logits.json")
    dump(greedy, "greedy.json")
    print(f"reference fixtures done in {time.time() - t0:.1f}s", file=sys.stderr)

    # 4. teacher-forced llama.cpp distributions on a ~512-token text
    tf = None
    if not args.skip_teacher_forced:
        tf = teacher_forced(args, m, old_tf)
        dump(tf, "llama_cpp_teacher_forced.json")
        print(f"teacher-forced done, total {time.time() - t0:.1f}s", file=sys.stderr)

    if args.tolerance_study:
        tolerance_study(meta, w32, qtype, m, gold, gold_rows)
    print(f"total {time.time() - t0:.1f}s", file=sys.stderr)


def compare_llama_cpp(srv, m, greedy, gold, gold_rows):
    """Adds llama_cpp_* fields to the greedy / golden entries in place."""
    import urllib.request

    worst = 0.0
    for e in gold:
        lc = []
        for k, p in enumerate(e["positions"]):
            tl = llama_top_logprobs(srv.complete(e["ids"][:p + 1], 5))
            lc.append(tl)
            r = gold_rows[e["name"]][k]
            lse = logsumexp(r)
            d = max(abs(lp - (r[i] - lse)) for i, lp in tl)
            worst = max(worst, d)
            print(f"llama.cpp golden {e['name']}@{p}: top1 {tl[0][0]} vs ref "
                  f"{e['top64'][k][0][0]} (ref gap {e['top1_gap'][k]:.3f}), "
                  f"max |dlogprob| over its top5 {d:.3f}", file=sys.stderr)
        e["llama_cpp_top5_logprobs"] = lc
    for e in greedy:
        body = {"prompt": e["prompt_ids"], "n_predict": N_GREEDY, "temperature": 0.0,
                "samplers": ["top_k"], "top_k": 1, "ignore_eos": False,
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(srv.base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            r = json.loads(resp.read())
        lt = [int(t) for t in r.get("tokens") or []]
        div = next((i for i, (a, b) in enumerate(zip(lt, e["tokens"])) if a != b), None)
        e["llama_cpp_tokens"] = lt
        e["llama_cpp_text"] = r.get("content")
        e["llama_cpp_first_divergence"] = div
        tf_arg, tf_gap, flips = [], [], []
        ctx = list(e["prompt_ids"])
        for i in range(N_GREEDY):
            tl = llama_top_logprobs(srv.complete(ctx, 2))
            tf_arg.append(tl[0][0])
            tf_gap.append(tl[0][1] - tl[1][1])
            if tl[0][0] != e["tokens"][i]:
                flips.append([i, round(e["gaps"][i], 4), round(tf_gap[-1], 4)])
            ctx.append(e["tokens"][i])
        e["llama_cpp_tf_argmax"] = tf_arg
        e["llama_cpp_tf_gaps"] = tf_gap
        e["llama_cpp_tf_disagreements"] = flips
        msg = "identical" if div is None else \
            f"diverges at step {div} (reference gap {e['gaps'][div]:.4f})"
        print(f"llama.cpp greedy {e['name']}: {msg}; teacher-forced disagreements "
              f"[step, ref gap, llama gap] {flips}", file=sys.stderr)
    print(f"llama.cpp golden: max |logprob(llama) - logprob(ref)| over its top-5 {worst:.3f}",
          file=sys.stderr)


def _depth(o):
    if isinstance(o, list):
        return 1 + max((_depth(x) for x in o), default=0)
    return 0 if not isinstance(o, dict) else 99


def to_json(o, ind=0):
    """Readable JSON: dicts one key per line, lists of depth <= 2 (an id list, a
    row of [id, value] pairs) on one line, deeper lists one element per line."""
    pad, pad1 = " " * ind, " " * (ind + 1)
    if isinstance(o, dict):
        items = [pad1 + json.dumps(k) + ": " + to_json(v, ind + 1) for k, v in o.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(o, list) and _depth(o) > 2:
        return "[\n" + ",\n".join(pad1 + to_json(x, ind + 1) for x in o) + "\n" + pad + "]"
    return json.dumps(o, ensure_ascii=False)


def teacher_forced(args, m, old):
    text = TEACHER_FORCED_TEXT
    if old is not None and old.get("text") == text:
        ids = old["ids"]
    else:
        ids = llama_tokenize(args.llama_bin, args.model, text, bos=True)
    n = len(ids)
    assert ids[0] == m.bos_id
    # reference: prefill-all, then the head in chunks
    t1 = time.time()
    h = m.forward(ids, m.new_cache())
    ref_top1, ref_gap, ref_lse, ref_lp_rows = [], [], [], []
    for s in range(0, n - 1, 64):
        lg = m.head(h[s:min(s + 64, n - 1)])
        for r in lg:
            t, g = top1_gap(r)
            ref_top1.append(t)
            ref_gap.append(g)
            lse = logsumexp(r)
            ref_lse.append(lse)
            ref_lp_rows.append(r)  # keep for the comparison below (n x vocab f64: ~1 GB)
    print(f"teacher-forced reference: {n} tokens, {time.time() - t1:.1f}s", file=sys.stderr)

    if old is not None and old.get("ids") == ids and "llama_cpp_top20" in old:
        top20 = old["llama_cpp_top20"]
        server_info = old.get("server")
    else:
        t1 = time.time()
        with LlamaServer(args.llama_bin, args.model) as srv:
            props = srv.props()
            top20 = []
            for p in range(n - 1):
                top20.append(llama_top_logprobs(srv.complete(ids[:p + 1], TOPK_LLAMA)))
                if p % 64 == 0:
                    print(f"  llama-server position {p}/{n - 2} ({time.time() - t1:.0f}s)",
                          file=sys.stderr)
            body = srv.request_body(["..."], TOPK_LLAMA)
            server_info = {"cmd": ["llama-server"] + srv.cmd[1:], "request": body,
                           "build_info": props.get("build_info"),
                           "source": "llama.cpp vendored in llama-cpp-python 0.3.36 sdist "
                                     "(../shared/tools/build-llama-cpp), CPU",
                           "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx")}
            server_info["cmd"][server_info["cmd"].index("-m") + 1] = os.path.basename(args.model)
            server_info["cmd"][server_info["cmd"].index("--port") + 1] = "PORT"  # a free one
        print(f"llama-server: {n - 1} positions in {time.time() - t1:.1f}s", file=sys.stderr)

    # summary: llama.cpp vs reference
    flips, ref_lp20, d_all, d_top1 = [], [], [], []
    for p in range(n - 1):
        r = ref_lp_rows[p]
        lse = ref_lse[p]
        rl = [float(r[i] - lse) for i, _ in top20[p]]
        ref_lp20.append(rl)
        d = [abs(lp - x) for (_, lp), x in zip(top20[p], rl)]
        d_all += d
        d_top1.append(d[0])
        if top20[p][0][0] != ref_top1[p]:
            lg = top20[p]
            flips.append([p, round(ref_gap[p], 4), round(lg[0][1] - lg[1][1], 4)])
    d_all, d_top1 = np.array(d_all), np.array(d_top1)
    summary = {"max_abs_logprob_diff_over_llama_top20": float(d_all.max()),
               "p99_abs_logprob_diff_over_llama_top20": float(np.percentile(d_all, 99)),
               "median_abs_logprob_diff_over_llama_top20": float(np.median(d_all)),
               "max_abs_logprob_diff_llama_top1": float(d_top1.max()),
               "p99_abs_logprob_diff_llama_top1": float(np.percentile(d_top1, 99)),
               "top1_disagreements_pos_refgap_llamagap": flips}
    print(f"teacher-forced llama.cpp vs ref: {summary}", file=sys.stderr)
    return {"text": text, "ids": ids, "n_tokens": n,
            "note": "row p = next-token distribution after ids[0..=p], p = 0..n_tokens-2",
            "server": server_info,
            "llama_cpp_top20": top20,
            "ref_logprobs_of_llama_top20": ref_lp20,
            "ref_top1": ref_top1, "ref_gap": ref_gap,
            "ref_logsumexp": ref_lse,
            "summary": summary}


def tolerance_study(meta, w32, qtype, ref, gold, gold_rows):
    """How far realistic engine arithmetic moves the golden logits away from f64."""
    m32 = Gemma3(meta, w32, qtype, dtype=np.float32)
    variants = [("f32 compute", m32, None),
                ("f64 + Q8_0 activations per 32-block before each matmul", ref, "q8_32"),
                ("f32 + llama.cpp-like (Q8_0/Q8_K acts, f16 KV/Q/probs, f16 GELU table)",
                 m32, "llama")]
    for label, mm, emu in variants:
        worst = worst_top = 0.0
        per_prompt = {}
        flips = []
        for e in gold:
            a = gold_rows[e["name"]]
            mm.emulate = emu
            b = mm.logits_at(e["ids"], e["positions"]).astype(np.float64)
            mm.emulate = None
            dp = float(np.abs(a - b).max())
            per_prompt[e["name"]] = round(dp, 6)
            worst = max(worst, dp)
            for k in range(len(a)):
                top = topk(a[k], 64)
                worst_top = max(worst_top, float(np.abs(a[k][top] - b[k][top]).max()))
                if top1_gap(a[k])[0] != top1_gap(b[k])[0]:
                    flips.append((e["name"], e["positions"][k], round(top1_gap(a[k])[1], 4)))
        print(f"tolerance: {label}: max |dlogit| all vocab {worst:.3e}, over ref top-64 "
              f"{worst_top:.3e}, per prompt {per_prompt}, argmax flips (name, pos, ref gap) "
              f"{flips}", file=sys.stderr)


if __name__ == "__main__":
    main()
