//! D2O: layer-level budgets from attention density, token-level eviction with
//! recall-and-merge of evicted tokens under an EMA similarity threshold.
//!
//! Rule (docs/methods/d2o.md, spec §2, the paper preset): per layer, the sample
//! variance of each head's prompt column sums, min-max normalised across the
//! layer's heads and averaged, gives s_l; φ = softmax(−s) over layers;
//! r_l = clamp(L·B·φ_l/P, 0.01, 1) (absolute-budget mode: B is the average
//! entries per layer); N_l = ⌊r_l·f·P⌋ important, M_l = ⌊r_l·(1−f)·P⌋ recent,
//! S_l = N_l + M_l. Per KV head (scores summed over the group): keep the
//! sinks (inside N), the top N of the rest and the last M; every evicted token
//! is matched to its most similar kept key (cosine); the threshold τ is the
//! EMA of the mean best similarity (τ₀ = the first mean, β weighting the
//! current one, updated before the test); tokens with μ ≥ τ are folded into
//! their match with weights e¹ (kept) and e^u (absorbed), the rest are dropped.
//! Decode: add the step's attention (summed over the group), evict the lowest
//! score outside the sinks and the last M entries, recall-and-merge it.

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::cache::HeadCache;
use crate::policy::{DecodeState, Policy, PrefillCtx, StepCtx};
use crate::params::{Kind, ParamInfo, Params};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "d2o",
    summary: "per-layer budgets from attention variance, H2O-style eviction whose evicted tokens merge into similar kept ones above an EMA threshold",
    paper: "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language Models (Wan et al., ICLR 2025, arXiv 2406.13035)",
    params: &[
        ParamInfo { name: "preset", default: "paper", kind: Kind::Choice(&["paper", "code"]), help: "paper: the switches below; code: the official code's settings (protected layers 0, 1, L−1; per-query-head caches; scaled-mean merge; τ ← (τ + m)/2; N:M = 1:1), overriding them" },
        ParamInfo { name: "f", default: "0.75", kind: Kind::Float, help: "important share N/(N+M) of each layer's budget (paper 3:1)" },
        ParamInfo { name: "beta", default: "0.7", kind: Kind::Float, help: "EMA weight of the current mean similarity" },
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "attention sinks, always kept" },
        ParamInfo { name: "sink_slot", default: "important", kind: Kind::Choice(&["important", "recent"]), help: "sinks count inside N (official code) or inside M (paper wording)" },
        ParamInfo { name: "threshold", default: "ema", kind: Kind::Choice(&["ema", "none"]), help: "filter evicted tokens by the EMA threshold, or merge them all" },
        ParamInfo { name: "merge", default: "weighted", kind: Kind::Choice(&["weighted", "average", "code_scaled_mean"]), help: "e-weighted convex merge (paper), plain mean, or the code's (k + Σ μ k_x)/(1 + |B|)" },
        ParamInfo { name: "match_on", default: "keys", kind: Kind::Choice(&["keys", "values", "split"]), help: "similarity used to match evicted tokens: keys, values, or keys for the key half and values for the value half (own thresholds)" },
        ParamInfo { name: "allocation", default: "inv_var_softmax", kind: Kind::Choice(&["inv_var_softmax", "uniform", "reciprocal", "exp_decay", "inv_var_softmax_raw"]), help: "layer budget rule (Table 4 variants; uniform = without the layer operation)" },
        ParamInfo { name: "protect_layers", default: "false", kind: Kind::Bool, help: "official code: layers 0, 1 and L−1 are never compressed" },
    ],
    caps: Caps { family: Family::Merging, phase: Phase::Decode, merges: true, holds_capacity: true, exact_when_covering: false, ..Caps::EVICT_PREFILL },
    test: "d2o_first_compression_merges_tokens_at_least_as_similar_as_the_mean",
    build: Build::Policy(|p| {
        Ok(Arc::new(D2o::from_params(p)?))
    }),
};

#[derive(Clone, Debug)]
pub struct D2o {
    pub f: f64,
    pub beta: f64,
    pub n_sink: usize,
    pub sinks_in_recent: bool,
    pub ema: bool,
    pub merge: String,
    /// 0 keys, 1 values, 2 split (keys for keys, values for values)
    pub match_on: u8,
    pub allocation: String,
    pub protect_layers: bool,
    /// One cache per query head (the official code repeats K/V per query head).
    pub per_query_head: bool,
    /// First compression at decode step 1 with the first decode query's
    /// attention in the scores and budgets from P + 1 (official code).
    pub defer_first: bool,
    /// One τ per layer shared by all its heads (official code).
    pub shared_tau: bool,
    /// Scores accumulated in f16 (official code).
    pub fp16_scores: bool,
}

impl D2o {
    fn from_params(p: &Params) -> Result<D2o, ReplayError> {
        let unit = |k: &str| -> Result<f64, ReplayError> {
            let x = p.float(k)?;
            if (0.0..=1.0).contains(&x) {
                Ok(x)
            } else {
                Err(ReplayError::BadParam {
                    policy: "d2o".into(),
                    key: k.into(),
                    value: x.to_string(),
                    msg: "must lie in [0, 1]".into(),
                })
            }
        };
        Ok(D2o {
            f: unit("f")?,
            beta: unit("beta")?,
            n_sink: p.int("n_sink")?,
            sinks_in_recent: p.word("sink_slot") == "recent",
            ema: p.word("threshold") == "ema",
            merge: p.word("merge").into(),
            match_on: match p.word("match_on") {
                "values" => 1,
                "split" => 2,
                _ => 0,
            },
            allocation: p.word("allocation").into(),
            protect_layers: p.bool("protect_layers")?,
            per_query_head: false,
            defer_first: false,
            shared_tau: false,
            fp16_scores: false,
        }
        .with_preset(p.word("preset")))
    }

    /// The official code's settings (d2o.md §2.6 items a to j): protected
    /// layers, first compression at decode step 1, per-query-head caches, one τ
    /// per layer, scaled-mean merge, τ ← (τ + m)/2, sinks inside N, layers
    /// whose budget reaches P − 1 stop compressing, N:M = 1:1, f16 scores.
    fn with_preset(self, preset: &str) -> D2o {
        if preset != "code" {
            return self;
        }
        D2o {
            protect_layers: true,
            per_query_head: true,
            defer_first: true,
            shared_tau: true,
            fp16_scores: true,
            merge: "code_scaled_mean".into(),
            beta: 0.5,
            f: 0.5,
            sinks_in_recent: false,
            ..self
        }
    }

    /// φ over layers from every layer's per-head column sums (each (n_heads·P)).
    pub fn layer_shares(&self, colsums: &[&[f32]], n_heads: usize, p: usize) -> Vec<f64> {
        let l = colsums.len();
        if p < 2 || self.allocation == "uniform" {
            return vec![1.0 / l as f64; l];
        }
        let var = |c: &[f32]| {
            let m = c.iter().map(|x| *x as f64).sum::<f64>() / c.len() as f64;
            c.iter().map(|x| (*x as f64 - m).powi(2)).sum::<f64>() / (c.len() - 1) as f64
        };
        let v: Vec<Vec<f64>> = colsums
            .iter()
            .map(|c| (0..n_heads).map(|h| var(&c[h * p..(h + 1) * p])).collect())
            .collect();
        let softmax = |x: Vec<f64>| {
            let mx = x.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = x.iter().map(|y| (y - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|y| y / z).collect::<Vec<f64>>()
        };
        let raw: Vec<f64> = v
            .iter()
            .map(|vh| vh.iter().sum::<f64>() / vh.len() as f64)
            .collect();
        match self.allocation.as_str() {
            "reciprocal" => {
                let r: Vec<f64> = raw.iter().map(|x| 1.0 / x.max(1e-12)).collect();
                let z: f64 = r.iter().sum();
                r.iter().map(|x| x / z).collect()
            }
            "exp_decay" => softmax(raw.iter().map(|x| -x).collect()),
            "inv_var_softmax_raw" => softmax(raw.iter().map(|x| 1.0 / x.max(1e-12)).collect()),
            _ => {
                let s: Vec<f64> = v
                    .iter()
                    .map(|vh| {
                        let (mn, mx) = vh
                            .iter()
                            .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
                        vh.iter().map(|x| (x - mn) / (mx - mn + 1e-6)).sum::<f64>()
                            / vh.len() as f64
                    })
                    .collect();
                softmax(s.iter().map(|x| -x).collect())
            }
        }
    }
}

/// r_l = clamp(L·B·φ_l/P, 0.01, 1): the layer's share of the prompt.
pub fn layer_ratio(phi: f64, n_layers: usize, b: usize, p: usize) -> f64 {
    (n_layers as f64 * b as f64 * phi / p as f64).clamp(0.01, 1.0)
}

/// (N, M) for a layer ratio `r` over `len` positions.
pub fn counts(r: f64, len: usize, f: f64) -> (usize, usize) {
    (
        (r * f * len as f64).floor() as usize,
        (r * (1.0 - f) * len as f64).floor() as usize,
    )
}

/// (N, M) of a layer for an average budget `b` per layer.
pub fn layer_counts(phi: f64, n_layers: usize, b: usize, p: usize, f: f64) -> (usize, usize) {
    counts(layer_ratio(phi, n_layers, b, p), p, f)
}

/// Per-(layer, KV head) state: scores, anchors and sink flags of the entries, τ.
struct HeadState {
    score: Vec<f64>,
    anchor: Vec<usize>,
    sink: Vec<bool>,
    /// EMA thresholds: [the match (or key half), the value half under split].
    tau: [Option<f64>; 2],
}

impl D2o {
    /// The first compression of a cache whose entry i is position i: keep the
    /// sinks (inside N, or inside M with `sink_slot=recent`), the N highest
    /// scores and the last M entries; returns the rest (to recall-and-merge).
    fn initial_evictions(&self, p: usize, st: &mut HeadState, n: usize, m: usize) -> Vec<usize> {
        let (z, recent_start) = if self.sinks_in_recent {
            let z = self.n_sink.min(m).min(p);
            (z, p.saturating_sub(m - z))
        } else {
            (self.n_sink.min(n).min(p), p.saturating_sub(m))
        };
        st.sink = (0..p).map(|i| i < z).collect();
        if p <= n.saturating_add(m) {
            return Vec::new();
        }
        let a = &st.score;
        let mut keep = vec![false; p];
        (0..z).for_each(|i| keep[i] = true);
        (recent_start.max(z)..p).for_each(|i| keep[i] = true);
        let n_top = if self.sinks_in_recent { n } else { n - z };
        let mut cand: Vec<usize> = (z..recent_start.max(z)).collect();
        cand.sort_by(|&x, &y| {
            a[y].partial_cmp(&a[x])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(x.cmp(&y))
        });
        cand.iter().take(n_top).for_each(|&i| keep[i] = true);
        (0..p).filter(|&i| !keep[i]).collect()
    }

    /// The passes of recall-and-merge: (similarity on values?, merge the keys?,
    /// merge the values?, threshold slot).
    fn passes(&self) -> &'static [(bool, bool, bool, usize)] {
        match self.match_on {
            1 => &[(true, true, true, 0)],
            2 => &[(false, true, false, 0), (true, false, true, 1)],
            _ => &[(false, true, true, 0)],
        }
    }

    /// Best kept match (index, cosine) of each evicted entry on the rows of
    /// `sim` (ties: the earliest kept entry).
    fn matches(sim: &[f32], d: usize, evict: &[usize], kept: &[usize]) -> Vec<(usize, f64)> {
        let row = |e: usize| &sim[e * d..(e + 1) * d];
        // The cosine ab / (|a| |b| + 1e-6) in f64, with each row's norm computed
        // once, and four kept rows per pass over the evicted row so the f64
        // sums of different pairs overlap (each sum keeps its order).
        let norm = |e: usize| {
            row(e)
                .iter()
                .map(|x| (*x as f64).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        let kept_norm: Vec<f64> = kept.iter().map(|&k| norm(k)).collect();
        evict
            .iter()
            .map(|&e| {
                let (x, nx) = (row(e), norm(e));
                let mut best = (kept[0], f64::MIN);
                for (ks, ns) in kept.chunks(4).zip(kept_norm.chunks(4)) {
                    let mut ab = [0f64; 4];
                    if ks.len() == 4 {
                        let r = [row(ks[0]), row(ks[1]), row(ks[2]), row(ks[3])];
                        for t in 0..d {
                            let xt = x[t] as f64;
                            for j in 0..4 {
                                ab[j] += xt * r[j][t] as f64;
                            }
                        }
                    } else {
                        for (j, &k) in ks.iter().enumerate() {
                            ab[j] = x
                                .iter()
                                .zip(row(k))
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum();
                        }
                    }
                    for j in 0..ks.len() {
                        let u = ab[j] / (nx * ns[j] + 1e-6);
                        if u > best.1 {
                            best = (ks[j], u);
                        }
                    }
                }
                best
            })
            .collect()
    }

    /// Fold the accepted evicted entries into their matches (weights from the
    /// vectors as they stood on entry: `old_k`, `old_v`).
    #[allow(clippy::too_many_arguments)]
    fn merge_pass(
        &self,
        c: &mut HeadCache,
        old: (&[f32], &[f32]),
        evict: &[usize],
        kept: &[usize],
        matches: &[(usize, f64)],
        accept: &[bool],
        merge: (bool, bool),
    ) {
        let d = c.d;
        for &k in kept {
            let absorbed: Vec<(usize, f64)> = evict
                .iter()
                .zip(matches)
                .zip(accept)
                .filter(|((_, (t, _)), ok)| *t == k && **ok)
                .map(|((&e, (_, u)), _)| (e, *u))
                .collect();
            if absorbed.is_empty() {
                continue;
            }
            let (wk, ws): (f64, Vec<f64>) = match self.merge.as_str() {
                "average" => (1.0, vec![1.0; absorbed.len()]),
                "code_scaled_mean" => (1.0, absorbed.iter().map(|x| x.1).collect()),
                _ => (1f64.exp(), absorbed.iter().map(|x| x.1.exp()).collect()),
            };
            let denom = match self.merge.as_str() {
                "weighted" => wk + ws.iter().sum::<f64>(),
                _ => 1.0 + absorbed.len() as f64,
            };
            for (on, dst, src) in [
                (merge.0, &mut c.keys, old.0),
                (merge.1, &mut c.values, old.1),
            ] {
                if !on {
                    continue;
                }
                for ch in 0..d {
                    let mut x = wk * src[k * d + ch] as f64;
                    for ((e, _), w) in absorbed.iter().zip(&ws) {
                        x += w * src[e * d + ch] as f64;
                    }
                    dst[k * d + ch] = (x / denom) as f32;
                }
            }
            if merge.0 {
                // positions follow the key half
                let mut mem = std::mem::take(&mut c.members[k]);
                for (e, _) in &absorbed {
                    mem.extend_from_slice(&c.members[*e]);
                }
                mem.sort_unstable();
                c.members[k] = mem;
            }
        }
    }

    /// The EMA threshold after observing mean best similarity `m`.
    fn update_tau(&self, tau: &mut Option<f64>, m: f64) -> f64 {
        if !self.ema {
            return f64::MIN;
        }
        let t = match *tau {
            None => m,
            Some(prev) => self.beta * m + (1.0 - self.beta) * prev,
        };
        *tau = Some(t);
        t
    }

    /// Recall-and-merge: fold the entries `evict` (indices into `c`) into their
    /// most similar kept entry when similar enough, then remove them. Every
    /// similarity and weight uses the vectors as they stood on entry.
    fn compensate(&self, c: &mut HeadCache, st: &mut HeadState, evict: &[usize]) {
        self.compensate_layer(
            std::slice::from_mut(c),
            std::slice::from_mut(st),
            &[evict.to_vec()],
            None,
        );
    }

    /// Recall-and-merge for several heads at once. With `shared` (the official
    /// code's one τ per layer) the threshold tracks the mean over heads and
    /// evicted slots, and the j-th evicted entry (in position order) of every
    /// head merges when the heads' mean best similarity for slot j reaches it;
    /// otherwise each head keeps its own τ.
    fn compensate_layer(
        &self,
        caches: &mut [HeadCache],
        states: &mut [HeadState],
        evicts: &[Vec<usize>],
        mut shared: Option<&mut [Option<f64>; 2]>,
    ) {
        let kept: Vec<Vec<usize>> = caches
            .iter()
            .zip(evicts)
            .map(|(c, ev)| (0..c.len()).filter(|e| !ev.contains(e)).collect())
            .collect();
        let old: Vec<(Vec<f32>, Vec<f32>)> = caches
            .iter()
            .map(|c| (c.keys.clone(), c.values.clone()))
            .collect();
        for &(on_values, merge_k, merge_v, slot) in self.passes() {
            let live: Vec<usize> = (0..caches.len())
                .filter(|&i| !evicts[i].is_empty() && !kept[i].is_empty())
                .collect();
            let matches: Vec<Vec<(usize, f64)>> = (0..caches.len())
                .map(|i| {
                    if live.contains(&i) {
                        Self::matches(
                            if on_values { &old[i].1 } else { &old[i].0 },
                            caches[i].d,
                            &evicts[i],
                            &kept[i],
                        )
                    } else {
                        Vec::new()
                    }
                })
                .collect();
            let accept: Vec<Vec<bool>> = match shared.as_deref_mut() {
                Some(taus) if !live.is_empty() => {
                    let slots = live.iter().map(|&i| matches[i].len()).min().unwrap();
                    let mean_slot: Vec<f64> = (0..slots)
                        .map(|j| {
                            live.iter().map(|&i| matches[i][j].1).sum::<f64>() / live.len() as f64
                        })
                        .collect();
                    let m = mean_slot.iter().sum::<f64>() / slots.max(1) as f64;
                    let tau = self.update_tau(&mut taus[slot], m);
                    (0..caches.len())
                        .map(|i| {
                            (0..matches[i].len())
                                .map(|j| j < slots && mean_slot[j] >= tau)
                                .collect()
                        })
                        .collect()
                }
                _ => (0..caches.len())
                    .map(|i| {
                        if matches[i].is_empty() {
                            return Vec::new();
                        }
                        let m =
                            matches[i].iter().map(|x| x.1).sum::<f64>() / matches[i].len() as f64;
                        let tau = self.update_tau(&mut states[i].tau[slot], m);
                        matches[i].iter().map(|x| x.1 >= tau).collect()
                    })
                    .collect(),
            };
            for &i in &live {
                self.merge_pass(
                    &mut caches[i],
                    (&old[i].0, &old[i].1),
                    &evicts[i],
                    &kept[i],
                    &matches[i],
                    &accept[i],
                    (merge_k, merge_v),
                );
            }
        }
        for ((c, st), ev) in caches.iter_mut().zip(states.iter_mut()).zip(evicts) {
            let mut idx = ev.clone();
            idx.sort_unstable_by(|a, b| b.cmp(a));
            for e in idx {
                c.remove(e);
                st.score.remove(e);
                st.anchor.remove(e);
                st.sink.remove(e);
            }
        }
    }
}

impl Policy for D2o {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b, nl, l) = (ctx.prompt_len(), ctx.budget, ctx.n_layers(), ctx.layer());
        let phi = match (0..nl)
            .map(|x| ctx.layer_colsum(x, 0).map(|_| x))
            .collect::<Option<Vec<_>>>()
        {
            Some(_) => {
                let p_len = p;
                let all: Vec<Vec<f32>> = (0..nl)
                    .map(|x| {
                        (0..ctx.n_heads())
                            .flat_map(|h| ctx.layer_colsum(x, h).unwrap().to_vec())
                            .collect()
                    })
                    .collect();
                self.layer_shares(
                    &all.iter().map(|v| v.as_slice()).collect::<Vec<_>>(),
                    ctx.n_heads(),
                    p_len,
                )[l]
            }
            None => 1.0 / nl as f64,
        };
        let protected_layer = self.protect_layers && (l < 2 || l + 1 == nl);
        let r = layer_ratio(phi, nl, b, p);
        let (n, m) = if protected_layer {
            (usize::MAX / 4, usize::MAX / 4)
        } else {
            counts(r, p, self.f)
        };
        let cap = n.saturating_add(m);
        let mut caches = Vec::new();
        let mut states = Vec::new();
        // One cache per KV head (scores summed over its group), or per query head.
        for (g, heads) in ctx.cache_units(self.per_query_head) {
            let a: Vec<f64> = (0..p)
                .map(|i| heads.clone().map(|h| ctx.colsum(h)[i] as f64).sum())
                .collect();
            let mut c = ctx.full_cache(g);
            let mut st = HeadState {
                score: a,
                anchor: (0..p).collect(),
                sink: vec![false; p],
                tau: [None, None],
            };
            if !self.defer_first || protected_layer {
                let evict = self.initial_evictions(p, &mut st, n, m);
                self.compensate(&mut c, &mut st, &evict);
            }
            caches.push(c);
            states.push(st);
        }
        Ok((
            caches,
            Box::new(Decode {
                cfg: self.clone(),
                cap,
                m,
                pending: (self.defer_first && !protected_layer).then_some(r),
                states,
                layer_tau: [None, None],
            }),
        ))
    }
}

struct Decode {
    cfg: D2o,
    cap: usize,
    m: usize,
    /// Some(r_l) until the deferred first compression has run.
    pending: Option<f64>,
    states: Vec<HeadState>,
    /// The layer's shared thresholds (shared_tau).
    layer_tau: [Option<f64>; 2],
}

impl DecodeState for Decode {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        if let Some(r) = self.pending {
            // from now on the caches hold the budgets of P + 1 positions; a layer
            // whose budget reaches P − 1 stops compressing (official code)
            let (n, m) = counts(r, ctx.pos + 1, self.cfg.f);
            self.cap = if n + m + 1 >= ctx.pos {
                usize::MAX
            } else {
                n + m
            };
            self.m = m;
        }
        let mut evicts: Vec<Vec<usize>> = vec![Vec::new(); caches.len()];
        for (ci, c) in caches.iter_mut().enumerate() {
            let st = &mut self.states[ci];
            st.score.push(0.0);
            st.anchor.push(ctx.pos);
            st.sink.push(false);
            let heads = ctx.heads_of(ci, self.cfg.per_query_head);
            for h in heads {
                for (s, x) in st.score.iter_mut().zip(&ctx.probs[h]) {
                    *s += *x as f64;
                    if self.cfg.fp16_scores {
                        *s = half::f16::from_f64(*s).to_f64();
                    }
                }
            }
            if let Some(r) = self.pending {
                // deferred first compression: budgets from the positions seen so far (P + 1)
                let (n, m) = counts(r, c.len(), self.cfg.f);
                evicts[ci] = self.cfg.initial_evictions(c.len(), st, n, m);
                continue;
            }
            if c.len() <= self.cap {
                continue;
            }
            // Protected: the sinks and the last M entries (M − |Z| with sinks in the recent share).
            let n = c.len();
            let sinks = st.sink.iter().filter(|x| **x).count();
            let recent = if self.cfg.sinks_in_recent {
                self.m.saturating_sub(sinks)
            } else {
                self.m
            };
            let victim = (0..n.saturating_sub(recent))
                .filter(|&e| !st.sink[e])
                .min_by(|&x, &y| {
                    st.score[x]
                        .partial_cmp(&st.score[y])
                        .unwrap_or(std::cmp::Ordering::Equal)
                        .then(st.anchor[x].cmp(&st.anchor[y]))
                });
            if let Some(e) = victim {
                evicts[ci] = vec![e];
            }
        }
        let shared = self.cfg.shared_tau.then_some(&mut self.layer_tau);
        self.cfg
            .compensate_layer(caches, &mut self.states, &evicts, shared);
        self.pending = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_budgets_stay_within_a_factor_e_squared() {
        // Budget B = 100 of P = 1000 (α = 0.1) over 4 layers: r_l = 4·0.1·φ_l and
        // φ_l ∝ exp(−s_l) with s_l ∈ [0, 1], so r_l ∈ [α/e, α·e].
        let cs: Vec<Vec<f32>> = (0..4)
            .map(|l| {
                (0..2 * 1000)
                    .map(|i| ((i * (l + 1)) % 97) as f32 * (1.0 + l as f32 * (i % 2) as f32))
                    .collect()
            })
            .collect();
        let d = D2o {
            f: 0.75,
            beta: 0.7,
            n_sink: 4,
            sinks_in_recent: false,
            ema: true,
            merge: "weighted".into(),
            match_on: 0,
            allocation: "inv_var_softmax".into(),
            protect_layers: false,
            per_query_head: false,
            defer_first: false,
            shared_tau: false,
            fp16_scores: false,
        };
        let phi = d.layer_shares(
            &cs.iter().map(|v| v.as_slice()).collect::<Vec<_>>(),
            2,
            1000,
        );
        assert!((phi.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        for x in &phi {
            let r = 4.0 * 0.1 * x;
            assert!(
                (0.1 / std::f64::consts::E - 1e-12..=0.1 * std::f64::consts::E + 1e-12)
                    .contains(&r),
                "{r}"
            );
        }
        let (n, m) = layer_counts(0.25, 4, 100, 1000, 0.75);
        assert_eq!((n, m), (75, 25));
    }
}
