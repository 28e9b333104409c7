//! SnapKV: observation-window voting with pooling (docs/methods/snapkv.md).
//! The window is the last w prompt positions; s_i = Σ_{j in window} A_{j,i}
//! for i < P − w (softmax over every key the query sees, causal inside the
//! window), group mean before pooling, pooled along positions (kernel k,
//! stride 1, padding k/2; max ignores padding, avg counts it); keep the top
//! B − w pooled scores plus the whole window. Prefill only. Our choice where
//! the paper requires B > w: with B <= w the B most recent positions are kept.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo, Params};
use crate::policy::{mean_rows, pool1d, Pool, PrefillCtx};
use crate::scorer::{Scorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "snapkv",
    summary: "observation window of the last w prompt queries votes with pooled attention; prefill only",
    paper: "SnapKV: LLM Knows What You are Looking for Before Generation (Li et al., NeurIPS 2024, arXiv 2404.14469); FasterDecoding/SnapKV",
    params: &[
        ParamInfo { name: "w", default: "32", kind: Kind::Int, help: "observation window: the last w prompt positions (kept, inside B)" },
        ParamInfo { name: "k", default: "7", kind: Kind::Int, help: "pooling kernel (odd)" },
        ParamInfo { name: "pool", default: "max", kind: Kind::Choice(&["max", "avg", "none"]), help: "pooling along positions" },
    ],
    caps: Caps::EVICT_PREFILL,
    test: "snapkv_pools_window_votes_and_breaks_ties_late",
    build: Build::Scorer(|p| Ok(Arc::new(SnapKv::from_params(p)?))),
};

/// Window scoring (also PyramidKV's and AdaKV's default scorer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapKv {
    pub w: usize,
    pub k: usize,
    pub pool: Pool,
    /// Divide the window sums by w (AdaKV's form, compared across heads).
    pub mean: bool,
}

impl SnapKv {
    pub fn from_params(p: &Params) -> Result<SnapKv, ReplayError> {
        let k = p.int("k")?;
        if k % 2 == 0 {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "k".into(),
                value: k.to_string(),
                msg: "the pooling kernel must be odd".into(),
            });
        }
        Ok(SnapKv {
            w: p.int("w")?,
            k,
            pool: p.choice("pool")?,
            mean: false,
        })
    }

    fn compute(&self, ctx: &PrefillCtx, heads: std::ops::Range<usize>) -> Vec<f32> {
        let p = ctx.prompt_len();
        let w = self.w.min(p);
        let per_head: Vec<Vec<f32>> = heads
            .map(|h| {
                let rows = ctx.attn_rows(h, p - w..p);
                let mut s = vec![0f32; p - w];
                for row in rows.chunks_exact(p) {
                    s.iter_mut().zip(row).for_each(|(a, x)| *a += x);
                }
                if self.mean {
                    s.iter_mut().for_each(|a| *a /= w as f32);
                }
                s
            })
            .collect();
        let s = mean_rows(per_head.iter().map(|v| v.as_slice()));
        pool1d(&s, self.k, self.pool)
    }
}

/// Memo key of the pooled window votes of the query heads `heads`.
#[derive(Debug, PartialEq)]
struct WindowVotes {
    cfg: SnapKv,
    heads: std::ops::Range<usize>,
}
impl crate::memo::MemoKey for WindowVotes {
    type Value = Vec<f32>;
}

impl Scorer for SnapKv {
    /// The observation window's rows.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        self.w.min(p)
    }
    /// Pooled window votes of positions 0..P−w: per query head the sums over
    /// the window rows, group mean, then pooling.
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        // Budget-independent: computed once per trace and layer in a sweep.
        let key = WindowVotes {
            cfg: *self,
            heads: u.heads.clone(),
        };
        ctx.memo(key, || self.compute(ctx, u.heads.clone()))
            .as_ref()
            .clone()
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.w, b))
    }
    fn across_heads(&self) -> Option<Arc<dyn Scorer>> {
        Some(Arc::new(SnapKv {
            mean: true,
            ..*self
        }))
    }
}
