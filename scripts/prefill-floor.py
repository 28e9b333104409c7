#!/usr/bin/env python3
"""The products of a prefill, timed alone with NumPy's BLAS: a ceiling for capture's prefill rate.

Capture's prefill is mostly matrix products: per chunk of the prompt and per
layer, x·Wᵀ for q, k, v, o, gate, up and down, and per head Q·Kᵀ and P·V over
the keys so far. This script times exactly those products in float32 with the
BLAS NumPy ships (OpenBLAS), chunk by chunk as `kvreplay capture` runs them,
and nothing else: no norms, RoPE, softmax, quantised weights or trace writes.
Attention's products are timed over every key up to the end of the chunk and
scaled to the causal part (the same rate assumed for it). The prompt's tokens
divided by the sum is the prefill rate capture could reach if all of its other
work were free and its products were as fast as this BLAS.

Threads: set OPENBLAS_NUM_THREADS (the figures in BENCHMARKS.md use 2, this
machine's cores). The defaults are SmolLM2-135M's shapes.

    OPENBLAS_NUM_THREADS=2 .venv-ref/bin/python scripts/prefill-floor.py --reps 5
"""
import argparse
import os
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    f32 = np.float32
    dm, nh, nkv, hd, ffn, c = a.d_model, a.heads, a.kv_heads, a.head_dim, a.ffn, a.chunk
    # One layer's weights, stored transposed (in, out) as NumPy multiplies
    # fastest; the same weights serve every layer (the shapes are what count).
    w = {
        "q": (dm, nh * hd), "k": (dm, nkv * hd), "v": (dm, nkv * hd), "o": (nh * hd, dm),
        "gate": (dm, ffn), "up": (dm, ffn), "down": (ffn, dm),
    }
    w = {n: rng.standard_normal(s, dtype=f32) for n, s in w.items()}
    x = rng.standard_normal((c, dm), dtype=f32)
    xo = rng.standard_normal((c, nh * hd), dtype=f32)
    xf = rng.standard_normal((c, ffn), dtype=f32)
    q = rng.standard_normal((nh, c, hd), dtype=f32)
    keys = rng.standard_normal((nh, a.prompt_tokens, hd), dtype=f32)
    vals = rng.standard_normal((nh, a.prompt_tokens, hd), dtype=f32)

    def chunk_products(pos0):
        n = pos0 + c
        t0 = time.perf_counter()
        for name in ("q", "k", "v"):
            x @ w[name]
        xo @ w["o"]
        x @ w["gate"]
        x @ w["up"]
        xf @ w["down"]
        t1 = time.perf_counter()
        s = q @ keys[:, :n].transpose(0, 2, 1)  # (nh, c, n)
        s @ vals[:, :n]  # (nh, c, hd)
        t2 = time.perf_counter()
        # Causal: query i of the chunk sees pos0 + i + 1 keys.
        causal = c * pos0 + c * (c + 1) / 2
        return t1 - t0, (t2 - t1) * causal / (c * n)

    lin_flops = 2 * a.prompt_tokens * sum(m.size for m in w.values()) * a.layers
    att_flops = 4 * nh * hd * sum(t + 1 for t in range(a.prompt_tokens)) * a.layers
    chunks = range(0, a.prompt_tokens, c)
    chunk_products(0)  # warm-up
    runs = []
    for _ in range(a.reps):
        lin = att = 0.0
        for _ in range(a.layers):
            for pos0 in chunks:
                tl, ta = chunk_products(pos0)
                lin, att = lin + tl, att + ta
        runs.append((lin + att, lin, att))
    runs.sort()
    tot, lin, att = runs[len(runs) // 2]
    print(f"products of a {a.prompt_tokens}-token prefill, {a.layers} layers, chunks of {c} "
          f"(median of {a.reps}):")
    print(f"  linear layers {lin:.3f} s ({lin_flops / lin / 1e9:.1f} GFLOP/s), "
          f"attention {att:.3f} s ({att_flops / att / 1e9:.1f} GFLOP/s)")
    print(f"  total {tot:.3f} s (all runs: {', '.join(f'{r[0]:.3f}' for r in runs)} s)")
    print(f"ceiling capture prefill from its products alone (NumPy's BLAS, "
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')} threads): "
          f"{a.prompt_tokens / tot:.1f} tok/s, with every other step free")


if __name__ == "__main__":
    main()
