"""Independent NumPy transcriptions of the kvpress presses expected_attention,
think (alone and as snapkv+think), simlayerkv, compactor and finch, each read
off kvpress 0.5.4's source and docs/methods/NAME.md, in float64, with their
default parameters (one `key=value` may follow the name, as in
reference_replay.py). Each rule gives, per layer and KV head, the prompt
positions kept and, for think, the keys as stored; `replay` below then
measures the same teacher-forced metrics as kvreplay (replay/SEMANTICS.md).

reference_replay.py dispatches the names in REPLAYS here.
"""
import numpy as np

# ---------------------------------------------------------------- helpers


def softmax_masked(logits, mask):
    x = np.where(mask, logits, -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    w = np.exp(x)
    return w / w.sum(axis=-1, keepdims=True)


def top_k(scores, cand, k):
    """The k best candidates by (score desc, position desc), ascending."""
    cand = np.asarray(cand)
    if k <= 0:
        return cand[:0]
    order = np.lexsort((-cand, -scores[cand]))
    return np.sort(cand[order[:k]])


def rope_rotate(x, positions, rope, sign):
    """Rotate rows x (n, d) at `positions` by sign * their RoPE angles (float64)."""
    assert rope["scaling"]["type"] == "none", rope
    rot = rope["rotated_dims"]
    half = rot // 2
    inv = rope["theta"] ** (-2.0 * np.arange(half) / rot)
    ang = sign * np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    if rope["style"] == "neox":
        i, j = np.arange(half), np.arange(half) + half
    else:
        i, j = 2 * np.arange(half), 2 * np.arange(half) + 1
    out = x.copy()
    out[:, i] = x[:, i] * c - x[:, j] * s
    out[:, j] = x[:, j] * c + x[:, i] * s
    return out


def causal_rows(qh, kg, rows, p, scale):
    """Attention (len(rows), P) of prompt queries `rows` over the prompt keys."""
    logits = scale * qh[rows] @ kg[:p].T
    return softmax_masked(logits, np.arange(p)[None, :] <= np.asarray(rows)[:, None])


def zscore(x):
    return (x - x.mean()) / max(x.std(ddof=1), 1e-6)


# ---------------------------------------------------------------- the rules


def expected_attention(L, b, n_future="512", n_sink="4", use_covariance="true", use_vnorm="true", epsilon="0", **_):
    """Per query head: pre-RoPE query mean / covariance of positions n_sink..P,
    R = mean over t in P..P+n_future-1 of the RoPE matrix at t (built column by
    column by rotating the unit vectors), z = K R mu / sqrt(d) + diag(K R S R^T K^T) / 2d,
    softmax over n_sink..P, group mean, times |v|; sinks kept, top B - n_sink."""
    p, d, rope = L["p"], L["d"], L["rope"]
    ns, nf = int(n_sink), int(n_future)
    eye = np.eye(d)
    R = np.zeros((d, d))
    for t in range(p, p + nf):
        R += rope_rotate(eye, [t] * d, rope, 1.0).T if rope else eye
    R /= nf
    keeps = []
    for g in range(L["nkv"]):
        kk = L["k"][g, ns:p]
        s = np.zeros(p - ns)
        for h in L["heads"](g):
            qs = L["q"][h, ns:p]
            if rope:
                qs = rope_rotate(qs, np.arange(ns, p), rope, -1.0)
            mu = qs.mean(axis=0)
            c = qs - mu
            cov = c.T @ c / (p - ns)
            mu_r, cov_r = R @ mu, R @ cov @ R.T
            z = kk @ mu_r / np.sqrt(d)
            if use_covariance == "true":
                z = z + np.einsum("id,de,ie->i", kk, cov_r, kk) / d / 2
            s += softmax_masked(z[None, :], np.ones((1, p - ns), bool))[0] / L["group"]
        if use_vnorm == "true":
            s = (s + float(epsilon)) * np.linalg.norm(L["v"][g, ns:p], axis=1)
        keeps.append(np.concatenate([np.arange(ns), ns + top_k(s, np.arange(p - ns), b - ns)]))
    return keeps, None


def finch(L, b, question="32", normalize="true", **_):
    """Last w rows' causal attention on keys < P - w, row j times j (kvpress's
    arange(P - w, P)), mean over rows, group mean; window kept, top B - w
    (B <= w: the last B, kvreplay's documented choice)."""
    p, w = L["p"], int(question)
    if b <= w:
        return [np.arange(p - b, p)] * L["nkv"], None
    keeps = []
    for g in range(L["nkv"]):
        s = np.zeros(p - w)
        for h in L["heads"](g):
            a = causal_rows(L["q"][h], L["k"][g], np.arange(p - w, p), p, L["scale"])[:, : p - w]
            if normalize == "true":
                a = a * np.arange(p - w, p)[:, None]
            s += a.mean(axis=0) / L["group"]
        keeps.append(np.concatenate([top_k(s, np.arange(p - w), b - w), np.arange(p - w, p)]))
    return keeps, None


def simlayerkv(L, b, lazy_threshold="0.9", n_last="1", n_initial="4", **_):
    """Lazy layer (mean over every query head and the last n_last rows of the
    mass on keys :n_initial and the n_recent = B - n_initial + n_last keys
    before the last n_last) keeps :n_initial and the last B - n_initial."""
    p, thr, nl, ni = L["p"], float(lazy_threshold), int(n_last), int(n_initial)
    nr = b - ni + nl
    full = [np.arange(p)] * L["nkv"]
    if thr >= 1.0 or p <= ni + nr + nl:
        return full, None
    mass = 0.0
    for h in range(L["nh"]):
        a = causal_rows(L["q"][h], L["k"][h // L["group"]], np.arange(p - nl, p), p, L["scale"])[:, : p - nl]
        mass += (a[:, :ni].sum() + a[:, -nr:].sum()) / nl
    if mass / L["nh"] <= thr:
        return full, None
    keep = np.concatenate([np.arange(ni), np.arange(p - (b - ni), p)])
    return [keep] * L["nkv"], None


def chunked_noncausal(q, k, chunk):
    """kvpress's non-causal chunked attention column sums, transcribed with
    its padding: zero rows appended, a padded last chunk's padded query rows
    set to logit 0 and padded key columns to -1e-9; unscaled logits."""
    s, d = k.shape
    s_pad = -(-s // chunk) * chunk
    qp = np.concatenate([q, np.zeros((s_pad - s, d))])
    kp = np.concatenate([k, np.zeros((s_pad - s, d))])
    out = np.zeros(s_pad)
    for c0 in range(0, s_pad, chunk):
        dots = qp[c0 : c0 + chunk] @ kp[c0 : c0 + chunk].T
        if c0 + chunk == s_pad and s_pad > s:
            invalid = np.arange(c0, s_pad) >= s
            dots[invalid, :] = 0.0
            dots[:, invalid] = -1e-9
        a = np.exp(dots - dots.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        out[c0 : c0 + chunk] = a.sum(axis=0)
    return out[:s]


def compactor(L, b, sink_start="8", sink_end="4", chunk="256", sketch="48", seed="0", blending="auto", **_):
    """blending * z(leverage of the centred pre-RoPE middle keys, seeded sketch)
    + z(avgpool3(group mean of chunked non-causal attention * |v|)); z over the
    layer; sinks at both ends kept; blending auto = 1 - B/P."""
    from reference_replay import SplitMix64  # kvreplay's seeded generator

    p, d, rope = L["p"], L["d"], L["rope"]
    lo, hi = int(sink_start), p - int(sink_end)
    mid = np.arange(lo, hi)
    m = int(sketch)
    lev, att = [], []
    for g in range(L["nkv"]):
        kk = L["k"][g, mid]
        pre = rope_rotate(kk, mid, rope, -1.0) if rope else kk
        x = pre - pre.mean(axis=0)
        r = SplitMix64.for_head(int(seed), L["layer"], g)
        z = []
        for _ in range(d * m):
            u1, u2 = 1.0 - r.next_f64(), r.next_f64()
            z.append(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2))
        xs = x @ (np.array(z).reshape(d, m) / np.sqrt(m))
        gram = xs.T @ xs + 1e-2 * np.eye(m)
        lev.append(np.maximum(np.einsum("ij,jk,ik->i", xs, np.linalg.inv(gram), xs), 0))
        a = sum(chunked_noncausal(L["q"][h, mid], kk, int(chunk)) for h in L["heads"](g)) / L["group"]
        a = a * np.linalg.norm(L["v"][g, mid], axis=1)
        padded = np.concatenate([[0.0], a, [0.0]])
        att.append((padded[:-2] + padded[1:-1] + padded[2:]) / 3)
    lev, att = zscore(np.array(lev)), zscore(np.array(att))
    blend = 1 - b / p if blending == "auto" else float(blending)
    keeps = []
    for g in range(L["nkv"]):
        s = blend * lev[g] + att[g]
        keep = top_k(s, np.arange(len(mid)), b - lo - int(sink_end)) + lo
        keeps.append(np.concatenate([np.arange(lo), keep, np.arange(hi, p)]))
    return keeps, None


def snapkv_paper(L, b, w=32, k=7):
    """SnapKV's default: window votes summed, group mean, max-pooled (k = 7)."""
    p = L["p"]
    keeps = []
    for g in range(L["nkv"]):
        s = np.zeros(p - w)
        for h in L["heads"](g):
            s += causal_rows(L["q"][h], L["k"][g], np.arange(p - w, p), p, L["scale"])[:, : p - w].sum(axis=0)
        s /= L["group"]
        pooled = np.array([s[max(i - k // 2, 0) : i + k // 2 + 1].max() for i in range(p - w)])
        keeps.append(np.concatenate([top_k(pooled, np.arange(p - w), b - w), np.arange(p - w, p)]))
    return keeps


def think_on(base):
    def rule(L, b, ratio="0.5", w="32", **_):
        """Per KV head: channel score = group mean of mean(q^2) over the last w
        queries x mean(k^2) over the kept keys; floor(d * ratio) lowest zeroed."""
        p, d, w = L["p"], L["d"], int(w)
        keeps = base(L, b) if base else [np.arange(p)] * L["nkv"]
        keys = []
        for g, keep in enumerate(keeps):
            qn = np.mean([(L["q"][h, p - w : p] ** 2).mean(axis=0) for h in L["heads"](g)], axis=0)
            kk = L["k"][g, :p].copy()
            kn = (kk[keep] ** 2).mean(axis=0)
            pruned = np.argsort(qn * kn, kind="stable")[: int(np.floor(d * float(ratio)))]
            kk[:, pruned] = 0.0
            keys.append(kk)
        return keeps, keys

    return rule


RULES = {
    "expected_attention": expected_attention,
    "finch": finch,
    "simlayerkv": simlayerkv,
    "compactor": compactor,
    "think": think_on(None),
    "snapkv+think": think_on(lambda L, b: snapkv_paper(L, b) if L["p"] > b else [np.arange(L["p"])] * L["nkv"]),
}

# ---------------------------------------------------------------- replay


def replay(policy, b, man, layers):
    """Mean (rel_l2, cosine, attn_mass, kl) over decode steps, then layers and query heads."""
    name, _, opt = policy.partition(":")
    opts = dict([opt.split("=")]) if opt else {}
    m = man["model"]
    nh, nkv, scale, d = m["n_heads"], m["n_kv_heads"], m["attn_scale"], m["head_dim"]
    group = nh // nkv
    p = man["tokens"]["prompt_len"]
    t_all = len(man["tokens"]["ids"])
    steps = np.arange(p, t_all)
    causal = np.arange(t_all)[None, :] <= steps[:, None]
    sums, count = np.zeros(4), 0
    for li, lay in enumerate(layers):
        L = dict(q=lay["q"], k=lay["k"], v=lay["v"], p=p, d=d, nh=nh, nkv=nkv, group=group, scale=scale,
                 rope=m.get("rope"), layer=li, heads=lambda g: range(g * group, (g + 1) * group))
        compress = name in ("think", "simlayerkv") or p > b
        keeps, keys = RULES[name](L, b, **opts) if compress else ([np.arange(p)] * nkv, None)
        for g in range(nkv):
            mask = np.zeros(t_all, bool)
            mask[keeps[g]] = True
            mask[p:] = True
            kept = causal & mask[None, :]
            kc = lay["k"][g].copy()
            if keys is not None:
                kc[:p] = keys[g]
            for h in range(g * group, (g + 1) * group):
                p_full = softmax_masked(scale * lay["q"][h, steps] @ lay["k"][g].T, causal)
                p_comp = softmax_masked(scale * lay["q"][h, steps] @ kc.T, kept)
                o_f, o_c = p_full @ lay["v"][g], p_comp @ lay["v"][g]
                nf, nc = np.linalg.norm(o_f, axis=1), np.linalg.norm(o_c, axis=1)
                rel = np.linalg.norm(o_c - o_f, axis=1) / np.maximum(nf, 1e-300)
                cos = (o_c * o_f).sum(axis=1) / np.maximum(nf * nc, 1e-300)
                mass = (p_full * kept).sum(axis=1)
                pf = np.where(kept, p_full, 0) / mass[:, None]
                with np.errstate(divide="ignore", invalid="ignore"):
                    kl = np.where(pf > 0, pf * np.log(pf / np.maximum(p_comp, np.finfo(float).tiny)), 0).sum(axis=1)
                sums += [rel.mean(), cos.mean(), mass.mean(), kl.mean()]
                count += 1
    return sums / count


REPLAYS = {name: replay for name in RULES}
