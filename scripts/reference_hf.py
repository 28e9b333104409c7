#!/usr/bin/env python3
"""Independent NumPy reference for kvreplay captures of HF checkpoints.

  reference_hf.py make-tiny OUT_DIR
      writes tiny random-weight checkpoints OUT_DIR/{qwen2,qwen3,mistral,llama3,gemma3_text}
      (config.json, model.safetensors or an index + 2 shards, a WordLevel tokenizer.json
      whose words are w0..w29 and whose post-processor adds BOS <s>)
  reference_hf.py check --checkpoint DIR --trace T.kvtrace [--tol 1e-4]
      recomputes the trace's model in NumPy float64 from config.json and the
      safetensors, written from transformers' modeling_{llama,mistral,qwen2,qwen3,gemma3}.py
      (rotate-half RoPE with llama3 frequency scaling, q/k/v/o biases, q/k RMSNorm,
      sliding-window mask kv > q - W, Gemma's (1 + w) norms, post norms, GELU-tanh,
      scaled embeddings), without a KV cache; checks the greedy continuation (recomputed
      from scratch each step) and every layer's q/k/v/o per head against the trace.

Needs numpy and safetensors (.venv-ref). The prompt ids are taken from the trace
(the tokenizer is checked by the Rust tests).
"""
import argparse
import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

WORDS = 30


def tokenizer_json():
    vocab = {"<s>": 0, "<unk>": 1}
    vocab.update({f"w{i}": i + 2 for i in range(WORDS)})
    special = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [special, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
        },
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


FAMILIES = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6, heads=4, kv=2, hd=8),
    "qwen3": dict(model_type="qwen3", attention_bias=False, head_dim=12, heads=4, kv=2, hd=12, dtype="f16"),
    "mistral": dict(model_type="mistral", sliding_window=3, heads=4, kv=2, hd=8, dtype="f16"),
    "llama3": dict(model_type="llama", attention_bias=True, head_dim=16, heads=2, kv=1, hd=16, shards=2,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=8, heads=4, kv=1, hd=8, sliding_window=3,
                        sliding_window_pattern=2, query_pre_attn_scalar=8, rope_theta=1e6,
                        rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
                        tie_word_embeddings=True),
}


def make_tiny(out):
    d, ffn, layers, vocab = 32, 48, 2, WORDS + 2 + 6
    for seed, (name, f) in enumerate(FAMILIES.items()):
        f = dict(f)
        rng = np.random.RandomState(1000 + seed)
        heads, kv, hd = f.pop("heads"), f.pop("kv"), f.pop("hd")
        dtype = np.float16 if f.pop("dtype", "f32") == "f16" else np.float32
        shards = f.pop("shards", 1)
        mt = f["model_type"]
        gemma = mt == "gemma3_text"
        cfg = {"model_type": mt, "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
               "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
               "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": False}
        if not gemma:
            cfg["hidden_act"] = "silu"
        cfg.update(f)
        w = {}
        mat = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)
        vec = lambda n, off: (off + rng.standard_normal(n) * 0.2).astype(np.float32)
        noff = 0.0 if gemma else 1.0  # Gemma stores w of (1 + w)
        w["model.embed_tokens.weight"] = mat(vocab, d)
        w["model.norm.weight"] = vec(d, noff)
        if not cfg["tie_word_embeddings"]:
            w["lm_head.weight"] = mat(vocab, d)
        bias = mt == "qwen2" or cfg.get("attention_bias", False)
        for l in range(layers):
            p = f"model.layers.{l}."
            w[p + "input_layernorm.weight"] = vec(d, noff)
            w[p + "post_attention_layernorm.weight"] = vec(d, noff)
            if gemma:
                w[p + "pre_feedforward_layernorm.weight"] = vec(d, noff)
                w[p + "post_feedforward_layernorm.weight"] = vec(d, noff)
            w[p + "self_attn.q_proj.weight"] = mat(heads * hd, d)
            w[p + "self_attn.k_proj.weight"] = mat(kv * hd, d)
            w[p + "self_attn.v_proj.weight"] = mat(kv * hd, d)
            w[p + "self_attn.o_proj.weight"] = mat(d, heads * hd)
            if bias:
                w[p + "self_attn.q_proj.bias"] = vec(heads * hd, 0.0)
                w[p + "self_attn.k_proj.bias"] = vec(kv * hd, 0.0)
                w[p + "self_attn.v_proj.bias"] = vec(kv * hd, 0.0)
            if mt == "llama" and bias:
                w[p + "self_attn.o_proj.bias"] = vec(d, 0.0)
            if mt in ("qwen3", "gemma3_text"):
                w[p + "self_attn.q_norm.weight"] = vec(hd, noff)
                w[p + "self_attn.k_norm.weight"] = vec(hd, noff)
            w[p + "mlp.gate_proj.weight"] = mat(ffn, d)
            w[p + "mlp.up_proj.weight"] = mat(ffn, d)
            w[p + "mlp.down_proj.weight"] = mat(d, ffn)
        w = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in w.items()}
        dd = os.path.join(out, name)
        os.makedirs(dd, exist_ok=True)
        if shards == 1:
            save_file(w, os.path.join(dd, "model.safetensors"))
        else:
            keys = sorted(w)
            per = (len(keys) + shards - 1) // shards
            wm = {}
            for s in range(shards):
                fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
                save_file({k: w[k] for k in keys[s * per:(s + 1) * per]}, os.path.join(dd, fn))
                wm.update({k: fn for k in keys[s * per:(s + 1) * per]})
            json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(dd, "model.safetensors.index.json"), "w"))
        json.dump(cfg, open(os.path.join(dd, "config.json"), "w"), indent=1)
        json.dump(tokenizer_json(), open(os.path.join(dd, "tokenizer.json"), "w"))
        json.dump({"bos_token": "<s>", "eos_token": "<unk>"}, open(os.path.join(dd, "tokenizer_config.json"), "w"))
        print(f"wrote {dd}")


def load_weights(dirp):
    single = os.path.join(dirp, "model.safetensors")
    if os.path.exists(single):
        w = load_file(single)
    else:
        idx = json.load(open(os.path.join(dirp, "model.safetensors.index.json")))
        w = {}
        for fn in sorted(set(idx["weight_map"].values())):
            w.update(load_file(os.path.join(dirp, fn)))
    return {k: v.astype(np.float64) for k, v in w.items()}


class Model:
    def __init__(self, dirp):
        c = json.load(open(os.path.join(dirp, "config.json")))
        self.c = c
        self.mt = c["model_type"]
        if self.mt not in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
            sys.exit(f"model_type {self.mt}: not in this reference")
        self.gemma = self.mt == "gemma3_text"
        self.w = load_weights(dirp)
        self.L, self.d = c["num_hidden_layers"], c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads") or self.nh
        self.hd = c.get("head_dim") or self.d // self.nh
        self.eps = c["rms_norm_eps"]
        self.tied = c.get("tie_word_embeddings", self.gemma)
        # per layer (window, inv_freq)
        base = self.inv_freq(c.get("rope_theta", 10000.0), c.get("rope_scaling"))
        self.layers = []
        for l in range(self.L):
            win = None
            if "layer_types" in c and c["layer_types"]:
                if c["layer_types"][l] == "sliding_attention":
                    win = c["sliding_window"]
            elif self.gemma:
                if (l + 1) % c.get("sliding_window_pattern", 6) != 0:
                    win = c["sliding_window"]
            elif self.mt == "mistral":
                win = c.get("sliding_window")
            elif self.mt in ("qwen2", "qwen3") and c.get("use_sliding_window"):
                if l >= c.get("max_window_layers", 0):
                    win = c.get("sliding_window")
            inv = base
            if self.gemma and win is not None:
                inv = self.inv_freq(c.get("rope_local_base_freq", 10000.0), None)
            self.layers.append((win, inv))
        self.scale = (c.get("query_pre_attn_scalar", 256) if self.gemma else self.hd) ** -0.5

    def inv_freq(self, theta, scaling):
        dim = self.hd
        inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if not scaling:
            return inv
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            return inv / scaling["factor"]
        if kind != "llama3":
            sys.exit(f"rope scaling {kind}: not in this reference")
        # transformers' _compute_llama3_parameters
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_l = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return np.where(medium, smoothed, inv_l)

    def norm(self, x, w):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return y * (1.0 + w) if self.gemma else y * w

    def lin(self, x, name, bias=True):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y + b if (b is not None and bias) else y

    def rope(self, x, inv):  # x (T, H, hd)
        T = x.shape[0]
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
        h = x.shape[-1] // 2
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def forward_all(self, ids):
        T, hd = len(ids), self.hd
        x = self.w["model.embed_tokens.weight"][ids]
        if self.gemma:
            x = x * math.sqrt(self.d)
        taps = []
        for l in range(self.L):
            p = f"model.layers.{l}."
            win, inv = self.layers[l]
            h = self.norm(x, self.w[p + "input_layernorm.weight"])
            q = self.lin(h, p + "self_attn.q_proj").reshape(T, self.nh, hd)
            k = self.lin(h, p + "self_attn.k_proj").reshape(T, self.nkv, hd)
            v = self.lin(h, p + "self_attn.v_proj").reshape(T, self.nkv, hd)
            if p + "self_attn.q_norm.weight" in self.w:
                q = self.norm(q, self.w[p + "self_attn.q_norm.weight"])
                k = self.norm(k, self.w[p + "self_attn.k_norm.weight"])
            q, k = self.rope(q, inv), self.rope(k, inv)
            q, k, v = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            i, j = np.arange(T)[:, None], np.arange(T)[None, :]
            mask = j <= i
            if win is not None:
                mask &= j > i - win
            g = self.nh // self.nkv
            o = np.empty_like(q)
            for hh in range(self.nh):
                s = q[hh] @ k[hh // g].T * self.scale
                s = np.where(mask, s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                o[hh] = (s / s.sum(-1, keepdims=True)) @ v[hh // g]
            taps.append((q, k, v, o))
            a = self.lin(o.transpose(1, 0, 2).reshape(T, -1), p + "self_attn.o_proj")
            if self.gemma:
                a = self.norm(a, self.w[p + "post_attention_layernorm.weight"])
                x = x + a
                h = self.norm(x, self.w[p + "pre_feedforward_layernorm.weight"])
            else:
                x = x + a
                h = self.norm(x, self.w[p + "post_attention_layernorm.weight"])
            gt = self.lin(h, p + "mlp.gate_proj")
            up = self.lin(h, p + "mlp.up_proj")
            if self.gemma:
                act = 0.5 * gt * (1 + np.tanh(math.sqrt(2 / math.pi) * (gt + 0.044715 * gt ** 3)))
            else:
                act = gt / (1 + np.exp(-gt))
            m = self.lin(act * up, p + "mlp.down_proj")
            if self.gemma:
                m = self.norm(m, self.w[p + "post_feedforward_layernorm.weight"])
            x = x + m
        x = self.norm(x, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight"] if self.tied else self.w["lm_head.weight"]
        return taps, x @ head.T


def rel_l2(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(a):
    man = json.load(open(os.path.join(a.trace, "manifest.json")))
    P, ids = man["tokens"]["prompt_len"], man["tokens"]["ids"]
    m = Model(a.checkpoint)
    fails = []
    seq = list(ids[:P])
    for _ in range(man["generation"]["n_decode"]):
        _, logits = m.forward_all(np.array(seq))
        seq.append(int(np.argmax(logits[-1])))
    if seq != ids:
        fails.append(f"greedy continuation differs: reference {seq[P:]} vs trace {ids[P:]}")
    taps, _ = m.forward_all(np.array(ids))
    worst = dict(q=0.0, k=0.0, v=0.0, o=0.0)
    for l, tap in enumerate(taps):
        layer = load_file(os.path.join(a.trace, f"layer-{l:03d}.safetensors"))
        for name, ref in zip("qkvo", tap):
            got = layer[name].astype(np.float64)
            for h in range(ref.shape[0]):
                e = rel_l2(got[h], ref[h])
                worst[name] = max(worst[name], e)
                if not e <= a.tol:
                    fails.append(f"layer {l} head {h} {name}: relative L2 {e:.3e} > {a.tol}")
    print(f"reference: {m.mt}, prompt {P} + {len(ids) - P} greedy tokens "
          f"({'identical' if seq == ids else 'DIFFERENT'}); worst relative L2 over {m.L} layers: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {a.tol:.0e})")
    if fails:
        for f in fails[:20]:
            print("MISMATCH:", f)
        sys.exit(1)
    print("reference: trace matches")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-tiny")
    mk.add_argument("out")
    ck = sub.add_parser("check")
    ck.add_argument("--checkpoint", required=True)
    ck.add_argument("--trace", required=True)
    ck.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    make_tiny(a.out) if a.cmd == "make-tiny" else check(a)


if __name__ == "__main__":
    main()
