//! LazyEviction: keep the tokens whose attention recurs, evicting lazily
//! once per observation window (docs/methods/lazyeviction.md). The rule is
//! transcribed from the official code (Halo-949/LazyEviction: model/kv_utils.py,
//! model/temp_cacheobs.py, evaluation.py).
//!
//! Recurrence tracking, per query head on its own attention: decode steps are
//! counted t = 1, 2, …; a token is *attended* at step t when that step's
//! query gives it weight a_t(i) >= α (α = 1e-4, the code's default; the
//! softmax is over the whole cache, the new entry included). Each token keeps
//! last(i), the step it was last attended, and MRI(i), its maximum recurrence
//! interval. At the first step every entry has last = 0, MRI = 0; an entry
//! created at step t starts with last = t − 1, MRI = 0 and is observed at
//! step t. When attended at t: MRI = max(MRI, t − last), last = t.
//!
//! Importance at step t, σ the logistic (highest kept):
//!   s(i) = 2σ(−(1 + (t − last)/(MRI + 1e-5))) + [MRI > 0]·2σ(−(MRI − 1)),
//! in f64, rounded to f32. With GQA (one cache per KV head, kvreplay's
//! equal-memory convention) the group's query heads track separately and
//! their importances are averaged to rank the KV head's entries (our
//! adaptation; the official code keeps one cache per query head:
//! `per_query_head=true`).
//!
//! Eviction (decode): when the step's entry makes the cache exceed B, the W
//! newest are kept and W entries are evicted from the rest, the lowest
//! importances (ties: the earlier position goes). Memory stays at most B and
//! eviction happens once every W steps: in steady state this is the official
//! rule (evict when the cache exceeds C at a step that is a multiple of W,
//! back to C) with C = B − W + 1.
//!
//! Prefill (our extension: the official code neither observes nor evicts the
//! prompt): the last R prompt queries (`rows`, 128) are steps 1..=R (row j
//! sees j + 1 keys; positions before the first observed row start at
//! last = 0, later ones at the step before their row), and when P > B the W
//! newest positions plus the B − W highest importances at t = R are kept.
//! Decode continues the clock: the token at position `pos` is step
//! pos − (P − R) + 1.

use std::ops::Range;
use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "lazyeviction",
    summary: "tracks each token's last attended step and maximum recurrence interval (MRI); evicts the W lowest importances at once, once per window of W steps",
    paper: "LazyEviction: Lagged KV Eviction with Attention Pattern Observation for Efficient Long Reasoning (Zhang et al., arXiv 2506.15969); official code Halo-949/LazyEviction (model/kv_utils.py, model/temp_cacheobs.py)",
    params: &[
        ParamInfo { name: "window", default: "16", kind: Kind::Int, help: "W: the W newest entries are kept, and W entries are evicted at once when the cache exceeds B (the paper tunes W per task, 27..363; code default 128)" },
        ParamInfo { name: "alpha", default: "1e-4", kind: Kind::Float, help: "attended threshold (code: 1e-4 Qwen, 5e-4 Llama; with threshold=uniform, 1 is the natural value)" },
        ParamInfo { name: "threshold", default: "absolute", kind: Kind::Choice(&["absolute", "uniform"]), help: "absolute: attended when a >= alpha (the code); uniform: when a > alpha / (entries seen)" },
        ParamInfo { name: "score", default: "official", kind: Kind::Choice(&["official", "ratio"]), help: "official: 2σ(−(1 + silence/(MRI + 1e-5))) + [MRI > 0]·2σ(−(MRI − 1)); ratio: −silence/(MRI + 1)" },
        ParamInfo { name: "rows", default: "128", kind: Kind::IntOr("all"), help: "the last prompt rows observed as steps at prefill (our extension; `all` = every prompt query; 128 fits a lean trace)" },
        ParamInfo { name: "per_query_head", default: "false", kind: Kind::Bool, help: "one cache per query head (the official repeat_kv layout) instead of one per KV head ranked by the group's mean importance" },
        crate::policy::BUDGET_PER,
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false = prefill only)" },
    ],
    caps: Caps {
        approximation: Some("the official rule (attended a >= α, last/MRI tracking, 2σ importance, W newest kept, W evicted once per W steps) with our choices: eviction when the cache exceeds B (memory <= B; the code's step-triggered rule with C = B − W + 1), the prompt's last 128 rows observed as steps and a prefill selection to B (the code neither observes nor evicts the prompt), one cache per KV head ranked by the group's mean importance (the code: one per query head), W = 16 (the code: 128, tuned per task), integer steps (the code keeps them in fp16)"),
        ..Caps::EVICT_DECODE
    },
    test: "lazyeviction_keeps_recurring_tokens_and_evicts_once_per_window",
    build: Build::Scorer(|p| {
        let window = p.int_positive("window", "must be at least 1")?;
        let rows = match p.word("rows") {
            "all" => None,
            _ => Some(p.int("rows")?),
        };
        if rows == Some(0) {
            return Err(p.bad("rows", "must be at least 1 (or all)".into()));
        }
        Ok(Arc::new(LazyEviction {
            window,
            alpha: p.float_positive("alpha")?,
            uniform: p.word("threshold") == "uniform",
            ratio: p.word("score") == "ratio",
            rows,
            per_query_head: p.bool("per_query_head")?,
            budget_per_cache: p.word("budget_per") == "query_head",
            decode_evict: p.bool("decode_evict")?,
        }))
    }),
};

#[derive(Clone, Copy, Debug)]
pub struct LazyEviction {
    pub window: usize,
    pub alpha: f64,
    /// Attended when a > α / n (false: a >= α, the code's rule).
    pub uniform: bool,
    /// Importance −silence / (MRI + 1) (false: the code's 2σ form).
    pub ratio: bool,
    /// Prompt rows observed at prefill (None: all).
    pub rows: Option<usize>,
    pub per_query_head: bool,
    /// `budget_per=query_head`: B entries per query-head cache (G× the memory).
    pub budget_per_cache: bool,
    pub decode_evict: bool,
}

/// Per entry of one query head: (last attended step, maximum recurrence interval).
type Recurrence = Vec<(u32, u32)>;

/// Memo key of one query head's prompt recurrence.
#[derive(Debug, PartialEq)]
struct PromptRecurrence {
    alpha: u64,
    uniform: bool,
    rows: usize,
    head: usize,
}
impl crate::memo::MemoKey for PromptRecurrence {
    type Value = Recurrence;
}

/// The attended test and the importance form.
#[derive(Clone, Copy, Debug)]
struct Rule {
    alpha: f64,
    uniform: bool,
    ratio: bool,
}

impl Rule {
    /// Record step `t`'s attention `a` (one value per entry, the entries the
    /// query sees) into `rec`.
    fn observe(&self, rec: &mut [(u32, u32)], a: &[f32], t: u32) {
        let n = a.len() as f64;
        for (r, &x) in rec.iter_mut().zip(a) {
            let hit = if self.uniform {
                x as f64 > self.alpha / n
            } else {
                x as f64 >= self.alpha
            };
            if hit {
                r.1 = r.1.max(t - r.0);
                r.0 = t;
            }
        }
    }

    /// One query head's importance of an entry at step `t`, in f64.
    fn importance(&self, (last, mri): (u32, u32), t: u32) -> f64 {
        let silence = (t - last) as f64;
        let mri = mri as f64;
        if self.ratio {
            return -silence / (mri + 1.0);
        }
        // 2σ(−x) = 2 / (1 + e^x)
        let lag = 2.0 / (1.0 + (1.0 + silence / (mri + 1e-5)).exp());
        let period = if mri > 0.0 {
            2.0 / (1.0 + (mri - 1.0).exp())
        } else {
            0.0
        };
        lag + period
    }

    /// Entry `e`'s importance for a cache read by the heads tracked in
    /// `recs`: their mean (in f64, summed in head order), rounded to f32.
    fn score(&self, recs: &[impl AsRef<[(u32, u32)]>], e: usize, t: u32) -> f32 {
        let sum: f64 = recs.iter().map(|r| self.importance(r.as_ref()[e], t)).sum();
        (sum / recs.len() as f64) as f32
    }
}

impl LazyEviction {
    fn rule(&self) -> Rule {
        Rule {
            alpha: self.alpha,
            uniform: self.uniform,
            ratio: self.ratio,
        }
    }

    /// Prompt rows observed at prefill for a P-token prompt.
    fn rows(&self, p: usize) -> usize {
        self.rows.unwrap_or(p).min(p)
    }

    /// Query head `h`'s (last, MRI) per prompt position after the last R
    /// prompt rows as steps 1..=R (row P − R + x is step x + 1).
    fn prompt(&self, ctx: &PrefillCtx, h: usize) -> Arc<Recurrence> {
        let p = ctx.prompt_len();
        let r = self.rows(p);
        let key = PromptRecurrence {
            alpha: self.alpha.to_bits(),
            uniform: self.uniform,
            rows: r,
            head: h,
        };
        ctx.memo(key, || {
            let base = p - r;
            // (R, P) causal attention rows of head h
            let a = ctx.attn_rows(h, base..p);
            // a position created at row j >= base starts at the step before
            // its own (j − base); earlier ones at 0, as at the code's first step
            let mut rec: Recurrence = (0..p).map(|i| (i.saturating_sub(base) as u32, 0)).collect();
            let rule = self.rule();
            for (x, j) in (base..p).enumerate() {
                // row j sees keys 0..=j
                rule.observe(&mut rec[..=j], &a[x * p..x * p + j + 1], x as u32 + 1);
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
        let p = ctx.prompt_len();
        let t = self.rows(p) as u32;
        let recs: Vec<Arc<Recurrence>> = u.heads.clone().map(|h| self.prompt(ctx, h)).collect();
        let recs: Vec<&[(u32, u32)]> = recs.iter().map(|r| r.as_slice()).collect();
        let rule = self.rule();
        (0..p).map(|i| rule.score(&recs, i, t)).collect()
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.window, b))
    }
    fn per_query_head(&self) -> bool {
        self.per_query_head
    }
    fn budget_share(&self, group: usize) -> usize {
        crate::policy::share_of(self.per_query_head, self.budget_per_cache, group)
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
                u.heads
                    .clone()
                    .map(|h| {
                        let r = self.prompt(ctx, h);
                        keep.iter().map(|&i| r[i]).collect()
                    })
                    .collect()
            })
            .collect();
        let p = ctx.prompt_len();
        Some(Box::new(Lazy {
            rec,
            heads: sel.units.iter().map(|u| u.heads.clone()).collect(),
            base: p - self.rows(p),
            rule: self.rule(),
            buf: Vec::new(),
            buf_of: None,
        }))
    }
}

/// Decode-time recurrence: per cache, per query head reading it, per entry.
struct Lazy {
    rec: Vec<Vec<Recurrence>>,
    heads: Vec<Range<usize>>,
    /// P − R: the token at position `pos` is step pos − base + 1.
    base: usize,
    rule: Rule,
    /// Scores of cache `buf_of` at the current step (kept across the
    /// evictions of one step, the evicted entries removed).
    buf: Vec<f32>,
    buf_of: Option<usize>,
}

impl Lazy {
    fn step(&self, pos: usize) -> u32 {
        (pos - self.base + 1) as u32
    }
}

impl StepScorer for Lazy {
    fn observe(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) {
        let t = self.step(ctx.pos);
        self.buf_of = None;
        for (r, h) in self.rec[c].iter_mut().zip(self.heads[c].clone()) {
            // the step's entry starts at the step before its own
            r.push((t - 1, 0));
            self.rule.observe(r, &ctx.probs[h], t);
        }
    }
    fn scores(&mut self, ctx: &StepCtx, c: usize, cache: &HeadCache) -> &[f32] {
        if self.buf_of != Some(c) {
            let t = self.step(ctx.pos);
            let recs = &self.rec[c];
            self.buf = (0..cache.len())
                .map(|e| self.rule.score(recs, e, t))
                .collect();
            self.buf_of = Some(c);
        }
        &self.buf
    }
    fn evicted(&mut self, c: usize, e: usize) {
        for r in &mut self.rec[c] {
            r.remove(e);
        }
        if self.buf_of == Some(c) {
            self.buf.remove(e);
        }
    }
}
