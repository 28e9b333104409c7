//! Element-wise and row-wise helpers of the llama block.

use rayon::prelude::*;

use super::simd::{exp, simd_fn, Simd};

/// Elements (or rows' worth of elements) per parallel task: a fixed size, so
/// results never depend on the thread count (each element, or row, is
/// computed on its own anyway).
const CHUNK: usize = 1 << 14;

/// RMSNorm of each row of `x` (rows, dim) in place: x * w / sqrt(mean(x²) + eps).
/// The mean square is accumulated in f64: the squares of eight lanes
/// (element i into lane i mod 8), the lanes added by a fixed tree, then the
/// dim % 8 last elements in order.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert_eq!(x.len() % dim, 0, "rms_norm: x is not (rows, dim)");
    let rows = (CHUNK / dim).max(1);
    x.par_chunks_mut(rows * dim)
        .for_each(|c| rms_norm_rows(c, w, eps));
}

simd_fn! {
    fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) = rms_norm_rows_impl;
}

#[inline(always)]
fn rms_norm_rows_impl<S: Simd>(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    let body = dim - dim % 8;
    for row in x.chunks_exact_mut(dim) {
        let mut acc = (S::dzero(), S::dzero());
        for c in row[..body].chunks_exact(8) {
            // SAFETY: c holds 8 elements.
            acc = S::dacc_sq(acc, unsafe { S::load(c.as_ptr()) });
        }
        let mut ss = S::dsum(acc);
        for v in &row[body..] {
            ss += (*v as f64) * (*v as f64);
        }
        let ms = ss / dim as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        let iv = S::splat(inv);
        for (c, g) in row[..body].chunks_exact_mut(8).zip(w.chunks_exact(8)) {
            // SAFETY: c and g hold 8 elements.
            unsafe {
                let y = S::mul(S::mul(S::load(c.as_ptr()), iv), S::load(g.as_ptr()));
                S::store(c.as_mut_ptr(), y);
            }
        }
        for (v, g) in row[body..].iter_mut().zip(&w[body..]) {
            *v = *v * inv * g;
        }
    }
}

/// SwiGLU: gate[i] = silu(gate[i]) * up[i] = gate / (1 + e^(−gate)) * up, in
/// place on `gate`, in f32 with e^x by [`super::simd::exp`] (within 1.011
/// ulp; the CUDA twin computes the same function with the same operations).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    gate.par_chunks_mut(CHUNK)
        .zip(up.par_chunks(CHUNK))
        .for_each(|(g, u)| silu_mul_chunk(g, u));
}

/// GeGLU with the tanh approximation of GELU (HF `gelu_pytorch_tanh`, ggml
/// `gelu`): gate[i] = gelu(gate[i]) * up[i], in place on `gate`, where
/// gelu(x) = 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x³), computed
/// as x / (1 + e^(−2z)) (the same function: 1 + tanh(z) = 2 / (1 + e^(−2z));
/// no cancellation where tanh(z) is near −1), in f32 with e^x by
/// [`super::simd::exp`].
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    gate.par_chunks_mut(CHUNK)
        .zip(up.par_chunks(CHUNK))
        .for_each(|(g, u)| gelu_tanh_mul_chunk(g, u));
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6; // sqrt(2 / pi)

simd_fn! {
    fn silu_mul_chunk(gate: &mut [f32], up: &[f32]) = silu_mul_impl;
}

simd_fn! {
    fn gelu_tanh_mul_chunk(gate: &mut [f32], up: &[f32]) = gelu_tanh_mul_impl;
}

/// gate = act(gate) · up, eight lanes at a time, the tail padded; act is
/// GELU-tanh if `GELU`, else SiLU (direct calls: a function passed as a value
/// would not be compiled with the lanes' features).
#[inline(always)]
fn gated<S: Simd, const GELU: bool>(gate: &mut [f32], up: &[f32]) {
    #[inline(always)]
    fn f<S: Simd, const GELU: bool>(v: S::F) -> S::F {
        if GELU {
            gelu_tanh::<S>(v)
        } else {
            silu::<S>(v)
        }
    }
    let n = gate.len();
    let body = n - n % 8;
    for (g, u) in gate[..body].chunks_exact_mut(8).zip(up.chunks_exact(8)) {
        // SAFETY: g and u hold 8 elements.
        unsafe {
            let y = S::mul(f::<S, GELU>(S::load(g.as_ptr())), S::load(u.as_ptr()));
            S::store(g.as_mut_ptr(), y);
        }
    }
    if body < n {
        let (mut g, mut u) = ([0f32; 8], [0f32; 8]);
        g[..n - body].copy_from_slice(&gate[body..]);
        u[..n - body].copy_from_slice(&up[body..]);
        // SAFETY: the buffers hold 8 elements.
        unsafe {
            let y = S::mul(f::<S, GELU>(S::load(g.as_ptr())), S::load(u.as_ptr()));
            S::store(g.as_mut_ptr(), y);
        }
        gate[body..].copy_from_slice(&g[..n - body]);
    }
}

#[inline(always)]
fn silu_mul_impl<S: Simd>(gate: &mut [f32], up: &[f32]) {
    gated::<S, false>(gate, up)
}

/// g / (1 + e^(−g))
#[inline(always)]
fn silu<S: Simd>(g: S::F) -> S::F {
    S::div(g, S::add(S::splat(1.0), exp::<S>(S::sub(S::zero(), g))))
}

#[inline(always)]
fn gelu_tanh_mul_impl<S: Simd>(gate: &mut [f32], up: &[f32]) {
    gated::<S, true>(gate, up)
}

/// x / (1 + e^(−2z)), z = sqrt(2/pi)·(x + ((0.044715·x)·x)·x)
#[inline(always)]
fn gelu_tanh<S: Simd>(x: S::F) -> S::F {
    let c = S::mul(S::mul(S::mul(S::splat(0.044715), x), x), x);
    let z = S::mul(S::splat(SQRT_2_OVER_PI), S::add(x, c));
    let e = exp::<S>(S::mul(S::splat(-2.0), z));
    S::div(x, S::add(S::splat(1.0), e))
}

/// x[i] *= s, in place.
pub fn scale(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

/// Embedding lookup: row r of `out` (ids.len(), dim) is row `ids[r]` of
/// `table` (vocab, dim).
pub fn embedding(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        ids.len() * dim,
        "embedding: out is not (ids, dim)"
    );
    for (o, &id) in out.chunks_exact_mut(dim).zip(ids) {
        let id = id as usize;
        assert!(
            (id + 1) * dim <= table.len(),
            "embedding: id {id} is outside the table"
        );
        o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
    }
}

/// Index of the largest value (the first one on ties); NaNs are never chosen.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_known_values() {
        // row (3, 4): mean square 12.5 -> x / sqrt(12.5) * w
        let mut x = vec![3.0, 4.0];
        rms_norm(&mut x, &[1.0, 2.0], 0.0);
        let s = 12.5f32.sqrt();
        assert!((x[0] - 3.0 / s).abs() < 1e-6 && (x[1] - 8.0 / s).abs() < 1e-6);
    }

    #[test]
    fn silu_known_values() {
        // silu(0) = 0; silu(2) = 2 / (1 + e^-2)
        let mut g = vec![0.0, 2.0];
        silu_mul(&mut g, &[5.0, 3.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 3.0 * 2.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn gelu_tanh_known_values() {
        // gelu(0) = 0; gelu(1) = 0.5 (1 + tanh(0.7978846 * 1.044715)) = 0.841192;
        // gelu(-1) = -0.158808; gelu(3) = 0.5*3*(1 + tanh(0.7978846 * 4.206305)) = 2.996363
        let mut g = vec![0.0, 1.0, -1.0, 3.0];
        gelu_tanh_mul(&mut g, &[7.0, 1.0, 1.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 0.841_192).abs() < 1e-5, "{}", g[1]);
        assert!((g[2] + 0.158_808).abs() < 1e-5, "{}", g[2]);
        assert!((g[3] - 2.0 * 2.996_363).abs() < 1e-5, "{}", g[3]);
    }

    /// silu and gelu against f64 over [-100, 100]: within 4 ulp of the f64
    /// value (exp ≤ 1.011 ulp, then an add, a division and a product; for
    /// gelu plus the rounding of its argument z, ~12|z| ulp where the value is
    /// x·e^(2z), i.e. below -2 or so), or
    /// within 1e-35 where the result is that small (e^x overflows to +inf
    /// above x = 88.38 here, 88.72 in libm: the value is then ±0 instead of
    /// ~1e-37). The AVX2 lanes equal the portable ones bit for bit, tails
    /// included.
    #[test]
    fn gated_activations_are_accurate_and_identical_on_both_lanes() {
        use crate::cpu::simd::Portable;
        let x: Vec<f32> = (0..20011).map(|i| -100.0 + i as f32 * 0.01).collect();
        let up: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let ulp = |v: f64| (f32::from_bits((v.abs() as f32).to_bits() + 1) - v.abs() as f32) as f64;
        for (name, f64_ref) in [
            ("silu", (|x: f64| x / (1.0 + (-x).exp())) as fn(f64) -> f64),
            ("gelu", |x: f64| {
                // 0.5 x (1 + tanh z), written without tanh's cancellation
                // near z = -inf (f64's 1 + tanh(z) is 0 below z = -19)
                let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
                x / (1.0 + (-2.0 * z).exp())
            }),
        ] {
            let (mut a, mut b) = (x.clone(), x.clone());
            if name == "silu" {
                silu_mul(&mut a, &up);
                silu_mul_impl::<Portable>(&mut b, &up);
            } else {
                gelu_tanh_mul(&mut a, &up);
                gelu_tanh_mul_impl::<Portable>(&mut b, &up);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{name}: AVX2 vs portable lanes");
            for i in 0..x.len() {
                let want = f64_ref(x[i] as f64) * up[i] as f64;
                let err = (a[i] as f64 - want).abs();
                // gelu's argument 2z = 2·sqrt(2/pi)·(x + 0.044715x³) is
                // rounded ~5 times in f32: in the tail, where the result is
                // x·e^(2z), that is a relative error of ~10|z| units.
                let z = if name == "gelu" {
                    0.8 * (x[i].abs() as f64 + 0.044715 * (x[i].abs() as f64).powi(3))
                } else {
                    0.0
                };
                assert!(
                    err <= (4.0 + 12.0 * z) * ulp(want) + 1e-35,
                    "{name}({}) * {} = {} vs {want}",
                    x[i],
                    up[i],
                    a[i]
                );
            }
        }
    }

    /// rms_norm against an f64 computation; AVX2 and portable lanes equal;
    /// any thread count gives the same bits.
    #[test]
    fn rms_norm_is_accurate_and_deterministic() {
        use crate::cpu::simd::Portable;
        for dim in [576usize, 13, 8, 640] {
            let rows = 37;
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
                .collect();
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 11) as f32 / 10.0).collect();
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut y = x.clone();
                pool.install(|| rms_norm(&mut y, &w, 1e-5));
                y
            };
            let y = run(1);
            assert_eq!(y, run(3));
            let mut z = x.clone();
            rms_norm_rows_impl::<Portable>(&mut z, &w, 1e-5);
            assert_eq!(y, z, "dim {dim}: lanes");
            for (r, row) in x.chunks_exact(dim).enumerate() {
                let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
                for (j, v) in row.iter().enumerate() {
                    let want = *v as f64 / (ms + 1e-5).sqrt() * w[j] as f64;
                    let got = y[r * dim + j] as f64;
                    assert!(
                        (got - want).abs() <= 3e-7 * want.abs() + 1e-30,
                        "{got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn scale_multiplies() {
        let mut x = vec![1.0, -2.0];
        scale(&mut x, 0.5);
        assert_eq!(x, vec![0.5, -1.0]);
    }

    #[test]
    fn argmax_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }
}
