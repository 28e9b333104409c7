//! MiniCache: merge the KV states of adjacent deep layers along their shared
//! direction (SLERP), keep each layer's norms, and keep the rare divergent
//! token pairs unmerged.
//!
//! Rule (docs/methods/minicache.md; landscape spec part A): layers S, S+1, ... form pairs
//! (a, b) = (S+2j, S+2j+1); per pair, KV head and tensor (K or V), each
//! position's two vectors become one unit direction e_p = SLERP(u_a, u_b; t)
//! (t weights the deeper layer) plus the norms n^a_p, n^b_p; the angular
//! distance dist_p = Ω_p/π decides retention: positions with
//! dist_p > d_max − γ·(d_max − d_min) keep their originals. Layer m restores
//! x̂^m_p = n^m_p·e_p. Decode positions are merged after their step against the
//! threshold frozen at prefill. Stored: directions (f16, renormalised), norms
//! (f16), retained originals (f16) and their indices (32 bits); a direction
//! is charged once per pair (to the shallower layer's entry).
//!
//! Budget (our choice; the paper has none): `start=budget` maps the budget to
//! the first merged layer, S = ⌊L·min(1, B/P)⌋, so B ≥ P merges nothing and
//! B/P = 0.5 is the paper's half-depth start; `start=0.5` fixes it.
//!
//! Files: `slerp` (one position's merge of a pair of vectors), `retention`
//! (the threshold that keeps divergent pairs), `restore` (writing merged
//! positions back into both layers' caches, with their bits).

mod config;
mod restore;
mod retention;
mod slerp;

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{DecodeState, GroupDecodeState, Policy, PrefillCtx, StepCtx};
use crate::ReplayError;

pub use config::*;

use retention::Threshold;
pub use slerp::{merge_token, Merged};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "minicache",
    summary: "merges adjacent deep layers' KV states by SLERP of their directions, keeping per-layer norms and divergent tokens",
    paper: "MiniCache: KV Cache Compression in Depth Dimension for Large Language Models (Liu et al., NeurIPS 2024, arXiv 2405.14366)",
    params: &[
        ParamInfo { name: "start", default: "budget", kind: Kind::FloatOr("budget"), help: "first merged layer as a fraction of depth; budget = min(1, B/P) (paper: 0.5)" },
        ParamInfo { name: "t", default: "0.6", kind: Kind::Float, help: "SLERP weight of the deeper layer" },
        ParamInfo { name: "gamma", default: "0.05", kind: Kind::Float, help: "retention threshold: share of the distance range kept unmerged" },
        ParamInfo { name: "rule", default: "default", kind: Kind::Choice(&["default", "literal_low", "top_fraction"]), help: "keep the most divergent pairs, xKV's most-similar reading, or the top rho fraction" },
        ParamInfo { name: "rho", default: "0.05", kind: Kind::Float, help: "fraction kept by rule=top_fraction" },
        ParamInfo { name: "scope", default: "per_head", kind: Kind::Choice(&["per_head", "global"]), help: "distance range per KV head, or over all heads of the pair" },
        ParamInfo { name: "shared_from_k", default: "false", kind: Kind::Bool, help: "values reuse the keys' retention set" },
        ParamInfo { name: "merge_decode", default: "true", kind: Kind::Bool, help: "merge decode positions after each step (false: xKV, prefill only)" },
        ParamInfo { name: "compact", default: "false", kind: Kind::Bool, help: "store no direction for retained positions" },
        ParamInfo { name: "merge", default: "slerp", kind: Kind::Choice(&["slerp", "mean"]), help: "SLERP with norms (MiniCache) or the Mean-KV baseline (x̂ = (x^a + x^b)/2, no retention)" },
        ParamInfo { name: "b_dir", default: "16", kind: Kind::Choice(&["16", "8", "4", "2"]), help: "direction storage bits; below 16 the quantiser's per-token groups of 32 channels with f16 scale and minimum (\"MiniCache-4bit\")" },
        ParamInfo { name: "b_norm", default: "16", kind: Kind::Choice(&["16", "32"]), help: "norm storage bits (f16, or f32 for exact norms)" },
        ParamInfo { name: "merge_k", default: "true", kind: Kind::Bool, help: "merge keys" },
        ParamInfo { name: "merge_v", default: "true", kind: Kind::Bool, help: "merge values" },
    ],
    caps: Caps { family: Family::CrossLayer, phase: Phase::Decode, merges: true, cross_layer: true, memory: Memory::Beyond("it merges pairs of deep layers (from layer ⌊L·min(1, B/P)⌋ on) and keeps the shallower layers whole: about half the full cache at best, whatever B"), ..Caps::EVICT_PREFILL },
    test: "minicache_restores_retained_positions_exactly_and_merged_ones_from_norm_and_direction",
    build: Build::Policy(|p| {
        Ok(Arc::new(MiniCache::from_params(p)?))
    }),
};

struct PairState {
    cfg: MiniCache,
    /// Per KV head: frozen thresholds for K and V (None when that half is not merged).
    thresholds: Vec<[Option<Threshold>; 2]>,
}

impl Policy for MiniCache {
    fn name(&self) -> String {
        "minicache".into()
    }
    /// Reads keys and values only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    /// A layer on its own is never merged.
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        Ok((ctx.full_caches(), Box::new(crate::policy::AppendOnly)))
    }

    /// A layer alone (below S, or the top one left over) is never merged.
    fn keeps_full_cache(&self, group_len: usize) -> bool {
        group_len == 1
    }

    /// The budget only picks S (with `start=budget`); a fixed start ignores it.
    fn budget_class(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Option<usize> {
        Some(self.pair_start(n_layers, budget, prompt_len))
    }

    /// A pair merges, and a layer alone keeps its cache, the same way at any
    /// budget: the budget only decides where the pairs start.
    fn group_budget_free(&self) -> bool {
        true
    }

    /// Layers below S alone, then pairs (S + 2j, S + 2j + 1), a leftover top layer alone.
    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        let s = self.pair_start(n_layers, budget, prompt_len);
        let mut g: Vec<Vec<usize>> = (0..s).map(|l| vec![l]).collect();
        let mut l = s;
        while l + 1 < n_layers {
            g.push(vec![l, l + 1]);
            l += 2;
        }
        if l < n_layers {
            g.push(vec![l]);
        }
        g
    }

    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let full: Vec<Vec<HeadCache>> = ctxs.iter().map(|c| c.full_caches()).collect();
        let none = || {
            Box::new(PairState {
                cfg: self.clone(),
                thresholds: Vec::new(),
            })
        };
        if ctxs.len() != 2 {
            return Ok((full, none()));
        }
        let a = &ctxs[0];
        let mut caches = full;
        let (left, right) = caches.split_at_mut(1);
        let (ca, cb) = (&mut left[0], &mut right[0]);
        let p = a.prompt_len();
        // Merge every prompt position, per KV head and half.
        let merged: Vec<Vec<[Option<Merged>; 2]>> = (0..a.n_kv_heads())
            .map(|g| (0..p).map(|e| self.merges(&ca[g], &cb[g], e)).collect())
            .collect();
        let mut thresholds: Vec<[Option<Threshold>; 2]> = Vec::new();
        for g in 0..a.n_kv_heads() {
            let mut th = [None, None];
            for (i, slot) in th.iter_mut().enumerate() {
                let set: Vec<&Merged> = if self.scope == Scope::Global {
                    merged
                        .iter()
                        .flat_map(|h| h.iter().filter_map(|x| x[i].as_ref()))
                        .collect()
                } else {
                    merged[g].iter().filter_map(|x| x[i].as_ref()).collect()
                };
                if !set.is_empty() {
                    *slot = Some(self.threshold(&set));
                }
            }
            thresholds.push(th);
        }
        for g in 0..a.n_kv_heads() {
            for (e, m) in merged[g].iter().enumerate() {
                self.merge_position(&mut ca[g], &mut cb[g], e, &thresholds[g], m.clone());
            }
        }
        Ok((
            caches,
            Box::new(PairState {
                cfg: self.clone(),
                thresholds,
            }),
        ))
    }
}

impl GroupDecodeState for PairState {
    fn step(&mut self, _ctxs: &[StepCtx], caches: &mut [Vec<HeadCache>]) {
        if self.thresholds.is_empty() || !self.cfg.merge_decode || caches.len() != 2 {
            return;
        }
        let (left, right) = caches.split_at_mut(1);
        for (g, th) in self.thresholds.iter().enumerate() {
            let (ca, cb) = (&mut left[0][g], &mut right[0][g]);
            let e = ca.len() - 1; // the step's new entry in both layers
            let m = self.cfg.merges(ca, cb, e);
            self.cfg.merge_position(ca, cb, e, th, m);
        }
    }
}
