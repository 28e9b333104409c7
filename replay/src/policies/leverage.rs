//! Leverage (docs/methods/leverage.md), kvpress `LeverageScorePress` after
//! Compactor: approximate statistical leverage of the pre-RoPE keys. Per KV
//! head, the keys are rotated back to pre-RoPE, centred over the prompt and
//! sketched with a seeded Gaussian d × m matrix Φ/√m (X = (K − mean)·Φ); the
//! score of position i is x_iᵀ(XᵀX + λI)⁻¹x_i (Cholesky, λ = 0.01, ×10 while
//! the factorisation fails, as kvpress), clamped at 0, then z-scored over the
//! layer's KV heads and positions. Keep the top B per KV head; no attention,
//! window or sinks. Prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{PrefillCtx, SplitMix64};
use crate::scorer::{Scorer, Unit};
use crate::ReplayError;
use kvreplay_kernels::cpu::RopeCache;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "leverage",
    summary: "keeps the keys with the highest approximate leverage (Gaussian-sketched, centred pre-RoPE keys); query-agnostic; prefill only",
    paper: "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores (Chari and Van Durme, arXiv 2507.08143); kvpress LeverageScorePress (NVIDIA/kvpress 0.5)",
    params: &[
        ParamInfo { name: "sketch", default: "48", kind: Kind::Int, help: "columns of the Gaussian sketch (kvpress sketch_dimension)" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed of the sketch (one matrix per layer and KV head)" },
    ],
    caps: Caps { approximation: Some("a seeded Gaussian sketch where kvpress draws an unseeded one (same distribution, reproducible)"), ..Caps::EVICT_PREFILL },
    test: "leverage_keeps_the_outlying_keys",
    build: Build::Scorer(|p| {
        let sketch = p.int("sketch")?;
        if sketch == 0 {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "sketch".into(),
                value: "0".into(),
                msg: "the sketch needs at least one column".into(),
            });
        }
        Ok(Arc::new(Leverage { sketch, seed: p.int("seed")? as u64 }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leverage {
    pub sketch: usize,
    pub seed: u64,
}

/// A standard normal from two uniforms (Box–Muller, the cosine branch).
fn normal(r: &mut SplitMix64) -> f64 {
    let u1 = 1.0 - r.next_f64(); // (0, 1]
    let u2 = r.next_f64();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Lower Cholesky factor of the m × m matrix `a` (row-major), None if not
/// positive definite.
fn cholesky(a: &[f64], m: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; m * m];
    for i in 0..m {
        for j in 0..=i {
            let s: f64 = a[i * m + j] - (0..j).map(|k| l[i * m + k] * l[j * m + k]).sum::<f64>();
            if i == j {
                if s <= 0.0 || !s.is_finite() {
                    return None;
                }
                l[i * m + i] = s.sqrt();
            } else {
                l[i * m + j] = s / l[j * m + j];
            }
        }
    }
    Some(l)
}

impl Leverage {
    /// Raw leverage scores of KV head `g`'s prompt positions.
    pub fn raw(&self, ctx: &PrefillCtx, g: usize) -> Vec<f64> {
        self.raw_range(ctx, g, 0..ctx.prompt_len())
    }

    /// Raw leverage scores of KV head `g`'s prompt positions `range` (keys
    /// centred over `range`; Compactor scores the positions between its
    /// sinks), (range.len(),).
    pub fn raw_range(&self, ctx: &PrefillCtx, g: usize, range: std::ops::Range<usize>) -> Vec<f64> {
        let (p, d, m) = (range.len(), ctx.head_dim(), self.sketch);
        let rope = ctx.rope().map(RopeCache::new);
        // pre-RoPE keys, centred over the positions scored
        let mut keys: Vec<Vec<f64>> = range
            .map(|i| {
                let mut k = ctx.key(g, i).to_vec();
                if let Some(r) = &rope {
                    r.rotate(&mut k, i, -1.0);
                }
                k.iter().map(|&x| x as f64).collect()
            })
            .collect();
        let mut mean = vec![0f64; d];
        for k in &keys {
            mean.iter_mut().zip(k).for_each(|(a, x)| *a += x);
        }
        mean.iter_mut().for_each(|a| *a /= p as f64);
        for k in &mut keys {
            k.iter_mut().zip(&mean).for_each(|(x, a)| *x -= a);
        }
        // Φ: d × m, row-major, N(0, 1)/√m
        let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), g);
        let phi: Vec<f64> = (0..d * m)
            .map(|_| normal(&mut rng) / (m as f64).sqrt())
            .collect();
        let x: Vec<Vec<f64>> = keys
            .iter()
            .map(|k| {
                (0..m)
                    .map(|c| (0..d).map(|r| k[r] * phi[r * m + c]).sum())
                    .collect()
            })
            .collect();
        let mut gram = vec![0f64; m * m];
        for row in &x {
            for a in 0..m {
                for b in 0..m {
                    gram[a * m + b] += row[a] * row[b];
                }
            }
        }
        let mut jitter = 1e-2;
        let mut l = None;
        for _ in 0..5 {
            let mut a = gram.clone();
            (0..m).for_each(|i| a[i * m + i] += jitter);
            l = cholesky(&a, m);
            if l.is_some() {
                break;
            }
            jitter *= 10.0;
        }
        let Some(l) = l else {
            // kvpress raises here; a degenerate head scores all equal
            return vec![0.0; p];
        };
        // x_iᵀ (LLᵀ)⁻¹ x_i = ‖L⁻¹ x_i‖²
        x.iter()
            .map(|row| {
                let mut y = vec![0f64; m];
                for i in 0..m {
                    let s: f64 = row[i] - (0..i).map(|k| l[i * m + k] * y[k]).sum::<f64>();
                    y[i] = s / l[i * m + i];
                }
                y.iter().map(|v| v * v).sum::<f64>().max(0.0)
            })
            .collect()
    }

    /// Every KV head's scores, z-scored over the layer (kvpress normalises
    /// over the whole (batch, KV head, position) tensor).
    fn layer_scores(&self, ctx: &PrefillCtx) -> Vec<Vec<f32>> {
        let raw: Vec<Vec<f64>> = (0..ctx.n_kv_heads()).map(|g| self.raw(ctx, g)).collect();
        zscore(&raw)
    }
}

/// Scores z-scored over every head and position together (kvpress's
/// `(s − s.mean()) / s.std().clamp_min(1e-6)`, unbiased std): (heads, n).
pub fn zscore(raw: &[Vec<f64>]) -> Vec<Vec<f32>> {
    let all: Vec<f64> = raw.iter().flatten().copied().collect();
    let n = all.len() as f64;
    let mean = all.iter().sum::<f64>() / n;
    let var = all.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let sd = var.sqrt().max(1e-6);
    raw.iter()
        .map(|r| r.iter().map(|v| ((v - mean) / sd) as f32).collect())
        .collect()
}

/// Memo key of a layer's scores.
#[derive(Debug, PartialEq)]
struct LayerLeverage(Leverage);
impl crate::memo::MemoKey for LayerLeverage {
    type Value = Vec<Vec<f32>>;
}

impl Scorer for Leverage {
    /// Keys only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        // Budget-independent: computed once per trace and layer in a sweep.
        ctx.memo(LayerLeverage(*self), || self.layer_scores(ctx))[u.kv_head].clone()
    }
}
