//! KVMerger: merge runs of adjacent, similar keys with a Gaussian kernel.
//!
//! Rule (docs/methods/kvmerger.md, spec §2): per KV head, keep a recent window R
//! and heavy hitters H (largest accumulated attention a = Σ over the group's
//! column sums, tie: smaller position) verbatim; split the rest (the pool) into
//! maximal runs of consecutive positions, scan each run from its last token
//! backwards and start a new set wherever cos(k_t, k_ref) ≤ ε (chain linkage:
//! k_ref = the next token); collapse each set S into one entry: pivot p = the
//! member with the largest a (tie: larger t), δ_t = ‖k_t − k_p‖²,
//! σ = Σ‖k_t − k_p‖ / (√2·|S|), g_t = exp(−δ_t/(2σ²)), w = g/Σg,
//! k̂ = Σ w_t k_t, v̂ = |S|·Σ w_t v_t. Prefill only; decode entries are appended.
//!
//! Budget: `budget_mode=soft` is the paper (R and H are fractions of the
//! prompt, the merged count is whatever ε gives, the budget is ignored). The
//! registry default is `hard` (the spec's extension for matched memory), since
//! every replay is budgeted: R = ⌊B·r_rec/β⌋ and H = ⌊B·r_hh/β⌋ keep the
//! paper's split of the kept entries at β = 0.5, and the pool gets
//! m = B − |R| − |H| entries: the ε result if it fits, else adjacent pairs
//! linked by decreasing cosine until m sets remain, else whole runs dropped by
//! increasing max a.
//!
//! Files: `sets` (the merging sets of a run, ε-linked or under the hard
//! budget), `merge` (one set collapsed into an entry).

mod config;
mod merge;
mod sets;

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, SplitMix64};
use crate::select::{top_k, Tie};
use crate::ReplayError;

pub use config::*;

use sets::hard_sets;
pub use sets::sets_of_run;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "kvmerger",
    summary: "keeps a recent window and heavy hitters, merges runs of similar adjacent keys into Gaussian-weighted entries",
    paper: "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context Tasks (Wang et al., arXiv 2407.08454)",
    params: &[
        ParamInfo { name: "eps", default: "0.75", kind: Kind::Float, help: "cosine a key needs with its neighbour to join its set (strict >)" },
        ParamInfo { name: "recent_ratio", default: "0.17", kind: Kind::Float, help: "r_rec: recent window as a fraction of the prompt (hard mode: of B·/beta)" },
        ParamInfo { name: "hh_ratio", default: "0.12", kind: Kind::Float, help: "r_hh: heavy hitters as a fraction of the prompt (hard mode: of B·/beta)" },
        ParamInfo { name: "beta", default: "0.5", kind: Kind::Float, help: "memory fraction the ratios were tuned for (hard mode rescales them to B)" },
        ParamInfo { name: "budget_mode", default: "hard", kind: Kind::Choice(&["hard", "soft"]), help: "hard: exactly B prompt entries at most; soft: the paper, budget ignored" },
        ParamInfo { name: "sigma", default: "adaptive", kind: Kind::Choice(&["adaptive", "adaptive_sq", "fixed"]), help: "kernel width: mean distance to the pivot / √2, mean squared distance / √2, or sigma0" },
        ParamInfo { name: "sigma0", default: "5.0", kind: Kind::Float, help: "σ for sigma=fixed (the paper's published runs)" },
        ParamInfo { name: "exclude_pivot_in_sigma", default: "false", kind: Kind::Bool, help: "divide the adaptive σ by √2(|S|−1) instead of √2|S|" },
        ParamInfo { name: "pivot", default: "attn_argmax", kind: Kind::Choice(&["attn_argmax", "within_set", "last_index", "random"]), help: "pivot: largest accumulated attention, attention from the set's own queries, last member, or random" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed for pivot=random" },
        ParamInfo { name: "weighting", default: "gaussian", kind: Kind::Choice(&["gaussian", "equal"]), help: "member weights" },
        ParamInfo { name: "value_mode", default: "scale_by_set_size", kind: Kind::Choice(&["scale_by_set_size", "logcount_bias", "plain"]), help: "v̂ = |S|·Σw v (paper), or Σw v with bias ln|S|, or Σw v" },
        ParamInfo { name: "linkage", default: "chain", kind: Kind::Choice(&["chain", "anchor"]), help: "compare with the next token (chain) or with the set's first-scanned token" },
        ParamInfo { name: "adjacency", default: "positions", kind: Kind::Choice(&["positions", "pool_order"]), help: "a protected token splits a run, or runs follow the pool order" },
        ParamInfo { name: "n_sink", default: "0", kind: Kind::Int, help: "extension: first positions forced into the heavy hitters" },
    ],
    caps: Caps { family: Family::Merging, merges: true, ..Caps::EVICT_PREFILL },
    test: "kvmerger_sigma_and_pivot_variants_give_the_exact_gaussian_merge",
    build: Build::Policy(|p| {
        Ok(Arc::new(KvMerger::from_params(p)?))
    }),
};

impl Policy for KvMerger {
    fn name(&self) -> String {
        "kvmerger".into()
    }
    /// Column sums only, except the within-set pivot (every set's own rows).
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        match self.pivot {
            config::Pivot::WithinSet => p,
            _ => 0,
        }
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (t, b, gs, d) = (ctx.prompt_len(), ctx.budget, ctx.group(), ctx.head_dim());
        if self.hard() && t <= b {
            return Ok((ctx.full_caches(), Box::new(AppendOnly)));
        }
        let (n_rec, n_hh) = if self.hard() {
            let r = ((b as f64 * self.r_rec / self.beta).floor() as usize).min(t);
            (
                r,
                ((b as f64 * self.r_hh / self.beta).floor() as usize).min(t - r),
            )
        } else {
            let r = ((self.r_rec * t as f64).floor() as usize).min(t);
            (r, ((self.r_hh * t as f64).floor() as usize).min(t - r))
        };
        let mut caches = Vec::new();
        for g in 0..ctx.n_kv_heads() {
            let a: Vec<f64> = (0..t)
                .map(|i| {
                    (g * gs..(g + 1) * gs)
                        .map(|h| ctx.colsum(h)[i] as f64)
                        .sum()
                })
                .collect();
            let sinks = self.n_sink.min(t - n_rec);
            let mut protected = vec![false; t];
            (t - n_rec..t).for_each(|i| protected[i] = true);
            (0..sinks).for_each(|i| protected[i] = true);
            // heavy hitters; the reference keeps the earlier of equal scores
            for i in top_k(
                &a,
                sinks..t - n_rec,
                n_hh.saturating_sub(sinks),
                |i| i,
                Tie::KeepEarlier,
            ) {
                protected[i] = true;
            }
            let n_prot = protected.iter().filter(|x| **x).count();
            if self.hard() && n_prot > b {
                return Err(ReplayError::BadParam {
                    policy: "kvmerger".into(),
                    key: "recent_ratio".into(),
                    value: self.r_rec.to_string(),
                    msg: format!("recent + heavy hitters ({n_prot}) exceed the budget {b} in hard mode; lower the ratios"),
                });
            }
            let pool: Vec<usize> = (0..t).filter(|&i| !protected[i]).collect();
            // Runs of the pool: consecutive original positions (or the whole pool in pool order).
            let mut runs: Vec<Vec<usize>> = Vec::new();
            let pool_order = self.adjacency == Adjacency::PoolOrder;
            for &i in &pool {
                match runs.last_mut() {
                    Some(r) if pool_order || *r.last().unwrap() + 1 == i => r.push(i),
                    _ => runs.push(vec![i]),
                }
            }
            let key = |i: usize| ctx.key(g, i).to_vec();
            let mut sets: Vec<Vec<usize>> = runs
                .iter()
                .flat_map(|r| sets_of_run(r, &key, self.eps, self.linkage == Linkage::Anchor))
                .collect();
            if self.hard() {
                let m = b - n_prot;
                if sets.len() > m {
                    sets = hard_sets(&runs, &key, m, &a);
                }
            }
            let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), g);
            // Assemble: verbatim protected entries and one entry per set, in position order.
            let mut items: Vec<(usize, Option<Vec<usize>>)> = (0..t)
                .filter(|&i| protected[i])
                .map(|i| (i, None))
                .collect();
            items.extend(sets.into_iter().map(|s| (s[0], Some(s))));
            items.sort_by_key(|x| x.0);
            let mut c = HeadCache::new(d);
            for (i, set) in items {
                match set {
                    Some(s) if s.len() > 1 => {
                        let (k, v, bias) = self.merge(ctx, g, &s, &a, &mut rng);
                        c.keys.extend_from_slice(&k);
                        c.values.extend_from_slice(&v);
                        c.bias.push(bias);
                        c.members.push(s.iter().map(|&x| x as u32).collect());
                        c.bits.push(
                            HeadCache::exact_bits(d) + if bias != 0.0 { F16_BITS } else { 0 },
                        );
                    }
                    _ => c.push_exact(i, ctx.key(g, i), ctx.value(g, i)),
                }
            }
            caches.push(c);
        }
        Ok((caches, Box::new(AppendOnly)))
    }
}
