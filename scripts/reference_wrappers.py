"""Independent NumPy transcriptions of the kvpress wrapper presses
(docs/methods/{chunkkv,chunk,block,criticalkv,criticaladakv,keyrerotation,
decoding,prefilldecoding}.md), float64, for tests/replay_real.rs.

Two kinds, both imported by reference_replay.py:
- WRAPPERS: "keep these prompt positions" rules, with the PRESSES call
  convention of reference_replay.py (keyword arguments kg, vg, colsum,
  heads, p, b, layer, g, rope, q, k_all, v_all and the spec's options);
  they return KV head g's kept prompt positions.
- REPLAYS: rules that are not a fixed prompt set (decode-time compression,
  re-rotated keys): replay(policy, b, man, layers) -> mean (rel_l2, cosine,
  attn_mass, kl), averaged over decode steps, then over layers and query
  heads, with the metrics written out here again.

Scorers supported inside the wrappers: snapkv (w 32, k 7, max pooling,
group mean before pooling; `w=` sets w), keydiff (one-shot on the set it is
given), tova (mean over every query head of the layer). Ties: the later
position is kept.
"""
import numpy as np


# ---------------------------------------------------------------- helpers

def top(scores, cand, k):
    """The k best of cand by (score desc, position desc), ascending."""
    cand = np.asarray(cand, dtype=np.int64)
    if k <= 0 or len(cand) == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort((-cand, -np.asarray(scores)[cand]))
    return np.sort(cand[order[:k]])


def causal_rows(qrows, keys, rows, scale):
    """Softmax rows (len(rows), n) of queries qrows (len(rows), d) over keys
    (n, d), the query of set index j seeing set indices <= j."""
    n = keys.shape[0]
    logits = scale * qrows @ keys.T
    mask = np.arange(n)[None, :] <= np.asarray(rows)[:, None]
    x = np.where(mask, logits, -np.inf)
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def snapkv_set(q, kg, heads, idx, scale, w=32, k=7):
    """SnapKV over the set idx (ascending positions): window = the set's last
    min(w, n) entries; s_i = group mean of the window rows' attention,
    max-pooled (kernel k, padding ignored), for set indices i < n - w."""
    n = len(idx)
    w = min(w, n)
    s = np.zeros(n - w)
    for h in heads:
        a = causal_rows(q[h][idx[n - w:]], kg[idx], np.arange(n - w, n), scale)
        s += a[:, : n - w].sum(axis=0) / len(heads)
    r = k // 2
    return np.array([s[max(i - r, 0): i + r + 1].max() for i in range(n - w)])


def keydiff_set(kg, idx):
    """-cos(k_i, anchor), anchor the mean unit key of the set."""
    x = kg[idx]
    nrm = np.maximum(np.linalg.norm(x, axis=1), 1e-12)
    a = (x / nrm[:, None]).mean(axis=0)
    return -(x @ a) / np.maximum(nrm * np.linalg.norm(a), 1e-12)


def scorer_of(opts):
    """(score function over a set, protected window at budget b)."""
    name = opts.get("scorer", "snapkv")
    w = int(opts.get("w", "32"))
    if name == "snapkv":
        return (lambda q, kg, heads, idx, scale: snapkv_set(q, kg, heads, idx, scale, w=w),
                lambda b: min(w, b))
    if name == "keydiff":
        return (lambda q, kg, heads, idx, scale: keydiff_set(kg, idx), lambda b: 0)
    raise ValueError(f"scorer {name} not transcribed")


def padded(s, n, recent):
    """Scores of a set of n: unscored positions and the last `recent` +inf."""
    out = np.full(n, np.inf)
    out[: len(s)] = s
    if recent:
        out[n - recent:] = np.inf
    return out


def scale_of(man):
    return man["model"]["attn_scale"]


# ------------------------------------------------------ keep-position rules

_cache = {}


def chunkkv_keep(kg, vg, colsum, heads, p, b, layer, g, rope, q, k_all, v_all, scale, **opts):
    """Chunks of chunk_length; chunk score = mean over its positions of the
    scores summed over KV heads (protected/unscored positions: the layer's
    maximum score); k = max(1, floor(n_chunks*B/P)) best chunks, each taken
    while its unprotected positions fit in B - protected, else skipped."""
    key = ("chunkkv", layer, b, tuple(sorted(opts.items())))
    if key not in _cache:
        score, recent_of = scorer_of(opts)
        L = int(opts.get("chunk_length", "20"))
        nkv = k_all.shape[0]
        group = q.shape[0] // nkv
        recent = recent_of(b)
        prot = np.zeros(p, bool)
        prot[p - recent:] = True
        rows = [score(q, k_all[u], range(u * group, (u + 1) * group), np.arange(p), scale)
                for u in range(nkv)]
        mx = max(r[i] for r in rows for i in range(len(r)) if not prot[i])
        summed = np.zeros(p)
        for r in rows:
            full = np.full(p, mx)
            full[: len(r)] = r
            full[prot] = mx
            summed += full
        n_chunks = -(-p // L)
        cs = np.array([summed[j * L: (j + 1) * L].mean() for j in range(n_chunks)])
        kk = max(1, n_chunks * b // p)
        keep = prot.copy()
        room = b - recent
        taken = 0
        for j in sorted(range(n_chunks), key=lambda j: (-cs[j], -j)):
            if taken == kk:
                break
            r = np.arange(j * L, min((j + 1) * L, p))
            new = int((~keep[r]).sum())
            if new <= room:
                keep[r] = True
                room -= new
                taken += 1
        _cache[key] = np.flatnonzero(keep)
    return _cache[key]


def chunk_keep(kg, vg, colsum, heads, p, b, layer, g, rope, q, k_all, v_all, scale, **opts):
    """Each chunk scored alone (its own causal attention), top
    floor(len*B/P) of it (at least 1 while the total stays within B)."""
    score, recent_of = scorer_of(opts)
    L = int(opts.get("chunk_length", "1024"))
    keep, total = [], 0
    for start in range(0, p, L):
        idx = np.arange(start, min(start + L, p))
        n = len(idx) * b // p
        if n == 0 and total < b:
            n = 1
        n = min(n, b - total)
        total += n
        if n == 0:
            continue
        s = padded(score(q, kg, heads, idx, scale), len(idx), recent_of(n))
        keep.extend(start + top(s, np.arange(len(idx)), n))
    return np.array(sorted(keep))


def block_keep(kg, vg, colsum, heads, p, b, layer, g, rope, q, k_all, v_all, scale, **opts):
    """Start with 0..B; per block of block_size, score kept + block as a set
    (protected: +inf) and keep its top B."""
    opts = dict(opts)
    opts.setdefault("scorer", "keydiff")
    score, recent_of = scorer_of(opts)
    bs = int(opts.get("block_size", "128"))
    kept = np.arange(b)
    for start in range(b, p, bs):
        cur = np.concatenate([kept, np.arange(start, min(start + bs, p))])
        s = padded(score(q, kg, heads, cur, scale), len(cur), recent_of(b))
        kept = np.sort(cur[top(s, np.arange(len(cur)), b)])
    return kept


def two_stage(p, recent, s, vnorm, count, first, eps=1e-4):
    """Protected (the last `recent`), then the best `first - recent` of the
    scored candidates by s, then the best of the others by (s + eps)*|v|_1
    up to `count` in all."""
    end = min(p - recent, len(s))
    cand = np.arange(end)
    left = max(count - recent, 0)
    n1 = min(max(first - recent, 0), left)
    s1 = top(s, cand, n1)
    full = np.zeros(end)
    full[:] = s[:end]
    wv = (full + eps) * vnorm[:end]
    rest = np.setdiff1d(cand, s1)
    s2 = top(wv, rest, left - n1)
    return np.sort(np.concatenate([s1, s2, np.arange(p - recent, p)]).astype(np.int64))


def criticalkv_keep(kg, vg, colsum, heads, p, b, layer, g, rope, q, k_all, v_all, scale, **opts):
    """Stage 1: floor(B*first_stage_ratio) by the score (window first);
    stage 2: (s + 1e-4)*|v|_1 fills B."""
    score, recent_of = scorer_of(opts)
    s = score(q, kg, heads, np.arange(p), scale)
    r = float(opts.get("first_stage_ratio", "0.5"))
    vnorm = np.abs(vg[:p]).sum(axis=1)
    return two_stage(p, recent_of(b), s, vnorm, b, int(np.floor(b * r)))


def criticaladakv_keep(kg, vg, colsum, heads, p, b, layer, g, rope, q, k_all, v_all, scale, **opts):
    """kvpress AdaKV budgets (each head's top floor(alpha*B) reserved, the
    protected first, then the layer's best pairs), then per head two stages
    with first = max(floor(B_h*ratio), min(floor(alpha*B), B_h))."""
    key = ("criticaladakv", layer, b, tuple(sorted(opts.items())))
    if key not in _cache:
        score, recent_of = scorer_of(opts)
        alpha = float(opts.get("alpha", "0.2"))
        r = float(opts.get("first_stage_ratio", "0.5"))
        nkv = k_all.shape[0]
        group = q.shape[0] // nkv
        recent = recent_of(b)
        s = [score(q, k_all[u], range(u * group, (u + 1) * group), np.arange(p), scale)
             for u in range(nkv)]
        avg = b - recent
        safe = int(np.floor(alpha * b))
        reserve = min(max(safe - recent, 0), avg)
        pairs = sorted(((s[u][i], i, u) for u in range(nkv) for i in range(p - recent)),
                       key=lambda x: (-x[0], -x[1], x[2]))
        seen = [0] * nkv
        rest = []
        for x in pairs:
            seen[x[2]] += 1
            if seen[x[2]] > reserve:
                rest.append(x)
        counts = [0] * nkv
        for x in rest[: nkv * (avg - reserve)]:
            counts[x[2]] += 1
        out = []
        for u in range(nkv):
            hb = counts[u] + min(reserve, seen[u]) + recent
            first = max(int(np.floor(hb * r)), min(safe, hb))
            vnorm = np.abs(v_all[u][:p]).sum(axis=1)
            out.append(two_stage(p, recent, s[u], vnorm, hb, first))
        _cache[key] = out
    return _cache[key][g]


WRAPPERS = {
    "chunkkv": chunkkv_keep,
    "chunk": chunk_keep,
    "block": block_keep,
    "criticalkv": criticalkv_keep,
    "criticaladakv": criticaladakv_keep,
}


# ------------------------------------------------------------ full replays

def step_metrics(o_c, o_f, p_full, kept, p_comp):
    """rel_l2, cosine, attention mass kept, KL(full on the kept set,
    renormalised || compressed), per step; p_* over trace positions."""
    rel = np.linalg.norm(o_c - o_f, axis=1) / np.linalg.norm(o_f, axis=1)
    cos = (o_c * o_f).sum(axis=1) / (np.linalg.norm(o_c, axis=1) * np.linalg.norm(o_f, axis=1))
    mass = (p_full * kept).sum(axis=1)
    pf = np.where(kept, p_full, 0.0) / mass[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(pf > 0, pf * np.log(pf / np.maximum(p_comp, np.finfo(float).tiny)), 0.0).sum(axis=1)
    return np.array([rel.mean(), cos.mean(), mass.mean(), kl.mean()])


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _setup(man):
    m = man["model"]
    p = man["tokens"]["prompt_len"]
    t_all = len(man["tokens"]["ids"])
    return m["n_heads"], m["n_kv_heads"], m["attn_scale"], p, t_all


def tova_scores(q, k, t, idx, scale):
    """Mean over every query head of the layer of query t's softmax over the
    entries idx of its KV head."""
    nh, nkv = q.shape[0], k.shape[0]
    group = nh // nkv
    return np.mean([softmax(scale * k[h // group][idx] @ q[h][t]) for h in range(nh)], axis=0)


def decoding_replay(policy, b, man, layers):
    """`decoding:scorer=tova,...` / `prefilldecoding:scorer=tova,...`: the
    prompt kept whole (decoding) or TOVA's top B by the last prompt row
    (prefilldecoding); each step appended, attention, then every
    compression_interval steps the set is cut to its top B by TOVA's score
    of that step's query. The set is the same for every KV head (TOVA's
    score is layer-wide)."""
    name, _, opt = policy.partition(":")
    opts = dict(o.split("=") for o in opt.split(",")) if opt else {}
    assert opts.get("scorer") == "tova", "transcribed for the TOVA scorer"
    every = int(opts.get("compression_interval", "512"))
    nh, nkv, scale, p, t_all = _setup(man)
    group = nh // nkv
    steps = np.arange(p, t_all)
    sums, count = np.zeros(4), 0
    for lay in layers:
        q, k, v = lay["q"], lay["k"], lay["v"]
        if name == "prefilldecoding" and p > b:
            s = tova_scores(q, k, p - 1, np.arange(p), scale)
            kept = list(top(s, np.arange(p), b))
        else:
            kept = list(range(p))
        masks = np.zeros((len(steps), t_all), bool)
        n_since = 0
        for i, t in enumerate(steps):
            kept.append(t)
            masks[i, kept] = True
            n_since += 1
            if n_since >= every:
                if len(kept) > b:
                    idx = np.array(kept)
                    s = tova_scores(q, k, t, idx, scale)
                    kept = list(idx[top(s, np.arange(len(idx)), b)])
                n_since = 0
        causal = np.arange(t_all)[None, :] <= steps[:, None]
        for h in range(nh):
            g = h // group
            logits = scale * q[h, steps] @ k[g].T
            p_full = softmax(np.where(causal, logits, -np.inf))
            p_comp = softmax(np.where(masks, logits, -np.inf))
            sums += step_metrics(p_comp @ v[g], p_full @ v[g], p_full, masks, p_comp)
            count += 1
    return sums / count


def rotate_back(x, delta, rope):
    """Rotate post-RoPE key rows x (n, d) by minus the angle of delta (n,)."""
    assert rope["scaling"]["type"] == "none", rope
    rot = rope["rotated_dims"]
    half = rot // 2
    ang = np.asarray(delta, float)[:, None] * rope["theta"] ** (-2.0 * np.arange(half) / rot)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    if rope["style"] == "neox":
        i, j = np.arange(half), np.arange(half) + half
    else:
        i, j = 2 * np.arange(half), 2 * np.arange(half) + 1
    out = x.copy()
    out[:, i] = x[:, i] * c + x[:, j] * s
    out[:, j] = -x[:, i] * s + x[:, j] * c
    return out


def keyrerotation_replay(policy, b, man, layers):
    """`snapkv+keyrerotation` (SnapKV defaults): SnapKV's kept prompt
    positions, the e-th kept key rotated from its position to e; decode
    keys and every query as in the trace."""
    assert policy == "snapkv+keyrerotation"
    nh, nkv, scale, p, t_all = _setup(man)
    group = nh // nkv
    rope = man["model"]["rope"]
    steps = np.arange(p, t_all)
    sums, count = np.zeros(4), 0
    for lay in layers:
        q, k, v = lay["q"], lay["k"], lay["v"]
        for g in range(nkv):
            heads = range(g * group, (g + 1) * group)
            if p <= b:
                keep = np.arange(p)
            else:
                w = 32
                s = snapkv_set(q, k[g], heads, np.arange(p), scale, w=w)
                keep = np.concatenate([top(s, np.arange(p - w), b - w), np.arange(p - w, p)])
            kr = rotate_back(k[g][keep], keep - np.arange(len(keep)), rope)
            causal = np.arange(t_all)[None, :] <= steps[:, None]
            kept = np.zeros((len(steps), t_all), bool)
            kept[:, keep] = True
            kept[:, p:] = causal[:, p:]
            for h in heads:
                logits = scale * q[h, steps] @ k[g].T
                p_full = softmax(np.where(causal, logits, -np.inf))
                # the compressed cache: re-rotated prompt keys, decode keys as they are
                kc = k[g].copy()
                kc[keep] = kr
                lc = scale * q[h, steps] @ kc.T
                p_comp = softmax(np.where(kept, lc, -np.inf))
                sums += step_metrics(p_comp @ v[g], p_full @ v[g], p_full, kept, p_comp)
                count += 1
    return sums / count


REPLAYS = {
    "decoding": decoding_replay,
    "prefilldecoding": decoding_replay,
    "snapkv+keyrerotation": keyrerotation_replay,
}
