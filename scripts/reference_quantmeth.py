"""Independent NumPy transcriptions (float64) of the methods of branch
`quantmeth` that re-express the prompt's keys and values instead of choosing
positions: MiKV, Mustafar, ZipCache, GEAR, KVQuant (docs/methods/NAME.md).

Each function takes the trace of one KV head (kg, vg: (T, d) float64 of the
f16 trace values; q: (n_heads, T, d); colsum: (n_heads, P)), the query heads
`heads` of that KV head, the prompt length p and budget b, and returns the
compressed prompt keys and values (P, d) that the cache holds (dequantised /
pruned / approximated). reference_replay.py attends over them for every
decode query; decode entries stay exact, as kvreplay appends them.

Quantisation is the KIVI min-max rule: scale = (max - min) / (2^b - 1) and
zero = min, both stored in f16 (np.float16 rounds to nearest even, as the
Rust `half` crate does), code = round((x - zero) / scale) clamped to
[0, 2^b - 1] with rounding half away from zero (Rust's f32::round; the codes
are never negative before the clamp matters, so floor(x + 0.5)).
"""
import hashlib

import numpy as np


def f16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def fake_quant(x, bits):
    """Min-max quantisation of each group of x (its last axis) at `bits` (one
    per group, or one for all), dequantised. Every group is quantised on its
    own: the same arithmetic, element by element, as one group at a time."""
    x = np.asarray(x, dtype=np.float64)
    levels = (2.0 ** np.asarray(bits, dtype=np.float64) - 1) * np.ones(x.shape[:-1])
    mn, mx = x.min(axis=-1), x.max(axis=-1)
    scale, zero = f16((mx - mn) / levels), f16(mn)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.floor((x - zero[..., None]) / scale[..., None] + 0.5), 0, levels[..., None])
    # a constant group (scale 0) is its zero
    return np.where((scale > 0)[..., None], q * scale[..., None] + zero[..., None], zero[..., None])


def quant_rows(x, bits, group):
    """Each row of x (n, d) quantised in groups of `group` channels at bits[i] (16: untouched)."""
    out = x.copy()
    bits = np.asarray(bits)
    rows = bits < 16
    for c0 in range(0, x.shape[1], group):
        out[rows, c0:c0 + group] = fake_quant(x[rows, c0:c0 + group], bits[rows])
    return out


def top_k(scores, cand, k):
    """The k best candidates by (score desc, position desc), ascending."""
    cand = np.asarray(cand)
    order = np.lexsort((-cand, -scores[cand]))
    return np.sort(cand[order[:k]])


# ---------------------------------------------------------------- MiKV

def mikv(kg, vg, q, colsum, heads, p, b, hi_bits="8", lo_bits="2", group="64", balance="true", **_):
    """H2O (prefill form, recent = B//2, group-mean column sums) picks the B
    important positions, quantised per token at hi_bits; the rest at lo_bits.
    Keys are scaled per channel by the balancer sqrt(max|q| / max|k|) (f16)
    before quantisation and divided back after."""
    hi, lo, grp = int(hi_bits), int(lo_bits), int(group)
    heads = list(heads)
    if p <= b:
        imp = np.arange(p)
    else:
        r = b // 2
        s = colsum[heads].mean(axis=0)
        imp = np.concatenate([top_k(s, np.arange(p - r), b - r), np.arange(p - r, p)])
    bits = np.full(p, lo)
    bits[imp] = hi
    k = kg[:p].copy()
    bal = None
    if balance == "true" and min(hi, lo) < 16:
        qmax = np.abs(q[heads][:, :p]).max(axis=(0, 1))
        kmax = np.abs(k).max(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            bal = np.where((qmax > 0) & (kmax > 0), f16(np.sqrt(qmax / kmax)), 1.0)
        quantised = bits < 16
        k[quantised] *= bal
    kc = quant_rows(k, bits, grp)
    if bal is not None:
        kc[bits < 16] /= bal
    return kc, quant_rows(vg[:p], bits, grp)


# ---------------------------------------------------------------- ZipCache

def separable_tokenwise(x, bits):
    """Channel-separable token-wise quantisation: channels divided by
    c = f16(sqrt(max |x|)) over the prompt, each row one group, times c."""
    m = np.abs(x).max(axis=0)
    c = np.where(m > 0, f16(np.sqrt(m)), 1.0)
    return quant_rows(x / c, bits, x.shape[1]) * c


def zipcache(kg, vg, colsum, heads, p, b, hi_bits="4", lo_bits="2", salient="budget", **_):
    """Saliency s_i = mean over the KV head's query heads of colsum_i / (P - i);
    the top B (or floor(f P)) at hi_bits, the rest at lo_bits."""
    heads = list(heads)
    s = (colsum[heads] / (p - np.arange(p))[None, :]).mean(axis=0)
    n = min(b, p) if salient == "budget" else min(int(np.floor(float(salient) * p)), p)
    bits = np.full(p, int(lo_bits))
    bits[top_k(s, np.arange(p), n)] = int(hi_bits)
    return separable_tokenwise(kg[:p], bits), separable_tokenwise(vg[:p], bits)


# ---------------------------------------------------------------- Mustafar

def prune_rows(x, keep):
    """Each row keeps its `keep` largest |x| (ties: lower channel), others 0."""
    out = np.zeros_like(x)
    idx = np.arange(x.shape[1])
    for i, row in enumerate(x):
        order = np.lexsort((idx, -np.abs(row)))[:keep]
        out[i, order] = row[order]
    return out


def mustafar(kg, vg, p, sparsity="0.7", window="32", **_):
    """Per-token magnitude pruning; newest `window` keys and newest P mod
    `window` values dense."""
    d = kg.shape[1]
    keep = d - int(np.floor(float(sparsity) * d))
    w = int(window)
    dk, dv = min(w, p), p % w
    k, v = kg[:p].copy(), vg[:p].copy()
    k[: p - dk] = prune_rows(k[: p - dk], keep)
    v[: p - dv] = prune_rows(v[: p - dv], keep)
    return k, v


# ---------------------------------------------------------------- GEAR

def gear_matrix(x, bits, group, rank, outliers, per_channel):
    """X^ = Q_b(X - S) + L + S: S the floor(s n) largest |x| (ties: lower flat
    index), Q per channel in groups of `group` positions (keys) or per token
    in groups of `group` channels (values), L the rank-r truncated SVD of the
    residual (np.linalg.svd)."""
    p, d = x.shape
    flat = x.ravel()
    n_out = min(int(np.floor(outliers * flat.size)), flat.size)
    idx = np.lexsort((np.arange(flat.size), -np.abs(flat)))[:n_out]
    s = np.zeros(flat.size)
    s[idx] = flat[idx]
    s = s.reshape(p, d)
    dm = x - s
    if per_channel:
        qd = np.empty_like(dm)
        for t0 in range(0, p, group):
            # each channel's run of positions is one group
            qd[t0:t0 + group] = fake_quant(dm[t0:t0 + group].T, bits).T
    else:
        qd = quant_rows(dm, [bits] * p, group)
    r = min(rank, p, d)
    resid = dm - qd
    if r > 0:
        u, sv, vt = np.linalg.svd(resid, full_matrices=False)
        low = (u[:, :r] * sv[:r]) @ vt[:r]
    else:
        low = np.zeros_like(resid)
    return qd + low + s


def gear(kg, vg, p, bits="4", group="64", rank="4", outliers="0.02", **_):
    a = (int(bits), int(group), int(rank), float(outliers))
    return gear_matrix(kg[:p], *a, per_channel=True), gear_matrix(vg[:p], *a, per_channel=False)


# ---------------------------------------------------------------- KVQuant

def rope_rotate(x, rope, sign):
    """Rotate rows (P, d) at positions 0..P-1 by sign * their RoPE angles
    (sign -1: back to pre-RoPE; no frequency scaling)."""
    assert rope["scaling"]["type"] == "none", rope
    p = x.shape[0]
    rot = rope["rotated_dims"]
    half = rot // 2
    ang = sign * np.arange(p)[:, None] * rope["theta"] ** (-2.0 * np.arange(half) / rot)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    if rope["style"] == "neox":
        i, j = np.arange(half), np.arange(half) + half
    else:
        i, j = 2 * np.arange(half), 2 * np.arange(half) + 1
    out = x.copy()
    out[:, i] = x[:, i] * c - x[:, j] * s
    out[:, j] = x[:, j] * c + x[:, i] * s
    return out


def nearest(cb, v):
    """Nearest centroid index per value (ties: the lower index)."""
    dist = np.abs(np.asarray(v)[:, None] - np.asarray(cb)[None, :])
    return np.argmin(dist, axis=1)  # argmin returns the first minimum


def kmeans_1d(z, k, iters):
    c = -1.0 + 2.0 * np.arange(k) / (k - 1)
    for _ in range(iters):
        a = nearest(c, z)
        for j in range(k):
            if (a == j).any():
                c[j] = z[a == j].mean()
    return c


_KVQUANT_MEMO = {}


def kvquant_matrix(x, bits, outliers, n_sink, iters, per_channel):
    """Memoised: the result does not depend on the budget, so a run over
    several budgets computes each head's codebook once."""
    # the input by digest: the memo holds results, not a second copy of each input
    key = (x.shape, hashlib.sha256(x.tobytes()).digest(), bits, outliers, n_sink, iters, per_channel)
    if key not in _KVQUANT_MEMO:
        _KVQUANT_MEMO[key] = kvquant_matrix_once(x, bits, outliers, n_sink, iters, per_channel)
    return _KVQUANT_MEMO[key].copy()


def kvquant_matrix_once(x, bits, outliers, n_sink, iters, per_channel):
    p, d = x.shape
    s = min(n_sink, p)
    x = x.copy()
    if s == p:
        return x
    body = x[s:]
    n = body.size
    k = min(int(np.floor(outliers * n)), n)
    flat = body.ravel()
    out = np.zeros(n, bool)
    out[np.lexsort((np.arange(n), -np.abs(flat)))[:k]] = True
    out = out.reshape(body.shape)
    centre, half = np.zeros(body.shape), np.ones(body.shape)
    zs = []
    vecs = [(slice(None), c) for c in range(d)] if per_channel else [(t, slice(None)) for t in range(body.shape[0])]
    for v in vecs:
        inl = body[v][~out[v]]
        if inl.size:
            h = f16((inl.max() - inl.min()) / 2)
            centre[v], half[v] = f16((inl.max() + inl.min()) / 2), (h if h > 0 else 1.0)
        zs.append(((body[v] - centre[v]) / half[v])[~out[v]])
    cb = f16(kmeans_1d(np.concatenate(zs), 2 ** bits, iters))
    z = (body - centre) / half
    deq = cb[nearest(cb, z.ravel())].reshape(body.shape) * half + centre
    x[s:] = np.where(out, body, deq)
    return x


def kvquant(kg, vg, p, rope, bits="3", outliers="0.01", n_sink="1", iters="20", **_):
    a = (int(bits), float(outliers), int(n_sink), int(iters))
    k = rope_rotate(kg[:p], rope, -1.0) if rope else kg[:p]
    kq = kvquant_matrix(k, *a, per_channel=True)
    if rope:
        kq = rope_rotate(kq, rope, 1.0)
    kq[: min(int(n_sink), p)] = kg[: min(int(n_sink), p)]
    return kq, kvquant_matrix(vg[:p], *a, per_channel=False)


QUANTMETH = {"mikv": mikv, "zipcache": zipcache, "mustafar": mustafar, "gear": gear, "kvquant": kvquant}
