#!/usr/bin/env python3
"""Tiny random-weight GGUF models + independent float64 expected logits.

For each architecture this writes a small GGUF file (what llama.cpp's converter
would write for that architecture, with random weights and a tiny vocabulary)
and the logits that a correct engine must produce for it, computed by an
independent numpy forward pass in float64 *from the file as written* (weights
read back with gguf.GGUFReader, F16 tensors widened exactly, hyper-parameters
as stored, e.g. the float32-rounded eps).

  python3 tests/reference/tiny.py --arch {llama3,qwen2,gemma3,llama} --out DIR \
      [--seed N] [--llama-tokenize PATH] [--tokenize-fixture FILE]

writes DIR/model.gguf and DIR/expected.json (plus, with --tokenize-fixture,
only the llama-tokenize results to FILE). Same arch + seed -> same bytes (for
the same numpy and gguf versions). Only numpy and gguf are needed; llama.cpp's
llama-tokenize only with --llama-tokenize. --no-ablations skips the ablation
study.
See tests/reference/README.md, "Tiny random-weight models (tiny.py)", for the
JSON layout and the exact model definitions.
"""

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

ARCHS = ("llama3", "qwen2", "gemma3", "llama")

# ----------------------------------------------------------------------------
# hyper-parameters
# ----------------------------------------------------------------------------

# Llama 3.1 "llama3" rope scaling, as convert_hf_to_gguf.py turns it into the
# rope_freqs tensor, with original_max_position_embeddings scaled down from
# 8192 to 64 so that the factors touch frequencies that matter at the short
# positions used here (factors come out as [1, 2.4, 8, 8, 8, 8, 8, 8]).
LLAMA3_ROPE_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=64)

HPARAMS = {
    "llama3": dict(gguf_arch="llama", n_ctx=128, n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
                   head_dim=16, n_ff=128, rms_eps=1e-5, rope_base=500000.0, rope_type="normal",
                   tied=False, qkv_bias=False, gemma=False),
    "qwen2": dict(gguf_arch="qwen2", n_ctx=128, n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
                  head_dim=16, n_ff=128, rms_eps=1e-6, rope_base=1000000.0, rope_type="neox",
                  tied=False, qkv_bias=True, gemma=False),
    "gemma3": dict(gguf_arch="gemma3", n_ctx=128, n_embd=64, n_layer=6, n_head=4, n_head_kv=2,
                   head_dim=32, n_ff=128, rms_eps=1e-6, rope_base=1000000.0, rope_type="neox",
                   tied=True, qkv_bias=False, gemma=True, sliding_window=4,
                   rope_base_swa=10000.0, swa_pattern=6),
    "llama": dict(gguf_arch="llama", n_ctx=128, n_embd=64, n_layer=2, n_head=4, n_head_kv=4,
                  head_dim=16, n_ff=128, rms_eps=1e-5, rope_base=10000.0, rope_type="normal",
                  tied=True, qkv_bias=False, gemma=False),
}

# tensors stored as F16 (everything else is F32)
F16_TENSORS = {
    "llama3": {"blk.0.attn_v.weight", "blk.1.ffn_up.weight"},
    "qwen2": {"blk.1.attn_q.weight", "output.weight"},
    "gemma3": {"token_embd.weight", "blk.5.ffn_down.weight"},
    "llama": {"blk.0.ffn_down.weight", "blk.1.attn_k.weight"},
}

N_GREEDY = 8


def llama3_rope_factors(base, dim, factor, low_freq_factor, high_freq_factor,
                        original_max_position_embeddings):
    """convert_hf_to_gguf.py (conversion/llama.py, LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    old = original_max_position_embeddings
    low_freq_wavelen = old / low_freq_factor
    high_freq_wavelen = old / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# ----------------------------------------------------------------------------
# vocabularies (fixed, independent of the seed)
# ----------------------------------------------------------------------------

TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6


def bytes_to_unicode():
    """GPT-2's byte -> printable unicode map, in GPT-2's vocabulary order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return list(zip(bs, [chr(c) for c in cs]))


def _bl(s):
    """UTF-8 text -> byte-level (GPT-2 mapped) string."""
    m = dict(bytes_to_unicode())
    return "".join(m[b] for b in s.encode("utf-8"))


# merges in rank order, written in plain text; " " inside a side is a space
# (mapped to "Ġ"). Each result becomes a token.
BPE_MERGES_TEXT = [
    (" ", "t"), ("h", "e"), (" t", "he"), ("i", "n"), (" ", "a"), ("e", "r"), ("o", "n"),
    (" ", " "), ("  ", "  "), ("\n", "\n"), ("'", "m"), ("l", "l"), ("'", "ll"),
    (" ", "I"), ("o", "u"), (" ", "y"), (" y", "ou"), (" ", "w"), ("o", "r"), ("l", "d"),
    (" w", "or"), (" wor", "ld"), ("1", "2"), ("12", "3"), ("4", "5"), ("6", "7"),
    ("67", "8"), ("é", ""), ("H", "e"), ("He", "ll"), ("Hell", "o"),
    (" ", "\n"), ("中", ""), ("!", "!"), ("in", "g"),
]
# tokens that are in the vocabulary but not the result of any merge: with
# llama3's ignore_merges (llama-bpe) a pre-token equal to one of these is
# emitted whole; qwen2 (no ignore_merges) has to merge and cannot reach it.
BPE_EXTRA_TOKENS = [" hello", "world"]

BPE_SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}


def build_bpe_vocab(arch):
    tokens = [u for _, u in bytes_to_unicode()]
    types = [TT_NORMAL] * 256
    merges = []
    have = set(tokens)

    def merge_sides(a, b):
        # "é" and "中" are multi-byte: merge their UTF-8 bytes left to right
        if b == "":
            bl = _bl(a)
            return [(bl[:i], bl[i]) for i in range(1, len(bl))]
        return [(_bl(a), _bl(b))]

    for a, b in BPE_MERGES_TEXT:
        for x, y in merge_sides(a, b):
            assert x in have and y in have, (x, y)
            merges.append(f"{x} {y}")
            if x + y not in have:
                tokens.append(x + y)
                types.append(TT_NORMAL)
                have.add(x + y)
    for t in BPE_EXTRA_TOKENS:
        bl = _bl(t)
        assert bl not in have
        tokens.append(bl)
        types.append(TT_NORMAL)
        have.add(bl)
    for s in BPE_SPECIALS[arch]:
        tokens.append(s)
        types.append(TT_CONTROL)
    ids = {t: i for i, t in enumerate(tokens)}
    assert len(ids) == len(tokens)
    if arch == "llama3":
        tok = dict(model="gpt2", pre="llama-bpe", bos="<|begin_of_text|>",
                   eos="<|end_of_text|>", add_bos=True)
    else:
        tok = dict(model="gpt2", pre="qwen2", bos="<|endoftext|>", eos="<|im_end|>",
                   pad="<|endoftext|>", add_bos=False)
    tok.update(tokens=tokens, types=types, merges=merges,
               bos_id=ids[tok["bos"]], eos_id=ids[tok["eos"]])
    if "pad" in tok:
        tok["pad_id"] = ids[tok["pad"]]
    return tok


# SentencePiece pieces ("▁" = space), in score order: the i-th gets score -i,
# so earlier pieces merge first (llama.cpp's SPM merges the highest score).
SPM_SINGLES = list("▁abcdefghijklmnopqrstuvwxyzIHTAW0123456789.,'!?-é中文")
SPM_PIECES = [
    "▁t", "he", "▁the", "in", "er", "▁a", "on", "▁I", "ll", "ou", "▁y", "▁you", "▁w", "or",
    "ld", "▁wor", "▁world", "el", "lo", "▁h", "▁hel", "▁hello", "▁H", "▁Hel", "▁Hello",
    "▁▁", "▁▁▁▁", "12", "123", "45", "'m", "'ll", "ing", "中文", "é▁", "▁c", "af", "▁caf",
]


def build_spm_vocab(arch):
    tokens, types, scores = [], [], []

    def add(t, ty, sc):
        tokens.append(t)
        types.append(ty)
        scores.append(sc)

    if arch == "gemma3":
        # ids as in Gemma 3: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4
        for t, ty in [("<pad>", TT_CONTROL), ("<eos>", TT_CONTROL), ("<bos>", TT_CONTROL),
                      ("<unk>", TT_UNKNOWN), ("<mask>", TT_CONTROL),
                      ("<start_of_turn>", TT_CONTROL), ("<end_of_turn>", TT_CONTROL)]:
            add(t, ty, -1000.0)
        # Gemma 3 has raw whitespace runs as USER_DEFINED tokens
        for t in ["\n", "\n\n", "  "]:
            add(t, TT_USER_DEFINED, -1000.0)
    else:
        add("<unk>", TT_UNKNOWN, 0.0)
        add("<s>", TT_CONTROL, 0.0)
        add("</s>", TT_CONTROL, 0.0)
    for b in range(256):
        add(f"<0x{b:02X}>", TT_BYTE, 0.0)
    rank = 0
    for p in SPM_PIECES + SPM_SINGLES:
        add(p, TT_NORMAL, -float(rank))
        rank += 1
    ids = {t: i for i, t in enumerate(tokens)}
    assert len(ids) == len(tokens)
    if arch == "gemma3":
        tok = dict(model="llama", pre="default", bos="<bos>", eos="<eos>", unk="<unk>",
                   pad="<pad>", add_bos=True, add_space_prefix=False)
    else:
        tok = dict(model="llama", bos="<s>", eos="</s>", unk="<unk>", add_bos=True)
    tok.update(tokens=tokens, types=types, scores=scores,
               bos_id=ids[tok["bos"]], eos_id=ids[tok["eos"]], unk_id=ids[tok["unk"]])
    if "pad" in tok:
        tok["pad_id"] = ids[tok["pad"]]
    return tok


def build_vocab(arch):
    return build_bpe_vocab(arch) if arch in ("llama3", "qwen2") else build_spm_vocab(arch)


def vocab_sha256(tok):
    h = hashlib.sha256()
    h.update(json.dumps({k: tok.get(k) for k in ("model", "pre", "tokens", "types", "merges",
                                                  "scores", "bos_id", "eos_id", "unk_id", "pad_id",
                                                  "add_bos", "add_space_prefix")},
                        ensure_ascii=False, sort_keys=True).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------
# random weights + GGUF writer
# ----------------------------------------------------------------------------

def make_weights(arch, hp, n_vocab, rng):
    """name -> numpy array in (rows, cols) = (out, in) order; y = W @ x."""
    E, L, F = hp["n_embd"], hp["n_layer"], hp["n_ff"]
    hd, H, KV = hp["head_dim"], hp["n_head"], hp["n_head_kv"]
    w = {}

    def n(shape, std):
        return rng.standard_normal(shape) * std

    def norm_w(size):
        # norms as stored in GGUF (Gemma's +1 already included), around 1
        return 1.0 + n(size, 0.1)

    w["token_embd.weight"] = n((n_vocab, E), 0.25)
    w["output_norm.weight"] = norm_w(E)
    if not hp["tied"]:
        w["output.weight"] = n((n_vocab, E), 0.25)
    if arch == "llama3":
        w["rope_freqs.weight"] = llama3_rope_factors(hp["rope_base"], hd, **LLAMA3_ROPE_SCALING)
    for l in range(L):
        p = f"blk.{l}."
        w[p + "attn_norm.weight"] = norm_w(E)
        w[p + "attn_q.weight"] = n((H * hd, E), 0.2)
        w[p + "attn_k.weight"] = n((KV * hd, E), 0.2)
        w[p + "attn_v.weight"] = n((KV * hd, E), 0.15)
        if hp["qkv_bias"]:
            w[p + "attn_q.bias"] = n(H * hd, 0.5)
            w[p + "attn_k.bias"] = n(KV * hd, 0.5)
            w[p + "attn_v.bias"] = n(KV * hd, 0.1)
        w[p + "attn_output.weight"] = n((E, H * hd), 0.15)
        if hp["gemma"]:
            w[p + "attn_q_norm.weight"] = norm_w(hd)
            w[p + "attn_k_norm.weight"] = norm_w(hd)
            # post norms around 4: block outputs outweigh the sqrt(n_embd)-scaled
            # embedding, so the tied head does not just echo the last token
            w[p + "post_attention_norm.weight"] = 4.0 * norm_w(E)
            w[p + "post_ffw_norm.weight"] = 4.0 * norm_w(E)
        w[p + "ffn_norm.weight"] = norm_w(E)
        w[p + "ffn_gate.weight"] = n((F, E), 0.15)
        w[p + "ffn_up.weight"] = n((F, E), 0.15)
        w[p + "ffn_down.weight"] = n((E, F), 0.1)
    for k in w:
        w[k] = w[k].astype(np.float16 if k in F16_TENSORS[arch] else np.float32)
    assert F16_TENSORS[arch] <= set(w)
    return w


def write_gguf(path, arch, hp, tok, weights):
    import gguf

    ga = hp["gguf_arch"]
    wr = gguf.GGUFWriter(path, ga)
    wr.add_type("model")
    wr.add_name(f"tiny-{arch}")
    # what convert_hf_to_gguf.py's TextModel.set_gguf_parameters (+ per-arch) writes
    wr.add_block_count(hp["n_layer"])
    wr.add_context_length(hp["n_ctx"])
    wr.add_embedding_length(hp["n_embd"])
    wr.add_feed_forward_length(hp["n_ff"])
    wr.add_head_count(hp["n_head"])
    wr.add_head_count_kv(hp["n_head_kv"])
    wr.add_rope_freq_base(hp["rope_base"])
    wr.add_layer_norm_rms_eps(hp["rms_eps"])
    if ga == "llama":
        wr.add_vocab_size(len(tok["tokens"]))
        wr.add_rope_dimension_count(hp["head_dim"])
    if ga == "gemma3":
        wr.add_key_length(hp["head_dim"])
        wr.add_value_length(hp["head_dim"])
        wr.add_sliding_window(hp["sliding_window"])
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    # tokenizer
    wr.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        wr.add_tokenizer_pre(tok["pre"])
    wr.add_token_list(tok["tokens"])
    if "scores" in tok:
        wr.add_token_scores(tok["scores"])
    wr.add_token_types(tok["types"])
    if "merges" in tok:
        wr.add_token_merges(tok["merges"])
    wr.add_bos_token_id(tok["bos_id"])
    wr.add_eos_token_id(tok["eos_id"])
    if "unk_id" in tok:
        wr.add_unk_token_id(tok["unk_id"])
    if "pad_id" in tok:
        wr.add_pad_token_id(tok["pad_id"])
    wr.add_add_bos_token(tok["add_bos"])
    if tok["model"] == "llama" or arch == "qwen2":
        wr.add_add_eos_token(False)
    if "add_space_prefix" in tok:
        wr.add_add_space_prefix(tok["add_space_prefix"])
    for name in sorted(weights, key=_tensor_order):
        wr.add_tensor(name, weights[name])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def _tensor_order(name):
    # global tensors first, then blocks in numeric order (as the converter does)
    if name.startswith("blk."):
        parts = name.split(".")
        return (1, int(parts[1]), ".".join(parts[2:]))
    return (0, 0, name)


# ----------------------------------------------------------------------------
# reading back + float64 forward
# ----------------------------------------------------------------------------

class Tiny:
    """Loads the GGUF as written and runs the model in float64."""

    def __init__(self, path, arch):
        import gguf

        r = gguf.GGUFReader(path)
        f = lambda k: r.fields[k].contents()  # noqa: E731
        ga = f("general.architecture")
        self.arch, self.ga = arch, ga
        hp = HPARAMS[arch]
        self.n_layer = int(f(f"{ga}.block_count"))
        self.n_embd = int(f(f"{ga}.embedding_length"))
        self.n_head = int(f(f"{ga}.attention.head_count"))
        self.n_head_kv = int(f(f"{ga}.attention.head_count_kv"))
        self.n_ff = int(f(f"{ga}.feed_forward_length"))
        self.eps = float(f(f"{ga}.attention.layer_norm_rms_epsilon"))  # float32 value, widened
        self.rope_base = float(f(f"{ga}.rope.freq_base"))
        if f"{ga}.attention.key_length" in r.fields:
            self.head_dim = int(f(f"{ga}.attention.key_length"))
            assert int(f(f"{ga}.attention.value_length")) == self.head_dim
        else:
            self.head_dim = self.n_embd // self.n_head
        self.vocab = len(f("tokenizer.ggml.tokens"))
        self.w, self.dtypes, self.gguf_shapes = {}, {}, {}
        for t in r.tensors:
            assert t.tensor_type.name in ("F32", "F16"), t.tensor_type.name
            gshape = [int(s) for s in t.shape]  # GGUF is innermost-first: [cols, rows]
            a = np.asarray(t.data).reshape(gshape[::-1])
            self.w[t.name] = a.astype(np.float64)  # exact for F32 and F16
            self.dtypes[t.name] = t.tensor_type.name
            self.gguf_shapes[t.name] = gshape
        # model definition knobs (the ablations flip these)
        self.cfg = dict(
            rope_type=hp["rope_type"],
            rope_freqs="rope_freqs.weight" in self.w,
            qkv_bias="blk.0.attn_q.bias" in self.w,
            head="output.weight" if "output.weight" in self.w else "token_embd.weight",
            gemma=hp["gemma"],
            embd_scale=math.sqrt(self.n_embd) if hp["gemma"] else 1.0,
            qk_norm=hp["gemma"],
            post_norms=hp["gemma"],
            act="gelu_tanh" if hp["gemma"] else "silu",
            sliding_window=None,
            swa_layers=[False] * self.n_layer,
            rope_base_swa=None,
            attn_scale=1.0 / math.sqrt(self.head_dim),
            gqa_map="div",  # query head h reads kv head h // (n_head / n_head_kv)
        )
        if hp["gemma"]:
            self.cfg["sliding_window"] = int(f(f"{ga}.attention.sliding_window"))
            pat = hp["swa_pattern"]
            self.cfg["swa_layers"] = [il % pat < pat - 1 for il in range(self.n_layer)]
            self.cfg["rope_base_swa"] = hp["rope_base_swa"]  # llama.cpp default, key absent
            assert f"{ga}.rope.freq_base_swa" not in r.fields

    # --- pieces -------------------------------------------------------------

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, base, cfg):
        """x: (n, heads, hd). theta_i = pos * base^(-2i/hd) / factor_i, i < hd/2.
        normal: rotates (x[2i], x[2i+1]); neox: rotates (x[i], x[i + hd/2])."""
        hd = self.head_dim
        inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        if cfg["rope_freqs"]:
            inv = inv / self.w["rope_freqs.weight"]
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        if cfg["rope_type"] == "normal":
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2] = a * c - b * s
            out[..., 1::2] = a * s + b * c
        else:
            h = hd // 2
            a, b = x[..., :h], x[..., h:]
            out[..., :h] = a * c - b * s
            out[..., h:] = a * s + b * c
        return out

    def act(self, g, cfg):
        if cfg["act"] == "silu":
            return g / (1.0 + np.exp(-g))
        if cfg["act"] == "gelu_tanh":
            return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
        if cfg["act"] == "gelu_erf":  # ablation only
            from math import erf
            return 0.5 * g * (1.0 + np.vectorize(erf)(g / math.sqrt(2.0)))
        raise ValueError(cfg["act"])

    def new_cache(self):
        return {"k": [None] * self.n_layer, "v": [None] * self.n_layer, "len": 0}

    # --- forward ------------------------------------------------------------

    def forward(self, ids, cache, cfg=None):
        """Feed ids after the cache contents; returns logits (len(ids), vocab)."""
        cfg = cfg or self.cfg
        w = self.w
        n = len(ids)
        start = cache["len"]
        pos = np.arange(start, start + n)
        H, KV, hd = self.n_head, self.n_head_kv, self.head_dim
        group = H // KV
        x = w["token_embd.weight"][list(ids)] * cfg["embd_scale"]
        for l in range(self.n_layer):
            p = f"blk.{l}."
            swa = cfg["swa_layers"][l]
            base = cfg["rope_base_swa"] if swa else self.rope_base
            h = self.rmsnorm(x, w[p + "attn_norm.weight"])
            q, k, v = (h @ w[p + f"attn_{t}.weight"].T for t in "qkv")
            if cfg["qkv_bias"]:
                q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
            q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
            if cfg["qk_norm"]:
                q = self.rmsnorm(q, w[p + "attn_q_norm.weight"])
                k = self.rmsnorm(k, w[p + "attn_k_norm.weight"])
            q, k = self.rope(q, pos, base, cfg), self.rope(k, pos, base, cfg)
            if cache["k"][l] is not None:
                k = np.concatenate([cache["k"][l], k])
                v = np.concatenate([cache["v"][l], v])
            cache["k"][l], cache["v"][l] = k, v
            kpos = np.arange(k.shape[0])
            masked = kpos[None, :] > pos[:, None]  # causal
            if swa and cfg["sliding_window"] is not None:
                masked |= (pos[:, None] - kpos[None, :]) >= cfg["sliding_window"]
            att = np.empty((n, H, hd))
            for hh in range(H):
                kv = hh // group if cfg["gqa_map"] == "div" else hh % KV
                s = (q[:, hh] @ k[:, kv].T) * cfg["attn_scale"]
                s = np.where(masked, -np.inf, s)
                e = np.exp(s - s.max(axis=-1, keepdims=True))
                att[:, hh] = (e / e.sum(axis=-1, keepdims=True)) @ v[:, kv]
            o = att.reshape(n, H * hd) @ w[p + "attn_output.weight"].T
            if cfg["post_norms"]:
                o = self.rmsnorm(o, w[p + "post_attention_norm.weight"])
            x = x + o
            h = self.rmsnorm(x, w[p + "ffn_norm.weight"])
            a = self.act(h @ w[p + "ffn_gate.weight"].T, cfg) * (h @ w[p + "ffn_up.weight"].T)
            d = a @ w[p + "ffn_down.weight"].T
            if cfg["post_norms"]:
                d = self.rmsnorm(d, w[p + "post_ffw_norm.weight"])
            x = x + d
        cache["len"] = start + n
        h = self.rmsnorm(x, w["output_norm.weight"])
        return h @ w[cfg["head"]].T

    def logits(self, ids, cfg=None):
        return self.forward(ids, self.new_cache(), cfg)

    def greedy(self, ids, n_new):
        cache = self.new_cache()
        lg = self.forward(ids, cache)[-1]
        toks, gaps, rows = [], [], []
        for i in range(n_new):
            t1, gap = top1_gap(lg)
            toks.append(t1)
            gaps.append(gap)
            rows.append(lg)
            if i + 1 < n_new:
                lg = self.forward([t1], cache)[-1]
        return toks, gaps, rows


def top1_gap(row):
    order = np.argsort(-row, kind="stable")
    return int(order[0]), float(row[order[0]] - row[order[1]])


# ----------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------

def make_cases(tok, hp, rng):
    """Id sequences: 1 token, 5 tokens, 12 tokens (> 2x the gemma3 window),
    20 tokens with repeats. Start with BOS; the rest are normal tokens."""
    normal = [i for i, t in enumerate(tok["types"]) if t == TT_NORMAL]
    bos = tok["bos_id"]
    out = []
    for name, n in [("single", 1), ("short", 5), ("medium", 12), ("long_repeats", 20)]:
        ids = [bos] + [int(normal[j]) for j in rng.integers(0, len(normal), n - 1)]
        if name == "long_repeats":
            ids[10:16] = ids[2:8]  # a repeated span: attention has something to match
        out.append((name, ids))
    return out


# ----------------------------------------------------------------------------
# llama-tokenize
# ----------------------------------------------------------------------------

TOKENIZE_TEXTS_COMMON = [
    "Hello world",
    "world hello Hello HELLO the the",
    "I'm you'll they'RE we'd",
    "12345 678 9",
    "a  b   c    d     e",
    "line1\nline2\n\nline3\n",
    "  leading and trailing  ",
    "tab\there \t x",
    "café é ÉTÉ",
    "中文 and 中",
    "emoji 😀👍🏽 end",
    "Hello, world!! (test) -- ok? [x] {y}",
    "The thing is in the world",
    "",
]
TOKENIZE_TEXTS_SPECIAL = {
    "llama3": ["<|begin_of_text|>hi<|eot_id|>", "a<|end_of_text|> b"],
    "qwen2": ["<|im_start|>user\nhi<|im_end|>\n", "before<|endoftext|>after"],
    "gemma3": ["<start_of_turn>user\nhi<end_of_turn>\n", "<bos>x<eos> y"],
    "llama": ["<s>hi</s>", "a</s> b"],
}


def llama_tokenize(binary, model, arch):
    out = []
    for text in TOKENIZE_TEXTS_COMMON + TOKENIZE_TEXTS_SPECIAL[arch]:
        with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as fh:
            fh.write(text.encode("utf-8"))
            fn = fh.name
        try:
            r = subprocess.run([binary, "-m", model, "-f", fn, "--ids", "--no-bos",
                                "--no-escape", "--log-disable"],
                               capture_output=True, timeout=120)
        finally:
            os.unlink(fn)
        if r.returncode != 0:
            sys.stderr.write(r.stderr.decode("utf-8", "replace"))
            raise SystemExit(f"llama-tokenize failed (rc {r.returncode}) on {text!r}")
        lines = [ln for ln in r.stdout.decode().splitlines() if ln.startswith("[")]
        if not lines:
            raise SystemExit(f"no ids from llama-tokenize on {text!r}: {r.stdout!r} {r.stderr!r}")
        out.append({"text": text, "ids": json.loads(lines[-1])})
    return out


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------

def ablations(m, cases):
    """max |logit - expected| over all cases and positions when one piece of the
    model definition is changed: how strongly each feature is tested."""
    variants = {}
    c = m.cfg
    alt = {"normal": "neox", "neox": "normal"}[c["rope_type"]]
    variants[f"rope_{alt}_layout"] = dict(rope_type=alt)
    if c["rope_freqs"]:
        variants["rope_freqs_ignored"] = dict(rope_freqs=False)
    if c["qkv_bias"]:
        variants["qkv_bias_ignored"] = dict(qkv_bias=False)
    if c["head"] == "output.weight":
        variants["tied_head_instead_of_output"] = dict(head="token_embd.weight")
    if m.n_head_kv != m.n_head:
        variants["gqa_kv_head_h_mod_n_kv"] = dict(gqa_map="mod")
    if c["gemma"]:
        variants["no_sliding_window"] = dict(sliding_window=None)
        variants["global_rope_base_everywhere"] = dict(rope_base_swa=m.rope_base)
        variants["no_qk_norm"] = dict(qk_norm=False)
        variants["no_embd_scale"] = dict(embd_scale=1.0)
        variants["no_post_norms"] = dict(post_norms=False)
        variants["gelu_erf_instead_of_tanh"] = dict(act="gelu_erf")
        variants["attn_scale_1_over_sqrt_n_embd_per_head"] = dict(
            attn_scale=1.0 / math.sqrt(m.n_embd / m.n_head))
    ref = [m.logits(ids) for _, ids in cases]
    out = {}
    for name, ch in variants.items():
        cfg = dict(m.cfg, **ch)
        got = [m.logits(ids, cfg) for _, ids in cases]
        out[name] = float(max(np.max(np.abs(a - b)) for a, b in zip(got, ref)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, choices=ARCHS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-tokenize", metavar="PATH",
                    help="llama.cpp's llama-tokenize binary: add a 'tokenize' list")
    ap.add_argument("--tokenize-fixture", metavar="FILE",
                    help="with --llama-tokenize: also write only the tokenize part to FILE")
    ap.add_argument("--no-ablations", action="store_true",
                    help="skip the ablation study (a little faster)")
    args = ap.parse_args()
    if args.tokenize_fixture and not args.llama_tokenize:
        ap.error("--tokenize-fixture needs --llama-tokenize")

    arch = args.arch
    hp = HPARAMS[arch]
    # one stream for weights, one for cases: cases do not move if weights change
    rng_w = np.random.default_rng([args.seed, 0, ARCHS.index(arch)])
    rng_c = np.random.default_rng([args.seed, 1, ARCHS.index(arch)])
    tok = build_vocab(arch)
    n_vocab = len(tok["tokens"])
    weights = make_weights(arch, hp, n_vocab, rng_w)

    os.makedirs(args.out, exist_ok=True)
    gguf_path = os.path.join(args.out, "model.gguf")
    write_gguf(gguf_path, arch, hp, tok, weights)

    m = Tiny(gguf_path, arch)
    assert m.vocab == n_vocab
    cases = make_cases(tok, hp, rng_c)
    out_cases = []
    for name, ids in cases:
        lg = m.logits(ids)
        t1, gap = top1_gap(lg[-1])
        out_cases.append({
            "name": name,
            "ids": ids,
            "logits_last": lg[-1].tolist(),
            "top1": t1,
            "top1_gap": gap,
            "logits_all_positions": lg.tolist(),
            "top1_all_positions": [top1_gap(r)[0] for r in lg],
            "top1_gap_all_positions": [top1_gap(r)[1] for r in lg],
        })

    # greedy with KV-cache incremental decoding; checked against prefill-all
    prompt = cases[1][1]
    toks, gaps, rows = m.greedy(prompt, N_GREEDY)
    full = m.logits(prompt + toks[:-1])[len(prompt) - 1:]
    inc_vs_full = float(np.max(np.abs(np.array(rows) - full)))
    assert inc_vs_full < 1e-10, inc_vs_full
    # and chunked prefill (two chunks) vs prefill-all
    cache = m.new_cache()
    ids12 = cases[2][1]
    a = m.forward(ids12[:5], cache)
    b = m.forward(ids12[5:], cache)
    chunk_vs_full = float(np.max(np.abs(np.concatenate([a, b]) - m.logits(ids12))))
    assert chunk_vs_full < 1e-10, chunk_vs_full

    c = m.cfg
    hparams = {
        "gguf_arch": m.ga,
        "n_vocab": m.vocab,
        "n_ctx": hp["n_ctx"],
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_head_kv": m.n_head_kv,
        "head_dim": m.head_dim,
        "n_ff": m.n_ff,
        "rms_eps": m.eps,
        "rope_base": m.rope_base,
        "rope_type": c["rope_type"],
        "rope_freqs": m.w["rope_freqs.weight"].tolist() if c["rope_freqs"] else None,
        "rope_base_swa": c["rope_base_swa"],
        "sliding_window": c["sliding_window"],
        "swa_layers": c["swa_layers"],
        "qkv_bias": c["qkv_bias"],
        "tied_output": c["head"] == "token_embd.weight",
        "embd_scale": c["embd_scale"],
        "attn_scale": c["attn_scale"],
        "qk_norm": c["qk_norm"],
        "post_norms": c["post_norms"],
        "ffn_act": c["act"],
    }
    expected = {
        "arch": arch,
        "seed": args.seed,
        "generator": "tests/reference/tiny.py",
        "hparams": hparams,
        "tokenizer": {
            "model": tok["model"], "pre": tok.get("pre"), "n_vocab": n_vocab,
            "bos_id": tok["bos_id"], "eos_id": tok["eos_id"], "add_bos": tok["add_bos"],
            "vocab_sha256": vocab_sha256(tok),
        },
        "tensors": {k: {"shape": m.gguf_shapes[k], "dtype": m.dtypes[k]}
                    for k in sorted(m.w, key=_tensor_order)},
        "cases": out_cases,
        "greedy": {
            "prompt_ids": prompt,
            "tokens": toks,
            "gaps": gaps,
            "logits": [r.tolist() for r in rows],
            "incremental_vs_prefill_max_abs": inc_vs_full,
            "chunked_prefill_max_abs": chunk_vs_full,
        },
    }
    if not args.no_ablations:
        expected["ablations"] = ablations(m, cases)
    if args.llama_tokenize:
        tk = llama_tokenize(args.llama_tokenize, gguf_path, arch)
        expected["tokenize"] = tk
        if args.tokenize_fixture:
            d = os.path.dirname(args.tokenize_fixture)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(args.tokenize_fixture, "w", encoding="utf-8") as fh:
                # one case per line
                dumps = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731
                fh.write("{\n")
                fh.write(f' "arch": {dumps(arch)},\n')
                fh.write(f' "generator": {dumps("tests/reference/tiny.py --llama-tokenize")},\n')
                fh.write(f' "vocab_sha256": {dumps(expected["tokenizer"]["vocab_sha256"])},\n')
                fh.write(' "tokenize": [\n')
                fh.write(",\n".join("  " + dumps(c) for c in tk))
                fh.write("\n ]\n}\n")
    with open(os.path.join(args.out, "expected.json"), "w", encoding="utf-8") as fh:
        json.dump(expected, fh, ensure_ascii=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
