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
mod config;
mod decode;
mod merge;

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub use config::*;

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
        crate::policy::BUDGET_PER,
    ],
    caps: Caps { family: Family::Merging, phase: Phase::Decode, merges: true, holds_capacity: true, exact_when_covering: false, ..Caps::EVICT_PREFILL },
    test: "d2o_layer_budgets_follow_the_inverse_variance_softmax",
    build: Build::Policy(|p| {
        Ok(Arc::new(D2o::from_params(p)?))
    }),
};

impl Policy for D2o {
    fn name(&self) -> String {
        "d2o".into()
    }
    /// A key merge gives the kept entry its absorbed positions (it then
    /// stands for several); a value merge leaves keys as they are; no entry
    /// has a bias.
    fn exact_keys(&self) -> bool {
        true
    }
    /// The code preset's per-query-head caches share their KV head's budget.
    fn budget_share(&self, group: usize) -> usize {
        crate::policy::share_of(self.per_query_head, self.budget_per_cache, group)
    }
    /// Reads keys, values and column sums only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b, nl, l) = (ctx.prompt_len(), ctx.budget, ctx.n_layers(), ctx.layer());
        let phi = match (0..nl)
            .map(|x| ctx.layer_colsum(x, 0).map(|_| x))
            .collect::<Option<Vec<_>>>()
        {
            // every layer's column sums decide this layer's share: the same
            // for every budget, so once per trace and layer
            Some(_) => *ctx.memo(LayerShare(self.allocation), || {
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
                    p,
                )[l]
            }),
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

/// Memo key of a layer's share φ_l of the budget under `allocation` (it reads
/// every layer's prompt column sums and nothing that depends on the budget).
#[derive(Debug, PartialEq)]
struct LayerShare(Allocation);

impl crate::memo::MemoKey for LayerShare {
    type Value = f64;
}
