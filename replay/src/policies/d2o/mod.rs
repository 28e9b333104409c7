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
//!
//! Files: `budgets` (φ, r_l and the (N, M) counts of each layer), `merge`
//! (matching evicted tokens, the threshold, the merge passes), `decode` (the
//! per-step eviction).

mod budgets;
mod decode;
mod merge;

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::cache::HeadCache;
use crate::policy::{DecodeState, Policy, PrefillCtx};
use crate::select::cmp_f64;
use crate::params::{choice_enum, Kind, ParamInfo, Params};
use crate::ReplayError;

pub use budgets::{counts, layer_counts, layer_ratio};
use decode::Decode;

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

choice_enum! {
    /// `preset`: the paper's switches or the official code's settings.
    pub enum Preset {
        Paper = "paper",
        Code = "code",
    }
}

choice_enum! {
    /// `sink_slot`: which share of the budget the sinks count in.
    pub enum SinkSlot {
        /// Inside N (official code).
        Important = "important",
        /// Inside M (paper wording).
        Recent = "recent",
    }
}

choice_enum! {
    /// `threshold`: which evicted tokens are merged.
    pub enum Threshold {
        /// Those whose best similarity reaches the EMA threshold τ.
        Ema = "ema",
        /// All of them.
        MergeAll = "none",
    }
}

choice_enum! {
    /// `merge`: the weights of a kept entry and the evicted ones it absorbs.
    pub enum Merge {
        /// e¹ for the kept entry and e^μ for each absorbed one, normalised (paper).
        Weighted = "weighted",
        /// The plain mean.
        Average = "average",
        /// The official code's (k + Σ μ k_x)/(1 + |B|).
        CodeScaledMean = "code_scaled_mean",
    }
}

choice_enum! {
    /// `match_on`: the similarity that matches evicted tokens to kept ones.
    pub enum MatchOn {
        Keys = "keys",
        Values = "values",
        /// Keys for the key half and values for the value half, each with its own τ.
        Split = "split",
    }
}

choice_enum! {
    /// `allocation`: the layer budget rule (Table 4's variants).
    pub enum Allocation {
        /// softmax(−s) of the min-max normalised head variances (paper).
        InvVarSoftmax = "inv_var_softmax",
        /// Without the layer operation: equal shares.
        Uniform = "uniform",
        /// Proportional to 1/variance.
        Reciprocal = "reciprocal",
        /// softmax(−variance).
        ExpDecay = "exp_decay",
        /// softmax(1/variance).
        InvVarSoftmaxRaw = "inv_var_softmax_raw",
    }
}

#[derive(Clone, Debug)]
pub struct D2o {
    pub f: f64,
    pub beta: f64,
    pub n_sink: usize,
    pub sink_slot: SinkSlot,
    pub threshold: Threshold,
    pub merge: Merge,
    pub match_on: MatchOn,
    pub allocation: Allocation,
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
            sink_slot: p.choice("sink_slot")?,
            threshold: p.choice("threshold")?,
            merge: p.choice("merge")?,
            match_on: p.choice("match_on")?,
            allocation: p.choice("allocation")?,
            protect_layers: p.bool("protect_layers")?,
            per_query_head: false,
            defer_first: false,
            shared_tau: false,
            fp16_scores: false,
        }
        .with_preset(p.choice("preset")?))
    }

    /// The sinks count inside M (`sink_slot=recent`).
    fn sinks_in_recent(&self) -> bool {
        self.sink_slot == SinkSlot::Recent
    }

    /// The official code's settings (d2o.md §2.6 items a to j): protected
    /// layers, first compression at decode step 1, per-query-head caches, one τ
    /// per layer, scaled-mean merge, τ ← (τ + m)/2, sinks inside N, layers
    /// whose budget reaches P − 1 stop compressing, N:M = 1:1, f16 scores.
    fn with_preset(self, preset: Preset) -> D2o {
        if preset == Preset::Paper {
            return self;
        }
        D2o {
            protect_layers: true,
            per_query_head: true,
            defer_first: true,
            shared_tau: true,
            fp16_scores: true,
            merge: Merge::CodeScaledMean,
            beta: 0.5,
            f: 0.5,
            sink_slot: SinkSlot::Important,
            ..self
        }
    }
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
        let (z, recent_start) = if self.sinks_in_recent() {
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
        let n_top = if self.sinks_in_recent() { n } else { n - z };
        let mut cand: Vec<usize> = (z..recent_start.max(z)).collect();
        cand.sort_by(|&x, &y| cmp_f64(a[y], a[x]).then(x.cmp(&y)));
        cand.iter().take(n_top).for_each(|&i| keep[i] = true);
        (0..p).filter(|&i| !keep[i]).collect()
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
            Box::new(Decode::new(
                self.clone(),
                cap,
                m,
                (self.defer_first && !protected_layer).then_some(r),
                states,
            )),
        ))
    }
}
