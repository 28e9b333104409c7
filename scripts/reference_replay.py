#!/usr/bin/env python3
"""Independent, straightforward NumPy replay of policies on a kvreplay trace.

For the performance benchmark (`kvreplay bench replay --reference`): the same
teacher-forced replay as kvreplay (replay/SEMANTICS.md) for `full`, `snapkv`,
`h2o` and `streaming_llm` with their default parameters, the same metrics
(rel_l2, cosine, attn_mass, kl, averaged over decode steps, then over layers
and query heads), vectorised the way one would write it in NumPy: every
decode query of a head at once where the kept set is known in advance (a
(steps, T) mask), and a step loop only where the policy needs it (H2O's
decode-time eviction). Computed in float64 from the trace's f16 values.

Also the prefill-only kvpress presses, each a direct transcription of its rule
(docs/methods/NAME.md) with default parameters: `observed_attention`,
`keydiff` (block-wise, block 128), `lagkv` (n_sink 4, lag 128); a policy may
carry one parameter, `NAME:key=value` (`keydiff:preset=kvpress`,
`lagkv:cross_scoring=true`), `cur` (window 16, key x value, 4 sinks;
`cur:window=none`), `leverage` (sketch 48, seed 0: the same seeded Gaussian
sketch as kvreplay, keys rotated back to pre-RoPE), and `a2sf` (alpha 0.8, H2O's split and
decode-time eviction with every score multiplied by alpha per step;
`a2sf:alpha=0.5`, `a2sf:decode_evict=false`). tests/replay_real.rs checks
these against replay.

Usage: reference_replay.py TRACE_DIR --budgets 32,64,... [--policies full,snapkv,h2o,streaming_llm]
Prints one JSON object: {"seconds": total, "points": [{policy, budget, seconds, rel_l2, cosine, attn_mass, kl}]}.
"""
import argparse
import json
import time

import numpy as np
from safetensors.numpy import load_file

from reference_quantmeth import QUANTMETH
from reference_heads import HEADS  # whole-model head-level methods (own replay over entries)
from reference_presses import REPLAYS as PRESS_REPLAYS
import reference_evict  # kvcrush, lazyeviction, xkv, triforce (scripts/reference_evict.py)


def load(trace):
    man = json.load(open(f"{trace}/manifest.json"))
    layers = []
    for f in man["files"]:
        t = load_file(f"{trace}/{f['file']}")
        layers.append({k: t[k].astype(np.float64) for k in ("q", "k", "v", "attn_colsum")})
    return man, layers


def softmax_masked(logits, mask):
    """Row-wise softmax of logits (n, T) over mask (n, T) True entries."""
    x = np.where(mask, logits, -np.inf)
    x = x - x.max(axis=1, keepdims=True)
    w = np.exp(x)
    return w / w.sum(axis=1, keepdims=True)


def metrics(o_c, o_f, p_full, kept, p_comp):
    """Per-step metrics (n,) of compressed vs full outputs. kept (n, T) bool."""
    diff = np.linalg.norm(o_c - o_f, axis=1)
    nf = np.linalg.norm(o_f, axis=1)
    nc = np.linalg.norm(o_c, axis=1)
    rel = diff / np.maximum(nf, 1e-300)
    cos = (o_c * o_f).sum(axis=1) / np.maximum(nf * nc, 1e-300)
    mass = (p_full * kept).sum(axis=1)
    # KL(full restricted to the kept set, renormalised || compressed): 0 for eviction
    pf = np.where(kept, p_full, 0) / mass[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(pf > 0, pf * np.log(pf / np.maximum(p_comp, np.finfo(float).tiny)), 0).sum(axis=1)
    return rel, cos, mass, kl


def top_k(scores, cand, k):
    """The k best candidates by (score desc, position desc), ascending."""
    cand = np.asarray(cand)
    order = np.lexsort((-cand, -scores[cand]))  # last key is primary
    return np.sort(cand[order[:k]])


def prompt_attention(q, k, rows, scale):
    """Causal attention rows (len(rows), P) of prompt queries `rows` over prompt keys."""
    p = k.shape[0]
    logits = scale * q[rows] @ k[:p].T
    mask = np.arange(p)[None, :] <= np.asarray(rows)[:, None]
    return softmax_masked(logits, mask)


def observed_attention_keep(colsum, heads, p, b, **_):
    """Column sums / causal count (P - i), group mean, top B."""
    s = colsum[list(heads)].mean(axis=0) / (p - np.arange(p))
    return top_k(s, np.arange(p), b)


def keydiff_scores(kg, idx):
    """-cos(k_i, anchor) for positions idx; anchor = mean of the unit keys of idx."""
    x = kg[idx]
    n = np.maximum(np.linalg.norm(x, axis=1), 1e-12)
    anchor = (x / n[:, None]).mean(axis=0)
    return -(x @ anchor) / np.maximum(n * np.linalg.norm(anchor), 1e-12)


def keydiff_keep(kg, p, b, preset="paper", block="128", **_):
    """Block-wise: start with 0..B, append each block, cut back to the top B by
    the scores over the cache. preset=kvpress: the whole prompt at once."""
    s = np.zeros(p)
    if preset == "kvpress":
        s[:] = keydiff_scores(kg, np.arange(p))
        return top_k(s, np.arange(p), b)
    kept = np.arange(b)
    for start in range(b, p, int(block)):
        cur = np.concatenate([kept, np.arange(start, min(start + int(block), p))])
        s[cur] = keydiff_scores(kg, cur)
        kept = top_k(s, cur, b)
    return kept


def lagkv_keep(kg, vg, p, b, n_sink="4", lag="128", cross_scoring="false", **_):
    """Last partition and tail score 1, sinks 2; each earlier partition is scored
    by the softmaxed spread of its keys and values min-max normalised by the next
    partition's range, then ranked within the partition (unless cross_scoring)."""
    ns, lag = int(n_sink), int(lag)
    if p < ns + 2 * lag:
        s = np.ones(p)
        s[ns:] = np.arange(p - ns) / (p - ns)
        return top_k(s, np.arange(p), b)
    n_part = (p - ns) // lag
    s = np.ones(p)
    s[:ns] = 2.0  # sinks above the last partition and the tail

    def spread(x, part, ref):
        lo, hi = x[ref].min(axis=0), x[ref].max(axis=0)
        rng = hi - lo
        z = np.where(rng > 0, (x[part] - lo) / np.where(rng > 0, rng, 1), 0.0)
        sd = z.std(axis=1, ddof=1)
        e = np.exp(sd - sd.max())
        return e / e.sum()

    for m in range(n_part - 1):
        part = np.arange(ns + m * lag, ns + (m + 1) * lag)
        ref = part + lag
        sc = (spread(kg, part, ref) + spread(vg, part, ref)) / 2
        if cross_scoring == "true":
            s[part] = sc
        else:
            s[part[np.argsort(sc, kind="stable")]] = np.arange(lag) / lag
    return top_k(s, np.arange(p), b)


def cur_keep(kg, vg, p, b, n_sink="4", leverage="kv_product", window="16", **_):
    """Squared key and value norms, each divided by its local window's sum,
    combined (product by default), normalised, first n_sink set to 1."""
    k2 = (kg[:p] ** 2).sum(axis=1)
    v2 = (vg[:p] ** 2).sum(axis=1)
    if window != "none":
        w = int(window)
        win = np.arange(p) // w
        k2 = k2 / np.bincount(win, weights=k2)[win]
        v2 = v2 / np.bincount(win, weights=v2)[win]
    s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage]
    s = s / s.sum()
    s[: int(n_sink)] = 1.0
    return top_k(s, np.arange(p), b)


M64 = (1 << 64) - 1


class SplitMix64:
    """kvreplay's seeded generator (replay/src/policy.rs), in Python integers."""

    def __init__(self, state):
        self.s = state & M64

    def next_u64(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def next_f64(self):
        return (self.next_u64() >> 11) / float(1 << 53)

    @staticmethod
    def for_head(seed, layer, head):
        a = SplitMix64(seed ^ 0x9E3779B97F4A7C15).next_u64() ^ ((layer * 0xBF58476D1CE4E5B9) & M64)
        return SplitMix64(SplitMix64(a).next_u64() ^ ((head * 0x94D049BB133111EB) & M64))


def unrope(kg, rope):
    """Rotate post-RoPE keys (P, d) back to pre-RoPE (no frequency scaling)."""
    assert rope["scaling"]["type"] == "none", rope
    p, d = kg.shape
    rot = rope["rotated_dims"]
    half = rot // 2
    ang = np.arange(p)[:, None] * rope["theta"] ** (-2.0 * np.arange(half) / rot)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    out = kg.copy()
    if rope["style"] == "neox":
        i, j = np.arange(half), np.arange(half) + half
    else:
        i, j = 2 * np.arange(half), 2 * np.arange(half) + 1
    x, y = kg[:, i], kg[:, j]
    out[:, i] = x * c + y * s
    out[:, j] = -x * s + y * c
    return out


def leverage_raw(kg, p, layer, g, rope, sketch="48", seed="0", **_):
    """Hat-matrix diagonal of the centred pre-RoPE keys sketched by a seeded
    Gaussian d x m matrix / sqrt(m), with (X^T X + 0.01 I)^-1."""
    m = int(sketch)
    k = unrope(kg[:p], rope) if rope else kg[:p]
    x = k - k.mean(axis=0)
    d = x.shape[1]
    r = SplitMix64.for_head(int(seed), layer, g)
    z = []
    for _ in range(d * m):
        u1, u2 = 1.0 - r.next_f64(), r.next_f64()
        z.append(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2))
    phi = np.array(z).reshape(d, m) / np.sqrt(m)
    xs = x @ phi
    gram = xs.T @ xs + 1e-2 * np.eye(m)
    return np.maximum(np.einsum("ij,jk,ik->i", xs, np.linalg.inv(gram), xs), 0)


def leverage_keep(kg, p, b, layer, g, rope, **opts):
    """Top B by leverage (kvpress's z-score over the layer is monotone: omitted)."""
    return top_k(leverage_raw(kg, p, layer, g, rope, **opts), np.arange(p), b)


PRESSES = {"observed_attention": observed_attention_keep, "keydiff": keydiff_keep, "lagkv": lagkv_keep,
           "cur": cur_keep, "leverage": leverage_keep}
# Methods that re-express the prompt's keys and values (every position kept):
# name -> fn(kg, vg, q, colsum, heads, p, b, layer, g, rope, scale, **opts) -> (K, V) of the prompt.
COMPRESSORS = {}
COMPRESSORS.update(QUANTMETH)

from reference_wrappers import REPLAYS, WRAPPERS  # noqa: E402  (the kvpress wrapper presses)

PRESSES.update(WRAPPERS)

PRESSES.update(reference_evict.PRESSES)


def replay(policy, b, man, layers):
    name, _, opt = policy.partition(":")
    if name in reference_evict.REPLAYS:
        opts = dict(o.split("=") for o in opt.split(",")) if opt else {}
        return reference_evict.REPLAYS[name](b, man, layers, **opts)
    if name in HEADS:
        return HEADS[name](b, man, layers, **dict(kv.split("=") for kv in opt.split(",") if kv))
    if name in PRESS_REPLAYS:
        return PRESS_REPLAYS[name](policy, b, man, layers)
    if name in REPLAYS:
        return REPLAYS[name](policy, b, man, layers)
    opts = dict(o.split("=") for o in opt.split(",")) if opt else {}
    m = man["model"]
    nh, nkv, scale = m["n_heads"], m["n_kv_heads"], m["attn_scale"]
    group = nh // nkv
    p = man["tokens"]["prompt_len"]
    t_all = len(man["tokens"]["ids"])
    steps = np.arange(p, t_all)
    n = len(steps)
    sums = np.zeros(4)
    count = 0
    for li, lay in enumerate(layers):
        q, k, v, colsum = lay["q"], lay["k"], lay["v"], lay["attn_colsum"]
        for g in range(nkv):
            heads = range(g * group, (g + 1) * group)
            causal = np.arange(t_all)[None, :] <= steps[:, None]  # (n, T)
            kept = None
            if policy == "full" or (policy == "snapkv" and p <= b):
                kept = causal
            elif policy == "streaming_llm":
                # 4 sinks + the B - 4 positions before the query, and the query itself
                pos = np.arange(t_all)[None, :]
                kept = causal & ((pos < 4) | (pos >= steps[:, None] - (b - 4)))
            elif policy == "snapkv":
                w = 32
                s = np.zeros(p - w)
                for h in heads:
                    s += prompt_attention(q[h], k[g], np.arange(p - w, p), scale)[:, : p - w].sum(axis=0) / group
                pooled = np.array([s[max(i - 3, 0): i + 4].max() for i in range(p - w)])
                keep = np.concatenate([top_k(pooled, np.arange(p - w), b - w), np.arange(p - w, p)])
                prompt_kept = np.zeros(t_all, bool)
                prompt_kept[keep] = True
                prompt_kept[p:] = True
                kept = causal & prompt_kept[None, :]
            elif name == "a2sf":
                # prompt scores from every prompt row, weighted alpha^(P-1-j), group mean
                alpha = float(opts.get("alpha", "0.8"))
                wts = alpha ** (p - 1 - np.arange(p))
                a2sf_s = np.zeros(p)
                for h in heads:
                    a = prompt_attention(q[h], k[g][:p], np.arange(p), scale)
                    a2sf_s += (wts[:, None] * a).sum(axis=0) / group
                r = b // 2
                keep = np.concatenate([top_k(a2sf_s, np.arange(p - r), b - r), np.arange(p - r, p)])
                prompt_kept = np.zeros(t_all, bool)
                prompt_kept[keep] = True
                prompt_kept[p:] = True
                kept = causal & prompt_kept[None, :]
            elif name in PRESSES:
                if p <= b:
                    kept = causal
                else:
                    keep = PRESSES[name](kg=k[g], vg=v[g], colsum=colsum, heads=heads, p=p, b=b,
                                         layer=li, g=g, rope=m.get("rope"), q=q, k_all=k, v_all=v,
                                         scale=scale, **opts)
                    prompt_kept = np.zeros(t_all, bool)
                    prompt_kept[keep] = True
                    prompt_kept[p:] = True
                    kept = causal & prompt_kept[None, :]
            kc, vc = k[g], v[g]
            if name in COMPRESSORS:
                kept = causal
                kc, vc = k[g].copy(), v[g].copy()
                kc[:p], vc[:p] = COMPRESSORS[name](kg=k[g], vg=v[g], q=q, colsum=colsum, heads=heads, p=p, b=b,
                                                   layer=li, g=g, rope=m.get("rope"), scale=scale, **opts)
            for h in heads:
                logits = scale * q[h, steps] @ k[g].T  # (n, T)
                p_full = softmax_masked(logits, causal)
                o_f = p_full @ v[g]
                if policy == "h2o":
                    p_comp, kept_h = h2o_steps(q, k, g, heads, colsum, b, p, steps, scale, logits_of=h)
                elif name == "a2sf" and opts.get("decode_evict") != "false":
                    p_comp, kept_h = h2o_steps(q, k, g, heads, colsum, b, p, steps, scale, logits_of=h,
                                               s=a2sf_s, alpha=float(opts.get("alpha", "0.8")))
                else:
                    kept_h = kept
                    p_comp = softmax_masked(scale * q[h, steps] @ kc.T, kept_h)
                o_c = p_comp @ vc
                r = metrics(o_c, o_f, p_full, kept_h, p_comp)
                sums += [x.mean() for x in r]
                count += 1
    return sums / count


def h2o_steps(q, k, g, heads, colsum, b, p, steps, scale, logits_of, s=None, alpha=1.0):
    """H2O with decode-time eviction for KV head g: returns the compressed
    attention (n, T) of query head `logits_of` and the kept mask (n, T).
    The set evolves with the group-mean attention, so it is simulated step by step.
    A2SF: prompt scores `s` given, and every score multiplied by `alpha` per step."""
    heads = list(heads)
    t_all = k.shape[1]
    r = b // 2
    if s is None:
        s = colsum[heads].mean(axis=0)  # (P,)
    keep = list(top_k(s, np.arange(p - r), b - r)) + list(range(p - r, p))
    score = np.zeros(t_all)
    score[:p] = s
    n = len(steps)
    p_comp = np.zeros((n, t_all))
    kept = np.zeros((n, t_all), bool)
    for i, t in enumerate(steps):
        keep.append(t)
        idx = np.array(keep)
        logits = scale * q[heads][:, t, :] @ k[g, idx].T  # (group, |keep|)
        a = np.exp(logits - logits.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        row = heads.index(logits_of)
        p_comp[i, idx] = a[row]
        kept[i, idx] = True
        score[t] = 0.0
        score[idx] = alpha * score[idx] + a.mean(axis=0)
        # evict the lowest score outside the r most recent (earliest on ties)
        cand = idx[: len(idx) - r] if r > 0 else idx
        if len(idx) > b:
            victim = cand[np.lexsort((cand, score[cand]))[0]]
            keep.remove(victim)
    return p_comp, kept


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--budgets", required=True)
    ap.add_argument("--policies", default="full,snapkv,h2o,streaming_llm")
    a = ap.parse_args()
    t0 = time.perf_counter()
    man, layers = load(a.trace)
    load_s = time.perf_counter() - t0
    points = []
    # `;` separates policies whose options are `,`-separated (`block:scorer=snapkv,w=8`)
    for pol in a.policies.split(";" if ";" in a.policies else ","):
        for b in [int(x) for x in a.budgets.split(",")]:
            t1 = time.perf_counter()
            rel, cos, mass, kl = replay(pol, b, man, layers)
            points.append(dict(policy=pol, budget=b, seconds=time.perf_counter() - t1,
                               rel_l2=rel, cosine=cos, attn_mass=mass, kl=kl))
    print(json.dumps(dict(seconds=time.perf_counter() - t0, load_seconds=load_s, points=points)))


if __name__ == "__main__":
    main()
