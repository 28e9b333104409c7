"""Independent NumPy transcriptions of the head-level methods (branch `heads`):
`retrieval_head`, `razor` (docs/methods/NAME.md), in float64 from the trace's
stored values.

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


HEADS = {"retrieval_head": retrieval_head, "razor": razor}
