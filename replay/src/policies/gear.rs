//! GEAR (docs/methods/gear.md): quantisation with a low-rank and a sparse
//! correction, X ≈ Q_b(X − S) + L + S, for the prompt's keys and values of
//! every KV head.
//!
//! Rule (Kang et al. 2024, §3, eq. 4–6; opengear-project/GEAR, the KCVT
//! quantiser): on X (P, d) of one KV head,
//! 1. S: the ⌊s·P·d⌋ entries of largest magnitude (s = `outliers`; ties: the
//!    lower (position, channel) first), kept exactly; D = X − S (zeros there).
//! 2. Q_b(D): keys per channel in groups of `group` consecutive positions,
//!    values per token in groups of `group` channels (KIVI's asymmetric
//!    min-max quantiser, scale and zero in f16).
//! 3. L: the best rank-r approximation (truncated SVD) of the residual
//!    R = D − Q_b(D); X̂ = Q_b(D) + L + S.
//!
//! Cost (bits): b per element + 2·16 per quantisation group (a key group's
//! charged to its first entry) + 16 (value) + 32 (index) per outlier on its
//! entry + the factors of L in f16: r numbers per entry (the left factor)
//! and d·r on the first entry (the right factor), for the keys and for the
//! values. Budget-independent (the budget is ignored); prefill only: decode
//! entries are appended in f16 (GEAR's streaming buffer). The SVD is exact
//! (Jacobi eigen-decomposition of RᵀR in f64) where GEAR runs a few power
//! iterations from a random start (an approximation of the same SVD).

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;
use kvreplay_kernels::cpu::fake_quant;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "gear",
    summary: "quantisation + low-rank residual + sparse outliers: X ≈ Q_b(X − S) + L + S (keys per channel, values per token); budget-independent",
    paper: "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative Inference of LLM (Kang et al., arXiv 2403.05527); opengear-project/GEAR",
    params: &[
        ParamInfo { name: "bits", default: "4", kind: Kind::Choice(&["2", "3", "4", "8"]), help: "bits of the quantised bulk" },
        ParamInfo { name: "group", default: "64", kind: Kind::Int, help: "quantisation group: positions per key group (per channel), channels per value group (per token)" },
        ParamInfo { name: "rank", default: "4", kind: Kind::Int, help: "rank r of the residual's approximation (the reference scripts' prefill rank)" },
        ParamInfo { name: "outliers", default: "0.02", kind: Kind::Float, help: "fraction s of entries kept exactly as sparse outliers" },
    ],
    caps: Caps {
        family: Family::LowRank,
        phase: Phase::Prefill,
        quantises: true,
        memory: Memory::Beyond("every position at a fixed precision plus low-rank and sparse corrections: its memory is set by them, not by B"),
        exact_when_covering: false,
        approximation: Some("exact truncated SVD of the residual where GEAR runs a few power iterations from a random start; the factors are charged as f16 but not rounded; prefill only (decode entries f16, GEAR's streaming buffer)"),
        ..Caps::EVICT_PREFILL
    },
    test: "gear_restores_outliers_and_the_low_rank_residual",
    build: Build::Policy(|p| {
        let group = p.int_positive("group", "must be at least 1")?;
        let outliers = p.float_in("outliers", 0.0, 1.0)?;
        Ok(Arc::new(Gear {
            bits: p.word("bits").parse().expect("validated choice"),
            group,
            rank: p.int("rank")?,
            outliers,
        }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gear {
    pub bits: u32,
    pub group: usize,
    pub rank: usize,
    pub outliers: f64,
}

/// Memo key: a layer's caches depend on the parameters only.
#[derive(Debug, PartialEq)]
struct GearCaches(Gear);
impl crate::memo::MemoKey for GearCaches {
    type Value = Vec<HeadCache>;
}

/// Eigen-decomposition of the symmetric n × n matrix `a` (row-major) by
/// cyclic Jacobi rotations: (eigenvalues, eigenvectors as columns of a
/// row-major n × n matrix).
pub fn jacobi_eigen(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0f64; n * n];
    (0..n).for_each(|i| v[i * n + i] = 1.0);
    for _sweep in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum();
        let total: f64 = a.iter().map(|x| x * x).sum();
        // converged: off-diagonal mass below 1e-24 of the total (relative 1e-12)
        if off <= 1e-24 * total || total == 0.0 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                // negligible against its diagonal: rotating changes nothing in f64
                if apq.abs() <= 1e-18 * (a[p * n + p].abs() + a[q * n + q].abs()) {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}

/// The best rank-`r` approximation of `r_mat` (n, d), row-major, in f64.
pub fn low_rank(r_mat: &[f64], n: usize, d: usize, r: usize) -> Vec<f64> {
    let r = r.min(d).min(n);
    if r == 0 || n == 0 {
        return vec![0.0; n * d];
    }
    // RᵀR (d, d)
    let mut g = vec![0f64; d * d];
    for row in r_mat.chunks(d) {
        for a in 0..d {
            for b in a..d {
                g[a * d + b] += row[a] * row[b];
            }
        }
    }
    for a in 0..d {
        for b in 0..a {
            g[a * d + b] = g[b * d + a];
        }
    }
    let (eval, evec) = jacobi_eigen(g, d);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| eval[b].total_cmp(&eval[a]).then(a.cmp(&b)));
    let top = &order[..r];
    // L = R V_r V_rᵀ
    let mut out = vec![0f64; n * d];
    for (row, o) in r_mat.chunks(d).zip(out.chunks_mut(d)) {
        for &c in top {
            let coef: f64 = (0..d).map(|k| row[k] * evec[k * d + c]).sum();
            for k in 0..d {
                o[k] += coef * evec[k * d + c];
            }
        }
    }
    out
}

impl Gear {
    /// X̂ of one matrix (P, d) and the bits it costs per entry.
    fn approximate(
        &self,
        x: &[f32],
        p: usize,
        d: usize,
        per_channel: bool,
    ) -> (Vec<f32>, Vec<u64>) {
        let n = p * d;
        let mut bits = vec![0u64; p];
        // 1. outliers by |x|, ties: lower flat index
        let k = ((self.outliers * n as f64).floor() as usize).min(n);
        let mut order: Vec<usize> = (0..n).collect();
        let by_size = |a: &usize, b: &usize| x[*b].abs().total_cmp(&x[*a].abs()).then(a.cmp(b));
        if k > 0 && k < n {
            // the k first in that total order, in O(n)
            order.select_nth_unstable_by(k - 1, by_size);
        }
        let mut is_out = vec![false; n];
        for &i in &order[..k] {
            is_out[i] = true;
            bits[i / d] += F16_BITS + 32;
        }
        let dmat: Vec<f32> = x
            .iter()
            .zip(&is_out)
            .map(|(v, o)| if *o { 0.0 } else { *v })
            .collect();
        // 2. quantise D
        let mut q = dmat.clone();
        let b = self.bits as u64;
        if per_channel {
            let mut start = 0;
            while start < p {
                let end = (start + self.group).min(p);
                for ch in 0..d {
                    let mut col: Vec<f32> = (start..end).map(|e| q[e * d + ch]).collect();
                    fake_quant(&mut col, self.bits);
                    for (i, e) in (start..end).enumerate() {
                        q[e * d + ch] = col[i];
                    }
                }
                bits[start] += 2 * F16_BITS * d as u64;
                start = end;
            }
        } else {
            for row in q.chunks_mut(d) {
                for g in row.chunks_mut(self.group) {
                    fake_quant(g, self.bits);
                }
            }
            bits.iter_mut()
                .for_each(|x| *x += 2 * F16_BITS * d.div_ceil(self.group) as u64);
        }
        bits.iter_mut().for_each(|x| *x += b * d as u64);
        // 3. low-rank residual
        let resid: Vec<f64> = dmat
            .iter()
            .zip(&q)
            .map(|(a, b)| *a as f64 - *b as f64)
            .collect();
        let l = low_rank(&resid, p, d, self.rank);
        let r = self.rank.min(d).min(p) as u64;
        bits.iter_mut().for_each(|x| *x += r * F16_BITS);
        if p > 0 {
            bits[0] += d as u64 * r * F16_BITS;
        }
        let out = (0..n)
            .map(|i| {
                let s = if is_out[i] { x[i] } else { 0.0 };
                (q[i] as f64 + l[i] + s as f64) as f32
            })
            .collect();
        (out, bits)
    }

    fn caches(&self, ctx: &PrefillCtx) -> Vec<HeadCache> {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        (0..ctx.n_kv_heads())
            .map(|g| {
                let mut c = ctx.full_cache(g);
                let (k, kb) = self.approximate(&c.keys, p, d, true);
                let (v, vb) = self.approximate(&c.values, p, d, false);
                c.keys = k.into();
                c.values = v.into();
                c.bits = kb.iter().zip(&vb).map(|(a, b)| a + b).collect();
                c
            })
            .collect()
    }
}

impl Policy for Gear {
    fn name(&self) -> String {
        "gear".into()
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
        let caches = ctx.memo(GearCaches(*self), || self.caches(ctx));
        Ok(((*caches).clone(), Box::new(AppendOnly)))
    }
}
