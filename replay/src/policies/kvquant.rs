//! KVQuant-lite (docs/methods/kvquant.md): per-channel quantisation of
//! pre-RoPE keys and per-token quantisation of values with non-uniform
//! codebooks and dense-and-sparse outliers.
//!
//! Rule (Hooper et al. 2024, §3.1–3.4), per KV head, on the prompt:
//! 1. Keys are rotated back to pre-RoPE (the trace's RoPE parameters; stored
//!    keys as they are when the trace has none).
//! 2. The first `n_sink` positions stay in f16 (attention-sink-aware).
//! 3. Outliers: the ⌊o·n⌋ entries of largest magnitude among the other
//!    positions' n entries (keys and values separately) stay in f16 (dense
//!    and sparse); they are left out of the ranges and codebooks below.
//! 4. Normalisation: keys per channel, values per token, to [−1, 1] by the
//!    centre and half-range of their non-outlier entries (both in f16).
//! 5. Non-uniform codebook: 2^b centroids per KV head for keys and for
//!    values, by 1-D k-means (Lloyd) on the normalised non-outlier entries,
//!    started from the uniform grid −1 + 2i/(2^b − 1), a fixed `iters`
//!    iterations, f64; centroids stored in f16. Each entry takes its nearest
//!    centroid (ties: the lower one).
//! 6. Dequantise, restore outliers, rotate keys back to post-RoPE.
//!
//! Cost per entry: b bits per element (an outlier's slot in the dense matrix
//! included) + 16 + 32 per outlier (value and index) + for values 2·16 (centre
//! and half-range); the keys' per-channel centres and half-ranges (2·d f16)
//! and both codebooks (2·2^b f16) are charged to the first quantised entry;
//! sink entries cost f16. Budget-independent; prefill only (decode entries
//! appended in f16).

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::mikv::f16r;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;
use kvreplay_kernels::cpu::RopeCache;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "kvquant",
    summary: "KVQuant-lite: pre-RoPE keys per channel, values per token, non-uniform k-means codebooks, 1% dense-and-sparse outliers, f16 attention sink; budget-independent",
    paper: "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache Quantization (Hooper et al., NeurIPS 2024, arXiv 2401.18079); SqueezeAILab/KVQuant",
    params: &[
        ParamInfo { name: "bits", default: "3", kind: Kind::Choice(&["2", "3", "4"]), help: "bits per element (codebook of 2^bits centroids)" },
        ParamInfo { name: "outliers", default: "0.01", kind: Kind::Float, help: "fraction of entries kept in f16 (dense-and-sparse)" },
        ParamInfo { name: "n_sink", default: "1", kind: Kind::Int, help: "first positions kept in f16 (attention-sink-aware)" },
        ParamInfo { name: "iters", default: "20", kind: Kind::Int, help: "k-means (Lloyd) iterations from the uniform grid" },
    ],
    caps: Caps {
        family: Family::Quantisation,
        phase: Phase::Prefill,
        quantises: true,
        memory: Memory::Beyond("every position at a fixed precision (plus dense-and-sparse outliers): its memory is set by the bit width, not by B"),
        exact_when_covering: false,
        approximation: Some("codebooks by plain k-means on the prompt's own normalised entries (the paper: Fisher-information-weighted k-means on calibration data, offline); per-KV-head codebooks; outliers by magnitude over the head's matrix, not calibrated per-vector thresholds; prefill only"),
        ..Caps::EVICT_PREFILL
    },
    test: "kvquant_quantises_pre_rope_keys_with_a_kmeans_codebook",
    build: Build::Policy(|p| {
        let iters = p.int_positive("iters", "must be at least 1")?;
        Ok(Arc::new(KvQuant {
            bits: p.word("bits").parse().expect("validated choice"),
            outliers: p.float_in("outliers", 0.0, 1.0)?,
            n_sink: p.int("n_sink")?,
            iters,
        }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvQuant {
    pub bits: u32,
    pub outliers: f64,
    pub n_sink: usize,
    pub iters: usize,
}

#[derive(Debug, PartialEq)]
struct KvQuantCaches(KvQuant);
impl crate::memo::MemoKey for KvQuantCaches {
    type Value = Vec<HeadCache>;
}

/// 1-D k-means of `x` with `k` centroids from the uniform grid on [−1, 1],
/// `iters` Lloyd iterations; an empty cluster keeps its centroid. Returns the
/// centroids (f64). In 1-D, Lloyd keeps sorted centroids sorted and the
/// nearest-centroid index is non-decreasing in the value, so on the sorted
/// data each cluster is a contiguous run, found by binary search with
/// [`nearest`] itself, and its mean comes from prefix sums: O(k² log n) per
/// iteration instead of O(n k).
pub fn kmeans_1d(x: &[f64], k: usize, iters: usize) -> Vec<f64> {
    let mut z = x.to_vec();
    z.sort_by(|a, b| a.total_cmp(b));
    let mut pre = vec![0f64; z.len() + 1];
    for (i, v) in z.iter().enumerate() {
        pre[i + 1] = pre[i] + v;
    }
    let mut c: Vec<f64> = (0..k)
        .map(|i| -1.0 + 2.0 * i as f64 / (k - 1) as f64)
        .collect();
    for _ in 0..iters {
        let starts: Vec<usize> = (0..=k)
            .map(|j| z.partition_point(|&v| nearest(&c, v) < j))
            .collect();
        for j in 0..k {
            let (a, b) = (starts[j], starts[j + 1]);
            if b > a {
                c[j] = (pre[b] - pre[a]) / (b - a) as f64;
            }
        }
    }
    c
}

/// Index of the centroid nearest to `v` (ties: the lower index).
pub fn nearest(c: &[f64], v: f64) -> usize {
    let mut best = 0;
    for j in 1..c.len() {
        if (v - c[j]).abs() < (v - c[best]).abs() {
            best = j;
        }
    }
    best
}

impl KvQuant {
    /// Quantise the rows `s..p` of `x` (p, d) in f64: per channel
    /// (`per_channel`) or per token; returns the rows and each row's bits.
    fn quantise(&self, x: &mut [f64], p: usize, d: usize, per_channel: bool) -> Vec<u64> {
        let s = self.n_sink.min(p);
        let mut bits = vec![d as u64 * F16_BITS; p];
        if s == p {
            return bits;
        }
        let body = s * d..p * d;
        let n = body.len();
        // outliers: the ⌊o·n⌋ largest |x| (ties: lower index)
        let k = ((self.outliers * n as f64).floor() as usize).min(n);
        let mut order: Vec<usize> = body.clone().collect();
        let by_size = |a: &usize, b: &usize| x[*b].abs().total_cmp(&x[*a].abs()).then(a.cmp(b));
        if k > 0 && k < n {
            order.select_nth_unstable_by(k - 1, by_size);
        }
        let mut out = vec![false; p * d];
        order[..k].iter().for_each(|&i| out[i] = true);
        // normalisation vectors: (centre, half-range) per channel or per token
        let vecs: Vec<Vec<usize>> = if per_channel {
            (0..d)
                .map(|c| (s..p).map(|t| t * d + c).collect())
                .collect()
        } else {
            (s..p).map(|t| (t * d..(t + 1) * d).collect()).collect()
        };
        let mut norm = vec![(0f64, 1f64); p * d];
        let mut z = Vec::with_capacity(n);
        for v in &vecs {
            let inl: Vec<f64> = v.iter().filter(|&&i| !out[i]).map(|&i| x[i]).collect();
            let (mn, mx) = inl
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &y| {
                    (a.min(y), b.max(y))
                });
            let (centre, half) = if inl.is_empty() {
                (0.0, 1.0)
            } else {
                let h = f16r(((mx - mn) / 2.0) as f32) as f64;
                (
                    f16r(((mx + mn) / 2.0) as f32) as f64,
                    if h > 0.0 { h } else { 1.0 },
                )
            };
            for &i in v {
                norm[i] = (centre, half);
                if !out[i] {
                    z.push((x[i] - centre) / half);
                }
            }
        }
        let levels = 1usize << self.bits;
        let cb: Vec<f64> = kmeans_1d(&z, levels, self.iters)
            .iter()
            .map(|c| f16r(*c as f32) as f64)
            .collect();
        for i in body {
            if !out[i] {
                let (centre, half) = norm[i];
                x[i] = cb[nearest(&cb, (x[i] - centre) / half)] * half + centre;
            }
        }
        for (t, b) in bits.iter_mut().enumerate().skip(s) {
            *b = self.bits as u64 * d as u64 + if per_channel { 0 } else { 2 * F16_BITS };
            *b += (t * d..(t + 1) * d).filter(|&i| out[i]).count() as u64 * (F16_BITS + 32);
        }
        bits[s] += if per_channel {
            2 * d as u64 * F16_BITS
        } else {
            0
        } + levels as u64 * F16_BITS;
        bits
    }

    fn caches(&self, ctx: &PrefillCtx) -> Vec<HeadCache> {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let rope = ctx.rope().map(RopeCache::new);
        (0..ctx.n_kv_heads())
            .map(|g| {
                let mut c = ctx.full_cache(g);
                let mut k: Vec<f64> = Vec::with_capacity(p * d);
                for t in 0..p {
                    let mut row = c.key(t).to_vec();
                    if let Some(r) = &rope {
                        r.rotate(&mut row, t, -1.0);
                    }
                    k.extend(row.iter().map(|&v| v as f64));
                }
                let kb = self.quantise(&mut k, p, d, true);
                let mut v: Vec<f64> = c.values.iter().map(|&x| x as f64).collect();
                let vb = self.quantise(&mut v, p, d, false);
                let s = self.n_sink.min(p);
                for t in s..p {
                    let mut row: Vec<f32> =
                        k[t * d..(t + 1) * d].iter().map(|&x| x as f32).collect();
                    if let Some(r) = &rope {
                        r.rotate(&mut row, t, 1.0);
                    }
                    c.keys[t * d..(t + 1) * d].copy_from_slice(&row);
                }
                c.values[s * d..]
                    .iter_mut()
                    .zip(&v[s * d..])
                    .for_each(|(a, b)| *a = *b as f32);
                c.bits = kb.iter().zip(&vb).map(|(a, b)| a + b).collect();
                c
            })
            .collect()
    }
}

impl Policy for KvQuant {
    fn name(&self) -> String {
        "kvquant".into()
    }
    fn budget_independent(&self) -> bool {
        true
    }
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        // Budget-independent: built once per trace and layer in a sweep.
        let caches = ctx.memo(KvQuantCaches(*self), || self.caches(ctx));
        Ok(((*caches).clone(), Box::new(AppendOnly)))
    }
}
