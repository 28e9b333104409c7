//! Expected attention (docs/methods/expected_attention.md), kvpress
//! `ExpectedAttentionPress` (NVIDIA/kvpress 0.5.4, unchanged since): the
//! attention future queries are expected to pay each key, from the statistics
//! of the prompt's queries.
//!
//! Per query head h: the prompt queries of positions n_sink..P, rotated back to
//! pre-RoPE (the trace holds post-RoPE queries), give a mean μ_h (d,) and a
//! covariance Σ_h (d, d) (divided by P − n_sink). R (d, d) is the RoPE rotation
//! averaged over the next n_future positions P..P+n_future−1; μ' = Rμ,
//! Σ' = RΣRᵀ. For the (post-RoPE) keys k_i, i in n_sink..P:
//! z_{h,i} = k_i·μ'_h/√d + k_iᵀΣ'_h k_i/(2d), a_{h,·} = softmax_i(z_{h,·});
//! the score is the group mean of a_{h,i}, plus ε, times ‖v_i‖₂. The first
//! n_sink positions are always kept. Keep the top B per KV head. Prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::PrefillCtx;
use crate::scorer::{Scorer, Unit};
use crate::select::Protect;
use crate::ReplayError;
use kvreplay_kernels::cpu::{rope_table, rotate_with_table, RopeParams, RopeStyle};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "expected_attention",
    summary: "keeps the keys future queries are expected to attend to (softmax of k·Rμ/√d + kᵀRΣRᵀk/2d from the prompt queries' mean and covariance, RoPE averaged over the next positions) times ‖v‖; sinks kept; prefill only",
    paper: "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution (Devoto, Jeblick and Jégou, arXiv 2510.00636); kvpress ExpectedAttentionPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "n_future", default: "512", kind: Kind::Int, help: "future positions the RoPE rotation is averaged over (kvpress n_future_positions)" },
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "first positions always kept and left out of the query statistics and the softmax" },
        ParamInfo { name: "use_covariance", default: "true", kind: Kind::Bool, help: "add the covariance term kᵀΣ'k/2d" },
        ParamInfo { name: "use_vnorm", default: "true", kind: Kind::Bool, help: "multiply (score + epsilon) by ‖v‖₂" },
        ParamInfo { name: "epsilon", default: "0", kind: Kind::Float, help: "added to the expected attention before the value-norm weighting" },
    ],
    caps: Caps::EVICT_PREFILL,
    test: "expected_attention_scores_by_the_query_statistics",
    build: Build::Scorer(|p| {
        let n_future = p.int("n_future")?;
        if n_future == 0 {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "n_future".into(),
                value: "0".into(),
                msg: "the rotation is averaged over at least one future position".into(),
            });
        }
        let epsilon = p.float("epsilon")?;
        if !epsilon.is_finite() {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "epsilon".into(),
                value: epsilon.to_string(),
                msg: "must be a finite number".into(),
            });
        }
        Ok(Arc::new(ExpectedAttention {
            n_future,
            n_sink: p.int("n_sink")?,
            use_covariance: p.bool("use_covariance")?,
            use_vnorm: p.bool("use_vnorm")?,
            epsilon,
        }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpectedAttention {
    pub n_future: usize,
    pub n_sink: usize,
    pub use_covariance: bool,
    pub use_vnorm: bool,
    pub epsilon: f64,
}

/// The RoPE rotation averaged over positions `from..from + n`: (d, d)
/// row-major, identity where nothing rotates (no RoPE, unrotated tail dims).
/// Each rotated pair (a, b) contributes [[c̄, −s̄], [s̄, c̄]] with c̄, s̄ the mean
/// cosine and sine of its angles (kvpress: R = mean_t(cos_t·I + sin_t·P)).
pub fn mean_rotation(rope: Option<&RopeParams>, d: usize, from: usize, n: usize) -> Vec<f64> {
    let mut r = vec![0f64; d * d];
    (0..d).for_each(|i| r[i * d + i] = 1.0);
    let Some(rp) = rope else { return r };
    let half = rp.rotated_dims / 2;
    for i in 0..half {
        let (a, b) = match rp.style {
            RopeStyle::Neox => (i, i + half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let (mut c, mut s) = (0f64, 0f64);
        for t in from..from + n {
            let ang = rp.angle(t, i);
            c += ang.cos();
            s += ang.sin();
        }
        let (c, s) = (c / n as f64, s / n as f64);
        r[a * d + a] = c;
        r[b * d + b] = c;
        r[a * d + b] = -s;
        r[b * d + a] = s;
    }
    r
}

impl ExpectedAttention {
    /// Expected attention of query head `h` over positions n_sink..P: (P − n_sink,).
    /// `unrope`: the layer's table undoing RoPE at positions n_sink..P.
    fn head_attention(
        &self,
        ctx: &PrefillCtx,
        h: usize,
        rot: &[f64],
        unrope: Option<&[f32]>,
    ) -> Vec<f64> {
        let (p, d, ns) = (ctx.prompt_len(), ctx.head_dim(), self.n_sink);
        let g = h / ctx.group();
        let n = p - ns;
        // pre-RoPE queries of n_sink..P: (n, d)
        let mut q32: Vec<f32> = (ns..p)
            .flat_map(|i| ctx.query(h, i).iter().copied())
            .collect();
        if let (Some(t), Some(rp)) = (unrope, ctx.rope()) {
            rotate_with_table(&mut q32, 1, d, rp.style, rp.rotated_dims, t);
        }
        let qs: Vec<f64> = q32.iter().map(|&x| x as f64).collect();
        let mut mu = vec![0f64; d];
        qs.chunks_exact(d)
            .for_each(|q| mu.iter_mut().zip(q).for_each(|(a, x)| *a += x));
        mu.iter_mut().for_each(|a| *a /= n as f64);
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let matmul = |a: &[f64], b: &[f64]| -> Vec<f64> {
            let mut out = vec![0f64; d * d];
            for r in 0..d {
                for k in 0..d {
                    let x = a[r * d + k];
                    out[r * d..(r + 1) * d]
                        .iter_mut()
                        .zip(&b[k * d..(k + 1) * d])
                        .for_each(|(o, y)| *o += x * y);
                }
            }
            out
        };
        let mu_r: Vec<f64> = (0..d).map(|r| dot(&rot[r * d..(r + 1) * d], &mu)).collect();
        // Σ' = R Σ Rᵀ, Σ = Σ_i (q_i − μ)(q_i − μ)ᵀ / (P − n_sink)
        let cov_r = self.use_covariance.then(|| {
            let mut cov = vec![0f64; d * d];
            let mut c = vec![0f64; d];
            for q in qs.chunks_exact(d) {
                c.iter_mut()
                    .zip(q)
                    .zip(&mu)
                    .for_each(|((c, x), m)| *c = x - m);
                for a in 0..d {
                    let x = c[a];
                    cov[a * d..(a + 1) * d]
                        .iter_mut()
                        .zip(&c)
                        .for_each(|(o, y)| *o += x * y);
                }
            }
            cov.iter_mut().for_each(|x| *x /= n as f64);
            let mut rt = vec![0f64; d * d];
            for a in 0..d {
                for b in 0..d {
                    rt[a * d + b] = rot[b * d + a];
                }
            }
            matmul(&matmul(rot, &cov), &rt)
        });
        let sqrt_d = (d as f64).sqrt();
        let (mut k, mut ck) = (vec![0f64; d], vec![0f64; d]);
        let z: Vec<f64> = (ns..p)
            .map(|i| {
                k.iter_mut()
                    .zip(ctx.key(g, i))
                    .for_each(|(a, x)| *a = *x as f64);
                let mut z = dot(&k, &mu_r) / sqrt_d;
                if let Some(c) = &cov_r {
                    // Σ'k as a sum of rows (Σ' is symmetric): vectorisable
                    ck.fill(0.0);
                    for (r, &x) in k.iter().enumerate() {
                        ck.iter_mut()
                            .zip(&c[r * d..(r + 1) * d])
                            .for_each(|(o, y)| *o += x * y);
                    }
                    z += dot(&k, &ck) / d as f64 / 2.0;
                }
                z
            })
            .collect();
        let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|x| (x - mx).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|x| x / sum).collect()
    }

    /// Scores of KV head `g`'s positions (P,): the sinks score above every other.
    fn compute(&self, ctx: &PrefillCtx, g: usize) -> Vec<f32> {
        let (p, ns) = (ctx.prompt_len(), self.n_sink);
        if p <= ns {
            // kvpress asserts P > n_sink; nothing to score (the sinks cover the prompt)
            return vec![0.0; p];
        }
        let rot = mean_rotation(ctx.rope().as_ref(), ctx.head_dim(), p, self.n_future);
        // one table for the layer (the same rotation as RopeCache, bit for bit)
        let unrope = ctx.rope().map(|rp| rope_table(p - ns, ns, &rp, -1.0));
        let gs = ctx.group();
        let mut mean = vec![0f64; p - ns];
        for h in g * gs..(g + 1) * gs {
            let a = self.head_attention(ctx, h, &rot, unrope.as_deref());
            mean.iter_mut()
                .zip(a)
                .for_each(|(m, x)| *m += x / gs as f64);
        }
        let s: Vec<f64> = mean
            .iter()
            .enumerate()
            .map(|(j, &a)| {
                if self.use_vnorm {
                    let v = ctx.value(g, ns + j);
                    let norm = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
                    (a + self.epsilon) * norm
                } else {
                    a
                }
            })
            .collect();
        let top = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut out = vec![(top + 1.0) as f32; ns];
        out.extend(s.iter().map(|&x| x as f32));
        out
    }
}

/// Memo key of one KV head's scores.
#[derive(Debug, PartialEq)]
struct HeadScores(ExpectedAttention, usize);
impl crate::memo::MemoKey for HeadScores {
    type Value = Vec<f32>;
}

impl Scorer for ExpectedAttention {
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        // Budget-independent: computed once per trace, layer and KV head in a sweep.
        ctx.memo(HeadScores(*self, u.kv_head), || {
            self.compute(ctx, u.kv_head)
        })
        .as_ref()
        .clone()
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(self.n_sink, 0, b))
    }
}
