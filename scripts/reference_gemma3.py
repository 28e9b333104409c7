#!/usr/bin/env python3
"""Independent f32 reference for kvreplay capture of Gemma 3 GGUFs (`gemma3`).

The sibling of reference_llama.py for the `gemma3` architecture, run on a trace
that `kvreplay capture` wrote:

- weights dequantised by the `gguf` Python package (not kvreplay's code);
- the tokenizer is the `sentencepiece` package itself, loaded from a
  ModelProto built from the GGUF pieces, scores and types (BPE, byte
  fallback, no dummy prefix, no normalisation) -- not kvreplay's SPM code and
  not transformers' GGUF tokenizer (which gets this file wrong). Before
  sentencepiece sees the text, the control and user-defined pieces written in
  it (`<start_of_turn>`, the whitespace runs "  ", "\n\n", ...) are split out
  whole, longest first, as HF tokenizers' added tokens and llama.cpp's special
  partition do (sentencepiece itself would spell `<start_of_turn>` out of
  ordinary pieces, and it escapes spaces before it looks for "  ");
- the forward pass in NumPy float32 over the whole sequence at once (no KV
  cache), written from HF transformers' Gemma 3: embeddings * sqrt(d_model);
  per block attn_norm -> q/k/v -> per-head RMSNorm of q and k -> rotate-half
  RoPE (base 1e6 on full layers, 10,000 on sliding ones) -> attention with
  scale head_dim^-0.5 and, on sliding layers (l % 6 != 5), the mask
  kv_idx > q_idx - W -> o_proj -> post_attention_norm -> residual;
  ffn_norm -> gelu_tanh(gate) * up -> down -> post_ffw_norm -> residual;
  output_norm, tied head. The GGUF norm weights already hold HF's (1 + w).

Checks: identical prompt token ids, identical greedy continuation (each step
recomputed from scratch), and per layer and head the relative L2 error of q,
k, v and o against the trace.

Usage: reference_gemma3.py --model M.gguf --trace T.kvtrace (--prompt TEXT | --prompt-file F) [--tol 0.01]
       reference_gemma3.py --model M.gguf --tokenize TEXT   (print the reference ids)
       reference_gemma3.py --model M.gguf --check-ids F.json (F: [{"name", "text", "ids"}]; exit 1 on a mismatch)
"""
import argparse
import json
import os
import re
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file

LOCAL_ROPE_BASE = 10000.0  # HF rope_local_base_freq; not in the GGUF
SWA_PATTERN = 6  # layer l is full attention when l % 6 == 5


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def sentencepiece_from_gguf(reader):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    pieces = field(reader, "tokenizer.ggml.tokens")
    scores = field(reader, "tokenizer.ggml.scores")
    types = field(reader, "tokenizer.ggml.token_type")
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(pieces)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = unk
    m.trainer_spec.bos_id = field(reader, "tokenizer.ggml.bos_token_id")
    m.trainer_spec.eos_id = field(reader, "tokenizer.ggml.eos_token_id")
    m.trainer_spec.pad_id = field(reader, "tokenizer.ggml.padding_token_id")
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix"))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (p, s, t) in enumerate(zip(pieces, scores, types)):
        sp = m.pieces.add()
        sp.piece = p
        sp.score = float(s)
        # GGUF and SentencePiece number the types alike (1 normal, 2 unknown,
        # 3 control, 4 user-defined, 5 unused, 6 byte); the GGUF marks <unk>
        # as control, SentencePiece wants it as the unknown piece.
        sp.type = 2 if i == unk else int(t)
    proc = spm.SentencePieceProcessor()
    proc.LoadFromSerializedProto(m.SerializeToString())
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token"))
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    # control (3) and user-defined (4) pieces written in the text are matched
    # whole, the longest at each position first
    special = {p: i for i, (p, t) in enumerate(zip(pieces, types)) if int(t) in (3, 4)}
    split = re.compile("|".join(re.escape(p) for p in sorted(special, key=len, reverse=True)))

    def encode(text):
        ids = [bos] if add_bos else []
        at = 0
        for m in split.finditer(text):
            if m.start() > at:
                ids += proc.encode(text[at:m.start()])
            ids.append(special[m.group()])
            at = m.end()
        if at < len(text):
            ids += proc.encode(text[at:])
        return ids

    return encode, proc


class Model:
    def __init__(self, path):
        r = GGUFReader(path)
        self.reader = r
        arch = field(r, "general.architecture")
        if arch != "gemma3":
            sys.exit(f"reference: architecture {arch!r} is not gemma3 (see reference_llama.py)")
        g = lambda k, d=None: field(r, f"gemma3.{k}") if field(r, f"gemma3.{k}") is not None else d
        for k in ("final_logit_softcapping", "attn_logit_softcapping"):
            if g(k) is not None:
                sys.exit(f"reference: {k} is not implemented")
        self.n_layers = g("block_count")
        self.n_heads = g("attention.head_count")
        self.n_kv = g("attention.head_count_kv", self.n_heads)
        self.dim = g("embedding_length")
        self.hd = g("attention.key_length")
        self.eps = np.float32(g("attention.layer_norm_rms_epsilon"))
        self.theta = g("rope.freq_base")
        self.window = g("attention.sliding_window")
        self.scale = np.float32(self.hd ** -0.5)  # query_pre_attn_scalar = head_dim
        self.t = {}
        for t in r.tensors:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.t[t.name] = w.reshape([int(x) for x in reversed(t.shape)])
        self.head = self.t.get("output.weight", self.t["token_embd.weight"])

    def sliding(self, l):
        return l % SWA_PATTERN != SWA_PATTERN - 1

    def rmsnorm(self, x, w):
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.eps)).astype(np.float32) * w

    def rope_half(self, x, pos, theta):
        # x: (T, heads, hd); dimension i pairs with i + hd/2 (HF rotate_half)
        half = self.hd // 2
        i = np.arange(half, dtype=np.float64)
        ang = pos[:, None].astype(np.float64) * theta ** (-2.0 * i / self.hd)
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def forward_all(self, ids, logits_last_only=True):
        T = len(ids)
        pos = np.arange(T)
        x = self.t["token_embd.weight"][ids] * np.float32(np.sqrt(self.dim))
        taps = []
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        causal = ki <= qi
        local = causal & (ki > qi - self.window)
        group = self.n_heads // self.n_kv
        for l in range(self.n_layers):
            w = lambda n: self.t[f"blk.{l}.{n}.weight"]
            h = self.rmsnorm(x, w("attn_norm"))
            q = (h @ w("attn_q").T).reshape(T, self.n_heads, self.hd)
            k = (h @ w("attn_k").T).reshape(T, self.n_kv, self.hd)
            v = (h @ w("attn_v").T).reshape(T, self.n_kv, self.hd)
            q, k = self.rmsnorm(q, w("attn_q_norm")), self.rmsnorm(k, w("attn_k_norm"))
            theta = LOCAL_ROPE_BASE if self.sliding(l) else self.theta
            q, k = self.rope_half(q, pos, theta), self.rope_half(k, pos, theta)
            q, k, v = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            kk, vv = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
            mask = np.where(local if self.sliding(l) else causal, 0.0, -np.inf).astype(np.float32)
            s = q @ kk.transpose(0, 2, 1) * self.scale + mask
            s = s - s.max(-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(-1, keepdims=True)
            o = p @ vv  # (heads, T, hd)
            taps.append((q, k, v, o))
            a = o.transpose(1, 0, 2).reshape(T, -1) @ w("attn_output").T
            x = x + self.rmsnorm(a, w("post_attention_norm"))
            h = self.rmsnorm(x, w("ffn_norm"))
            gte, up = h @ w("ffn_gate").T, h @ w("ffn_up").T
            gelu = 0.5 * gte * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (gte + np.float32(0.044715) * gte ** 3)))
            x = x + self.rmsnorm((gelu * up) @ w("ffn_down").T, w("post_ffw_norm"))
        last = x[-1:] if logits_last_only else x
        logits = self.rmsnorm(last, self.t["output_norm.weight"]) @ self.head.T
        return taps, logits


def rel_l2(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trace")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text given to kvreplay capture")
    src.add_argument("--prompt-file")
    src.add_argument("--tokenize", help="only print the reference token ids of this text")
    src.add_argument("--check-ids", help="JSON list of {name, text, ids}: compare each with the reference ids")
    ap.add_argument("--tol", type=float, default=0.01, help="relative L2 tolerance (default 1%%)")
    args = ap.parse_args()
    if args.tokenize is not None:
        encode, _ = sentencepiece_from_gguf(GGUFReader(args.model))
        print(json.dumps(encode(args.tokenize)))
        return
    if args.check_ids is not None:
        encode, proc = sentencepiece_from_gguf(GGUFReader(args.model))
        bad = 0
        for item in json.load(open(args.check_ids, encoding="utf-8")):
            ref = encode(item["text"])
            got = item["ids"]
            if ref == got:
                print(f"reference: {item['name']}: {len(ref)} ids identical")
                continue
            bad += 1
            at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            print(f"MISMATCH: {item['name']}: {len(ref)} reference ids vs {len(got)} given; first difference "
                  f"at {at}: reference {[proc.id_to_piece(i) for i in ref[at:at + 5]]} vs "
                  f"given {[proc.id_to_piece(i) for i in got[at:at + 5]]}")
        sys.exit(1 if bad else 0)
    if not args.trace:
        sys.exit("--trace is required unless --tokenize or --check-ids")
    man = json.load(open(os.path.join(args.trace, "manifest.json")))
    P = man["tokens"]["prompt_len"]
    n_dec = man["generation"]["n_decode"]
    trace_ids = man["tokens"]["ids"]
    model = Model(args.model)
    encode, proc = sentencepiece_from_gguf(model.reader)
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    ref_ids = encode(prompt)
    failures = []
    if ref_ids != trace_ids[:P]:
        failures.append(f"prompt token ids differ: reference {ref_ids[:20]}... vs trace {trace_ids[:20]}...")

    # The manifest's per-layer list must say what this script computes.
    layers_meta = man["model"].get("layers", [])
    for l in range(model.n_layers):
        want = {"window": model.window if model.sliding(l) else None,
                "rope_theta": LOCAL_ROPE_BASE if model.sliding(l) else model.theta}
        got = layers_meta[l] if l < len(layers_meta) else None
        if got != want:
            failures.append(f"manifest model.layers[{l}] is {got}, expected {want}")

    ids = list(ref_ids)
    for _ in range(n_dec):
        _, logits = model.forward_all(np.array(ids))
        ids.append(int(np.argmax(logits[-1])))
    if ids[P:] != trace_ids[P:]:
        failures.append(f"greedy continuation differs: reference {ids[P:]} vs trace {trace_ids[P:]}")

    taps, _ = model.forward_all(np.array(trace_ids))
    layers = [load_file(os.path.join(args.trace, f"layer-{l:03d}.safetensors")) for l in range(model.n_layers)]
    worst = {n: 0.0 for n in "qkvo"}
    per_layer = []
    for l, (q, k, v, o) in enumerate(taps):
        tr = {n: layers[l][n].astype(np.float32) for n in "qkvo"}
        ref = {"q": q, "k": k, "v": v, "o": o}
        lw = {n: 0.0 for n in "qkvo"}
        for n in "qkvo":
            heads = model.n_heads if n in "qo" else model.n_kv
            for h in range(heads):
                e = rel_l2(tr[n][h], ref[n][h])
                lw[n] = max(lw[n], e)
                if not e <= args.tol:
                    failures.append(f"layer {l} {n} head {h}: relative L2 error {e:.3e} > {args.tol}")
        for n in "qkvo":
            worst[n] = max(worst[n], lw[n])
        per_layer.append(lw)

    for l, lw in enumerate(per_layer):
        kind = f"sliding {model.window}" if model.sliding(l) else "full"
        print(f"reference: layer {l:2d} ({kind:>11}): q {lw['q']:.2e} k {lw['k']:.2e} v {lw['v']:.2e} o {lw['o']:.2e}")
    print(f"reference: prompt {P} tokens ({'identical' if ref_ids == trace_ids[:P] else 'DIFFERENT'} ids), "
          f"greedy continuation {ids[P:] == trace_ids[P:] and 'identical' or 'DIFFERENT'} over {n_dec} tokens "
          f"({proc.decode(ids[P:])!r})")
    print(f"reference: worst relative L2 error over {model.n_layers} layers x {model.n_heads} heads: "
          f"q {worst['q']:.2e}, k {worst['k']:.2e}, v {worst['v']:.2e}, o {worst['o']:.2e} (tolerance {args.tol:.0e})")
    if failures:
        for f in failures[:20]:
            print("MISMATCH:", f)
        sys.exit(1)
    print("reference: trace matches")


if __name__ == "__main__":
    main()
