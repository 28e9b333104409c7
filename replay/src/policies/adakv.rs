//! AdaKV: head-adaptive budgets around any scorer (docs/methods/adakv.md;
//! default scorer SnapKV in its cross-head form: window means).
//!
//! Rule (FFY0/AdaKV `AdaptiveSnapKVCluster`): with w the scorer's protected
//! positions and P = B − w, score each KV head; take the top H_kv·P (head,
//! position) pairs of the layer and let n_h be head h's count;
//! B_h = round((1 − α)·n_h + ⌊α·P⌋); head h keeps its own top B_h plus the
//! protected positions. Optional `normalize` scales head h's scores by
//! (sum of its top P) / (sum of all its scores). Memory is charged from the
//! actual per-head counts; decode-time scorers hold each head's own count.

use std::sync::Arc;

use super::{Build, Caps, Family, PolicyInfo};
use crate::scorer::{Allocation, TopK};
use crate::select::cmp_f32;
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "adakv",
    summary: "redistributes a layer's budget across KV heads by where a scorer's top scores fall; prefill only",
    paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (Feng et al., arXiv 2407.11550); FFY0/AdaKV",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer compared across heads (its parameters are accepted too)" },
        ParamInfo { name: "alpha", default: "0.2", kind: Kind::Float, help: "safeguard: share of P every head keeps" },
        ParamInfo { name: "normalize", default: "false", kind: Kind::Bool, help: "scale each head's scores by its top-P share" },
    ],
    caps: Caps { family: Family::Allocation, ..Caps::EVICT_PREFILL },
    test: "adakv_gives_every_scorer_per_head_budgets",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| {
            let alpha = p.float("alpha")?;
            if !(0.0..=1.0).contains(&alpha) {
                return Err(ReplayError::BadParam { policy: "adakv".into(), key: "alpha".into(), value: alpha.to_string(), msg: "must lie in [0, 1]".into() });
            }
            let allocation = Allocation::Ada { alpha, normalize: p.bool("normalize")? };
            Ok(Arc::new(TopK { scorer, allocation, merge: None }))
        },
    },
};

/// Per-head selection counts B_h from per-head scores (each over the same
/// candidates 0..n), `per_head` = P selected entries per head on average.
pub fn head_budgets(
    scores: &[&[f32]],
    per_head: usize,
    alpha: f64,
    normalize: bool,
) -> Vec<usize> {
    let hk = scores.len();
    let mut pairs: Vec<(f32, usize, usize)> = Vec::new(); // (score, position, head)
    for (h, s) in scores.iter().enumerate() {
        let f = if normalize {
            let mut sorted = s.to_vec();
            sorted.sort_by(|a, b| cmp_f32(*b, *a));
            let top: f32 = sorted.iter().take(per_head).sum();
            let all: f32 = sorted.iter().sum();
            if all > 0.0 {
                top / all
            } else {
                1.0
            }
        } else {
            1.0
        };
        pairs.extend(s.iter().enumerate().map(|(i, x)| (x * f, i, h)));
    }
    // (score desc, position desc, head asc)
    pairs.sort_by(|a, b| {
        cmp_f32(b.0, a.0)
            .then(b.1.cmp(&a.1))
            .then(a.2.cmp(&b.2))
    });
    let mut n_h = vec![0usize; hk];
    for &(_, _, h) in pairs.iter().take(hk * per_head) {
        n_h[h] += 1;
    }
    let floor = (alpha * per_head as f64).floor();
    n_h.iter()
        .map(|&n| ((1.0 - alpha) * n as f64 + floor).round() as usize)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_follow_where_the_top_scores_fall() {
        // Two heads, P = 2 per head: the layer's top 4 scores are 9, 8, 7 (head 0)
        // and 6 (head 1) -> n = (3, 1). alpha = 0.5: B_h = round(0.5 n + ⌊0.5·2⌋) = (2.5 -> 3, 1.5 -> 2)
        let s: Vec<&[f32]> = vec![&[9.0, 8.0, 7.0, 0.0], &[6.0, 1.0, 0.5, 0.0]];
        assert_eq!(head_budgets(&s, 2, 0.5, false), vec![3, 2]);
        // alpha = 0: the pure top-k split
        assert_eq!(head_budgets(&s, 2, 0.0, false), vec![3, 1]);
        // alpha = 1: uniform
        assert_eq!(head_budgets(&s, 2, 1.0, false), vec![2, 2]);
    }
}
