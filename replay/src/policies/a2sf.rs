//! A2SF: accumulated attention with a forgetting factor (docs/methods/a2sf.md).
//! s_i = Σ_j α^(t−j) A_{j,i} over every query j that has seen i, t the latest
//! query, reduced to the KV head by the group mean: H2O's score with older
//! attention forgotten geometrically, so early positions are no longer
//! favoured for having been summed over more queries. Keep the r = ⌊B/2⌋ most
//! recent entries and the B − r highest scores among the rest. At decode every
//! score is multiplied by α and the step's attention row is added (a new entry
//! starts with its own self-attention), then the lowest-scoring entry outside
//! the recent r is evicted. α = 1 is H2O.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{mean_rows, PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "a2sf",
    summary: "H2O with a forgetting factor: accumulated attention decays by alpha per query; recent window + top scores; evicts one entry per decode step",
    paper: "A2SF: Accumulative Attention Scoring with Forgetting Factor for Token Pruning in Transformer Decoder (Jo and Shin, arXiv 2407.20485); Dirac-Notation/A2SF",
    params: &[
        ParamInfo { name: "alpha", default: "0.8", kind: Kind::Float, help: "forgetting factor in [0, 1]: a query's attention is weighted alpha^(age) (1 = h2o)" },
        ParamInfo { name: "recent", default: "half", kind: Kind::IntOr("half"), help: "recent entries kept (inside B): `half` = ⌊B/2⌋, or a number" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false = prefill only)" },
    ],
    caps: Caps::EVICT_DECODE,
    test: "a2sf_forgets_old_attention_geometrically",
    build: Build::Scorer(|p| {
        let recent = match p.word("recent") {
            "half" => None,
            _ => Some(p.int("recent")?),
        };
        Ok(Arc::new(A2sf { alpha: p.float_in("alpha", 0.0, 1.0)? as f32, recent, decode_evict: p.bool("decode_evict")? }))
    }),
};

/// Prompt rows whose weight α^(P−1−j) falls below this are not read.
pub const NEGLIGIBLE: f64 = 1e-10;

pub struct A2sf {
    pub alpha: f32,
    /// None = ⌊B/2⌋.
    pub recent: Option<usize>,
    pub decode_evict: bool,
}

impl A2sf {
    /// The last prompt rows with a weight of at least [`NEGLIGIBLE`] (0 when
    /// α = 1: the column sums are the score).
    fn rows(&self, p: usize) -> usize {
        let a = self.alpha as f64;
        if a >= 1.0 {
            0
        } else if a <= 0.0 {
            1.min(p)
        } else {
            // α^(w−1) >= NEGLIGIBLE
            let w = (NEGLIGIBLE.ln() / a.ln()).floor() as usize + 1;
            w.min(p)
        }
    }
}

/// Memo key of the decayed prompt scores of the query heads `heads`.
#[derive(Debug, PartialEq)]
struct Decayed {
    alpha_bits: u32,
    heads: std::ops::Range<usize>,
}
impl crate::memo::MemoKey for Decayed {
    type Value = Vec<f32>;
}

impl Scorer for A2sf {
    /// The rows whose weight is not negligible.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        self.rows(p)
    }
    /// s_i = mean over the group of Σ_{j≥i} α^(P−1−j) A^h_{j,i} (summed in f64).
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let p = ctx.prompt_len();
        let w = self.rows(p);
        if w == 0 {
            return mean_rows(u.heads.clone().map(|h| ctx.colsum(h)));
        }
        let key = Decayed {
            alpha_bits: self.alpha.to_bits(),
            heads: u.heads.clone(),
        };
        ctx.memo(key, || {
            let per_head: Vec<Vec<f32>> = u
                .heads
                .clone()
                .map(|h| {
                    let rows = ctx.attn_rows(h, p - w..p);
                    let mut s = vec![0f64; p];
                    for (r, row) in rows.chunks_exact(p).enumerate() {
                        let weight = (self.alpha as f64).powi((w - 1 - r) as i32);
                        s.iter_mut()
                            .zip(row)
                            .for_each(|(a, x)| *a += weight * *x as f64);
                    }
                    s.iter().map(|&x| x as f32).collect()
                })
                .collect();
            mean_rows(per_head.iter().map(|v| v.as_slice()))
        })
        .as_ref()
        .clone()
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.recent.unwrap_or(b / 2), b))
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, _: &PrefillCtx, sel: &Selected) -> Option<Box<dyn StepScorer>> {
        Some(Box::new(Forgetting {
            alpha: self.alpha,
            acc: (0..sel.units.len()).map(|u| sel.kept_scores(u)).collect(),
            heads: sel.units.iter().map(|u| u.heads.clone()).collect(),
        }))
    }
}

/// Decode scores: s ← α·s + the step's group-mean attention.
struct Forgetting {
    alpha: f32,
    acc: Vec<Vec<f32>>,
    heads: Vec<std::ops::Range<usize>>,
}

impl StepScorer for Forgetting {
    fn observe(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) {
        let a = self.alpha;
        self.acc[c].iter_mut().for_each(|x| *x *= a);
        ctx.accumulate(&mut self.acc[c], self.heads[c].clone());
    }
    fn scores(&mut self, _: &StepCtx, c: usize, _: &HeadCache) -> &[f32] {
        &self.acc[c]
    }
    fn evicted(&mut self, c: usize, e: usize) {
        self.acc[c].remove(e);
    }
}
