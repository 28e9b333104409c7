//! Dot products in f32 for screening: many pairs, eight to an instruction,
//! each within a stated bound of the exact value. A caller that needs the
//! largest of many exact f64 sums computes them all here, keeps the pairs
//! whose value lies within the bound of the screened largest, and sums only
//! those exactly: the largest exact sum is always among them.
//!
//! The bound: each sum here adds its d products in element order in one f32
//! accumulator (one rounding per product and per addition, or one per fused
//! multiply-add), so `|ŝ − Σ a_t b_t| ≤ γ_d · Σ |a_t b_t| + d · 2⁻¹⁴⁹` with
//! γ_d = d·u / (1 − d·u), u = 2⁻²⁴ (Higham, *Accuracy and Stability of
//! Numerical Algorithms*, §3.1; the second term covers gradual underflow).
//! Which instructions compute a sum (AVX2 or the portable loop) changes its
//! bits but not the bound.

/// Rows of `b` (n, d) stored eight to a block, each block column by column:
/// row j's element t at `(j / 8) · 8d + 8t + j % 8` (the missing rows of the
/// last block are zero).
#[derive(Clone, Debug, Default)]
pub struct Blocks8 {
    pub d: usize,
    pub n: usize,
    data: Vec<f32>,
}

/// γ_d of the module's bound: `|ŝ − s| ≤ dot_error_factor(d) · Σ |a_t b_t|`
/// (plus `d · 2⁻¹⁴⁹`) for a sum `ŝ` of d products computed here.
pub fn dot_error_factor(d: usize) -> f64 {
    let du = d as f64 * f32::EPSILON as f64 / 2.0;
    assert!(
        du < 0.5,
        "dot_error_factor: d = {d} is too long for the bound"
    );
    du / (1.0 - du)
}

impl Blocks8 {
    /// The blocks of `rows` (n, d).
    pub fn of_rows(rows: &[f32], d: usize) -> Blocks8 {
        let n = rows.len() / d.max(1);
        assert_eq!(rows.len(), n * d, "Blocks8::of_rows: rows is not (n, d)");
        let mut data = vec![0f32; n.div_ceil(8) * 8 * d];
        for (j, r) in rows.chunks_exact(d.max(1)).enumerate() {
            let base = (j / 8) * 8 * d + j % 8;
            for (t, v) in r.iter().enumerate() {
                data[base + 8 * t] = *v;
            }
        }
        Blocks8 { d, n, data }
    }

    /// `out[i · n + j]` ≈ Σ_t a_i[t] · row_j[t] within the module's bound,
    /// for every row of `a` (na, d) and every stored row j (out: (na, n)).
    pub fn dots(&self, a: &[f32], out: &mut [f32]) {
        let (d, n) = (self.d, self.n);
        let na = a.len() / d.max(1);
        assert!(
            a.len() == na * d && out.len() == na * n,
            "Blocks8::dots: shapes"
        );
        if d == 0 {
            out.fill(0.0);
            return;
        }
        let blocks = n.div_ceil(8);
        let mut put = |i: usize, b: usize, r: &[f32; 8]| {
            let j0 = 8 * b;
            match n - j0 {
                // a whole block: a copy of known length, no call
                8.. => {
                    let dst: &mut [f32; 8] = (&mut out[i * n + j0..i * n + j0 + 8])
                        .try_into()
                        .expect("eight values");
                    *dst = *r;
                }
                w => out[i * n + j0..i * n + j0 + w].copy_from_slice(&r[..w]),
            }
        };
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            let mut b = 0;
            while b < blocks {
                let w = if b + 2 <= blocks { 2 } else { 1 };
                let cols = &self.data[b * 8 * d..(b + w) * 8 * d];
                let mut i = 0;
                while i + 4 <= na {
                    let rows = &a[i * d..(i + 4) * d];
                    // SAFETY: AVX2 and FMA are present; rows holds 4 rows of
                    // d floats and cols w blocks of 8d.
                    match w {
                        2 => {
                            let mut r = [[[0f32; 8]; 2]; 4];
                            unsafe { tile_avx2::<4, 2>(rows, cols, d, &mut r) };
                            for (k, rk) in r.iter().enumerate() {
                                put(i + k, b, &rk[0]);
                                put(i + k, b + 1, &rk[1]);
                            }
                        }
                        _ => {
                            let mut r = [[[0f32; 8]; 1]; 4];
                            unsafe { tile_avx2::<4, 1>(rows, cols, d, &mut r) };
                            for (k, rk) in r.iter().enumerate() {
                                put(i + k, b, &rk[0]);
                            }
                        }
                    }
                    i += 4;
                }
                for k in i..na {
                    let row = &a[k * d..(k + 1) * d];
                    for c in 0..w {
                        // SAFETY: as above, one row and one block.
                        let mut r = [[[0f32; 8]; 1]; 1];
                        unsafe { tile_avx2::<1, 1>(row, &cols[c * 8 * d..], d, &mut r) };
                        put(k, b + c, &r[0][0]);
                    }
                }
                b += w;
            }
            return;
        }
        for b in 0..blocks {
            let col = &self.data[b * 8 * d..(b + 1) * 8 * d];
            for (i, x) in a.chunks_exact(d).enumerate() {
                let mut acc = [0f32; 8];
                for (t, xt) in x.iter().enumerate() {
                    for (l, s) in acc.iter_mut().enumerate() {
                        *s += xt * col[8 * t + l];
                    }
                }
                put(i, b, &acc);
            }
        }
    }
}

/// R rows (`a`, R · d floats) against the B consecutive blocks of `cols`
/// (B · 8d floats): per row and block the eight sums into `out`, R · B
/// independent chains of fused multiply-adds, each sum in t order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const B: usize>(
    a: &[f32],
    cols: &[f32],
    d: usize,
    out: &mut [[[f32; 8]; B]; R],
) {
    use std::arch::x86_64::*;
    debug_assert!(a.len() >= R * d && cols.len() >= B * 8 * d);
    let (ap, cp) = (a.as_ptr(), cols.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); B]; R];
    for t in 0..d {
        let mut y = [_mm256_setzero_ps(); B];
        for (c, yc) in y.iter_mut().enumerate() {
            *yc = _mm256_loadu_ps(cp.add(c * 8 * d + 8 * t));
        }
        for (r, ar) in acc.iter_mut().enumerate() {
            let xr = _mm256_broadcast_ss(&*ap.add(r * d + t));
            for (a, yc) in ar.iter_mut().zip(&y) {
                *a = _mm256_fmadd_ps(xr, *yc, *a);
            }
        }
    }
    for (or, ar) in out.iter_mut().zip(&acc) {
        for (o, a) in or.iter_mut().zip(ar) {
            _mm256_storeu_ps(o.as_mut_ptr(), *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn screened_dots_lie_within_the_bound_of_the_exact_sums() {
        use crate::cpu::dots64::test_rows::{pseudo as f, SHAPES};
        // the exact products' shapes, and a long row (a larger bound)
        for (na, nb, d) in SHAPES.into_iter().chain([(4, 17, 256)]) {
            let a: Vec<f32> = (0..na * d).map(|i| f(i, 1)).collect();
            let b: Vec<f32> = (0..nb * d).map(|i| f(i, 2)).collect();
            let blocks = Blocks8::of_rows(&b, d);
            let mut out = vec![f32::NAN; na * nb];
            blocks.dots(&a, &mut out);
            for i in 0..na {
                for j in 0..nb {
                    let (x, y) = (&a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]);
                    // exact: each product is exact in f64 and the sum of at most
                    // 256 of them rounds far below the bound checked
                    let exact: f64 = x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum();
                    let s: f64 = x
                        .iter()
                        .zip(y)
                        .map(|(p, q)| (*p as f64 * *q as f64).abs())
                        .sum();
                    let err = (out[i * nb + j] as f64 - exact).abs();
                    let bound = dot_error_factor(d) * s + d as f64 * 2f64.powi(-149);
                    assert!(err <= bound, "({i}, {j}) {na}x{nb} d={d}: {err} > {bound}");
                    // and it is a sum of these rows, not of others
                    assert!(err <= 1e-3 * s.max(1.0), "({i}, {j}): {err}");
                }
            }
        }
    }

    #[test]
    fn the_error_factor_is_gamma_d() {
        let u = 2f64.powi(-24);
        assert_eq!(dot_error_factor(64), 64.0 * u / (1.0 - 64.0 * u));
        assert!(dot_error_factor(1) > u && dot_error_factor(1) < 1.0000001 * u);
    }
}
