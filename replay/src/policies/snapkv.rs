//! SnapKV: observation-window voting with pooling (docs/methods/snapkv.md).
//! The window is the last w prompt positions; s_i = Σ_{j in window} A_{j,i}
//! for i < P − w (softmax over every key the query sees, causal inside the
//! window), group mean before pooling, pooled along positions (kernel k,
//! stride 1, padding k/2; max ignores padding, avg counts it); keep the top
//! B − w pooled scores plus the whole window. Prefill only. Our choice where
//! the paper requires B > w: with B <= w the B most recent positions are kept.
//! `group_mean=after_pool` pools each query head's votes first and then takes
//! the group mean (kvpress SnapKVPress; equal to the default unless
//! pool=max). `preset=kvpress` is kvpress 0.5.x's SnapKVPress: w = 64, k = 5,
//! avg pooling, group mean after pooling (its mean over the window instead of
//! the sum ranks the same).

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo, Params, Preset};
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
        ParamInfo { name: "group_mean", default: "before_pool", kind: Kind::Choice(&["before_pool", "after_pool"]), help: "when the votes are averaged over the GQA group (after_pool: each query head pooled first, as kvpress)" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x SnapKVPress (sets the parameters not given)" },
    ],
    caps: Caps::EVICT_PREFILL,
    test: "snapkv_pools_window_votes_and_breaks_ties_late",
    build: Build::Scorer(|p| Ok(Arc::new(SnapKv::from_params(p)?))),
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's SnapKVPress.
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[
            ("w", "64"),
            ("k", "5"),
            ("pool", "avg"),
            ("group_mean", "after_pool"),
        ],
    },
];

crate::params::choice_enum! {
    /// When SnapKV's votes are averaged over the GQA group.
    pub enum GroupMean {
        /// Mean of the query heads' window votes, then pooling.
        BeforePool = "before_pool",
        /// Each query head's votes pooled, then the mean (kvpress).
        AfterPool = "after_pool",
    }
}

/// Window scoring (also PyramidKV's and AdaKV's default scorer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapKv {
    pub w: usize,
    pub k: usize,
    pub pool: Pool,
    pub group_mean: GroupMean,
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
            group_mean: p.choice("group_mean")?,
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
                match self.group_mean {
                    GroupMean::BeforePool => s,
                    GroupMean::AfterPool => pool1d(&s, self.k, self.pool),
                }
            })
            .collect();
        let s = mean_rows(per_head.iter().map(|v| v.as_slice()));
        match self.group_mean {
            GroupMean::BeforePool => pool1d(&s, self.k, self.pool),
            GroupMean::AfterPool => s,
        }
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
    /// the window rows, group mean, then pooling (or pooling, then the group
    /// mean, with `group_mean=after_pool`).
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
