//! Dot products of f32 rows accumulated in f64, in element order, as the
//! policies' similarity code sums them (`Σ_t a_t as f64 · b_t as f64`,
//! starting from −0.0 like `Iterator::sum`), many pairs at once.
//!
//! A product of two f32 values is exact in f64, so a fused multiply-add
//! rounds exactly as adding the product does: the vector path (four pairs
//! per instruction, FMA) gives the scalar loop's results bit for bit.

/// Rows of `b` (nb, d) stored four to a block, each block column by column:
/// row j's element t at `(j / 4) · 4d + 4t + j % 4` (the missing rows of the
/// last block are zero). Build once, use for many rows of `a`.
#[derive(Clone, Debug, Default)]
pub struct ColumnBlocks {
    pub d: usize,
    pub n: usize,
    data: Vec<f32>,
}

impl ColumnBlocks {
    pub fn new(d: usize) -> ColumnBlocks {
        ColumnBlocks {
            d,
            n: 0,
            data: Vec::new(),
        }
    }

    /// The blocks of `rows` (n, d).
    pub fn of_rows(rows: &[f32], d: usize) -> ColumnBlocks {
        let mut c = ColumnBlocks::new(d);
        for (j, r) in rows.chunks_exact(d.max(1)).enumerate() {
            c.set(j, r);
        }
        c
    }

    /// Put `row` (d,) at index j (growing the blocks as needed).
    pub fn set(&mut self, j: usize, row: &[f32]) {
        let d = self.d;
        assert_eq!(
            row.len(),
            d,
            "ColumnBlocks::set: row of {} values, d = {d}",
            row.len()
        );
        let need = (j / 4 + 1) * 4 * d;
        if self.data.len() < need {
            self.data.resize(need, 0.0);
        }
        self.n = self.n.max(j + 1);
        let base = (j / 4) * 4 * d + j % 4;
        for (t, v) in row.iter().enumerate() {
            self.data[base + 4 * t] = *v;
        }
    }

    /// Row j's element t.
    pub fn get(&self, j: usize, t: usize) -> f32 {
        self.data[(j / 4) * 4 * self.d + 4 * t + j % 4]
    }

    /// Blocks stored (⌈n / 4⌉).
    pub fn blocks(&self) -> usize {
        self.n.div_ceil(4)
    }

    /// Σ_t x_t · row_j[t] (f64, t order) for the four rows of block `b`
    /// (zero rows give −0.0 or 0).
    pub fn block_dots(&self, x: &[f64], b: usize) -> [f64; 4] {
        let d = self.d;
        assert_eq!(x.len(), d);
        let col = &self.data[b * 4 * d..(b + 1) * 4 * d];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present; col holds 4d floats.
            return unsafe { block_dots_avx2::<1, 1>(&[x], col)[0][0] };
        }
        let mut acc = [-0.0f64; 4];
        for (t, xt) in x.iter().enumerate() {
            for (j, a) in acc.iter_mut().enumerate() {
                *a += xt * col[4 * t + j] as f64;
            }
        }
        acc
    }

    /// `out[i · n + j]` = Σ_t a_i[t] · row_j[t] for every row of `a`
    /// (na, d) and every stored row j (out: (na, n)).
    pub fn dots(&self, a: &[f32], out: &mut [f64]) {
        let (d, n) = (self.d, self.n);
        let na = a.len() / d.max(1);
        assert!(
            a.len() == na * d && out.len() == na * n,
            "ColumnBlocks::dots: shapes"
        );
        let a64: Vec<f64> = a.iter().map(|v| *v as f64).collect();
        let rows: Vec<&[f64]> = a64.chunks_exact(d.max(1)).collect();
        let fast = cfg!(target_arch = "x86_64") && {
            #[cfg(target_arch = "x86_64")]
            {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        };
        let mut put = |i: usize, b: usize, r: [f64; 4]| {
            for (l, v) in r.iter().enumerate() {
                let j = 4 * b + l;
                if j < n {
                    out[i * n + j] = *v;
                }
            }
        };
        let blocks = self.blocks();
        let mut b = 0;
        while b < blocks {
            // two blocks at once where two are left: eight independent FMA
            // chains against four rows (one block: four)
            let w = if fast && b + 2 <= blocks { 2 } else { 1 };
            let cols = &self.data[b * 4 * d..(b + w) * 4 * d];
            let mut i = 0;
            #[cfg(target_arch = "x86_64")]
            if fast {
                while i + 4 <= na {
                    let put = |k: usize, c: usize, v| put(i + k, b + c, v);
                    match w {
                        2 => tile::<4, 2>(&rows[i..i + 4], cols, put),
                        _ => tile::<4, 1>(&rows[i..i + 4], cols, put),
                    }
                    i += 4;
                }
                for k in i..na {
                    let put = |_: usize, c: usize, v| put(k, b + c, v);
                    match w {
                        2 => tile::<1, 2>(&rows[k..k + 1], cols, put),
                        _ => tile::<1, 1>(&rows[k..k + 1], cols, put),
                    }
                }
                i = na;
            }
            // the portable code (w is 1 here)
            for (k, x) in rows.iter().enumerate().skip(i) {
                let mut acc = [-0.0f64; 4];
                for (t, xt) in x.iter().enumerate() {
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a += xt * cols[4 * t + j] as f64;
                    }
                }
                put(k, b, acc);
            }
            b += w;
        }
    }
}

/// [`block_dots_avx2`] of `R` rows against the `B` blocks in `cols`, each
/// block's four sums handed to `put(row, block, sums)`. The CPU must have
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
fn tile<const R: usize, const B: usize>(
    rows: &[&[f64]],
    cols: &[f32],
    mut put: impl FnMut(usize, usize, [f64; 4]),
) {
    let x: &[&[f64]; R] = rows.try_into().expect("R rows");
    assert!(
        cols.len() >= B * 4 * x[0].len(),
        "tile: B blocks of 4d floats"
    );
    // SAFETY: the callers checked AVX2 and FMA; cols holds B blocks of 4d
    // floats (checked above), each row d.
    let r = unsafe { block_dots_avx2::<R, B>(x, cols) };
    for (k, rk) in r.into_iter().enumerate() {
        for (c, v) in rk.into_iter().enumerate() {
            put(k, c, v);
        }
    }
}

/// `out[j]` = Σ_t x_t · rows[idx[j]][t] in f64, t in order (from −0.0): one
/// row against the rows `idx` of the row-major `rows` (·, d), without a copy
/// (four rows at a time, transposed in registers).
pub fn dots_at(x: &[f32], rows: &[f32], d: usize, idx: &[usize], out: &mut [f64]) {
    dots_norms_at(x, rows, d, idx, out, None)
}

/// [`dots_at`], and where `sq` is given, each row's own Σ_t row[t]² (the
/// square of [`crate::cpu::l2_norm`]) from the same pass.
pub fn dots_norms_at(
    x: &[f32],
    rows: &[f32],
    d: usize,
    idx: &[usize],
    out: &mut [f64],
    mut sq: Option<&mut [f64]>,
) {
    assert!(x.len() == d && out.len() == idx.len(), "dots_at: shapes");
    assert!(
        sq.as_ref().is_none_or(|s| s.len() == idx.len()),
        "dots_at: sq is not (idx,)"
    );
    assert!(
        idx.iter().all(|&j| (j + 1) * d <= rows.len()),
        "dots_at: a row index is out of range"
    );
    let x64: Vec<f64> = x.iter().map(|v| *v as f64).collect();
    let mut j0 = 0;
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(4)
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
    {
        let ptrs = |j0: usize| {
            [idx[j0], idx[j0 + 1], idx[j0 + 2], idx[j0 + 3]].map(|j| rows[j * d..].as_ptr())
        };
        let squares = sq.is_some();
        let mut put = |j0: usize, (v, q): ([f64; 4], [f64; 4])| {
            out[j0..j0 + 4].copy_from_slice(&v);
            if let Some(s) = sq.as_deref_mut() {
                s[j0..j0 + 4].copy_from_slice(&q);
            }
        };
        while j0 + 16 <= idx.len() {
            let r = [ptrs(j0), ptrs(j0 + 4), ptrs(j0 + 8), ptrs(j0 + 12)];
            // SAFETY: AVX2 and FMA are present; each of the rows holds d
            // floats (checked above) and d is a multiple of 4.
            let res = unsafe { dots4_rows_avx2::<4>(&x64, r, squares) };
            for (g, vq) in res.into_iter().enumerate() {
                put(j0 + 4 * g, vq);
            }
            j0 += 16;
        }
        while j0 + 4 <= idx.len() {
            // SAFETY: as above.
            let [vq] = unsafe { dots4_rows_avx2::<1>(&x64, [ptrs(j0)], squares) };
            put(j0, vq);
            j0 += 4;
        }
    }
    for (k, &j) in idx.iter().enumerate().skip(j0) {
        let row = &rows[j * d..(j + 1) * d];
        out[k] = x64.iter().zip(row).map(|(a, b)| a * *b as f64).sum();
        if let Some(s) = sq.as_deref_mut() {
            s[k] = row.iter().map(|v| (*v as f64) * (*v as f64)).sum();
        }
    }
}

/// `G` groups of four rows (`r`, each d floats) against `x`: per group the
/// four sums (and, with `squares`, the rows' own Σ row[t]²), G independent
/// FMA chains so that their latencies overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots4_rows_avx2<const G: usize>(
    x: &[f64],
    r: [[*const f32; 4]; G],
    squares: bool,
) -> [([f64; 4], [f64; 4]); G] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_pd(-0.0); G];
    let mut sq = [_mm256_set1_pd(-0.0); G];
    let mut t = 0;
    while t < x.len() {
        for g in 0..G {
            let (a, b, c, e) = (
                _mm_loadu_ps(r[g][0].add(t)),
                _mm_loadu_ps(r[g][1].add(t)),
                _mm_loadu_ps(r[g][2].add(t)),
                _mm_loadu_ps(r[g][3].add(t)),
            );
            // 4 x 4 transpose: column i holds element t + i of the four rows
            let (ab_lo, ab_hi) = (_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));
            let (ce_lo, ce_hi) = (_mm_unpacklo_ps(c, e), _mm_unpackhi_ps(c, e));
            let cols = [
                _mm_movelh_ps(ab_lo, ce_lo),
                _mm_movehl_ps(ce_lo, ab_lo),
                _mm_movelh_ps(ab_hi, ce_hi),
                _mm_movehl_ps(ce_hi, ab_hi),
            ];
            for (i, col) in cols.into_iter().enumerate() {
                let y = _mm256_cvtps_pd(col);
                acc[g] = _mm256_fmadd_pd(_mm256_set1_pd(*x.get_unchecked(t + i)), y, acc[g]);
                if squares {
                    sq[g] = _mm256_fmadd_pd(y, y, sq[g]);
                }
            }
        }
        t += 4;
    }
    let mut out = [([0f64; 4], [0f64; 4]); G];
    for g in 0..G {
        _mm256_storeu_pd(out[g].0.as_mut_ptr(), acc[g]);
        _mm256_storeu_pd(out[g].1.as_mut_ptr(), sq[g]);
    }
    out
}

/// R rows of `x` against the B consecutive blocks of `cols` (B · 4d
/// floats): R × B × 4 sums, R · B independent FMA chains, each sum in t
/// order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_dots_avx2<const R: usize, const B: usize>(
    x: &[&[f64]; R],
    cols: &[f32],
) -> [[[f64; 4]; B]; R] {
    use std::arch::x86_64::*;
    let d = x[0].len();
    let mut acc = [[_mm256_set1_pd(-0.0); B]; R];
    for t in 0..d {
        let mut y = [_mm256_setzero_pd(); B];
        for (c, yc) in y.iter_mut().enumerate() {
            *yc = _mm256_cvtps_pd(_mm_loadu_ps(cols.as_ptr().add(c * 4 * d + 4 * t)));
        }
        for r in 0..R {
            let xr = _mm256_set1_pd(*x[r].get_unchecked(t));
            for c in 0..B {
                acc[r][c] = _mm256_fmadd_pd(xr, y[c], acc[r][c]);
            }
        }
    }
    let mut out = [[[0f64; 4]; B]; R];
    for r in 0..R {
        for c in 0..B {
            _mm256_storeu_pd(out[r][c].as_mut_ptr(), acc[r][c]);
        }
    }
    out
}

/// Rows shared by this module's tests and the screen's
/// ([`super::screen`]).
#[cfg(test)]
pub(crate) mod test_rows {
    /// A fixed pseudo-random value in about −10 ..= 10 per (index, stream).
    pub(crate) fn pseudo(i: usize, s: usize) -> f32 {
        (((i * 2654435761 + s) >> 7) % 1999) as f32 / 97.0 - 10.0
    }

    /// (rows of a, rows of b, d) for the many-pair products: one pair, ragged
    /// tiles, an odd d, no rows; two-block tiles with rows and a block left
    /// over; 16-row groups.
    pub(crate) const SHAPES: [(usize, usize, usize); 7] = [
        (1, 1, 64),
        (5, 7, 64),
        (9, 13, 3),
        (4, 8, 16),
        (0, 3, 8),
        (6, 21, 8),
        (9, 37, 64),
    ];
}

#[cfg(test)]
mod tests {
    use super::test_rows::{pseudo, SHAPES};
    use super::*;

    fn scalar(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    #[test]
    fn dots_equal_the_scalar_sums_bit_for_bit() {
        let f = pseudo;
        for (na, nb, d) in SHAPES {
            let a: Vec<f32> = (0..na * d).map(|i| f(i, 1)).collect();
            let b: Vec<f32> = (0..nb * d).map(|i| f(i, 2)).collect();
            let cb = ColumnBlocks::of_rows(&b, d);
            let mut out = vec![0f64; na * nb];
            cb.dots(&a, &mut out);
            for i in 0..na {
                let x: Vec<f64> = a[i * d..(i + 1) * d].iter().map(|v| *v as f64).collect();
                for j in 0..nb {
                    let want = scalar(&a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]);
                    assert_eq!(
                        out[i * nb + j].to_bits(),
                        want.to_bits(),
                        "({i}, {j}) {na}x{nb} d={d}"
                    );
                    assert_eq!(cb.block_dots(&x, j / 4)[j % 4].to_bits(), want.to_bits());
                    assert_eq!(cb.get(j, d - 1), b[j * d + d - 1]);
                }
                let idx: Vec<usize> = (0..nb).rev().chain(0..nb.min(3)).collect();
                let mut at = vec![0f64; idx.len()];
                let mut sq = vec![0f64; idx.len()];
                dots_norms_at(&a[i * d..(i + 1) * d], &b, d, &idx, &mut at, Some(&mut sq));
                for ((o, q), &j) in at.iter().zip(&sq).zip(&idx) {
                    let row = &b[j * d..(j + 1) * d];
                    let want = scalar(&a[i * d..(i + 1) * d], row);
                    assert_eq!(o.to_bits(), want.to_bits(), "dots_at ({i}, {j}) d={d}");
                    assert_eq!(
                        q.sqrt().to_bits(),
                        crate::cpu::l2_norm(row).to_bits(),
                        "norm {j}"
                    );
                }
            }
        }
    }
}
