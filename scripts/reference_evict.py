"""Independent NumPy transcriptions (float64) of kvcrush, lazyeviction, xkv
and triforce (docs/methods/NAME.md), for scripts/reference_replay.py.

- `PRESSES["kvcrush"]`: the kept prompt positions of one KV head (the
  reference's prefill-only replay does the rest): H2O's recent window and
  top scores, with a share of the selections given to representatives of
  the evicted positions picked along their Hamming distance to the layer's
  anchor.
- `REPLAYS["lazyeviction"]`, `REPLAYS["xkv"]`, `REPLAYS["triforce"]`: whole
  replays returning the mean (rel_l2, cosine, attn_mass, kl), for rules the
  prefill-keep loop cannot express: LazyEviction's decode-time batches
  (simulated step by step), xKV's cross-layer low-rank keys and values (every
  position kept, the prompt's keys and values replaced by their rank-r
  reconstruction) and TriForce's per-step retrieval (a kept mask per decode
  query).

Nothing here calls kvreplay; the seeded generator is reference_replay.py's.
"""
import numpy as np


def top_k(scores, cand, k):
    """The k best candidates by (score desc, position desc), ascending."""
    cand = np.asarray(cand, dtype=int)
    order = np.lexsort((-cand, -scores[cand]))
    return np.sort(cand[order[:k]])


def softmax_rows(logits, mask):
    x = np.where(mask, logits, -np.inf)
    x = x - x.max(axis=1, keepdims=True)
    w = np.exp(x)
    return w / w.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------- kvcrush

def kvcrush_pick(pick, n, k):
    """Ranks kept of n distance-sorted evicted positions: OpenVINO's i * (n // k),
    or vLLM's torch.linspace(0, n - 1, k, dtype=torch.long) as PyTorch's CPU
    kernel computes it (float64 step, the second half counted back from the
    end, truncated)."""
    if k == 0:
        return []
    if pick == "step":
        return [i * (n // k) for i in range(k)]
    if k == 1:
        return [0]
    step = float(n - 1) / float(k - 1)
    return [int(i * step) if i < k // 2 else int(float(n - 1) - (k - 1 - i) * step) for i in range(k)]


def kvcrush_keep(colsum, heads, p, b, layer, g, share="0.25", bit="half", anchor="random", seed="0",
                 bits_per="kv", pick="step", recent=None, **_):
    """Kept positions of KV head g: H2O (recent B//2, group-mean column sums)
    keeps its top A - R, then R representatives of its evicted positions by
    Hamming distance to the layer's anchor."""
    r = b // 2 if recent is None else int(recent)
    r = min(r, b)
    cand = np.arange(p - r)
    avg = b - r
    reps = int(np.floor(float(share) * avg))
    mean = colsum[list(heads)].mean(axis=0)
    top = top_k(mean, cand, avg - reps)
    keep = list(top) + list(range(p - r, p))
    if reps > 0:
        nh = colsum.shape[0]
        gs = len(heads)
        if bits_per == "kv":  # one bit per KV head: its group's mean column sums
            unit_scores = [colsum[k * gs:(k + 1) * gs].mean(axis=0) for k in range(nh // gs)]
        else:  # one bit per query head
            unit_scores = [colsum[h] for h in range(nh)]
        nu = len(unit_scores)
        sig = np.zeros((p, nu), dtype=int)
        for u, s in enumerate(unit_scores):
            if bit == "half":
                on = top_k(s, cand, len(cand) // 2)
            else:
                on = cand[s[cand] > s[cand].mean()]
            sig[on, u] = 1
        ones = sig[cand].sum(axis=0)  # per unit, over all candidates
        if anchor == "random":
            from reference_replay import SplitMix64  # kvreplay's seeded generator

            rng = SplitMix64.for_head(int(seed), layer, 0)  # one anchor per layer
            a = np.array([rng.next_u64() >> 63 for _ in range(nu)])
        elif anchor == "mean":
            a = (ones / len(cand) > 0.5).astype(int)
        elif anchor == "inv_mean":
            a = (ones / len(cand) < 0.5).astype(int)
        elif anchor == "zeros":
            a = np.zeros(nu, dtype=int)
        elif anchor == "ones":
            a = np.ones(nu, dtype=int)
        else:
            a = np.arange(nu) % 2
        evicted = np.array(sorted(set(cand) - set(top)), dtype=int)
        dist = (sig[evicted] != a[None, :]).sum(axis=1)
        order = evicted[np.lexsort((evicted, dist))]
        keep += [order[j] for j in kvcrush_pick(pick, len(order), min(reps, len(order)))]
    return np.array(sorted(keep))


# ---------------------------------------------------------------- metrics

def step_metrics(p_full, o_f, p_comp, o_c, kept):
    """Per-step (rel_l2, cosine, attn_mass, kl) of rows (n, T); kept (n, T) bool."""
    diff = np.linalg.norm(o_c - o_f, axis=1)
    nf = np.linalg.norm(o_f, axis=1)
    nc = np.linalg.norm(o_c, axis=1)
    rel = diff / np.maximum(nf, 1e-300)
    cos = (o_c * o_f).sum(axis=1) / np.maximum(nf * nc, 1e-300)
    mass = (p_full * kept).sum(axis=1)
    pf = np.where(kept, p_full, 0) / mass[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(pf > 0, pf * np.log(pf / np.maximum(p_comp, np.finfo(float).tiny)), 0).sum(axis=1)
    return np.array([rel.mean(), cos.mean(), mass.mean(), kl.mean()])


def shape(man):
    m = man["model"]
    p = man["tokens"]["prompt_len"]
    t_all = len(man["tokens"]["ids"])
    return m, m["n_heads"], m["n_kv_heads"], m["attn_scale"], p, t_all


# ---------------------------------------------------------------- lazyeviction

def lazy_hits(a, alpha, uniform, n):
    """Attended entries of one step's weights a over n entries seen."""
    return a > alpha / n if uniform else a >= alpha


def lazy_importance(last, mri, t, ratio):
    """Importance of entries with (last, mri) at step t, float64."""
    silence = (t - last).astype(float)
    m = mri.astype(float)
    if ratio:
        return -silence / (m + 1.0)
    with np.errstate(over="ignore"):
        lag = 2.0 / (1.0 + np.exp(1.0 + silence / (m + 1e-5)))
        period = np.where(m > 0, 2.0 / (1.0 + np.exp(m - 1.0)), 0.0)
    return lag + period


def lazy_rank(recs, idx, t, ratio):
    """Group-mean importance of entries idx over the heads' (last, mri), as float32."""
    total = np.zeros(len(idx))
    for last, mri in recs:
        total = total + lazy_importance(last[idx], mri[idx], t, ratio)
    return (total / len(recs)).astype(np.float32)


def lazy_replay(b, man, layers, window="16", alpha="1e-4", threshold="absolute", score="official",
                rows="128", per_query_head="false", decode_evict="true", budget_per="kv_head", **_):
    """Steps: prompt rows P-R..P-1 are steps 1..R, decode position t is step
    t-(P-R)+1; an entry starts at (step before its own, 0), prompt positions
    before the observed rows at (0, 0); attended: MRI = max(MRI, t - last),
    last = t. Prefill keeps the W newest and the top B-W at step R (P > B);
    decode evicts the W lowest outside the W newest when the cache exceeds B."""
    m, nh, nkv, scale, p, t_all = shape(man)
    w, alpha = int(window), float(alpha)
    uniform, ratio = threshold == "uniform", score == "ratio"
    rows = p if rows == "all" else min(int(rows), p)
    base = p - rows
    group = nh // nkv
    if per_query_head == "true":
        units = [(h // group, [h]) for h in range(nh)]
        # --budget is per KV head: its G query-head caches share it
        b = b if budget_per == "query_head" else max(b // group, 1)
    else:
        units = [(g, list(range(g * group, (g + 1) * group))) for g in range(nkv)]
    steps = np.arange(p, t_all)
    causal = np.arange(t_all)[None, :] <= steps[:, None]
    js = np.arange(base, p)
    pcausal = np.arange(p)[None, :] <= js[:, None]
    sums, count = np.zeros(4), 0
    for lay in layers:
        q, k, v = lay["q"], lay["k"], lay["v"]
        for g, heads in units:
            recs = []
            for h in heads:
                last = np.zeros(t_all, dtype=np.int64)
                last[:p] = np.maximum(np.arange(p) - base, 0)
                mri = np.zeros(t_all, dtype=np.int64)
                a = softmax_rows(scale * q[h, js] @ k[g, :p].T, pcausal)
                for x, j in enumerate(js):
                    t = x + 1
                    hit = np.nonzero(lazy_hits(a[x, : j + 1], alpha, uniform, j + 1))[0]
                    mri[hit] = np.maximum(mri[hit], t - last[hit])
                    last[hit] = t
                recs.append((last, mri))
            r = min(w, b)
            if p > b:
                s = lazy_rank(recs, np.arange(p), rows, ratio)
                keep = list(top_k(s, np.arange(p - r), b - r)) + list(range(p - r, p))
            else:
                keep = list(range(p))
            n = len(steps)
            p_comp = np.zeros((len(heads), n, t_all))
            kept = np.zeros((n, t_all), bool)
            for i, pos in enumerate(steps):
                t = pos - base + 1
                keep.append(pos)
                idx = np.array(keep)
                for hi, h in enumerate(heads):
                    logits = scale * q[h, pos] @ k[g, idx].T
                    a = np.exp(logits - logits.max())
                    a /= a.sum()
                    p_comp[hi, i, idx] = a
                    last, mri = recs[hi]
                    last[pos], mri[pos] = t - 1, 0
                    hit = idx[lazy_hits(a, alpha, uniform, len(idx))]
                    mri[hit] = np.maximum(mri[hit], t - last[hit])
                    last[hit] = t
                kept[i, idx] = True
                if decode_evict == "true" and len(keep) > b:
                    cand = idx[: len(idx) - r]
                    s = lazy_rank(recs, cand, t, ratio)
                    gone = set(cand[np.lexsort((cand, s))[: min(w, len(cand))]].tolist())
                    keep = [e for e in keep if e not in gone]
            for hi, h in enumerate(heads):
                p_full = softmax_rows(scale * q[h, steps] @ k[g].T, causal)
                sums += step_metrics(p_full, p_full @ v[g], p_comp[hi], p_comp[hi] @ v[g], kept)
                count += 1
    return sums / count


# ---------------------------------------------------------------- xkv

def rotate(x, rope, sign):
    """RoPE rotation of rows x (P, d) at positions 0..P-1 by sign (+1 apply, -1 undo)."""
    assert rope["scaling"]["type"] == "none", rope
    p, d = x.shape
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
    out[:, j] = x[:, i] * s + x[:, j] * c
    return out


def f16(x):
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def rank_r(x, r):
    """Rank-r reconstruction from f16 factors U_r and S_r V_r^T (NumPy's SVD)."""
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    return f16(u[:, :r]) @ f16(s[:r, None] * vt[:r])


def xkv_replay(b, man, layers, group="4", rank_k="budget", rank_v="budget", v_share="0.6", **_):
    m, nh, nkv, scale, p, t_all = shape(man)
    grp = nh // nkv
    d = m["head_dim"]
    rope = m.get("rope")
    steps = np.arange(p, t_all)
    causal = np.arange(t_all)[None, :] <= steps[:, None]
    size = int(group)
    sums, count = np.zeros(4), 0
    for first in range(0, len(layers), size):
        members = layers[first:first + size]
        ks = [lay["k"].copy() for lay in members]
        vs = [lay["v"].copy() for lay in members]
        if p > b:
            n = len(members) * nkv * d
            total = (2 * b * n) // (p + n)
            rk = int(np.floor((1 - float(v_share)) * total))
            rv = total - rk
            rk = min(rk if rank_k == "budget" else int(rank_k), p, n)
            rv = min(rv if rank_v == "budget" else int(rank_v), p, n)
            pre = [[rotate(lay["k"][g, :p], rope, -1) if rope else lay["k"][g, :p] for g in range(nkv)]
                   for lay in members]
            xk = np.concatenate([pre[i][g] for i in range(len(members)) for g in range(nkv)], axis=1)
            xv = np.concatenate([lay["v"][g, :p] for lay in members for g in range(nkv)], axis=1)
            rk_x, rv_x = rank_r(xk, rk), rank_r(xv, rv)
            for i in range(len(members)):
                for g in range(nkv):
                    cols = slice((i * nkv + g) * d, (i * nkv + g + 1) * d)
                    kr = rk_x[:, cols]
                    ks[i][g, :p] = rotate(kr, rope, 1) if rope else kr
                    vs[i][g, :p] = rv_x[:, cols]
        for i, lay in enumerate(members):
            q = lay["q"]
            for h in range(nh):
                g = h // grp
                p_full = softmax_rows(scale * q[h, steps] @ lay["k"][g].T, causal)
                p_comp = softmax_rows(scale * q[h, steps] @ ks[i][g].T, causal)
                sums += step_metrics(p_full, p_full @ lay["v"][g], p_comp, p_comp @ vs[i][g], causal)
                count += 1
    return sums / count


# ---------------------------------------------------------------- triforce

def triforce_replay(b, man, layers, chunk="8", refresh="1", per_query_head="false", decode_evict="true",
                    budget_per="kv_head", **_):
    """The retrieval draft: chunk 0, then chunks by descending q . mean key
    (summed over the cache's query heads; later chunk on ties), the first
    B - n_dec positions of that order plus the decode entries; the order is
    recomputed from the query of the latest completed step every `refresh`
    steps (the last prompt query before the first)."""
    m, nh, nkv, scale, p, t_all = shape(man)
    c, every = int(chunk), int(refresh)
    grp = nh // nkv
    steps = np.arange(p, t_all)
    causal = np.arange(t_all)[None, :] <= steps[:, None]
    nc = -(-p // c)
    units = [[h] for h in range(nh)] if per_query_head == "true" else \
        [list(range(g * grp, (g + 1) * grp)) for g in range(nkv)]
    if per_query_head == "true" and budget_per != "query_head":
        b = max(b // grp, 1)  # --budget is per KV head: its G query-head caches share it
    sums, count = np.zeros(4), 0
    for lay in layers:
        q, k, v = lay["q"], lay["k"], lay["v"]
        for heads in units:
            g = heads[0] // grp
            means = np.stack([k[g, i * c:min((i + 1) * c, p)].mean(axis=0) for i in range(nc)])

            def ranking(pos):
                sc = (q[heads, pos] @ means.T).sum(axis=0)
                rest = np.arange(1, nc)
                rest = rest[np.lexsort((-rest, -sc[rest]))]
                return np.concatenate([np.arange(i * c, min((i + 1) * c, p)) for i in [0, *rest]])

            kept = np.zeros((len(steps), t_all), bool)
            for i, t in enumerate(steps):
                done = t - p  # completed decode steps before the query at t
                if decode_evict == "true":
                    last = (done // every) * every  # the latest refresh step (0: prefill)
                    order = ranking(p - 1 if last == 0 else p + last - 1)
                    n_dec = min(done, b)
                    kept[i, order[: b - n_dec]] = True
                    kept[i, t - n_dec:t] = True
                else:
                    kept[i, ranking(p - 1)[:b]] = True
                    kept[i, p:t] = True
                kept[i, t] = True
            for h in heads:
                logits = scale * q[h, steps] @ k[g].T
                p_full = softmax_rows(logits, causal)
                p_comp = softmax_rows(logits, kept)
                sums += step_metrics(p_full, p_full @ v[g], p_comp, p_comp @ v[g], kept)
                count += 1
    return sums / count


PRESSES = {"kvcrush": kvcrush_keep}
REPLAYS = {"lazyeviction": lazy_replay, "xkv": xkv_replay, "triforce": triforce_replay}
