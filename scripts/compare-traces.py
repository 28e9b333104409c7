#!/usr/bin/env python3
"""Compare two kvreplay traces of the same prompt (e.g. captured with
--device cpu and --device cuda): per layer, the largest absolute difference
and the relative L2 error of q, k, v and o, and whether the tokens (prompt
and greedy decode) agree. Prints Markdown.

Usage: scripts/compare-traces.py REFERENCE.kvtrace OTHER.kvtrace

Uses numpy when it is installed, else plain Python (slower: about a minute
for a 2,000-token SmolLM2 trace). Reads the safetensors layer files
directly, so it needs no other package.
"""

import json
import math
import struct
import sys

try:
    import numpy as np
except ImportError:  # plain Python below
    np = None

TENSORS = ("q", "k", "v", "o")


def manifest(trace):
    with open(f"{trace}/manifest.json") as f:
        return json.load(f)


def read_layer(path):
    """{name: (dtype, shape, raw bytes)} of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = (t["dtype"], t["shape"], data[a:b])
    return out


def values(dtype, raw):
    """The tensor as a flat numpy float64 array, or a Python list."""
    if np is not None:
        if dtype == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            return u.view("<f4").astype(np.float64)
        return np.frombuffer(raw, dtype={"F16": "<f2", "F32": "<f4"}[dtype]).astype(
            np.float64
        )
    if dtype == "F16":
        return struct.unpack(f"<{len(raw) // 2}e", raw)
    if dtype == "F32":
        return struct.unpack(f"<{len(raw) // 4}f", raw)
    if dtype == "BF16":
        u = struct.unpack(f"<{len(raw) // 2}H", raw)
        return struct.unpack(f"<{len(u)}f", struct.pack(f"<{len(u)}I", *(x << 16 for x in u)))
    raise SystemExit(f"unsupported dtype {dtype}")


def diff(a, b):
    """(max |a - b|, ||a - b|| / ||a||, max |a|)."""
    if np is not None:
        d = b - a
        ref = float(np.sqrt(np.dot(a, a)))
        return float(np.max(np.abs(d))), float(np.sqrt(np.dot(d, d))) / max(ref, 1e-30), float(np.max(np.abs(a)))
    mx = num = den = amax = 0.0
    for x, y in zip(a, b):
        d = y - x
        num += d * d
        den += x * x
        ad = abs(d)
        if ad > mx:
            mx = ad
        ax = abs(x)
        if ax > amax:
            amax = ax
    return mx, math.sqrt(num) / max(math.sqrt(den), 1e-30), amax


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ref_dir, other_dir = sys.argv[1], sys.argv[2]
    ref, other = manifest(ref_dir), manifest(other_dir)
    print(f"reference `{ref_dir}` ({ref['capture']['device']}), other `{other_dir}` ({other['capture']['device']})\n")

    # tokens: the prompt must be the same; the greedy decode may diverge
    p = ref["tokens"]["prompt_len"]
    ra, oa = ref["tokens"]["ids"], other["tokens"]["ids"]
    if ra[:p] != oa[:p]:
        print("**prompt tokens differ**: the traces are not of the same prompt\n")
        return 2
    rd, od = ra[p:], oa[p:]
    first = next((i for i, (x, y) in enumerate(zip(rd, od)) if x != y), None)
    if first is None and len(rd) == len(od):
        print(f"greedy decode tokens: **agree** ({len(rd)} of {len(rd)})\n")
    else:
        at = first if first is not None else min(len(rd), len(od))
        print(f"greedy decode tokens: **differ** from decode step {at} (of {len(rd)}; "
              f"reference {rd[at:at + 4]}, other {od[at:at + 4]}); later positions compare different continuations\n")

    print("| layer | " + " | ".join(f"{t} max abs | {t} rel L2" for t in TENSORS) + " |")
    print("|---:|" + "---:|---:|" * len(TENSORS))
    worst = {t: (0.0, 0.0) for t in TENSORS}
    for fr, fo in zip(ref["files"], other["files"]):
        lr = read_layer(f"{ref_dir}/{fr['file']}")
        lo = read_layer(f"{other_dir}/{fo['file']}")
        cells = []
        for t in TENSORS:
            (dr, sr, br), (do, so, bo) = lr[t], lo[t]
            if sr != so:
                print(f"**layer {fr['layer']} {t}: shapes differ ({sr} vs {so})**")
                return 2
            mx, rel, _ = diff(values(dr, br), values(do, bo))
            worst[t] = (max(worst[t][0], mx), max(worst[t][1], rel))
            cells.append(f"{mx:.3e} | {rel:.3e}")
        print(f"| {fr['layer']} | " + " | ".join(cells) + " |")
    print("| **max** | " + " | ".join(f"**{worst[t][0]:.3e}** | **{worst[t][1]:.3e}**" for t in TENSORS) + " |")
    print("\n(rel L2 = ||other - reference|| / ||reference|| over the whole tensor of the layer, all heads and positions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
