//! LagKV (docs/methods/lagkv.md), kvpress `LagKVPress`: after `n_sink` sinks
//! the prompt is cut into partitions of `lag` positions; each partition is
//! scored against the next one (its lag reference): every key and value is
//! min-max normalised per channel by the reference's range, its spread is the
//! standard deviation over channels, softmax over the partition, and the key
//! and value scores are averaged. Unless `cross_scoring`, the score becomes
//! the rank within the partition divided by `lag`, so the top B takes about
//! as many positions from every partition. The last full partition and the
//! remainder after it score 1, the sinks above them (kvpress: 1, a tie). A prompt shorter than
//! n_sink + 2·lag gets StreamingLLM's order (sinks, then the most recent).
//! Prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::PrefillCtx;
use crate::scorer::{Scorer, Unit};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "lagkv",
    summary: "scores each lag partition's keys and values by their spread after min-max normalising with the next partition's range; sinks and the last partition kept; prefill only",
    paper: "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important (Liang et al., arXiv 2504.04704); kvpress LagKVPress (NVIDIA/kvpress 0.5)",
    params: &[
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "first positions always kept (score 1)" },
        ParamInfo { name: "lag", default: "128", kind: Kind::Int, help: "partition size; each partition is normalised by the next (kvpress lag_size)" },
        ParamInfo { name: "cross_scoring", default: "false", kind: Kind::Bool, help: "compare the raw scores across partitions instead of their ranks within a partition" },
    ],
    caps: Caps { approximation: Some("kvpress's one-shot form, not the paper's streaming compression partition by partition; sinks outrank the last partition when B cannot hold both"), ..Caps::EVICT_PREFILL },
    test: "lagkv_ranks_each_partition_against_the_next",
    build: Build::Scorer(|p| {
        let lag = p.int_positive("lag", "a partition holds at least one position")?;
        Ok(Arc::new(LagKv { n_sink: p.int("n_sink")?, lag, cross_scoring: p.bool("cross_scoring")? }))
    }),
};

/// The sinks' score: above the 1 of the last partition and the tail.
const SINK: f32 = 2.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LagKv {
    pub n_sink: usize,
    pub lag: usize,
    pub cross_scoring: bool,
}

/// Per position of partition `part` (lag rows of `rows`), the softmax over
/// the partition of the standard deviation (over channels, N − 1) of the row
/// min-max normalised by the per-channel range of the reference partition
/// `reference`. A channel whose reference range is zero contributes 0
/// (kvpress divides by zero there).
fn lag_scores(
    rows: &dyn Fn(usize) -> Vec<f64>,
    part: std::ops::Range<usize>,
    reference: std::ops::Range<usize>,
    d: usize,
) -> Vec<f64> {
    let mut lo = vec![f64::INFINITY; d];
    let mut hi = vec![f64::NEG_INFINITY; d];
    for j in reference {
        for (c, x) in rows(j).into_iter().enumerate() {
            lo[c] = lo[c].min(x);
            hi[c] = hi[c].max(x);
        }
    }
    let std: Vec<f64> = part
        .map(|i| {
            let x: Vec<f64> = rows(i)
                .into_iter()
                .enumerate()
                .map(|(c, v)| {
                    let r = hi[c] - lo[c];
                    if r > 0.0 {
                        (v - lo[c]) / r
                    } else {
                        0.0
                    }
                })
                .collect();
            let m = x.iter().sum::<f64>() / d as f64;
            (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (d as f64 - 1.0).max(1.0)).sqrt()
        })
        .collect();
    let mx = std.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = std.iter().map(|s| (s - mx).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

impl LagKv {
    pub fn scores(&self, ctx: &PrefillCtx, g: usize) -> Vec<f32> {
        let (p, s, lag, d) = (ctx.prompt_len(), self.n_sink, self.lag, ctx.head_dim());
        if p < s + 2 * lag {
            // no partition has a reference: sinks, then later positions higher
            return (0..p)
                .map(|i| {
                    if i < s {
                        1.0
                    } else {
                        ((i - s) as f64 / (p - s) as f64) as f32
                    }
                })
                .collect();
        }
        let n_part = (p - s) / lag;
        let key = |i: usize| {
            ctx.key(g, i)
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<f64>>()
        };
        let value = |i: usize| {
            ctx.value(g, i)
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<f64>>()
        };
        let mut out = vec![1f32; p];
        // kvpress gives the sinks 1 too; when B cannot hold every position
        // scoring 1, the tie is ours to break: the sinks first
        out[..s].iter_mut().for_each(|x| *x = SINK);
        for k in 0..n_part - 1 {
            let part = s + k * lag..s + (k + 1) * lag;
            let reference = part.end..part.end + lag;
            let ks = lag_scores(&key, part.clone(), reference.clone(), d);
            let vs = lag_scores(&value, part.clone(), reference, d);
            let sc: Vec<f64> = ks.iter().zip(&vs).map(|(a, b)| (a + b) / 2.0).collect();
            if self.cross_scoring {
                for (o, v) in out[part].iter_mut().zip(&sc) {
                    *o = *v as f32;
                }
            } else {
                // rank within the partition (0 = lowest; equal scores by position)
                let mut idx: Vec<usize> = (0..lag).collect();
                idx.sort_by(|&x, &y| sc[x].total_cmp(&sc[y]).then(x.cmp(&y)));
                for (rank, &x) in idx.iter().enumerate() {
                    out[part.start + x] = (rank as f64 / lag as f64) as f32;
                }
            }
        }
        out
    }
}

/// Memo key of one KV head's scores.
#[derive(Debug, PartialEq)]
struct LagScores {
    cfg: LagKv,
    kv_head: usize,
}
impl crate::memo::MemoKey for LagScores {
    type Value = Vec<f32>;
}

impl Scorer for LagKv {
    /// Keys and values only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        // Budget-independent: computed once per trace and layer in a sweep.
        let key = LagScores {
            cfg: *self,
            kv_head: u.kv_head,
        };
        ctx.memo(key, || self.scores(ctx, u.kv_head))
            .as_ref()
            .clone()
    }
}
