//! AdaKV: head-adaptive budgets around any scorer.
//!
//! Rule (landscape.md B3, FFY0/AdaKV `AdaptiveSnapKVCluster`): with P = B − w,
//! score each KV head (default: SnapKV window scores, the mean over the last w
//! queries, group-reduced before a max pool); take the top H_kv·P (head,
//! position) pairs of the layer and let n_h be head h's count;
//! B_h = round((1 − α)·n_h + ⌊α·P⌋); head h keeps its own top B_h plus the
//! window. Optional `normalize` scales head h's scores by
//! (sum of its top P) / (sum of all its scores). Prefill only; memory is
//! charged from the actual per-head counts.

use std::sync::Arc;

use super::snapkv::{trivial_prefill, Window};
use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{mean_rows, pool1d, AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "adakv",
    summary: "redistributes a layer's budget across KV heads by where a scorer's top scores fall; prefill only",
    paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (Feng et al., arXiv 2407.11550); FFY0/AdaKV",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Choice(&["snapkv", "h2o", "knorm"]), help: "wrapped scorer: window attention, accumulated attention, or -|k|" },
        ParamInfo { name: "w", default: "32", kind: Kind::Int, help: "observation window (kept, inside B)" },
        ParamInfo { name: "k", default: "7", kind: Kind::Int, help: "pooling kernel (odd)" },
        ParamInfo { name: "pool", default: "max", kind: Kind::Choice(&["max", "avg", "none"]), help: "pooling along positions" },
        ParamInfo { name: "alpha", default: "0.2", kind: Kind::Float, help: "safeguard: share of P every head keeps" },
        ParamInfo { name: "normalize", default: "false", kind: Kind::Bool, help: "scale each head's scores by its top-P share" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        let alpha = p.float("alpha")?;
        if !(0.0..=1.0).contains(&alpha) {
            return Err(ReplayError::BadParam { policy: "adakv".into(), key: "alpha".into(), value: alpha.to_string(), msg: "must lie in [0, 1]".into() });
        }
        Ok(Arc::new(AdaKv { scorer: p.word("scorer").to_string(), window: Window::from_params(p)?, alpha, normalize: p.bool("normalize")? }))
    },
};

pub struct AdaKv {
    pub scorer: String,
    pub window: Window,
    pub alpha: f64,
    pub normalize: bool,
}

impl AdaKv {
    /// Scores over positions 0..P−w for KV head `g`.
    fn scores(&self, ctx: &PrefillCtx, g: usize) -> Vec<f32> {
        let n = ctx.prompt_len() - self.window.w.min(ctx.prompt_len());
        match self.scorer.as_str() {
            "snapkv" => self.window.scores(ctx, g, true),
            "h2o" => {
                let gs = ctx.group();
                let s = mean_rows((g * gs..(g + 1) * gs).map(|h| &ctx.colsum(h)[..n]));
                pool1d(&s, self.window.k, self.window.pool)
            }
            _ => (0..n).map(|i| -super::knorm::norm(ctx.key(g, i))).collect(),
        }
    }
}

/// Per-head selection counts B_h from per-head scores (each over the same
/// candidates 0..n), `per_head` = P selected entries per head on average.
pub fn head_budgets(
    scores: &[Vec<f32>],
    per_head: usize,
    alpha: f64,
    normalize: bool,
) -> Vec<usize> {
    let hk = scores.len();
    let mut pairs: Vec<(f32, usize, usize)> = Vec::new(); // (score, position, head)
    for (h, s) in scores.iter().enumerate() {
        let f = if normalize {
            let mut sorted = s.clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal));
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
        b.0.partial_cmp(&a.0)
            .unwrap_or(std::cmp::Ordering::Equal)
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

impl Policy for AdaKv {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        if let Some(done) = trivial_prefill(ctx, self.window.w) {
            return Ok(done);
        }
        let (p, b, w) = (ctx.prompt_len(), ctx.budget, self.window.w);
        let scores: Vec<Vec<f32>> = (0..ctx.n_kv_heads()).map(|g| self.scores(ctx, g)).collect();
        let budgets = head_budgets(&scores, b - w, self.alpha, self.normalize);
        let caches = (0..ctx.n_kv_heads())
            .map(|g| ctx.exact_cache(g, &self.window.keep(p, &scores[g], budgets[g])))
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_follow_where_the_top_scores_fall() {
        // Two heads, P = 2 per head: the layer's top 4 scores are 9, 8, 7 (head 0)
        // and 6 (head 1) -> n = (3, 1). alpha = 0.5: B_h = round(0.5 n + ⌊0.5·2⌋) = (2.5 -> 3, 1.5 -> 2)
        let s = vec![vec![9.0, 8.0, 7.0, 0.0], vec![6.0, 1.0, 0.5, 0.0]];
        assert_eq!(head_budgets(&s, 2, 0.5, false), vec![3, 2]);
        // alpha = 0: the pure top-k split
        assert_eq!(head_budgets(&s, 2, 0.0, false), vec![3, 1]);
        // alpha = 1: uniform
        assert_eq!(head_budgets(&s, 2, 1.0, false), vec![2, 2]);
    }
}
