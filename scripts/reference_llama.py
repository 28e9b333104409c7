#!/usr/bin/env python3
"""Independent f32 reference for kvreplay capture, and the check against a trace.

Runs the same GGUF llama model a second way and compares it with a trace that
`kvreplay capture` wrote:

- weights dequantised by the `gguf` Python package (not kvreplay's code);
- a plain-Python byte-level BPE tokenizer (GPT-2 byte map, rank-ordered merges,
  the `smollm`/`gpt2` pre-tokenizer regexes, control tokens matched whole);
- the forward pass in NumPy float32 in llama.cpp's own layout: Q/K weights as
  stored in the GGUF (rows interleaved) with interleaved ("normal") RoPE on
  adjacent pairs. kvreplay instead un-permutes the weights and applies
  rotate-half RoPE; both must give the same post-RoPE vectors once this script
  maps its q/k into the HF order the trace stores (hf[j*d/2+i] = gguf[2i+j]).

Checks: identical prompt token ids, identical greedy continuation (the first
`--decode` tokens), and per layer and head the relative L2 error of the
attention logits q.k^T (causal part), of V and of the attention output `o`.

Usage: reference_llama.py --model M.gguf --trace T.kvtrace --prompt TEXT [--chat] [--tol 0.01]
(the same prompt and --chat as the capture; the decode length comes from the manifest).
"""
import argparse
import json
import os
import sys

import numpy as np
import regex
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Bpe:
    def __init__(self, reader):
        self.tokens = field(reader, "tokenizer.ggml.tokens")
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = field(reader, "tokenizer.ggml.merges")
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        types = field(reader, "tokenizer.ggml.token_type")
        self.control = sorted((t for t, ty in zip(self.tokens, types) if ty == 3), key=len, reverse=True)
        self.pre = field(reader, "tokenizer.ggml.pre") or "default"
        if self.pre not in ("smollm", "gpt2", "default"):
            sys.exit(f"reference tokenizer: pre-tokenizer {self.pre!r} not implemented here")
        self.byte_map = bytes_to_unicode()
        self.byte_inv = {c: b for b, c in self.byte_map.items()}

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 60), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 60:
                break
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
        return [self.vocab[p] for p in parts]

    def encode_plain(self, text):
        pieces = [text]
        if self.pre == "smollm":  # every digit is its own piece, then the GPT-2 regex
            pieces = [p for p in regex.split(r"(\p{N})", text) if p]
        ids = []
        for piece in pieces:
            for word in regex.findall(GPT2_PAT, piece):
                ids += self.bpe("".join(self.byte_map[b] for b in word.encode("utf-8")))
        return ids

    def encode(self, text):
        if not self.control:
            return self.encode_plain(text)
        pat = "(" + "|".join(regex.escape(c) for c in self.control) + ")"
        ids = []
        for part in regex.split(pat, text):
            if part in self.control:
                ids.append(self.vocab[part])
            elif part:
                ids += self.encode_plain(part)
        return ids


class Model:
    def __init__(self, path):
        r = GGUFReader(path)
        self.reader = r
        arch = field(r, "general.architecture")
        if arch != "llama":
            sys.exit(f"reference: architecture {arch!r} not implemented here")
        g = lambda k, d=None: field(r, f"llama.{k}") if field(r, f"llama.{k}") is not None else d
        self.n_layers = g("block_count")
        self.n_heads = g("attention.head_count")
        self.n_kv = g("attention.head_count_kv", self.n_heads)
        self.dim = g("embedding_length")
        self.hd = self.dim // self.n_heads
        self.eps = np.float32(g("attention.layer_norm_rms_epsilon"))
        self.theta = g("rope.freq_base", 10000.0)
        self.rot = g("rope.dimension_count", self.hd)
        self.t = {}
        for t in r.tensors:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.t[t.name] = w.reshape([int(x) for x in reversed(t.shape)])
        self.head = self.t.get("output.weight", self.t["token_embd.weight"])

    def rmsnorm(self, x, w):
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.eps)).astype(np.float32) * w

    def rope_interleaved(self, x, pos):
        # x: (T, heads, hd) in GGUF row order: pairs (2i, 2i+1) rotate together
        i = np.arange(self.rot // 2, dtype=np.float64)
        ang = pos[:, None].astype(np.float64) * self.theta ** (-2.0 * i / self.rot)  # (T, rot/2)
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        out = x.copy()
        a, b = x[..., 0:self.rot:2], x[..., 1:self.rot:2]
        out[..., 0:self.rot:2] = a * cos - b * sin
        out[..., 1:self.rot:2] = b * cos + a * sin
        return out

    def forward_all(self, ids):
        """Full causal forward over all ids at once. Returns per-layer
        (q, k, v, o) as (heads, T, hd) and the logits (T, vocab)."""
        T = len(ids)
        pos = np.arange(T)
        x = self.t["token_embd.weight"][ids]
        taps = []
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        group = self.n_heads // self.n_kv
        for l in range(self.n_layers):
            w = lambda n: self.t[f"blk.{l}.{n}.weight"]
            h = self.rmsnorm(x, w("attn_norm"))
            q = (h @ w("attn_q").T).reshape(T, self.n_heads, self.hd)
            k = (h @ w("attn_k").T).reshape(T, self.n_kv, self.hd)
            v = (h @ w("attn_v").T).reshape(T, self.n_kv, self.hd)
            q, k = self.rope_interleaved(q, pos), self.rope_interleaved(k, pos)
            q, k, v = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            kk = np.repeat(k, group, axis=0)
            vv = np.repeat(v, group, axis=0)
            s = q @ kk.transpose(0, 2, 1) / np.float32(np.sqrt(self.hd)) + mask
            s = s - s.max(-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(-1, keepdims=True)
            o = p @ vv  # (heads, T, hd)
            taps.append((q, k, v, o))
            x = x + o.transpose(1, 0, 2).reshape(T, -1) @ w("attn_output").T
            h = self.rmsnorm(x, w("ffn_norm"))
            gte, up = h @ w("ffn_gate").T, h @ w("ffn_up").T
            x = x + ((gte / (1 + np.exp(-gte))) * up) @ w("ffn_down").T
        logits = self.rmsnorm(x, self.t["output_norm.weight"]) @ self.head.T
        return taps, logits


def to_hf_order(x, hd):
    """(heads, T, hd) GGUF pair-interleaved -> HF rotate-half order."""
    half = hd // 2
    out = np.empty_like(x)
    out[..., :half] = x[..., 0::2]
    out[..., half:] = x[..., 1::2]
    return out


def rel_l2(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trace", required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text given to kvreplay capture")
    src.add_argument("--prompt-file")
    ap.add_argument("--chat", action="store_true", help="the capture used --chat")
    ap.add_argument("--tol", type=float, default=0.01, help="relative L2 tolerance (default 1%%)")
    args = ap.parse_args()
    man = json.load(open(os.path.join(args.trace, "manifest.json")))
    P = man["tokens"]["prompt_len"]
    n_dec = man["generation"]["n_decode"]
    trace_ids = man["tokens"]["ids"]
    model = Model(args.model)
    tok = Bpe(model.reader)
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    if args.chat:
        import jinja2
        tmpl = jinja2.Environment().from_string(field(model.reader, "tokenizer.chat_template"))
        rendered = tmpl.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        rendered = prompt
    ref_ids = tok.encode(rendered)
    failures = []
    if ref_ids != trace_ids[:P]:
        failures.append(f"prompt token ids differ: reference {ref_ids[:20]}... vs trace {trace_ids[:20]}...")

    # Greedy continuation, recomputed from scratch at every step (no KV cache: a
    # different algorithm from kvreplay's cached decode).
    ids = list(ref_ids)
    for _ in range(n_dec):
        _, logits = model.forward_all(np.array(ids))
        ids.append(int(np.argmax(logits[-1])))
    if ids[P:] != trace_ids[P:]:
        failures.append(f"greedy continuation differs: reference {ids[P:]} vs trace {trace_ids[P:]}")

    taps, _ = model.forward_all(np.array(trace_ids))
    T = len(trace_ids)
    tri = np.tril(np.ones((T, T), dtype=bool))
    worst = {"logits": 0.0, "v": 0.0, "o": 0.0}
    layers = load_layers(args.trace, model.n_layers)
    group = model.n_heads // model.n_kv
    for l, (q, k, v, o) in enumerate(taps):
        tq, tk, tv, to = (layers[l][n].astype(np.float32) for n in ("q", "k", "v", "o"))
        q, k = to_hf_order(q, model.hd), to_hf_order(k, model.hd)
        for h in range(model.n_heads):
            g = h // group
            e_log = rel_l2((tq[h] @ tk[g].T)[tri], (q[h] @ k[g].T)[tri])
            e_o = rel_l2(to[h], o[h])
            worst["logits"] = max(worst["logits"], e_log)
            worst["o"] = max(worst["o"], e_o)
            for name, e in (("logits", e_log), ("o", e_o)):
                if not e <= args.tol:
                    failures.append(f"layer {l} head {h}: {name} relative L2 error {e:.3e} > {args.tol}")
        for g in range(model.n_kv):
            e_v = rel_l2(tv[g], v[g])
            worst["v"] = max(worst["v"], e_v)
            if not e_v <= args.tol:
                failures.append(f"layer {l} kv head {g}: v relative L2 error {e_v:.3e} > {args.tol}")

    print(f"reference: prompt {P} tokens ({'identical' if ref_ids == trace_ids[:P] else 'DIFFERENT'} ids), "
          f"greedy continuation {ids[P:] == trace_ids[P:] and 'identical' or 'DIFFERENT'} over {n_dec} tokens "
          f"({tok_text(tok, ids[P:])!r})")
    print(f"reference: worst relative L2 error over {model.n_layers} layers x {model.n_heads} heads: "
          f"logits {worst['logits']:.2e}, v {worst['v']:.2e}, o {worst['o']:.2e} (tolerance {args.tol:.0e})")
    if failures:
        for f in failures[:20]:
            print("MISMATCH:", f)
        sys.exit(1)
    print("reference: trace matches")


def tok_text(tok, ids):
    return bytes(tok.byte_inv[c] for i in ids for c in tok.tokens[i] if c in tok.byte_inv).decode("utf-8", "replace")


def load_layers(trace, n):
    return [load_file(os.path.join(trace, f"layer-{l:03d}.safetensors")) for l in range(n)]


if __name__ == "__main__":
    main()
