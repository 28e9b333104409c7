//! Scissorhands: persistence of importance via pivotal-token counts.
//!
//! Rule (landscape.md B3, lzcemma/Scissorhands): entry i is pivotal for row j
//! if A_{j,i} > θ_j strictly; θ_j is the value at index ⌊0.9·n_j⌋ of row j
//! sorted ascending (n_j = P with the causally masked zeros when
//! `include_masked`, as the reference does; the visible keys otherwise), or
//! 1/(λ·n_j) with `threshold=uniform`. The importance c_i counts the last w_h
//! rows in which i was pivotal (group mean over query heads). Keep the r most
//! recent entries and the top B − r by c; during decode, when the cache exceeds
//! B drop the m lowest-c entries outside the recent r (ties: earliest first).

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{top_k, victim, AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx};
use crate::spec::{Kind, ParamInfo};
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
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
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
    },
};

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
        let n = if self.include_masked {
            n_full
        } else {
            visible.len()
        };
        if self.uniform {
            return (1.0 / (self.lambda * n as f64)) as f32;
        }
        let mut sorted = visible.to_vec();
        sorted.resize(n, 0.0);
        sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        sorted[(0.9 * n as f64).floor() as usize]
    }
}

/// Group mean of pivotal counts: masks[e][h'] has bit 0 = latest row.
fn counts(masks: &[Vec<u128>]) -> Vec<f32> {
    masks
        .iter()
        .map(|m| m.iter().map(|x| x.count_ones() as f32).sum::<f32>() / m.len() as f32)
        .collect()
}

impl Policy for Scissorhands {
    #[allow(clippy::needless_range_loop)] // hh indexes the group's heads in masks and rows alike
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b, gs) = (ctx.prompt_len(), ctx.budget, ctx.group());
        let w = self.w_h.min(p);
        let mut caches = Vec::new();
        let mut all_masks = Vec::new();
        for g in 0..ctx.n_kv_heads() {
            // masks[i][h'] over the last w prompt rows: budget-independent, so
            // computed once per trace and layer in a sweep
            let key = format!(
                "scissorhands_masks:w={w},uniform={},lambda={},masked={},g={g}",
                self.uniform, self.lambda, self.include_masked
            );
            let masks = ctx.memo(&key, || {
                let mut masks = vec![vec![0u128; gs]; p];
                for hh in 0..gs {
                    let rows = ctx.attn_rows(g * gs + hh, p - w..p);
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
            });
            let keep = if p <= b {
                (0..p).collect()
            } else {
                let r = self.r.min(b);
                let c = counts(&masks);
                let mut keep = top_k(&c, &(0..p - r).collect::<Vec<_>>(), b - r, |i| i);
                keep.extend(p - r..p);
                keep
            };
            all_masks.push(keep.iter().map(|&i| masks[i].clone()).collect::<Vec<_>>());
            caches.push(ctx.exact_cache(g, &keep));
        }
        let state: Box<dyn DecodeState> = if self.decode_evict {
            Box::new(Evict {
                masks: all_masks,
                cfg: Scissorhands { ..*self },
            })
        } else {
            Box::new(AppendOnly)
        };
        Ok((caches, state))
    }
}

struct Evict {
    /// Per KV head, per entry, per query head of the group: pivotal history bits.
    masks: Vec<Vec<Vec<u128>>>,
    cfg: Scissorhands,
}

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        let keep_bits = if self.cfg.w_h == 128 {
            u128::MAX
        } else {
            (1u128 << self.cfg.w_h) - 1
        };
        for (g, c) in caches.iter_mut().enumerate() {
            let masks = &mut self.masks[g];
            masks.push(vec![0u128; ctx.group]);
            for (hh, row) in ctx.probs[g * ctx.group..(g + 1) * ctx.group]
                .iter()
                .enumerate()
            {
                let theta = self.cfg.threshold(row, row.len());
                for (e, a) in row.iter().enumerate() {
                    let m = &mut masks[e][hh];
                    *m = ((*m << 1) | (*a > theta) as u128) & keep_bits;
                }
            }
            if c.len() > ctx.budget {
                let r = self.cfg.r.min(ctx.budget);
                for _ in 0..self.cfg.m.min(c.len() - r) {
                    let n = c.len();
                    let s = counts(masks);
                    let pos = c.positions();
                    let e = victim(&s, 0..n - r, |e| pos[e])
                        .expect("candidates outside the recent window");
                    c.remove(e);
                    masks.remove(e);
                }
            }
        }
    }
}
