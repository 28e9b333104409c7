//! CriticalKV: two-stage selection around any scorer, the second stage
//! weighted by the size of each value's contribution to the output
//! (docs/methods/criticalkv.md; kvpress `CriticalKVPress`, arXiv 2502.03805).
//!
//! Rule (kvpress 0.5.4 `CriticalKVPress.score`), per cache with budget B:
//! stage 1 keeps the top n₁ = ⌊B·first_stage_ratio⌋ positions by the
//! scorer's score s_i (kvpress `int((1 − ratio)·P·first_stage_ratio)`, with
//! (1 − ratio)·P = B); stage 2 fills the rest of B with the best of the
//! other positions by (s_i + ε)·‖W_o v_i‖₁ (per query head, averaged over
//! the group). The scorer's protected positions (its window) are kept
//! inside B and count first in stage 1 (kvpress pads them with the maximum
//! score, so they lead its stage-1 top-k).
//!
//! Approximation: a trace holds no W_o, so ‖W_o v_i‖₁ is taken as ‖v_i‖₁
//! (W_o = I; the same for every query head of a group). The second stage's
//! ranking is exact when W_o's columns for the head scale the L1 norm of
//! every value alike; otherwise it is the value-norm proxy of the paper's
//! projected norm. Ties follow the scorer's tie rule. Prefill only.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo, Params};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::scorer::{units_to_compress, Scorer};
use crate::select::{top_k, Protect, Tie};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "criticalkv",
    summary: "two-stage selection: the top half of B by a scorer (default: SnapKV), the rest by the score times the value's L1 norm; prefill only",
    paper: "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective (Feng et al., arXiv 2502.03805); FFY0/AdaKV (CriticalKV), kvpress CriticalKVPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the first-stage scorer (its parameters are accepted too)" },
        ParamInfo { name: "first_stage_ratio", default: "0.5", kind: Kind::Float, help: "share of B chosen by the scorer alone" },
        ParamInfo { name: "epsilon", default: "0.0001", kind: Kind::Float, help: "added to the score before the norm weighting" },
    ],
    caps: Caps {
        family: Family::Eviction,
        phase: Phase::Prefill,
        approximation: Some("the projected value norm ‖W_o v‖₁ is taken as ‖v‖₁: a trace holds no W_o"),
        ..Caps::EVICT_PREFILL
    },
    test: "criticalkv_fills_the_second_stage_by_score_times_value_norm",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| Ok(Arc::new(Critical { scorer, stage: Stage::from_params(p)?, ada: None })),
    },
};

/// The two stages' parameters.
#[derive(Clone, Copy, Debug)]
pub struct Stage {
    pub first_stage_ratio: f64,
    pub epsilon: f32,
}

impl Stage {
    pub fn from_params(p: &Params) -> Result<Stage, ReplayError> {
        Ok(Stage {
            first_stage_ratio: p.float_in("first_stage_ratio", 0.0, 1.0)?,
            epsilon: p.float("epsilon")? as f32,
        })
    }
}

/// ‖v_i‖₁ of KV head `g`'s prompt values: (P,), summed in f64.
pub fn value_l1(ctx: &PrefillCtx, g: usize) -> Vec<f32> {
    (0..ctx.prompt_len())
        .map(|i| ctx.value(g, i).iter().map(|x| x.abs() as f64).sum::<f64>() as f32)
        .collect()
}

/// One cache's two-stage keep: the protected positions, then the `first`
/// best candidates by `s` (protected ones counted in `first`), then the best
/// of the other candidates by (s + ε)·norm up to `count` entries in all.
/// `s` is indexed by position; candidates are the unprotected positions
/// below `s.len()`. Returns ascending positions.
#[allow(clippy::too_many_arguments)]
pub fn two_stage(
    p: usize,
    prot: Protect,
    s: &[f32],
    norm: &[f32],
    count: usize,
    first: usize,
    eps: f32,
    tie: Tie,
) -> Vec<usize> {
    let end = (p - prot.recent).min(s.len()).max(prot.sinks);
    let cand = prot.sinks..end;
    let mut keep: Vec<usize> = (0..prot.sinks).chain(p - prot.recent..p).collect();
    let left = count.saturating_sub(prot.total());
    let n1 = first.saturating_sub(prot.total()).min(left);
    let stage1 = top_k(s, cand.clone(), n1, |i| i, tie);
    let mut taken = vec![false; p];
    stage1.iter().for_each(|&i| taken[i] = true);
    let w: Vec<f32> = (0..end).map(|i| (s[i] + eps) * norm[i]).collect();
    let rest: Vec<usize> = cand.filter(|&i| !taken[i]).collect();
    let stage2 = top_k(&w, rest, left - n1, |i| i, tie);
    keep.extend(stage1);
    keep.extend(stage2);
    keep.sort_unstable();
    keep
}

/// CriticalKV (`ada: None`) or CriticalAdaKV (`ada: Some(alpha)`).
pub struct Critical {
    pub scorer: Arc<dyn Scorer>,
    pub stage: Stage,
    pub ada: Option<f64>,
}

impl Policy for Critical {
    /// The scorer's caches share a KV head's budget as the scorer says.
    fn budget_share(&self, group: usize) -> usize {
        self.scorer.budget_share(group)
    }
    fn name(&self) -> String {
        if self.ada.is_some() {
            "criticaladakv"
        } else {
            "criticalkv"
        }
        .into()
    }
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.scorer.prompt_queries(p, b)
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let s = &*self.scorer;
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let units = match units_to_compress(ctx, s) {
            Ok(units) => units,
            Err(whole) => return Ok(whole),
        };
        let prot = s.protect(b)?;
        let scores: Vec<Vec<f32>> = units.iter().map(|u| s.score(ctx, u)).collect();
        if b > prot.total() && scores.iter().any(|v| v.len() < p - prot.recent) {
            return Err(ReplayError::Contract {
                policy: self.name(),
                msg: "its scorer returned fewer scores than the positions it must score".into(),
            });
        }
        // per cache: its entries (protected included), and its stage-1 count
        let counts: Vec<(usize, usize)> = match self.ada {
            // only the protected positions fit: nothing to select
            _ if b <= prot.total() => vec![(b, b); units.len()],
            None => {
                let first = (b as f64 * self.stage.first_stage_ratio).floor() as usize;
                vec![(b, first); units.len()]
            }
            Some(alpha) => {
                // kvpress AdaKVPress's per-head budgets (the safeguard: each
                // head's top ⌊α·B⌋, protected first), then per head
                // ⌊B_h·first_stage_ratio⌋ in stage 1, and the safeguard kept
                let cand = prot.sinks..p - prot.recent;
                let sl: Vec<&[f32]> = scores.iter().map(|v| &v[cand.clone()]).collect();
                let safe = (alpha * b as f64).floor() as usize;
                let reserve = safe.saturating_sub(prot.total());
                crate::allocation::head_budgets_reserved(&sl, b - prot.total(), reserve, false)
                    .into_iter()
                    .map(|n| {
                        let hb = n + prot.total();
                        let first = (hb as f64 * self.stage.first_stage_ratio).floor() as usize;
                        (hb, first.max(safe.min(hb)))
                    })
                    .collect()
            }
        };
        let caches = units
            .iter()
            .zip(&scores)
            .zip(counts)
            .map(|((u, sc), (count, first))| {
                let norm = value_l1(ctx, u.kv_head);
                let keep = two_stage(
                    p,
                    prot,
                    sc,
                    &norm,
                    count,
                    first,
                    self.stage.epsilon,
                    s.tie(),
                );
                ctx.exact_cache(u.kv_head, &keep)
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
