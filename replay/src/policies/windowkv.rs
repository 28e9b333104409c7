//! WindowKV (docs/methods/windowkv.md; Zuo et al., arXiv 2503.17922, code
//! github.com/optim996/WindowKV): the prompt before the observation window
//! (the last `suffix` positions, always kept) is cut into contiguous review
//! windows of `window` positions (the last one may be shorter); each window
//! is scored from the observation window's attention: A[h, i] = Σ over the
//! `suffix` last prompt queries of query head h of their softmax weight on
//! position i. `select=max` (the reference code's choice for QA tasks):
//! the mean over the layer's query heads of the mean of each head's top
//! ⌊window/2⌋ values inside the window; `select=average` (other tasks): the
//! mean of A over the layer's heads and the window's positions. The
//! ⌈(P − suffix − R_l)/window⌉ lowest windows are dropped (R_l: the layer's
//! review budget; sorted by score, the later of equal windows dropped first),
//! the rest kept whole, one set for every KV head of the layer.
//!
//! Index sharing: layers form groups of `group` consecutive layers; the
//! group's first layer scores and selects, the others keep the same
//! positions (a cross-layer policy: `layer_groups` gives the groups).
//!
//! Budgets: B counts the observation window: R = B − suffix review entries
//! per layer on average (B ≤ suffix: the last B prompt positions). With
//! `schedule=arithmetic` (the reference code's default, β = 14) group j of n
//! gets an arithmetic sequence from 2R − ⌊R·group/β⌋ down to ⌊R·group/β⌋.
//!
//! Task-adaptive part: the paper picks `select` with a BERT classifier of
//! the task (QA → max with a 32-token observation window, otherwise average
//! with 16); no classifier is replayed: `task=qa|other` sets both, and
//! `suffix=N` overrides the window. Prefill only.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{prefill_alone, DecodeState, GroupDecodeState, PerLayer, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "windowkv",
    summary: "keeps whole contiguous windows ranked by the observation window's attention; the first layer of each layer group selects, the others reuse its indices; arithmetic layer-group budgets; prefill only",
    paper: "WindowKV: Task-Adaptive Group-Wise KV Cache Window Selection for Efficient LLM Inference (Zuo et al., arXiv 2503.17922); code github.com/optim996/WindowKV",
    params: &[
        ParamInfo { name: "window", default: "8", kind: Kind::Int, help: "review window size (contiguous positions kept or dropped together)" },
        ParamInfo { name: "task", default: "qa", kind: Kind::Choice(&["qa", "other"]), help: "the task class the paper's classifier would output: qa = select max, 32-token observation window; other = select average, 16" },
        ParamInfo { name: "select", default: "auto", kind: Kind::Choice(&["auto", "max", "average"]), help: "window score: max = mean of each head's top window/2 scores; average = mean over heads and positions; auto = from task" },
        ParamInfo { name: "suffix", default: "auto", kind: Kind::IntOr("auto"), help: "observation window (last prompt positions, always kept, inside B); auto = 32 for qa, 16 for other" },
        ParamInfo { name: "group", default: "8", kind: Kind::Int, help: "consecutive layers sharing the first layer's window indices" },
        ParamInfo { name: "schedule", default: "arithmetic", kind: Kind::Choice(&["arithmetic", "uniform"]), help: "per-group review budgets: arithmetic decrease (beta) or R everywhere" },
        ParamInfo { name: "beta", default: "14", kind: Kind::Int, help: "last group's review budget is floor(R·group/beta)" },
    ],
    caps: Caps {
        family: Family::CrossLayer,
        cross_layer: true,
        approximation: Some("no task classifier: the task class is a parameter (task=qa by default); layer groups round up when the group size does not divide the layers (the reference code assumes it does)"),
        ..Caps::EVICT_PREFILL
    },
    test: "windowkv_keeps_whole_windows_and_shares_them_within_a_group",
    build: Build::Policy(|p| {
        let qa = p.word("task") == "qa";
        let select = match p.word("select") {
            "auto" => if qa { Select::Max } else { Select::Average },
            "max" => Select::Max,
            _ => Select::Average,
        };
        let suffix = match p.word("suffix") {
            "auto" => if qa { 32 } else { 16 },
            _ => p.int("suffix")?,
        };
        let window = p.int_positive("window", "must be at least 1")?;
        let group = p.int_positive("group", "must be at least 1")?;
        let beta = p.int_positive("beta", "must be at least 1")?;
        Ok(Arc::new(WindowKv { window, select, suffix, group, arithmetic: p.word("schedule") == "arithmetic", beta }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Select {
    Max,
    Average,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WindowKv {
    pub window: usize,
    pub select: Select,
    pub suffix: usize,
    pub group: usize,
    pub arithmetic: bool,
    pub beta: usize,
}

/// Memo key: per query head, the observation window's attention summed over
/// its rows, on the positions before it: (n_heads, P − suffix).
#[derive(Debug, PartialEq)]
struct ObsSums(usize);
impl crate::memo::MemoKey for ObsSums {
    type Value = Vec<Vec<f32>>;
}

impl WindowKv {
    /// Review budget of layer `l` of `n` for an average review budget `r`.
    pub fn review_budget(&self, r: usize, l: usize, n: usize) -> usize {
        let groups = n.div_ceil(self.group);
        if !self.arithmetic || groups < 2 {
            return r;
        }
        let last = r * self.group / self.beta;
        let first = (2 * r).saturating_sub(last);
        let step = first.saturating_sub(last) / (groups - 1);
        match l / self.group {
            j if j + 1 == groups => last,
            j => first - j * step,
        }
    }

    /// Kept prompt positions of a layer whose review budget is `r_l`.
    fn select(&self, ctx: &PrefillCtx, r_l: usize) -> Vec<usize> {
        let p = ctx.prompt_len();
        let s = self.suffix.min(ctx.budget).min(p);
        let len = p - s;
        if len <= r_l {
            return (0..p).collect();
        }
        let sums = ctx.memo(ObsSums(s), || {
            (0..ctx.n_heads())
                .map(|h| {
                    let rows = ctx.attn_rows(h, len..p);
                    let mut a = vec![0f32; len];
                    for row in rows.chunks_exact(p) {
                        a.iter_mut().zip(row).for_each(|(x, y)| *x += y);
                    }
                    a
                })
                .collect()
        });
        let w = self.window;
        let n_win = len.div_ceil(w);
        let drop = (len - r_l).div_ceil(w);
        if drop * w >= len {
            return (len..p).collect();
        }
        let score = |i: usize| -> f64 {
            let span = i * w..((i + 1) * w).min(len);
            match self.select {
                Select::Average => {
                    let tot: f64 = sums
                        .iter()
                        .map(|a| a[span.clone()].iter().map(|x| *x as f64).sum::<f64>())
                        .sum();
                    tot / (sums.len() * span.len()) as f64
                }
                Select::Max => {
                    let k = (w / 2).min(span.len()).max(1);
                    let per: f64 = sums
                        .iter()
                        .map(|a| {
                            let mut v: Vec<f32> = a[span.clone()].to_vec();
                            v.sort_by(|x, y| y.total_cmp(x));
                            v[..k].iter().map(|x| *x as f64).sum::<f64>() / k as f64
                        })
                        .sum();
                    per / sums.len() as f64
                }
            }
        };
        let scores: Vec<f64> = (0..n_win).map(score).collect();
        // best first, the earlier of equal windows first (a stable sort)
        let mut order: Vec<usize> = (0..n_win).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let mut keep: Vec<usize> = order[..n_win - drop].to_vec();
        keep.sort_unstable();
        keep.iter()
            .flat_map(|&i| i * w..((i + 1) * w).min(len))
            .chain(len..p)
            .collect()
    }
}

impl Policy for WindowKv {
    fn name(&self) -> String {
        "windowkv".into()
    }

    fn prompt_queries(&self, prompt_len: usize, budget: usize) -> usize {
        self.suffix.min(budget).min(prompt_len)
    }

    fn layer_groups(&self, n_layers: usize, _: usize, _: usize) -> Vec<Vec<usize>> {
        (0..n_layers)
            .collect::<Vec<_>>()
            .chunks(self.group)
            .map(|c| c.to_vec())
            .collect()
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        prefill_alone(self, ctx)
    }

    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let first = &ctxs[0];
        let r = first.budget.saturating_sub(self.suffix.min(first.budget));
        let r_l = self.review_budget(r, first.layer(), first.n_layers());
        let keep = if first.prompt_len() <= first.budget {
            (0..first.prompt_len()).collect()
        } else {
            self.select(first, r_l)
        };
        let caches = ctxs
            .iter()
            .map(|c| {
                (0..c.n_kv_heads())
                    .map(|g| c.exact_cache(g, &keep))
                    .collect()
            })
            .collect();
        Ok((caches, PerLayer::append_only(ctxs.len())))
    }
}
