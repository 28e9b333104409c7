//! SnapKV: observation-window voting with pooling.
//!
//! Rule (landscape.md B3): the window is the last w prompt positions;
//! s_i = Σ_{j in window} A_{j,i} for i < P − w (softmax over every key the
//! query sees, causal inside the window), group mean before pooling, pooled
//! along positions (kernel k, stride 1, padding k/2; max ignores padding, avg
//! counts it); keep the top B − w pooled scores plus the whole window.
//! Prefill only. Our choice where the paper requires B > w: with B <= w the
//! B most recent positions are kept.

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{mean_rows, pool1d, top_k, AppendOnly, DecodeState, Policy, Pool, PrefillCtx};
use crate::spec::{Kind, ParamInfo, Params};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "snapkv",
    summary: "observation window of the last w prompt queries votes with pooled attention; prefill only",
    paper: "SnapKV: LLM Knows What You are Looking for Before Generation (Li et al., NeurIPS 2024, arXiv 2404.14469); FasterDecoding/SnapKV",
    params: WINDOW_PARAMS_32,
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(SnapKv { window: Window::from_params(p)? }))
    },
};

pub(crate) static WINDOW_PARAMS_32: &[ParamInfo] = &[
    ParamInfo {
        name: "w",
        default: "32",
        kind: Kind::Int,
        help: "observation window: the last w prompt positions (kept, inside B)",
    },
    ParamInfo {
        name: "k",
        default: "7",
        kind: Kind::Int,
        help: "pooling kernel (odd)",
    },
    ParamInfo {
        name: "pool",
        default: "max",
        kind: Kind::Choice(&["max", "avg", "none"]),
        help: "pooling along positions",
    },
];

/// Window scoring shared by SnapKV, PyramidKV and AdaKV.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub w: usize,
    pub k: usize,
    pub pool: Pool,
}

impl Window {
    pub fn from_params(p: &Params) -> Result<Window, ReplayError> {
        let k = p.int("k")?;
        if k % 2 == 0 {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "k".into(),
                value: k.to_string(),
                msg: "the pooling kernel must be odd".into(),
            });
        }
        let pool = match p.word("pool") {
            "max" => Pool::Max,
            "avg" => Pool::Avg,
            _ => Pool::None,
        };
        Ok(Window {
            w: p.int("w")?,
            k,
            pool,
        })
    }

    /// Pooled window scores of KV head `g` for the positions before the
    /// window, 0..P−w: the per-query-head sums over the window rows, group
    /// mean, then pooling. `mean` divides the sums by w (AdaKV's form).
    pub fn scores(&self, ctx: &PrefillCtx, g: usize, mean: bool) -> Vec<f32> {
        // Budget-independent: computed once per trace and layer in a sweep.
        let key = format!(
            "window_scores:w={},k={},pool={:?},mean={mean},g={g}",
            self.w, self.k, self.pool
        );
        ctx.memo(&key, || self.compute_scores(ctx, g, mean))
            .as_ref()
            .clone()
    }

    fn compute_scores(&self, ctx: &PrefillCtx, g: usize, mean: bool) -> Vec<f32> {
        let p = ctx.prompt_len();
        let w = self.w.min(p);
        let gs = ctx.group();
        let per_head: Vec<Vec<f32>> = (g * gs..(g + 1) * gs)
            .map(|h| {
                let rows = ctx.attn_rows(h, p - w..p);
                let mut s = vec![0f32; p - w];
                for row in rows.chunks_exact(p) {
                    s.iter_mut().zip(row).for_each(|(a, x)| *a += x);
                }
                if mean {
                    s.iter_mut().for_each(|a| *a /= w as f32);
                }
                s
            })
            .collect();
        let s = mean_rows(per_head.iter().map(|v| v.as_slice()));
        pool1d(&s, self.k, self.pool)
    }

    /// Keep `count` selected positions (by `scores` over 0..P−w) plus the window.
    pub fn keep(&self, p: usize, scores: &[f32], count: usize) -> Vec<usize> {
        let w = self.w.min(p);
        let cand: Vec<usize> = (0..p - w).collect();
        let mut keep = top_k(scores, &cand, count, |i| i);
        keep.extend(p - w..p);
        keep
    }
}

pub struct SnapKv {
    pub window: Window,
}

/// The caches of the cases every window policy shares: the prompt fits the
/// budget (keep everything), or the budget does not exceed the window (our
/// choice: keep the B most recent positions). None: the policy selects.
pub(crate) fn trivial_prefill(
    ctx: &PrefillCtx,
    w: usize,
) -> Option<(Vec<HeadCache>, Box<dyn DecodeState>)> {
    let (p, b) = (ctx.prompt_len(), ctx.budget);
    if p <= b {
        return Some((ctx.full_caches(), Box::new(AppendOnly)));
    }
    if b <= w {
        let keep: Vec<usize> = (p - b..p).collect();
        return Some((
            (0..ctx.n_kv_heads())
                .map(|g| ctx.exact_cache(g, &keep))
                .collect(),
            Box::new(AppendOnly),
        ));
    }
    None
}

impl Policy for SnapKv {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        if let Some(done) = trivial_prefill(ctx, self.window.w) {
            return Ok(done);
        }
        let (p, b, w) = (ctx.prompt_len(), ctx.budget, self.window.w);
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                ctx.exact_cache(
                    g,
                    &self
                        .window
                        .keep(p, &self.window.scores(ctx, g, false), b - w),
                )
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
