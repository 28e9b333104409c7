//! Scissorhands: persistence of importance via pivotal-token counts
//! (docs/methods/scissorhands.md; lzcemma/Scissorhands): entry i is pivotal for row j
//! if A_{j,i} > θ_j strictly; θ_j is the value at index ⌊0.9·n_j⌋ of row j
//! sorted ascending (n_j = P with the causally masked zeros when
//! `include_masked`, as the reference does; the visible keys otherwise), or
//! 1/(λ·n_j) with `threshold=uniform`. The importance c_i counts the last w_h
//! rows in which i was pivotal (group mean over query heads). Keep the r most
//! recent entries and the top B − r by c; during decode, when the cache exceeds
//! B drop the m lowest-c entries outside the recent r (ties: earliest first).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::{cmp_f32, Protect};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "scissorhands",
    summary: "keeps entries that were pivotal (above a per-row attention threshold) most often in the last w_h queries",
    paper: "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache Compression at Test Time (Liu et al., NeurIPS 2023, arXiv 2305.17118); lzcemma/Scissorhands",
    params: &[
        ParamInfo { name: "w_h", default: "100", kind: Kind::Int, help: "history window of query rows counted (at most 128)" },
        ParamInfo { name: "r", default: "10", kind: Kind::Int, help: "most recent entries always kept (inside B)" },
        ParamInfo { name: "m", default: "1", kind: Kind::Int, help: "entries dropped at a time when the cache exceeds B" },
        ParamInfo { name: "threshold", default: "quantile", kind: Kind::Choice(&["quantile", "uniform"]), help: "θ_j: the 0.9 quantile of the row, or 1/(lambda·n_j)" },
        ParamInfo { name: "lambda", default: "1.0", kind: Kind::Float, help: "scale of the uniform threshold" },
        ParamInfo { name: "include_masked", default: "true", kind: Kind::Bool, help: "prompt rows' quantile includes the causally masked zeros (reference behaviour)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode" },
    ],
    caps: Caps::EVICT_DECODE,
    test: "scissorhands_counts_pivotal_rows",
    build: Build::Scorer(|p| {
        let w_h = p.int("w_h")?;
        if w_h == 0 || w_h > 128 {
            return Err(ReplayError::BadParam { policy: "scissorhands".into(), key: "w_h".into(), value: w_h.to_string(), msg: "must lie in 1..=128".into() });
        }
        Ok(Arc::new(Scissorhands {
            w_h,
            r: p.int("r")?,
            m: p.int("m")?.max(1),
            uniform: p.word("threshold") == "uniform",
            lambda: p.float("lambda")?,
            include_masked: p.bool("include_masked")?,
            decode_evict: p.bool("decode_evict")?,
        }))
    }),
};

#[derive(Clone, Copy, Debug)]
pub struct Scissorhands {
    pub w_h: usize,
    pub r: usize,
    pub m: usize,
    pub uniform: bool,
    pub lambda: f64,
    pub include_masked: bool,
    pub decode_evict: bool,
}

impl Scissorhands {
    /// θ of a row whose visible part is `visible` and full length `n_full`.
    fn threshold(&self, visible: &[f32], n_full: usize) -> f32 {
        self.threshold_in(visible, n_full, &mut Vec::new())
    }

    /// [`Self::threshold`] with `scratch` for the row's copy.
    fn threshold_in(&self, visible: &[f32], n_full: usize, scratch: &mut Vec<f32>) -> f32 {
        let n = if self.include_masked {
            n_full
        } else {
            visible.len()
        };
        if self.uniform {
            return (1.0 / (self.lambda * n as f64)) as f32;
        }
        // the value at index ⌊0.9·n⌋ of the row sorted ascending: selected in
        // linear time (total order, so the same value a full sort puts there)
        scratch.clear();
        scratch.extend_from_slice(visible);
        scratch.resize(n, 0.0);
        let k = (0.9 * n as f64).floor() as usize;
        *scratch.select_nth_unstable_by(k, |a, b| cmp_f32(*a, *b)).1
    }

    /// masks[i][h'] over the last w_h prompt rows (bit 0 = latest row), per
    /// position i and query head h' of the unit: budget-independent, so
    /// computed once per trace and layer in a sweep.
    #[allow(clippy::needless_range_loop)] // hh indexes the unit's heads in masks and rows alike
    fn masks(&self, ctx: &PrefillCtx, u: &Unit) -> Arc<Vec<Vec<u128>>> {
        let p = ctx.prompt_len();
        let w = self.w_h.min(p);
        let key = PivotalMasks {
            w,
            uniform: self.uniform,
            lambda: self.lambda.to_bits(),
            include_masked: self.include_masked,
            heads: u.heads.clone(),
        };
        ctx.memo(key, || {
            let mut masks = vec![vec![0u128; u.heads.len()]; p];
            for (hh, h) in u.heads.clone().enumerate() {
                let rows = ctx.attn_rows(h, p - w..p);
                for (r, row) in rows.chunks_exact(p).enumerate() {
                    let j = p - w + r;
                    let theta = self.threshold(&row[..=j], p);
                    let bit = 1u128 << (p - 1 - j);
                    for (i, a) in row[..=j].iter().enumerate() {
                        if *a > theta {
                            masks[i][hh] |= bit;
                        }
                    }
                }
            }
            masks
        })
    }
}

/// Memo key of the pivotal bits of the query heads `heads` over the last w prompt rows.
#[derive(Debug, PartialEq)]
struct PivotalMasks {
    w: usize,
    uniform: bool,
    lambda: u64,
    include_masked: bool,
    heads: std::ops::Range<usize>,
}
impl crate::memo::MemoKey for PivotalMasks {
    type Value = Vec<Vec<u128>>;
}

/// Group mean of pivotal counts: masks[e][h'] has bit 0 = latest row.
fn counts(masks: &[Vec<u128>]) -> Vec<f32> {
    let mut out = Vec::new();
    counts_into(masks, &mut out);
    out
}

/// [`counts`] into `out`.
fn counts_into(masks: &[Vec<u128>], out: &mut Vec<f32>) {
    out.clear();
    out.extend(
        masks
            .iter()
            .map(|m| m.iter().map(|x| x.count_ones() as f32).sum::<f32>() / m.len() as f32),
    );
}

impl Scorer for Scissorhands {
    /// The history window's rows.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        self.w_h.min(p)
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        counts(&self.masks(ctx, u))
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.r, b))
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn evict_batch(&self) -> usize {
        self.m
    }
    fn decoder(&self, ctx: &PrefillCtx, sel: &Selected) -> Option<Box<dyn StepScorer>> {
        let masks = sel
            .units
            .iter()
            .zip(sel.kept)
            .map(|(u, keep)| {
                let m = self.masks(ctx, u);
                keep.iter().map(|&i| m[i].clone()).collect()
            })
            .collect();
        let heads = sel.units.iter().map(|u| u.heads.clone()).collect();
        Some(Box::new(Pivotal {
            masks,
            heads,
            cfg: *self,
            counts: Vec::new(),
            row: Vec::new(),
        }))
    }
}

/// Decode-time pivotal histories.
struct Pivotal {
    /// Per cache, per entry, per query head of the cache: pivotal history bits.
    masks: Vec<Vec<Vec<u128>>>,
    heads: Vec<std::ops::Range<usize>>,
    cfg: Scissorhands,
    /// The last counts asked for.
    counts: Vec<f32>,
    /// A row's copy for its threshold.
    row: Vec<f32>,
}

impl StepScorer for Pivotal {
    fn observe(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) {
        let keep_bits = if self.cfg.w_h == 128 {
            u128::MAX
        } else {
            (1u128 << self.cfg.w_h) - 1
        };
        let heads = self.heads[c].clone();
        let masks = &mut self.masks[c];
        masks.push(vec![0u128; heads.len()]);
        for (hh, row) in ctx.probs[heads].iter().enumerate() {
            let theta = self.cfg.threshold_in(row, row.len(), &mut self.row);
            for (e, a) in row.iter().enumerate() {
                let m = &mut masks[e][hh];
                *m = ((*m << 1) | (*a > theta) as u128) & keep_bits;
            }
        }
    }
    fn scores(&mut self, _: &StepCtx, c: usize, _: &HeadCache) -> &[f32] {
        counts_into(&self.masks[c], &mut self.counts);
        &self.counts
    }
    fn evicted(&mut self, c: usize, e: usize) {
        self.masks[c].remove(e);
    }
}
