//! xKV: cross-layer SVD. The prompt keys (pre-RoPE) of G adjacent layers,
//! concatenated over layers and KV heads, share one token basis; so do their
//! values (docs/methods/xkv.md).
//!
//! Rule, per group of G layers and tensor X ∈ {K, V} (prefill, P > B):
//!   X = [X_l1 | … | X_lG] ∈ R^{P × n}, n = G·H_kv·d (column (i, g, c) =
//!   layer i, KV head g, channel c; keys rotated back to pre-RoPE);
//!   X ≈ A·F with A = U_r (P × r, the top r left singular vectors) and
//!   F = Σ_r V_rᵀ (r × n), both stored in f16; each layer's keys are read
//!   back from its columns of A·F (keys re-rotated). Decode entries are
//!   appended exact (xKV compresses the prefill).
//!
//! SVD: the symmetric eigen-decomposition, in f64, of the smaller Gram
//! matrix (X Xᵀ when P ≤ n, else Xᵀ X; Householder tridiagonalisation and
//! implicit QL, as EISPACK tred2/tql2), memoised per trace and group; from
//! Xᵀ X, A = X V_r Σ_r⁻¹.
//!
//! Budget (our choice; the paper fixes ranks): the group's factors cost
//! 16·(r_k + r_v)·(P + n) bits against 2·16·B·n for B exact entries per KV
//! head and layer, so R = ⌊2·B·n / (P + n)⌋, r_v = R − r_k with
//! r_k = ⌊(1 − v_share)·R⌋ (v_share 0.6: the paper's k:v ranks 2:3), each at
//! most min(P, n). P ≤ B keeps every entry exact. Bits: the group's factor
//! bits spread evenly over its prompt entries (in layer, head, position
//! order, the first ones taking the remainder: the sum is exact).

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{prefill_alone, DecodeState, GroupDecodeState, PerLayer, Policy, PrefillCtx};
use crate::ReplayError;
use kvreplay_kernels::cpu::RopeCache;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "xkv",
    summary: "cross-layer SVD: the prompt keys (pre-RoPE) and values of G adjacent layers share one rank-r token basis, stored as f16 factors",
    paper: "xKV: Cross-Layer SVD for KV-Cache Compression (Chang et al., arXiv 2503.18893); abdelfattah-lab/xKV",
    params: &[
        ParamInfo { name: "group", default: "4", kind: Kind::Int, help: "G: adjacent layers sharing one basis (the paper's xKV-4; 1 = per-layer SVD)" },
        ParamInfo { name: "rank_k", default: "budget", kind: Kind::IntOr("budget"), help: "rank of the keys' factors: `budget` = from B (see the page), or a number" },
        ParamInfo { name: "rank_v", default: "budget", kind: Kind::IntOr("budget"), help: "rank of the values' factors: `budget` = from B, or a number" },
        ParamInfo { name: "v_share", default: "0.6", kind: Kind::Float, help: "share of the budget's total rank given to the values (paper's runs: 0.6)" },
    ],
    caps: Caps {
        family: Family::LowRank,
        cross_layer: true,
        approximation: Some("the budget is mapped to ranks by memory (the paper fixes the ranks); the factors are rounded to f16 from an f64 decomposition of the f32 trace"),
        ..Caps::EVICT_PREFILL
    },
    test: "xkv_reconstructs_the_shared_rank_r_basis_and_charges_its_factors",
    build: Build::Policy(|p| {
        let group = p.int_positive("group", "must be at least 1")?;
        let rank = |key: &str| -> Result<Option<usize>, ReplayError> {
            Ok(match p.word(key) {
                "budget" => None,
                _ => Some(p.int(key)?),
            })
        };
        Ok(Arc::new(Xkv { group, rank_k: rank("rank_k")?, rank_v: rank("rank_v")?, v_share: p.float_in("v_share", 0.0, 1.0)? }))
    }),
};

#[derive(Clone, Copy, Debug)]
pub struct Xkv {
    pub group: usize,
    /// None: from the budget.
    pub rank_k: Option<usize>,
    pub rank_v: Option<usize>,
    pub v_share: f64,
}

/// Memo key of the Gram eigen-decomposition of a group's keys or values.
#[derive(Debug, PartialEq)]
struct GramEig {
    layers: Vec<usize>,
    values: bool,
}
impl crate::memo::MemoKey for GramEig {
    type Value = Eig;
}

/// Eigen-decomposition of a symmetric m × m matrix: eigenvalues descending,
/// eigenvector j in column j of `vecs` (row-major m × m).
#[derive(Debug)]
pub struct Eig {
    pub m: usize,
    pub vals: Vec<f64>,
    pub vecs: Vec<f64>,
}

impl Xkv {
    /// (r_k, r_v) for a P-token prompt, budget B and n columns.
    pub fn ranks(&self, p: usize, b: usize, n: usize) -> (usize, usize) {
        let total = (2 * b * n) / (p + n);
        let rk = ((1.0 - self.v_share) * total as f64).floor() as usize;
        let cap = p.min(n);
        (
            self.rank_k.unwrap_or(rk).min(cap),
            self.rank_v.unwrap_or(total - rk).min(cap),
        )
    }

    fn compress(&self, ctxs: &[PrefillCtx]) -> Result<Vec<Vec<HeadCache>>, ReplayError> {
        let mut caches: Vec<Vec<HeadCache>> = ctxs.iter().map(|c| c.full_caches()).collect();
        let c0 = &ctxs[0];
        let (p, b, nkv, d) = (c0.prompt_len(), c0.budget, c0.n_kv_heads(), c0.head_dim());
        if p <= b {
            return Ok(caches);
        }
        let n = ctxs.len() * nkv * d;
        let (rk, rv) = self.ranks(p, b, n);
        let layers: Vec<usize> = ctxs.iter().map(|c| c.layer()).collect();
        let ropes: Vec<Option<RopeCache>> =
            ctxs.iter().map(|c| c.rope().map(RopeCache::new)).collect();
        for (values, r) in [(false, rk), (true, rv)] {
            // X: (P, n) f64, keys pre-RoPE
            let mut x = vec![0f64; p * n];
            for (i, c) in ctxs.iter().enumerate() {
                for g in 0..nkv {
                    for t in 0..p {
                        let mut row = if values {
                            c.value(g, t).to_vec()
                        } else {
                            c.key(g, t).to_vec()
                        };
                        if let (false, Some(rc)) = (values, &ropes[i]) {
                            rc.rotate(&mut row, t, -1.0);
                        }
                        let col = (i * nkv + g) * d;
                        for (ch, v) in row.iter().enumerate() {
                            x[t * n + col + ch] = *v as f64;
                        }
                    }
                }
            }
            let key = GramEig {
                layers: layers.clone(),
                values,
            };
            let eig = c0.memo(key, || gram_eig(&x, p, n));
            let xr = reconstruct(&x, p, n, &eig, r);
            for (i, cs) in caches.iter_mut().enumerate() {
                for (g, cache) in cs.iter_mut().enumerate() {
                    let col = (i * nkv + g) * d;
                    for t in 0..p {
                        let mut row: Vec<f32> =
                            (0..d).map(|ch| xr[t * n + col + ch] as f32).collect();
                        if values {
                            cache.value_mut(t).copy_from_slice(&row);
                        } else {
                            if let Some(rc) = &ropes[i] {
                                rc.rotate(&mut row, t, 1.0);
                            }
                            cache.keys[t * d..(t + 1) * d].copy_from_slice(&row);
                        }
                    }
                }
            }
        }
        // the factors' bits, spread over the group's prompt entries
        let total = F16_BITS * ((rk + rv) * (p + n)) as u64;
        let count = (ctxs.len() * nkv * p) as u64;
        let (base, rem) = (total / count, total % count);
        let mut idx = 0u64;
        for cs in caches.iter_mut() {
            for cache in cs.iter_mut() {
                for t in 0..p {
                    cache.bits[t] = base + u64::from(idx < rem);
                    idx += 1;
                }
            }
        }
        Ok(caches)
    }
}

/// Round to f16 (through f32) and back.
fn f16(x: f64) -> f64 {
    half::f16::from_f32(x as f32).to_f64()
}

/// Eigen-decomposition of the smaller Gram matrix of X (P × n).
fn gram_eig(x: &[f64], p: usize, n: usize) -> Eig {
    let m = p.min(n);
    let mut a = vec![0f64; m * m];
    if p <= n {
        // (X Xᵀ)_ij: dot products of rows
        for i in 0..m {
            for j in 0..=i {
                a[i * m + j] = x[i * n..(i + 1) * n]
                    .iter()
                    .zip(&x[j * n..(j + 1) * n])
                    .map(|(u, v)| u * v)
                    .sum();
            }
        }
    } else {
        // (Xᵀ X)_ij = Σ_t x_ti x_tj, accumulated row by row (contiguous):
        // four rows per pass over A, each element still adding t in order
        let mut t = 0;
        while t + 4 <= p {
            let r: [&[f64]; 4] = std::array::from_fn(|k| &x[(t + k) * n..(t + k + 1) * n]);
            for i in 0..m {
                let xi = [r[0][i], r[1][i], r[2][i], r[3][i]];
                a[i * m..i * m + i + 1]
                    .iter_mut()
                    .zip(r[0][..=i].iter().zip(&r[1][..=i]))
                    .zip(r[2][..=i].iter().zip(&r[3][..=i]))
                    .for_each(|((o, (x0, x1)), (x2, x3))| {
                        *o = (((*o + xi[0] * x0) + xi[1] * x1) + xi[2] * x2) + xi[3] * x3;
                    });
            }
            t += 4;
        }
        for t in t..p {
            let row = &x[t * n..(t + 1) * n];
            for i in 0..m {
                let xi = row[i];
                a[i * m..i * m + i + 1]
                    .iter_mut()
                    .zip(&row[..=i])
                    .for_each(|(o, xj)| *o += xi * xj);
            }
        }
    }
    for i in 0..m {
        for j in 0..i {
            a[j * m + i] = a[i * m + j];
        }
    }
    symmetric_eig(a, m)
}

/// The rank-r reconstruction A·F of X from the f16 factors A = U_r (P × r)
/// and F = Σ_r V_rᵀ (r × n). Compiled for AVX2 where the CPU has it; lanes
/// hold different sums, each adding its terms in the order written (the
/// factors' sums from −0.0, as `Iterator::sum` does; the product's from +0).
fn reconstruct(x: &[f64], p: usize, n: usize, eig: &Eig, r: usize) -> Vec<f64> {
    kvreplay_kernels::cpu::with_avx2(
        #[inline(always)]
        || reconstruct_body(x, p, n, eig, r),
    )
}

#[inline(always)]
fn reconstruct_body(x: &[f64], p: usize, n: usize, eig: &Eig, r: usize) -> Vec<f64> {
    let m = eig.m;
    // per component j: u_j (P,), f_j (n,)
    let mut a = vec![0f64; p * r];
    let mut f = vec![0f64; r * n];
    if p <= n {
        // u_j = e_j (column j of the vectors), f_j = u_jᵀ X: f_jc = Σ_t e_tj
        // x_tc over t in order, X's rows added whole
        for j in 0..r {
            let fj = &mut f[j * n..(j + 1) * n];
            fj.fill(-0.0);
            for t in 0..p {
                let e = eig.vecs[t * m + j];
                a[t * r + j] = e;
                fj.iter_mut()
                    .zip(&x[t * n..(t + 1) * n])
                    .for_each(|(o, v)| *o += e * v);
            }
        }
    } else {
        // v_j = e_j, σ_j = √λ_j, u_j = X v_j / σ_j, f_j = σ_j v_jᵀ (a
        // component of σ_j = 0 keeps u_j = f_j = 0). X v_j: per row t, Σ_c
        // x_tc e_cj over c in order, eight components side by side.
        let sigma: Vec<f64> = (0..r).map(|j| eig.vals[j].max(0.0).sqrt()).collect();
        let mut eb = vec![0f64; n * 8];
        for j0 in (0..r).step_by(8) {
            let w = (r - j0).min(8);
            // components j0 .. j0 + w of every channel, (n, 8)
            for c in 0..n {
                eb[c * 8..c * 8 + w].copy_from_slice(&eig.vecs[c * m + j0..c * m + j0 + w]);
            }
            let mut put = |t: usize, acc: &[f64; 8]| {
                for k in 0..w {
                    if sigma[j0 + k] != 0.0 {
                        a[t * r + j0 + k] = acc[k] / sigma[j0 + k];
                    }
                }
            };
            // two rows of X per pass over the packed components (a last odd row alone)
            for (i, rows) in x[..p * n].chunks(2 * n).enumerate() {
                if rows.len() == 2 * n {
                    let [s0, s1] = sums8(&eb, [&rows[..n], &rows[n..]]);
                    put(2 * i, &s0);
                    put(2 * i + 1, &s1);
                } else {
                    let [s0] = sums8(&eb, [rows]);
                    put(2 * i, &s0);
                }
            }
        }
        for j in (0..r).filter(|&j| sigma[j] != 0.0) {
            for c in 0..n {
                f[j * n + c] = sigma[j] * eig.vecs[c * m + j];
            }
        }
    }
    a.iter_mut().for_each(|v| *v = f16(*v));
    f.iter_mut().for_each(|v| *v = f16(*v));
    let mut out = vec![0f64; p * n];
    for t in 0..p {
        for j in 0..r {
            let at = a[t * r + j];
            if at != 0.0 {
                let row = &mut out[t * n..(t + 1) * n];
                row.iter_mut()
                    .zip(&f[j * n..(j + 1) * n])
                    .for_each(|(o, v)| *o += at * v);
            }
        }
    }
    out
}

/// Per row x of `xs` (n channels), the eight sums Σ_c x_c · eb[c, k] with
/// the packed components `eb` (n, 8), each over c in order from −0.0.
#[inline(always)]
fn sums8<const R: usize>(eb: &[f64], xs: [&[f64]; R]) -> [[f64; 8]; R] {
    let mut acc = [[-0.0f64; 8]; R];
    for (c, e) in eb.chunks_exact(8).enumerate() {
        for (a, x) in acc.iter_mut().zip(&xs) {
            let u = x[c];
            for k in 0..8 {
                a[k] += u * e[k];
            }
        }
    }
    acc
}

/// Eigen-decomposition of the symmetric matrix `a` (m × m, row-major):
/// Householder reduction to tridiagonal form, then the implicit QL method
/// (EISPACK tred2 and tql2). Eigenvalues sorted descending (ties: lower
/// index first), vectors in the columns.
pub fn symmetric_eig(a: Vec<f64>, m: usize) -> Eig {
    if m == 0 {
        return Eig {
            m,
            vals: Vec::new(),
            vecs: Vec::new(),
        };
    }
    // columns as contiguous rows: tred2 walks columns, and QL rotates pairs of them
    let mut vt: Vec<Vec<f64>> = (0..m)
        .map(|c| (0..m).map(|r| a[r * m + c]).collect())
        .collect();
    let mut d = vec![0f64; m];
    let mut e = vec![0f64; m];
    // compiled for AVX2 where the CPU has it (the same operations in the
    // same order; four f64 lanes instead of two)
    kvreplay_kernels::cpu::with_avx2(
        #[inline(always)]
        || {
            tred2(&mut vt, &mut d, &mut e);
            tql2(&mut vt, &mut d, &mut e);
        },
    );
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&x, &y| d[y].total_cmp(&d[x]).then(x.cmp(&y)));
    let vals = order.iter().map(|&j| d[j]).collect();
    let mut vecs = vec![0f64; m * m];
    for (jj, &j) in order.iter().enumerate() {
        for k in 0..m {
            vecs[k * m + jj] = vt[j][k];
        }
    }
    Eig { m, vals, vecs }
}

/// EISPACK tred2 on the transpose: `w[c][r]` holds element (r, c) of the
/// matrix on entry (only its lower triangle is read) and of the transform on
/// return, so the loops that walk a column of the matrix walk a contiguous
/// row of `w`. Every element sees the same operations in the same order as
/// tred2 on the matrix itself.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn tred2(w: &mut [Vec<f64>], d: &mut [f64], e: &mut [f64]) {
    let n = d.len();
    for j in 0..n {
        d[j] = w[j][n - 1];
    }
    for i in (1..n).rev() {
        let mut scale = 0f64;
        let mut h = 0f64;
        for k in 0..i {
            scale += d[k].abs();
        }
        if scale == 0.0 {
            e[i] = d[i - 1];
            for j in 0..i {
                d[j] = w[j][i - 1];
                w[j][i] = 0.0;
                w[i][j] = 0.0;
            }
        } else {
            for k in 0..i {
                d[k] /= scale;
                h += d[k] * d[k];
            }
            let mut f = d[i - 1];
            let mut g = h.sqrt();
            if f > 0.0 {
                g = -g;
            }
            e[i] = scale * g;
            h -= f * g;
            d[i - 1] = f - g;
            for j in 0..i {
                e[j] = 0.0;
            }
            for j in 0..i {
                f = d[j];
                w[i][j] = f;
                let col = &w[j];
                g = e[j] + col[j] * f;
                for k in j + 1..i {
                    g += col[k] * d[k];
                    e[k] += col[k] * f;
                }
                e[j] = g;
            }
            f = 0.0;
            for j in 0..i {
                e[j] /= h;
                f += e[j] * d[j];
            }
            let hh = f / (h + h);
            for j in 0..i {
                e[j] -= hh * d[j];
            }
            for j in 0..i {
                f = d[j];
                g = e[j];
                let col = &mut w[j];
                for k in j..i {
                    col[k] -= f * e[k] + g * d[k];
                }
                d[j] = col[i - 1];
                col[i] = 0.0;
            }
        }
        d[i] = h;
    }
    for i in 0..n - 1 {
        w[i][n - 1] = w[i][i];
        w[i][i] = 1.0;
        let h = d[i + 1];
        if h != 0.0 {
            let (lo, hi) = w.split_at_mut(i + 1);
            let next = &hi[0];
            for k in 0..=i {
                d[k] = next[k] / h;
            }
            // four columns at a time: their sums are independent chains
            let mut cols = lo.chunks_exact_mut(4);
            for c in cols.by_ref() {
                let [c0, c1, c2, c3] = c else { unreachable!() };
                let mut g = [0f64; 4];
                for k in 0..=i {
                    g[0] += next[k] * c0[k];
                    g[1] += next[k] * c1[k];
                    g[2] += next[k] * c2[k];
                    g[3] += next[k] * c3[k];
                }
                for (col, g) in [c0, c1, c2, c3].into_iter().zip(g) {
                    for k in 0..=i {
                        col[k] -= g * d[k];
                    }
                }
            }
            for col in cols.into_remainder() {
                let mut g = 0f64;
                for k in 0..=i {
                    g += next[k] * col[k];
                }
                for k in 0..=i {
                    col[k] -= g * d[k];
                }
            }
        }
        for k in 0..=i {
            w[i + 1][k] = 0.0;
        }
    }
    for j in 0..n {
        d[j] = w[j][n - 1];
        w[j][n - 1] = 0.0;
    }
    w[n - 1][n - 1] = 1.0;
    e[0] = 0.0;
}

/// `vt[j]` is column j of the tridiagonalising transform on entry and
/// eigenvector j on return.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn tql2(vt: &mut [Vec<f64>], d: &mut [f64], e: &mut [f64]) {
    let n = d.len();
    for i in 1..n {
        e[i - 1] = e[i];
    }
    e[n - 1] = 0.0;
    let mut f = 0f64;
    let mut tst1 = 0f64;
    let eps = f64::EPSILON;
    for l in 0..n {
        tst1 = tst1.max(d[l].abs() + e[l].abs());
        let mut m = l;
        while m < n {
            if e[m].abs() <= eps * tst1 {
                break;
            }
            m += 1;
        }
        if m > l {
            loop {
                let mut g = d[l];
                let mut p = (d[l + 1] - g) / (2.0 * e[l]);
                let mut r = p.hypot(1.0);
                if p < 0.0 {
                    r = -r;
                }
                d[l] = e[l] / (p + r);
                d[l + 1] = e[l] * (p + r);
                let dl1 = d[l + 1];
                let mut h = g - d[l];
                for i in l + 2..n {
                    d[i] -= h;
                }
                f += h;
                p = d[m];
                let mut c = 1f64;
                let mut c2 = c;
                let mut c3 = c;
                let el1 = e[l + 1];
                let mut s = 0f64;
                let mut s2 = 0f64;
                for i in (l..m).rev() {
                    c3 = c2;
                    c2 = c;
                    s2 = s;
                    g = c * e[i];
                    h = c * p;
                    r = p.hypot(e[i]);
                    e[i + 1] = s * r;
                    s = e[i] / r;
                    c = p / r;
                    p = c * d[i] - s * g;
                    d[i + 1] = h + s * (c * g + s * d[i]);
                    let (lo, hi) = vt.split_at_mut(i + 1);
                    for (a, b) in lo[i].iter_mut().zip(hi[0].iter_mut()) {
                        h = *b;
                        *b = s * *a + c * h;
                        *a = c * *a - s * h;
                    }
                }
                p = -s * s2 * c3 * el1 * e[l] / dl1;
                e[l] = s * p;
                d[l] = c * p;
                if e[l].abs() <= eps * tst1 {
                    break;
                }
            }
        }
        d[l] += f;
        e[l] = 0.0;
    }
}

impl Policy for Xkv {
    fn name(&self) -> String {
        "xkv".into()
    }
    /// Reads keys and values only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    /// A layer on its own: a group of one (per-layer SVD).
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        prefill_alone(self, ctx)
    }
    /// Adjacent layers, G at a time from layer 0 (the top group may be smaller).
    fn layer_groups(&self, n_layers: usize, _: usize, _: usize) -> Vec<Vec<usize>> {
        (0..n_layers)
            .collect::<Vec<_>>()
            .chunks(self.group)
            .map(|c| c.to_vec())
            .collect()
    }
    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let caches = self.compress(ctxs)?;
        Ok((caches, PerLayer::append_only(ctxs.len())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eigen_decomposition_of_a_known_matrix() {
        // [[2, 1], [1, 2]]: eigenvalues 3, 1 with vectors (1, 1)/√2, (1, −1)/√2
        let e = symmetric_eig(vec![2.0, 1.0, 1.0, 2.0], 2);
        assert!((e.vals[0] - 3.0).abs() < 1e-12 && (e.vals[1] - 1.0).abs() < 1e-12);
        let s = std::f64::consts::FRAC_1_SQRT_2;
        assert!((e.vecs[0].abs() - s).abs() < 1e-12 && (e.vecs[2].abs() - s).abs() < 1e-12);
        assert!(e.vecs[0] * e.vecs[2] > 0.0, "first vector along (1, 1)");
        // a random symmetric 6 × 6: A v = λ v for every pair, orthonormal vectors
        let mut rng = crate::policy::SplitMix64(7);
        let m = 6;
        let mut a = vec![0f64; m * m];
        for i in 0..m {
            for j in 0..=i {
                let x = rng.next_f64() - 0.5;
                a[i * m + j] = x;
                a[j * m + i] = x;
            }
        }
        let e = symmetric_eig(a.clone(), m);
        for j in 0..m {
            for i in 0..m {
                let av: f64 = (0..m).map(|k| a[i * m + k] * e.vecs[k * m + j]).sum();
                assert!((av - e.vals[j] * e.vecs[i * m + j]).abs() < 1e-12);
            }
            for k in 0..m {
                let dot: f64 = (0..m).map(|i| e.vecs[i * m + j] * e.vecs[i * m + k]).sum();
                assert!((dot - f64::from(j == k)).abs() < 1e-12);
            }
        }
        assert!(e.vals.windows(2).all(|w| w[0] >= w[1]));
    }
}
