"""Independent NumPy transcriptions of the head-level methods (branch `heads`):
`retrieval_head`, `razor`, `windowkv`, `compresskv` (docs/methods/NAME.md), in
float64 from the trace's stored values.

These methods rank heads over the whole model and (razor) write a merged
compensation entry, so they do not fit the per-KV-head "keep these positions"
loop of reference_replay.py: each entry of HEADS builds every layer's caches
as entries (key, value, logit bias, member positions) and `replay_entries`
replays them teacher-forced (decode entries appended exactly) with the
metrics of replay/SEMANTICS.md: rel_l2, cosine, attention mass on the
represented positions, and KL of the full attention aggregated onto the
entries (renormalised) to the compressed attention.

Signature: HEADS[name](b, man, layers, **opts) -> (rel_l2, cosine, attn_mass, kl)
with `layers` as reference_replay.load returns them (q, k, v in float64).
"""
import math

import numpy as np


def head_scores(q, k, ids, p, group, span):
    """Per query head: (copy share, echo share) over the T - P steps. The query
    at t (P-1 .. T-2) produces ids[t+1]; its most-attended position j (first
    argmax of q_t . k_j over 0..t) counts as a copy when j < P, j in span and
    ids[j] == ids[t+1]; as an echo when also j < t and ids[j] == ids[t]."""
    nh, t_all = q.shape[0], len(ids)
    copy = np.zeros(nh)
    echo = np.zeros(nh)
    if t_all <= p:
        return copy, echo
    lo, hi = span
    for h in range(nh):
        g = h // group
        for t in range(p - 1, t_all - 1):
            j = int(np.argmax(k[g, : t + 1] @ q[h, t]))
            if j < p and lo <= j < hi:
                copy[h] += ids[j] == ids[t + 1]
                echo[h] += j < t and ids[j] == ids[t]
    return copy / (t_all - p), echo / (t_all - p)


def top_mask(scores, frac):
    """ceil(frac * n) best positive scores, ties to the lower index."""
    n = math.ceil(frac * len(scores))
    order = [i for i in np.lexsort((np.arange(len(scores)), -scores)) if scores[i] > 0][:n]
    m = np.zeros(len(scores), bool)
    m[order] = True
    return m


def exact_entries(kg, vg, positions):
    return [(kg[i], vg[i], 0.0, [i]) for i in positions]


def head_split(b, man, layers, frac="0.15", echo_frac="0", n_sink="4", compensate="false",
               scope="model", span="auto", **_):
    """Prompt entries per (layer, KV head): all P for a KV head with a
    retrieval query head, else sinks + recent window (+ compensation token)."""
    m = man["model"]
    nh, nkv = m["n_heads"], m["n_kv_heads"]
    group = nh // nkv
    p = man["tokens"]["prompt_len"]
    ids = man["tokens"]["ids"]
    needle = [s for s in man.get("spans", []) if s["name"] == "needle"]
    sp = (min(needle[0]["start"], p), min(needle[0]["end"], p)) if (needle and span == "auto") else (0, p)
    scores = [head_scores(lay["q"], lay["k"], ids, p, group, sp) for lay in layers]
    frac, echo_frac, ns = float(frac), float(echo_frac), int(n_sink)
    if scope == "model":
        cm = top_mask(np.concatenate([s[0] for s in scores]), frac)
        em = top_mask(np.concatenate([s[1] for s in scores]), echo_frac)
        picked = (cm | em).reshape(len(layers), nh)
    else:
        picked = np.array([top_mask(s[0], frac) | top_mask(s[1], echo_frac) for s in scores])
    out = []
    for li, lay in enumerate(layers):
        per = []
        for g in range(nkv):
            kg, vg = lay["k"][g], lay["v"][g]
            if picked[li, g * group:(g + 1) * group].any() or p <= b:
                per.append(exact_entries(kg, vg, range(p)))
            elif compensate == "true":
                s = min(ns, b - 1)
                w = b - 1 - s
                drop = list(range(s, p - w))
                comp = (kg[drop].mean(axis=0), vg[drop].mean(axis=0), math.log(len(drop)), drop)
                per.append(exact_entries(kg, vg, range(s)) + [comp] + exact_entries(kg, vg, range(p - w, p)))
            else:
                s = min(ns, b)
                per.append(exact_entries(kg, vg, list(range(s)) + list(range(p - (b - s), p))))
        out.append(per)
    return out


def replay_entries(caches, man, layers):
    """Teacher-forced replay of prompt caches given as entries; mean metrics."""
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
        q, k, v = lay["q"], lay["k"], lay["v"]
        for g in range(nkv):
            ents = caches[li][g]
            e = len(ents)
            kc = np.array([x[0] for x in ents])
            vc = np.array([x[1] for x in ents])
            bias = np.array([x[2] for x in ents])
            memb = np.zeros((e, p))
            for i, x in enumerate(ents):
                memb[i, x[3]] = 1.0
            # decode entries: exact, visible causally
            dec_mask = np.arange(p, t_all)[None, :] <= steps[:, None]  # (n, n_dec)
            for h in range(g * group, (g + 1) * group):
                lf = scale * q[h, steps] @ k[g].T  # (n, T)
                causal = np.arange(t_all)[None, :] <= steps[:, None]
                lf = np.where(causal, lf, -np.inf)
                pf = np.exp(lf - lf.max(axis=1, keepdims=True))
                pf /= pf.sum(axis=1, keepdims=True)
                o_f = pf @ v[g]
                lc = np.concatenate([scale * q[h, steps] @ kc.T + bias[None, :],
                                     np.where(dec_mask, scale * q[h, steps] @ k[g, p:].T, -np.inf)], axis=1)
                pc = np.exp(lc - lc.max(axis=1, keepdims=True))
                pc /= pc.sum(axis=1, keepdims=True)
                o_c = pc @ np.concatenate([vc, v[g, p:]])
                cell = np.concatenate([pf[:, :p] @ memb.T, pf[:, p:]], axis=1)  # (n, e + n_dec)
                mass = cell.sum(axis=1)
                rel = np.linalg.norm(o_c - o_f, axis=1) / np.maximum(np.linalg.norm(o_f, axis=1), 1e-300)
                cos = (o_c * o_f).sum(axis=1) / np.maximum(
                    np.linalg.norm(o_f, axis=1) * np.linalg.norm(o_c, axis=1), 1e-300)
                pr = cell / mass[:, None]
                with np.errstate(divide="ignore", invalid="ignore"):
                    kl = np.where(pr > 0, pr * np.log(pr / np.maximum(pc, np.finfo(float).tiny)), 0).sum(axis=1)
                sums += [rel.mean(), cos.mean(), mass.mean(), kl.mean()]
                count += 1
    assert n > 0
    return sums / count


def retrieval_head(b, man, layers, **opts):
    return replay_entries(head_split(b, man, layers, **opts), man, layers)


def razor(b, man, layers, **opts):
    o = dict(frac="0.14", echo_frac="0.01", compensate="true")
    o.update(opts)
    return replay_entries(head_split(b, man, layers, **o), man, layers)


def window_attention(q, k, heads, p, w, scale):
    """Per query head: the causal softmax rows of the last w prompt queries
    over the prompt keys, (w, P)."""
    out = []
    rows = np.arange(p - w, p)
    for h in heads:
        g = h // (q.shape[0] // k.shape[0])
        lg = scale * q[h, rows] @ k[g, :p].T
        lg = np.where(np.arange(p)[None, :] <= rows[:, None], lg, -np.inf)
        e = np.exp(lg - lg.max(axis=1, keepdims=True))
        out.append(e / e.sum(axis=1, keepdims=True))
    return out


def windowkv(b, man, layers, window="8", task="qa", select="auto", suffix="auto", group="8",
             schedule="arithmetic", beta="14", **_):
    """Windows of the review part scored by the observation rows (max: mean of
    each head's top window//2, average: mean over heads and positions); the
    lowest ceil((len - R_l)/window) dropped; the group's first layer selects."""
    m = man["model"]
    nh, nkv, scale = m["n_heads"], m["n_kv_heads"], m["attn_scale"]
    p = man["tokens"]["prompt_len"]
    sel = select if select != "auto" else ("max" if task == "qa" else "average")
    suf = int(suffix) if suffix != "auto" else (32 if task == "qa" else 16)
    win, grp, beta = int(window), int(group), int(beta)
    n = len(layers)
    s = min(suf, b, p)
    r = b - min(suf, b)
    n_groups = -(-n // grp)
    caches = []
    for l0 in range(0, n, grp):
        if schedule == "arithmetic" and n_groups >= 2:
            last = r * grp // beta
            first = max(2 * r - last, 0)
            step = max(first - last, 0) // (n_groups - 1)
            j = l0 // grp
            r_l = last if j == n_groups - 1 else first - j * step
        else:
            r_l = r
        lay = layers[l0]
        ln = p - s
        if p <= b or ln <= r_l:
            keep = list(range(p))
        else:
            a = np.array([x.sum(axis=0)[:ln] for x in window_attention(lay["q"], lay["k"], range(nh), p, s, scale)])
            n_win = -(-ln // win)
            drop = -(-(ln - r_l) // win)
            if drop * win >= ln:
                keep = list(range(ln, p))
            else:
                sc = []
                for i in range(n_win):
                    blk = a[:, i * win:min((i + 1) * win, ln)]
                    if sel == "average":
                        sc.append(blk.mean())
                    else:
                        kk = max(min(win // 2, blk.shape[1]), 1)
                        sc.append(np.sort(blk, axis=1)[:, ::-1][:, :kk].mean())
                order = sorted(range(n_win), key=lambda i: -sc[i])  # stable: earlier first on ties
                kept_w = sorted(order[: n_win - drop])
                keep = [x for i in kept_w for x in range(i * win, min((i + 1) * win, ln))] + list(range(ln, p))
        for li in range(l0, min(l0 + grp, n)):
            caches.append([exact_entries(layers[li]["k"][g], layers[li]["v"][g], keep) for g in range(nkv)])
    return replay_entries(caches, man, layers)


def compresskv(b, man, layers, heads="4", w="8", kernel="5", score="copy", span="auto", alloc="error", **_):
    """Top `heads` query heads per layer by head score score the prompt:
    window attention summed over the w rows, avg-pooled (zero padding
    counted), mean over those heads; top B_l - w + the window. B_l from the
    layers' relative output errors at uniform B (the reference allocation)."""
    m = man["model"]
    nh, nkv, scale = m["n_heads"], m["n_kv_heads"], m["attn_scale"]
    group = nh // nkv
    p = man["tokens"]["prompt_len"]
    ids = man["tokens"]["ids"]
    needle = [x for x in man.get("spans", []) if x["name"] == "needle"]
    sp = (min(needle[0]["start"], p), min(needle[0]["end"], p)) if (needle and span == "auto") else (0, p)
    nhd, ww, ker = int(heads), min(int(w), p), int(kernel)
    n = len(layers)

    def srh_scores(q, k):
        t_all = len(ids)
        toks = set(ids[sp[0]:sp[1]])
        out = np.zeros(nh)
        for h in range(nh):
            g = h // group
            for t in range(p - 1, t_all - 1):
                if ids[t + 1] in toks:
                    lg = scale * (k[g, : t + 1] @ q[h, t])
                    e = np.exp(lg - lg.max())
                    out[h] += e[sp[0]:sp[1]].sum() / e.sum()
        return out / (t_all - p)

    def keep_at(li, bl):
        if p <= bl:
            return list(range(p))
        if bl <= ww:
            return list(range(p - bl, p))
        lay = layers[li]
        if score == "srh":
            hs = srh_scores(lay["q"], lay["k"])
        else:
            hs = head_scores(lay["q"], lay["k"], ids, p, group, sp)[0]
        chosen = list(np.lexsort((np.arange(nh), -hs))[:nhd])
        rows = window_attention(lay["q"], lay["k"], chosen, p, ww, scale)
        ln = p - ww
        s = np.zeros(ln)
        for a in rows:
            x = np.concatenate([np.zeros(ker // 2), a.sum(axis=0)[:ln], np.zeros(ker // 2)])
            s += np.array([x[i:i + ker].sum() / ker for i in range(ln)])
        s /= len(chosen)
        order = np.lexsort((-np.arange(ln), -s))  # score desc, later position first
        return sorted(order[: bl - ww].tolist()) + list(range(ln, p))

    def layer_error(li):
        lay = layers[li]
        keep = keep_at(li, b)
        rows = window_attention(lay["q"], lay["k"], range(nh), p, ww, scale)
        err = nrm = 0.0
        for h, a in enumerate(rows):
            vg = lay["v"][h // group][:p]
            o = a @ vg
            ak = a[:, keep]
            oc = (ak / ak.sum(axis=1, keepdims=True)) @ vg[keep]
            err += ((oc - o) ** 2).sum()
            nrm += (o ** 2).sum()
        return math.sqrt(err) / (math.sqrt(nrm) + 1e-5)

    budgets = [b] * n
    if alloc == "error" and p > b:
        e = np.array([layer_error(li) for li in range(n)])
        if e.sum() > 0:
            imp = e / e.sum()
            lo, hi, total = min(b // 4, 32), 3 * b, b * n
            bl = np.clip(lo + np.round(imp * (total - lo * n)), lo, hi)
            diff = int(total - bl.sum())
            while diff != 0:
                before = diff
                if diff > 0:
                    for i in np.lexsort((np.arange(n), -imp)):
                        if bl[i] < hi:
                            bl[i] += 1
                            diff -= 1
                            if diff == 0:
                                break
                else:
                    for i in np.lexsort((np.arange(n), -imp))[::-1]:
                        if bl[i] > lo:
                            bl[i] -= 1
                            diff += 1
                            if diff == 0:
                                break
                if diff == before:
                    break
            budgets = [int(x) for x in bl]
    caches = []
    for li in range(n):
        keep = keep_at(li, max(budgets[li], 1))
        caches.append([exact_entries(layers[li]["k"][g], layers[li]["v"][g], keep) for g in range(nkv)])
    return replay_entries(caches, man, layers)


HEADS = {"retrieval_head": retrieval_head, "razor": razor, "windowkv": windowkv, "compresskv": compresskv}
