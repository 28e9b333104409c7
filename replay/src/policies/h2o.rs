//! H2O: heavy hitters (accumulated attention) plus a recent window.
//!
//! Rule (landscape.md B3): s_i = Σ_j A_{j,i} over every query that has seen i
//! (the prompt queries, causal, then each decode query over the compressed
//! cache), reduced to the KV head by the group mean. Keep the r = ⌊B/2⌋ most
//! recent entries and the B − r highest scores among the rest. At decode the
//! step's attention row is added to s (a new entry starts with its own
//! self-attention), then the lowest-scoring entry outside the recent r is
//! evicted (earliest position on ties); an evicted entry's score is discarded.

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{
    mean_rows, top_k, victim, AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx,
};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "h2o",
    summary: "recent window + heavy hitters by accumulated attention; evicts one entry per decode step",
    paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (Zhang et al., NeurIPS 2023, arXiv 2306.14048); FMInference/H2O",
    params: &[
        ParamInfo { name: "recent", default: "half", kind: Kind::IntOr("half"), help: "recent entries kept (inside B): `half` = ⌊B/2⌋, or a number" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false = KVCache-Factory's prefill-only form)" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        let recent = match p.word("recent") {
            "half" => None,
            _ => Some(p.int("recent")?),
        };
        Ok(Arc::new(H2o { recent, decode_evict: p.bool("decode_evict")? }))
    },
};

pub struct H2o {
    /// None = ⌊B/2⌋.
    pub recent: Option<usize>,
    pub decode_evict: bool,
}

impl H2o {
    fn recent(&self, b: usize) -> usize {
        self.recent.unwrap_or(b / 2).min(b)
    }
}

/// Group-mean accumulated prompt attention of KV head `g`: (P,).
pub fn prompt_scores(ctx: &PrefillCtx, g: usize) -> Vec<f32> {
    let gs = ctx.group();
    mean_rows((g * gs..(g + 1) * gs).map(|h| ctx.colsum(h)))
}

/// Kept prompt positions: the r most recent plus the top B - r of the rest.
pub fn kept_positions(scores: &[f32], b: usize, r: usize) -> Vec<usize> {
    let p = scores.len();
    if p <= b {
        return (0..p).collect();
    }
    let rest: Vec<usize> = (0..p - r).collect();
    let mut keep = top_k(scores, &rest, b - r, |i| i);
    keep.extend(p - r..p);
    keep
}

impl Policy for H2o {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (b, r) = (ctx.budget, self.recent(ctx.budget));
        let mut caches = Vec::new();
        let mut scores = Vec::new();
        for g in 0..ctx.n_kv_heads() {
            let s = prompt_scores(ctx, g);
            let keep = kept_positions(&s, b, r);
            scores.push(keep.iter().map(|&i| s[i]).collect::<Vec<f32>>());
            caches.push(ctx.exact_cache(g, &keep));
        }
        let state: Box<dyn DecodeState> = if self.decode_evict {
            Box::new(Evict { recent: r, scores })
        } else {
            Box::new(AppendOnly)
        };
        Ok((caches, state))
    }
}

struct Evict {
    recent: usize,
    /// Per KV head, per entry: accumulated attention.
    scores: Vec<Vec<f32>>,
}

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for (g, c) in caches.iter_mut().enumerate() {
            let s = &mut self.scores[g];
            s.push(0.0);
            for (x, a) in s.iter_mut().zip(ctx.group_mean(g)) {
                *x += a;
            }
            while c.len() > ctx.budget {
                let n = c.len();
                let pos = c.positions();
                let e = victim(s, 0..n - self.recent.min(n), |e| pos[e])
                    .expect("budget >= 1 leaves candidates");
                c.remove(e);
                s.remove(e);
            }
        }
    }
}
