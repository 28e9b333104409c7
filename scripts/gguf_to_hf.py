#!/usr/bin/env python3
"""Convert a llama-architecture GGUF (byte-level BPE tokenizer) into an HF
transformers checkpoint directory, for testing kvreplay's HF loader against
its GGUF loader on the same weights.

Writes into OUT_DIR:
- model.safetensors: every weight dequantised by the `gguf` package to f32
  (or f16 with --dtype f16), named as transformers names them, with the rows
  of q_proj and k_proj un-permuted from llama.cpp's interleaved-RoPE order
  back to the HF rotate-half order (HF row j*d/2 + i = GGUF row 2i + j per
  head; the inverse of convert_hf_to_gguf.py's `permute`);
- config.json: model_type llama, sizes, rope_theta, rms_norm_eps,
  tie_word_embeddings (no output.weight in the GGUF), vocab, context;
- tokenizer.json: byte-level BPE from tokenizer.ggml.tokens/merges, the
  pre-tokenizer named by tokenizer.ggml.pre (smollm: digits split one by one
  then GPT-2 ByteLevel; gpt2/default: ByteLevel), control tokens (type 3) as
  special added tokens and user-defined ones (type 4) as plain added tokens,
  no post-processor (the GGUF path adds no BOS for this tokenizer);
- tokenizer_config.json: the GGUF chat template, bos/eos tokens.

Usage: gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype f32|f16] [--shards N]
"""
import argparse
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def unpermute(w, n_heads):
    """GGUF (interleaved pairs) -> HF (halves) row order of a Q/K weight (rows, cols)."""
    rows, cols = w.shape
    hd = rows // n_heads
    # GGUF row h*hd + 2i + j holds HF row h*hd + j*hd/2 + i
    return w.reshape(n_heads, hd // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    ap.add_argument("--shards", type=int, default=1, help="write a sharded checkpoint with an index")
    a = ap.parse_args()

    r = GGUFReader(a.model)
    arch = field(r, "general.architecture")
    if arch != "llama":
        sys.exit(f"{a.model}: architecture {arch!r}; this script converts llama GGUFs")
    if field(r, "tokenizer.ggml.model") != "gpt2":
        sys.exit(f"{a.model}: tokenizer model {field(r, 'tokenizer.ggml.model')!r}; only byte-level BPE (gpt2)")
    k = lambda s: field(r, f"llama.{s}")
    n_layers = int(k("block_count"))
    d = int(k("embedding_length"))
    n_heads = int(k("attention.head_count"))
    n_kv = int(k("attention.head_count_kv") or n_heads)
    tokens = list(field(r, "tokenizer.ggml.tokens"))
    types = list(field(r, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(field(r, "tokenizer.ggml.merges"))
    pre = field(r, "tokenizer.ggml.pre") or "default"
    if field(r, "llama.rope.scaling.type") not in (None, "none"):
        sys.exit("RoPE scaling in the GGUF: not converted by this script")

    dt = np.float32 if a.dtype == "f32" else np.float16
    t = {}
    for ten in r.tensors:
        w = dequantize(ten.data, ten.tensor_type).astype(np.float32)
        t[ten.name] = w.reshape([int(x) for x in reversed(ten.shape)])
    hf = {}
    hf["model.embed_tokens.weight"] = t["token_embd.weight"]
    hf["model.norm.weight"] = t["output_norm.weight"]
    tied = "output.weight" not in t
    if not tied:
        hf["lm_head.weight"] = t["output.weight"]
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for l in range(n_layers):
        for g, h in names.items():
            w = t[f"blk.{l}.{g}.weight"]
            if g == "attn_q":
                w = unpermute(w, n_heads)
            elif g == "attn_k":
                w = unpermute(w, n_kv)
            hf[f"model.layers.{l}.{h}.weight"] = w
    hf = {n: np.ascontiguousarray(w.astype(dt)) for n, w in hf.items()}

    os.makedirs(a.out, exist_ok=True)
    if a.shards <= 1:
        save_file(hf, os.path.join(a.out, "model.safetensors"))
    else:
        keys = sorted(hf)
        per = (len(keys) + a.shards - 1) // a.shards
        wm = {}
        for s in range(a.shards):
            fn = f"model-{s + 1:05d}-of-{a.shards:05d}.safetensors"
            part = keys[s * per:(s + 1) * per]
            save_file({n: hf[n] for n in part}, os.path.join(a.out, fn))
            wm.update({n: fn for n in part})
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": int(sum(w.nbytes for w in hf.values()))}, "weight_map": wm}, f)

    vocab = len(tokens)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": int(k("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(k("attention.key_length") or d // n_heads),
        "max_position_embeddings": int(k("context_length")),
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(k("rope.freq_base") or 10000.0),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "vocab_size": int(k("vocab_size") or vocab),
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32" if a.dtype == "f32" else "float16",
        "_name_or_path": field(r, "general.name") or "",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre == "smollm":
        pre_tok = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, bytelevel]}
    elif pre in ("gpt2", "default"):
        pre_tok = bytelevel
    else:
        sys.exit(f"pre-tokenizer {pre!r}: not converted by this script (smollm, gpt2, default)")
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": ty != 3, "special": ty == 3}
        for i, (tok, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tok,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    tid = lambda key: field(r, key)
    tc = {
        "add_bos_token": False,
        "bos_token": tokens[tid("tokenizer.ggml.bos_token_id")] if tid("tokenizer.ggml.bos_token_id") is not None else None,
        "eos_token": tokens[tid("tokenizer.ggml.eos_token_id")] if tid("tokenizer.ggml.eos_token_id") is not None else None,
        "chat_template": field(r, "tokenizer.chat_template"),
        "tokenizer_class": "GPT2Tokenizer",
    }
    with open(os.path.join(a.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, ensure_ascii=False, indent=2)
    print(f"wrote {a.out}: {len(hf)} tensors ({a.dtype}), {n_layers} layers, vocab {vocab}, tied={tied}, pre={pre}")


if __name__ == "__main__":
    main()
