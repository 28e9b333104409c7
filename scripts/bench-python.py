#!/usr/bin/env python3
"""Python scorer overhead against the same rule in Rust, per replay point.

    scripts/test-python.sh -k nothing   # builds the wheel into .venv-py (or: maturin develop --release)
    .venv-py/bin/python scripts/bench-python.py results/bench2048.kvtrace [--reps 5]

Each point is one `kvreplay.replay` call from a cold start (the trace
converted to f32, the full-cache reference computed), the built-in and the
Python port alternating; prints the median per point of each and the
difference (the Python scorer's cost: its score() per layer, the copies of
keys/values/colsum handed to it, and the GIL hand-offs).
"""
import argparse
import statistics
import time
from pathlib import Path

import kvreplay

PORTS = Path(__file__).resolve().parent.parent / "python" / "tests" / "ports"

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--budget", type=int, default=256)
a = ap.parse_args()
t = kvreplay.Trace(a.trace)
print(f"trace {a.trace}: P={t.prompt_len}, decode={t.n_decode}, {t.n_layers} layers, budget {a.budget}")
pairs = [
    ("snapkv:w=32", f"py:{PORTS}/snapkv.py:SnapKV:w=32"),
    ("knorm", f"py:{PORTS}/knorm.py:KNorm"),
]
kvreplay.replay(t, "full", budget=a.budget)  # page the trace in
for rust, py in pairs:
    times = {rust: [], py: []}
    for _ in range(a.reps):
        for spec in (rust, py):
            t0 = time.perf_counter()
            r = kvreplay.replay(t, spec, budget=a.budget)
            times[spec].append(time.perf_counter() - t0)
        same = r.retention["position"].tolist() == kvreplay.replay(t, rust, budget=a.budget).retention["position"].tolist()
    # the time inside score() itself, per point (the same port as an object)
    path, cls = py[3:].split(":")[0], py[3:].split(":")[1]
    mod = kvreplay._load_scorer(path, cls, dict(kv.split("=") for kv in py.split(":")[3:4] if kv))
    inner = []
    orig = type(mod).score

    def timed(self, ctx, _o=orig):
        t0 = time.perf_counter()
        try:
            return _o(self, ctx)
        finally:
            inner[-1] += time.perf_counter() - t0

    mod.score = timed.__get__(mod)
    for _ in range(a.reps):
        inner.append(0.0)
        kvreplay.replay(t, mod, budget=a.budget)
    mr, mp = statistics.median(times[rust]), statistics.median(times[py])
    print(f"{'':14s} inside score(): median {statistics.median(inner):.3f} s per point ({len(inner)} points)")
    print(f"{rust:14s} Rust {mr:.3f} s  Python {mp:.3f} s  overhead {mp - mr:+.3f} s ({mp / mr:.2f}x)  same kept: {same}")
    print(f"    Rust {[round(x, 3) for x in times[rust]]}  Python {[round(x, 3) for x in times[py]]}")
