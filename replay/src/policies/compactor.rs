//! Compactor (docs/methods/compactor.md), kvpress `CompactorPress`
//! (NVIDIA/kvpress 0.5.4, unchanged since): approximate leverage scores of the
//! keys blended with non-causal chunked attention.
//!
//! The first `sink_start` and last `sink_end` prompt positions are always kept;
//! the S positions between them are scored, per KV head:
//! - leverage: [`Leverage::raw_range`] over those positions (pre-RoPE keys
//!   centred over them, the seeded sketch of `leverage`), z-scored over the
//!   layer's KV heads and positions ([`zscore`]);
//! - attention: the S positions cut into chunks of `chunk` (the last one
//!   padded), inside each chunk every query attends to every key of the chunk
//!   (non-causal) with logits q·k, unscaled as kvpress computes them; column
//!   sums over the chunk's queries; kvpress fills a padded chunk's missing keys
//!   with logit −1e-9 (≈ 0, not −∞) and its missing queries with logits 0, and
//!   sums those rows too: both kept here. Group mean over the query heads, times
//!   ‖v_i‖₂, average pooling (kernel 3, padding 1, zero padding counted),
//!   z-scored over the layer's KV heads and positions.
//!
//! score = blending · leverage + attention, where blending defaults to kvpress's
//! compression ratio, 1 − B/P. Keep the top B per KV head. Prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::leverage::{zscore, Leverage};
use crate::policy::PrefillCtx;
use crate::scorer::{Scorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "compactor",
    summary: "blends z-scored approximate key leverage (weight: the compression ratio) with z-scored non-causal chunked attention × ‖v‖; 8 sinks and 4 recent kept; prefill only",
    paper: "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores (Chari and Van Durme, arXiv 2507.08143); kvpress CompactorPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "sink_start", default: "8", kind: Kind::Int, help: "first positions always kept (kvpress sink_size_start)" },
        ParamInfo { name: "sink_end", default: "4", kind: Kind::Int, help: "last positions always kept (kvpress sink_size_end)" },
        ParamInfo { name: "chunk", default: "256", kind: Kind::Int, help: "chunk of the non-causal attention (kvpress chunk_size)" },
        ParamInfo { name: "sketch", default: "48", kind: Kind::Int, help: "columns of the leverage sketch (kvpress sketch_dimension)" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed of the sketch (the same matrices as leverage with this seed)" },
        ParamInfo { name: "blending", default: "auto", kind: Kind::FloatOr("auto"), help: "weight of the leverage scores; auto: kvpress's default, the compression ratio 1 − B/P" },
    ],
    caps: Caps {
        approximation: Some("a seeded Gaussian sketch where kvpress draws an unseeded one (same distribution, reproducible), as leverage"),
        ..Caps::EVICT_PREFILL
    },
    test: "compactor_blends_leverage_with_chunked_attention",
    build: Build::Scorer(|p| {
        let bad = |key: &str, msg: &str| ReplayError::BadParam {
            policy: p.policy.into(),
            key: key.into(),
            value: p.word(key).into(),
            msg: msg.into(),
        };
        let sketch = p.int_positive("sketch", "the sketch needs at least one column")?;
        let chunk = p.int_positive("chunk", "a chunk holds at least one position")?;
        let blending = match p.word("blending") {
            "auto" => None,
            w => match w.parse::<f64>() {
                Ok(x) if x.is_finite() => Some(x),
                _ => return Err(bad("blending", "expected auto or a number")),
            },
        };
        Ok(Arc::new(Compactor {
            sink_start: p.int("sink_start")?,
            sink_end: p.int("sink_end")?,
            chunk,
            leverage: Leverage { sketch, seed: p.int("seed")? as u64 },
            blending,
        }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Compactor {
    pub sink_start: usize,
    pub sink_end: usize,
    pub chunk: usize,
    pub leverage: Leverage,
    /// None: the compression ratio 1 − B/P.
    pub blending: Option<f64>,
}

/// kvpress's logit of a padded key in the last chunk (−1e-9, not −∞).
const PAD_LOGIT: f64 = -1e-9;

/// Column sums of non-causal chunked attention of query head `h` over the
/// positions `range` (kvpress NonCausalAttnPress.non_causal_chunked_attn):
/// (range.len(),). Each chunk's rows come from the attention-rows kernel
/// (f32 logits, f64 normaliser) over the chunk's keys plus one zero key per
/// padded slot: logit 0 where kvpress has −1e-9, a relative difference of
/// 1e-9 in those weights, below f32 resolution. The padded query rows (logit
/// 0 on every real key) add pad/(n + pad·e^(−1e-9)) to each real key.
pub fn chunked_attention(
    ctx: &PrefillCtx,
    h: usize,
    range: std::ops::Range<usize>,
    chunk: usize,
) -> Vec<f64> {
    let (g, d) = (h / ctx.group(), ctx.head_dim());
    let s = range.len();
    let mut out = vec![0f64; s];
    for c0 in (0..s).step_by(chunk) {
        let c1 = (c0 + chunk).min(s);
        let (n, pad) = (c1 - c0, chunk - (c1 - c0));
        // (n, d) queries; (n + pad, d) keys, the padded ones zero
        let q: Vec<f32> = (c0..c1)
            .flat_map(|j| ctx.query(h, range.start + j).iter().copied())
            .collect();
        let mut keys: Vec<f32> = (c0..c1)
            .flat_map(|i| ctx.key(g, range.start + i).iter().copied())
            .collect();
        keys.resize((n + pad) * d, 0.0);
        let mut rows = vec![0f32; n * (n + pad)];
        kvreplay_kernels::cpu::attention_rows(
            &q,
            &keys,
            d,
            &vec![n + pad; n],
            &vec![1.0; n],
            1.0,
            &mut rows,
        );
        for row in rows.chunks_exact(n + pad) {
            out[c0..c1]
                .iter_mut()
                .zip(row)
                .for_each(|(o, x)| *o += *x as f64);
        }
        if pad > 0 {
            let extra = pad as f64 / (n as f64 + pad as f64 * PAD_LOGIT.exp());
            out[c0..c1].iter_mut().for_each(|o| *o += extra);
        }
    }
    out
}

impl Compactor {
    /// The scored positions: between the kept first and last ones.
    fn middle(&self, p: usize) -> std::ops::Range<usize> {
        let left = self.sink_start.min(p);
        let right = self.sink_end.min(p - left);
        left..p - right
    }

    /// Per KV head, z-scored leverage and attention of the middle positions.
    fn layer_parts(&self, ctx: &PrefillCtx) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let range = self.middle(ctx.prompt_len());
        let nkv = ctx.n_kv_heads();
        let lev: Vec<Vec<f64>> = (0..nkv)
            .map(|g| self.leverage.raw_range(ctx, g, range.clone()))
            .collect();
        let gs = ctx.group();
        let att: Vec<Vec<f64>> = (0..nkv)
            .map(|g| {
                let mut a = vec![0f64; range.len()];
                for h in g * gs..(g + 1) * gs {
                    let c = chunked_attention(ctx, h, range.clone(), self.chunk);
                    a.iter_mut().zip(c).for_each(|(x, y)| *x += y / gs as f64);
                }
                let weighted: Vec<f64> = a
                    .iter()
                    .zip(range.clone())
                    .map(|(x, i)| {
                        let v = ctx.value(g, i);
                        x * v.iter().map(|&y| (y as f64).powi(2)).sum::<f64>().sqrt()
                    })
                    .collect();
                // avg_pool1d(kernel 3, padding 1): zero padding counted
                let n = weighted.len();
                (0..n)
                    .map(|i| {
                        weighted[i.saturating_sub(1)..(i + 2).min(n)]
                            .iter()
                            .sum::<f64>()
                            / 3.0
                    })
                    .collect()
            })
            .collect();
        (zscore(&lev), zscore(&att))
    }
}

/// Memo key of a layer's z-scored parts.
#[derive(Debug, PartialEq)]
struct LayerParts {
    sink_start: usize,
    sink_end: usize,
    chunk: usize,
    leverage: Leverage,
}
impl crate::memo::MemoKey for LayerParts {
    type Value = (Vec<Vec<f32>>, Vec<Vec<f32>>);
}

impl Scorer for Compactor {
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let p = ctx.prompt_len();
        let range = self.middle(p);
        if range.is_empty() {
            return vec![0.0; p];
        }
        // Budget-independent parts: computed once per trace and layer in a sweep.
        let key = LayerParts {
            sink_start: self.sink_start,
            sink_end: self.sink_end,
            chunk: self.chunk,
            leverage: self.leverage,
        };
        let parts = ctx.memo(key, || self.layer_parts(ctx));
        let blending = self.blending.unwrap_or(1.0 - ctx.budget as f64 / p as f64) as f32;
        let mid: Vec<f32> = parts.0[u.kv_head]
            .iter()
            .zip(&parts.1[u.kv_head])
            .map(|(l, a)| blending * l + a)
            .collect();
        // kvpress pads the kept ends with the maximum score
        let top = mid.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut out = vec![top; range.start];
        out.extend(mid);
        out.resize(p, top);
        out
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(self.sink_start, self.sink_end, b))
    }
}
