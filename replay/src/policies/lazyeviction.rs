//! LazyEviction: keep the tokens whose attention recurs, evicting lazily
//! once per observation window (docs/methods/lazyeviction.md).
//!
//! Recurrence tracking, per cache (group mean of its query heads' attention):
//! a token is *attended* at step t when its attention a_t(i) > α / n_t, n_t
//! the entries the query at t sees (above the uniform share; α = 1). Each
//! token keeps the step it was last attended, last(i) (its own step when it
//! is created), and its maximum recurrence interval MRI(i), the longest gap
//! between consecutive attended steps (0 until it recurs). Priority at step t
//! (our reading, see the page): s(i) = −(t − last(i)) / (MRI(i) + 1), the
//! share of its longest observed gap the token has now been silent for,
//! negated: 0 for a token attended at the latest step, above −1 while it is
//! within its longest gap (it may still recur), below once it has been
//! silent longer than ever before.
//!
//! Prefill (P > B): the last R prompt queries (`rows`, 128) are the steps
//! (row j sees j + 1 keys; a position's history starts at its creation);
//! the W most recent positions (the observation window) are kept and the
//! B − W highest priorities at t = P − 1 among the rest. Decode: the cache
//! holds B; when a step's entry makes it exceed B, the W lowest priorities
//! outside the window are evicted at once, so eviction happens once every W
//! steps (ties: the earlier position goes).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{mean_rows, PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "lazyeviction",
    summary: "tracks each token's maximum recurrence interval of high attention; evicts W lowest priorities at once, once per observation window of W steps",
    paper: "LazyEviction: Lagged KV Eviction with Attention Pattern Observation for Efficient Long Reasoning (Zhang et al., arXiv 2506.15969); Halo-949/LazyEviction",
    params: &[
        ParamInfo { name: "window", default: "16", kind: Kind::Int, help: "observation window W: the W most recent entries are kept, and W entries are evicted at once when the cache exceeds B" },
        ParamInfo { name: "alpha", default: "1.0", kind: Kind::Float, help: "a token is attended at a step when its attention exceeds alpha / (entries seen)" },
        ParamInfo { name: "rows", default: "128", kind: Kind::IntOr("all"), help: "the last prompt rows observed as steps at prefill (`all` = every prompt query; 128 fits a lean trace)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false = prefill only)" },
    ],
    caps: Caps {
        approximation: Some("the priority s = −(t − last attended step)/(MRI + 1) and the attended threshold α/n are our reading of the paper's recurrence-interval priority (its code and equations were not available here)"),
        ..Caps::EVICT_DECODE
    },
    test: "lazyeviction_keeps_recurring_tokens_and_evicts_once_per_window",
    build: Build::Scorer(|p| {
        let window = p.int("window")?;
        if window == 0 {
            return Err(p.bad("window", "must be at least 1".into()));
        }
        let rows = match p.word("rows") {
            "all" => None,
            _ => Some(p.int("rows")?),
        };
        if rows == Some(0) {
            return Err(p.bad("rows", "must be at least 1 (or all)".into()));
        }
        Ok(Arc::new(LazyEviction { window, alpha: p.float_positive("alpha")?, rows, decode_evict: p.bool("decode_evict")? }))
    }),
};

#[derive(Clone, Copy, Debug)]
pub struct LazyEviction {
    pub window: usize,
    pub alpha: f64,
    /// Prompt rows observed at prefill (None: all).
    pub rows: Option<usize>,
    pub decode_evict: bool,
}

/// Per position: (last attended step, maximum recurrence interval).
type Recurrence = Vec<(u32, u32)>;

/// Memo key of the prompt recurrence of the query heads `heads`.
#[derive(Debug, PartialEq)]
struct PromptRecurrence {
    alpha: u64,
    rows: usize,
    heads: std::ops::Range<usize>,
}
impl crate::memo::MemoKey for PromptRecurrence {
    type Value = Recurrence;
}

/// Whether attention `a` among `n` entries counts as attended.
fn attended(a: f32, n: usize, alpha: f64) -> bool {
    a as f64 > alpha / n as f64
}

/// Record step `t`'s attention `a` (one value per entry) into `rec`.
fn observe(rec: &mut [(u32, u32)], a: &[f32], t: usize, alpha: f64) {
    let n = a.len();
    for (r, &x) in rec.iter_mut().zip(a) {
        if attended(x, n, alpha) {
            r.1 = r.1.max(t as u32 - r.0);
            r.0 = t as u32;
        }
    }
}

/// s = −(t − last) / (MRI + 1): the share of its longest observed gap a
/// token has been silent for, negated (0: attended at the latest step).
fn priority(r: (u32, u32), t: usize) -> f32 {
    -((t - r.0 as usize) as f64 / (r.1 as f64 + 1.0)) as f32
}

impl LazyEviction {
    /// Prompt rows observed at prefill for a P-token prompt.
    fn rows(&self, p: usize) -> usize {
        self.rows.unwrap_or(p).min(p)
    }

    /// The last R prompt rows as steps: every position's (last, MRI) after
    /// row P − 1 (each starts at its own position, MRI 0).
    fn prompt(&self, ctx: &PrefillCtx, u: &Unit) -> Arc<Recurrence> {
        let p = ctx.prompt_len();
        let r = self.rows(p);
        let key = PromptRecurrence {
            alpha: self.alpha.to_bits(),
            rows: r,
            heads: u.heads.clone(),
        };
        ctx.memo(key, || {
            // group mean of the (R, P) causal attention rows, summed in head order
            let mut mean: Vec<f32> = Vec::new();
            for h in u.heads.clone() {
                let a = ctx.attn_rows(h, p - r..p);
                if mean.is_empty() {
                    mean = a;
                } else {
                    mean.iter_mut().zip(&a).for_each(|(x, y)| *x += y);
                }
            }
            let n = u.heads.len() as f32;
            mean.iter_mut().for_each(|x| *x /= n);
            let mut rec: Recurrence = (0..p as u32).map(|i| (i, 0)).collect();
            for (x, j) in (p - r..p).enumerate() {
                // row j sees keys 0..=j
                observe(&mut rec[..=j], &mean[x * p..x * p + j + 1], j, self.alpha);
            }
            rec
        })
    }
}

impl Scorer for LazyEviction {
    /// The observed prompt rows.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        self.rows(p)
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let t = ctx.prompt_len().saturating_sub(1);
        self.prompt(ctx, u)
            .iter()
            .map(|&r| priority(r, t))
            .collect()
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.window, b))
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn evict_batch(&self) -> usize {
        self.window
    }
    fn decoder(&self, ctx: &PrefillCtx, sel: &Selected) -> Option<Box<dyn StepScorer>> {
        let rec = sel
            .units
            .iter()
            .zip(sel.kept)
            .map(|(u, keep)| {
                let r = self.prompt(ctx, u);
                keep.iter().map(|&i| r[i]).collect()
            })
            .collect();
        Some(Box::new(Lazy {
            rec,
            heads: sel.units.iter().map(|u| u.heads.clone()).collect(),
            alpha: self.alpha,
            buf: Vec::new(),
        }))
    }
}

/// Decode-time recurrence of every entry of each cache.
struct Lazy {
    rec: Vec<Recurrence>,
    heads: Vec<std::ops::Range<usize>>,
    alpha: f64,
    buf: Vec<f32>,
}

impl StepScorer for Lazy {
    fn observe(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) {
        let rec = &mut self.rec[c];
        rec.push((ctx.pos as u32, 0));
        let mean = mean_rows(
            ctx.probs[self.heads[c].clone()]
                .iter()
                .map(|v| v.as_slice()),
        );
        observe(rec, &mean, ctx.pos, self.alpha);
    }
    fn scores(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) -> &[f32] {
        self.buf = self.rec[c].iter().map(|&r| priority(r, ctx.pos)).collect();
        &self.buf
    }
    fn evicted(&mut self, c: usize, e: usize) {
        self.rec[c].remove(e);
    }
}
