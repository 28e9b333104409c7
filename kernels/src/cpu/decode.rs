//! Replay-side kernels: attention of decode queries over a (compressed) cache
//! with per-entry logit bias, causal scoring rows, and top-k selection.

/// Run `body` compiled for AVX2 when the CPU has it (same results: the
/// vectorised loops keep their lane order and no multiply-add is fused).
macro_rules! with_avx2 {
    ($generic:ident ( $($arg:expr),* )) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2")]
            unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { avx2(#[inline(always)] || $generic($($arg),*)) };
            }
        }
        $generic($($arg),*)
    }};
}

/// Dot product with eight fixed accumulators (the summation order is fixed,
/// so results never depend on the machine's thread count). Vectorises.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// [`dot`] of `q` with four rows at once: the same arithmetic per row (so the
/// same results), with four independent accumulators to hide add latency.
#[inline(always)]
fn dot4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let d = q.len();
    let body = d - d % 8;
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i < body {
        let x = &q[i..i + 8];
        for (a, kr) in acc.iter_mut().zip(&k) {
            let y = &kr[i..i + 8];
            for l in 0..8 {
                a[l] += x[l] * y[l];
            }
        }
        i += 8;
    }
    let mut out = [0f32; 4];
    for ((o, a), kr) in out.iter_mut().zip(&acc).zip(&k) {
        let tail: f32 = q[body..].iter().zip(&kr[body..d]).map(|(x, y)| x * y).sum();
        *o = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail;
    }
    out
}

/// Attention of one query over a cache of `n` entries, each with a logit bias.
///
/// - `q`: (d,); `keys`, `values`: (n, d); `bias`: (n,)
/// - `w`: (n,) receives exp(logit - max) in f64, logit = scale·q·k + bias
/// - `out`: (d,) receives Σ_e (w_e / z) v_e, accumulated in f32
///
/// Returns z = Σ_e w_e (f64).
pub fn attend_biased(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    out: &mut [f32],
) -> f64 {
    let d = q.len();
    let n = bias.len();
    assert!(
        keys.len() == n * d && values.len() == n * d && w.len() == n && out.len() == d,
        "attend_biased: shapes do not match (n={n}, d={d})"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the slices' lengths were checked above and
        // every load/store stays inside them.
        return unsafe { attend_biased_avx2(q, keys, values, bias, scale, w, out) };
    }
    attend_biased_generic(q, keys, values, bias, scale, w, out)
}

/// [`dot`]'s final reduction of an 8-lane accumulator:
/// (a0+a4, a1+a5, a2+a6, a3+a7), then ((s0+s1)+(s2+s3)).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn reduce8(a: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let mut l = [0f32; 4];
    _mm_storeu_ps(l.as_mut_ptr(), s);
    (l[0] + l[1]) + (l[2] + l[3])
}

/// [`attend_biased`] for `nq` queries over one cache (GQA: the query heads of
/// a KV head): `q` (nq, d), `w` (nq, n), `z` (nq,), `out` (nq, d). Each
/// query's results are bit-identical to [`attend_biased`]; keys and values
/// are read once for all queries.
#[allow(clippy::too_many_arguments)]
pub fn attend_biased_multi(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    z: &mut [f64],
    out: &mut [f32],
) {
    let (nq, n) = (z.len(), bias.len());
    let d = q.len() / nq.max(1);
    assert!(
        q.len() == nq * d
            && keys.len() == n * d
            && values.len() == n * d
            && w.len() == nq * n
            && out.len() == nq * d,
        "attend_biased_multi: shapes do not match (nq={nq}, n={n}, d={d})"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && d.is_multiple_of(32) && nq > 0 {
        for q0 in (0..nq).step_by(3) {
            let m = (nq - q0).min(3);
            // SAFETY: AVX2 is present; shapes were checked above.
            unsafe {
                attend_multi_avx2(
                    &q[q0 * d..(q0 + m) * d],
                    keys,
                    values,
                    bias,
                    scale,
                    &mut w[q0 * n..(q0 + m) * n],
                    &mut z[q0..q0 + m],
                    &mut out[q0 * d..(q0 + m) * d],
                )
            };
        }
        return;
    }
    for i in 0..nq {
        z[i] = attend_biased(
            &q[i * d..(i + 1) * d],
            keys,
            values,
            bias,
            scale,
            &mut w[i * n..(i + 1) * n],
            &mut out[i * d..(i + 1) * d],
        );
    }
}

/// Up to three queries, d a multiple of 32: the arithmetic of
/// [`attend_biased_avx2`] per query, interleaved over the queries.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // lanes index several arrays
unsafe fn attend_multi_avx2(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    z: &mut [f64],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let m = z.len();
    let n = bias.len();
    let d = q.len() / m;
    let (qp, kp, vp) = (q.as_ptr(), keys.as_ptr(), values.as_ptr());
    // the tail of dot (d % 8 elements) is empty here: d is a multiple of 32,
    // and `Iterator::sum` of nothing is -0.0, which `+` leaves unchanged
    let tail0: f32 = std::iter::empty::<f32>().sum();
    let mut mx = [f32::NEG_INFINITY; 3];
    for e in 0..n {
        let mut a = [_mm256_setzero_ps(); 3];
        let mut i = 0;
        while i < d {
            let k = _mm256_loadu_ps(kp.add(e * d + i));
            for (j, aj) in a.iter_mut().enumerate().take(m) {
                *aj = _mm256_add_ps(*aj, _mm256_mul_ps(_mm256_loadu_ps(qp.add(j * d + i)), k));
            }
            i += 8;
        }
        for j in 0..m {
            let l = (reduce8(a[j]) + tail0) * scale + bias[e];
            w[j * n + e] = l as f64;
            mx[j] = mx[j].max(l);
        }
    }
    for j in 0..m {
        let mut zj = 0f64;
        for we in w[j * n..(j + 1) * n].iter_mut() {
            *we = ((*we as f32 - mx[j]) as f64).exp();
            zj += *we;
        }
        z[j] = zj;
    }
    let op = out.as_mut_ptr();
    let mut t0 = 0;
    while t0 < d {
        let mut acc = [[_mm256_setzero_ps(); 4]; 3];
        for e in 0..n {
            let v = [
                _mm256_loadu_ps(vp.add(e * d + t0)),
                _mm256_loadu_ps(vp.add(e * d + t0 + 8)),
                _mm256_loadu_ps(vp.add(e * d + t0 + 16)),
                _mm256_loadu_ps(vp.add(e * d + t0 + 24)),
            ];
            for j in 0..m {
                let p = _mm256_set1_ps((w[j * n + e] / z[j]) as f32);
                for r in 0..4 {
                    acc[j][r] = _mm256_add_ps(acc[j][r], _mm256_mul_ps(p, v[r]));
                }
            }
        }
        for j in 0..m {
            for r in 0..4 {
                _mm256_storeu_ps(op.add(j * d + t0 + 8 * r), acc[j][r]);
            }
        }
        t0 += 32;
    }
}

/// AVX2 twin of [`attend_biased_generic`] written with intrinsics: the same
/// additions and products in the same order per lane (mul then add, never
/// fused), so the results are bit-identical; only the scheduling differs
/// (four keys per pass, the output held in registers across entries).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_biased_avx2(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    out: &mut [f32],
) -> f64 {
    use std::arch::x86_64::*;
    let d = q.len();
    let n = bias.len();
    let body = d - d % 8;
    let tail = |e: usize| -> f32 {
        q[body..]
            .iter()
            .zip(&keys[e * d + body..(e + 1) * d])
            .map(|(x, y)| x * y)
            .sum()
    };
    let kp = keys.as_ptr();
    let qp = q.as_ptr();
    let mut mx = f32::NEG_INFINITY;
    let mut e = 0;
    while e + 4 <= n {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut i = 0;
        while i < body {
            let x = _mm256_loadu_ps(qp.add(i));
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(x, _mm256_loadu_ps(kp.add(e * d + i))));
            a1 = _mm256_add_ps(
                a1,
                _mm256_mul_ps(x, _mm256_loadu_ps(kp.add((e + 1) * d + i))),
            );
            a2 = _mm256_add_ps(
                a2,
                _mm256_mul_ps(x, _mm256_loadu_ps(kp.add((e + 2) * d + i))),
            );
            a3 = _mm256_add_ps(
                a3,
                _mm256_mul_ps(x, _mm256_loadu_ps(kp.add((e + 3) * d + i))),
            );
            i += 8;
        }
        for (j, a) in [a0, a1, a2, a3].into_iter().enumerate() {
            let l = (reduce8(a) + tail(e + j)) * scale + bias[e + j];
            w[e + j] = l as f64;
            mx = mx.max(l);
        }
        e += 4;
    }
    while e < n {
        let mut a = _mm256_setzero_ps();
        let mut i = 0;
        while i < body {
            a = _mm256_add_ps(
                a,
                _mm256_mul_ps(
                    _mm256_loadu_ps(qp.add(i)),
                    _mm256_loadu_ps(kp.add(e * d + i)),
                ),
            );
            i += 8;
        }
        let l = (reduce8(a) + tail(e)) * scale + bias[e];
        w[e] = l as f64;
        mx = mx.max(l);
        e += 1;
    }
    let mut z = 0f64;
    for we in w.iter_mut() {
        *we = ((*we as f32 - mx) as f64).exp();
        z += *we;
    }
    // out[t] = Σ_e p_e v[e, t] in entry order, 32 columns (4 registers) at a time
    let vp = values.as_ptr();
    let mut t0 = 0;
    while t0 + 32 <= d {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (e, we) in w.iter().enumerate() {
            let p = _mm256_set1_ps((we / z) as f32);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(
                    *a,
                    _mm256_mul_ps(p, _mm256_loadu_ps(vp.add(e * d + t0 + 8 * r))),
                );
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(t0 + 8 * r), *a);
        }
        t0 += 32;
    }
    if t0 < d {
        out[t0..].fill(0.0);
        for (e, we) in w.iter().enumerate() {
            let p = (we / z) as f32;
            for (o, v) in out[t0..].iter_mut().zip(&values[e * d + t0..(e + 1) * d]) {
                *o += p * v;
            }
        }
    }
    z
}

/// The portable body of [`attend_biased`] (shapes checked by the caller).
#[inline(always)]
fn attend_biased_generic(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    out: &mut [f32],
) -> f64 {
    let d = q.len();
    let n = bias.len();
    let mut mx = f32::NEG_INFINITY;
    let row = |e: usize| &keys[e * d..(e + 1) * d];
    let quads = n - n % 4;
    for e in (0..quads).step_by(4) {
        let s = dot4(q, [row(e), row(e + 1), row(e + 2), row(e + 3)]);
        for j in 0..4 {
            let l = s[j] * scale + bias[e + j];
            w[e + j] = l as f64;
            mx = mx.max(l);
        }
    }
    for e in quads..n {
        let l = dot(q, row(e)) * scale + bias[e];
        w[e] = l as f64;
        mx = mx.max(l);
    }
    let mut z = 0f64;
    for we in w.iter_mut() {
        *we = ((*we as f32 - mx) as f64).exp();
        z += *we;
    }
    out.fill(0.0);
    for (e, we) in w.iter().enumerate() {
        let p = (we / z) as f32;
        for (o, v) in out.iter_mut().zip(&values[e * d..(e + 1) * d]) {
            *o += p * v;
        }
    }
    z
}

/// All pairwise [`dot`] products of the rows of `a` (na, d) and `b` (nb, d):
/// `out[i * nb + j] = dot(a_i, b_j)`, bit-identical to calling `dot`.
pub fn dot_rows(a: &[f32], b: &[f32], d: usize, out: &mut [f32]) {
    with_avx2!(dot_rows_generic(a, b, d, out))
}

#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dot_rows_generic(a: &[f32], b: &[f32], d: usize, out: &mut [f32]) {
    let (na, nb) = (a.len() / d.max(1), b.len() / d.max(1));
    assert!(
        a.len() == na * d && b.len() == nb * d && out.len() == na * nb,
        "dot_rows: shapes do not match (na={na}, nb={nb}, d={d})"
    );
    fn row(m: &[f32], i: usize, d: usize) -> &[f32] {
        &m[i * d..(i + 1) * d]
    }
    let quads = nb - nb % 4;
    for (i, o) in out.chunks_exact_mut(nb.max(1)).enumerate().take(na) {
        let x = row(a, i, d);
        for j in (0..quads).step_by(4) {
            let k = [
                row(b, j, d),
                row(b, j + 1, d),
                row(b, j + 2, d),
                row(b, j + 3, d),
            ];
            o[j..j + 4].copy_from_slice(&dot4(x, k));
        }
        for j in quads..nb {
            o[j] = dot(x, row(b, j, d));
        }
    }
}

/// Causal attention rows for scoring: row r is query `q[r]` over keys
/// `0 .. lens[r]`, logits scale·gain[r]·q·k, softmax with an f64 normaliser;
/// entries at and beyond `lens[r]` are zero.
///
/// - `q`: (r, d); `keys`: (n, d); `lens`, `gains`: (r,); `out`: (r, n)
pub fn attention_rows(
    q: &[f32],
    keys: &[f32],
    d: usize,
    lens: &[usize],
    gains: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    with_avx2!(attention_rows_generic(q, keys, d, lens, gains, scale, out))
}

#[inline(always)]
fn attention_rows_generic(
    q: &[f32],
    keys: &[f32],
    d: usize,
    lens: &[usize],
    gains: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let r = lens.len();
    let n = keys.len() / d;
    assert!(
        q.len() == r * d && gains.len() == r && out.len() == r * n,
        "attention_rows: shapes do not match (r={r}, n={n}, d={d})"
    );
    for (i, row) in out.chunks_exact_mut(n).enumerate() {
        let len = lens[i];
        assert!(
            len <= n,
            "attention_rows: row {i} attends to {len} > {n} keys"
        );
        let qi = &q[i * d..(i + 1) * d];
        let (live, rest) = row.split_at_mut(len);
        for (j, x) in live.iter_mut().enumerate() {
            *x = dot(qi, &keys[j * d..(j + 1) * d]) * scale * gains[i];
        }
        softmax_in_place(live);
        rest.fill(0.0);
    }
}

/// Max-shifted softmax in place: exp in f32, normaliser summed in f64.
pub fn softmax_in_place(x: &mut [f32]) {
    let mx = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut z = 0f64;
    for v in x.iter_mut() {
        *v = (*v - mx).exp();
        z += *v as f64;
    }
    let inv = (1.0 / z) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attend_biased_by_hand() {
        // two entries, d = 1: logits 0 and ln 3 (via bias) -> weights 1/4, 3/4
        let (q, k, v) = ([1.0f32], [0.0f32, 0.0], [4.0f32, 8.0]);
        let bias = [0.0f32, 3f32.ln()];
        let (mut w, mut o) = ([0f64; 2], [0f32; 1]);
        let z = attend_biased(&q, &k, &v, &bias, 1.0, &mut w, &mut o);
        assert!((w[0] / z - 0.25).abs() < 1e-7 && (w[1] / z - 0.75).abs() < 1e-7);
        assert!((o[0] - 7.0).abs() < 1e-5, "{}", o[0]);
    }

    #[test]
    fn dot_rows_equals_dot_bit_for_bit() {
        let d = 19;
        let a: Vec<f32> = (0..3 * d)
            .map(|i| ((i * 31 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let b: Vec<f32> = (0..6 * d)
            .map(|i| ((i * 17 % 29) as f32 - 14.0) / 9.0)
            .collect();
        let mut out = vec![0f32; 18];
        dot_rows(&a, &b, d, &mut out);
        for i in 0..3 {
            for j in 0..6 {
                let want = dot(&a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]);
                assert_eq!(out[i * 6 + j].to_bits(), want.to_bits(), "({i}, {j})");
            }
        }
    }

    #[test]
    fn dot4_equals_dot_bit_for_bit() {
        for d in [1usize, 7, 8, 64, 67] {
            let q: Vec<f32> = (0..d).map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0).collect();
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|r| {
                    (0..d)
                        .map(|i| ((i * 13 + r * 7) % 17) as f32 / 7.0 - 1.1)
                        .collect()
                })
                .collect();
            let got = dot4(&q, [&rows[0], &rows[1], &rows[2], &rows[3]]);
            for r in 0..4 {
                assert_eq!(
                    got[r].to_bits(),
                    dot(&q, &rows[r]).to_bits(),
                    "d={d} row {r}"
                );
            }
        }
    }

    #[test]
    fn attend_biased_avx2_equals_the_generic_code_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            for (n, d) in [(1usize, 64usize), (7, 64), (9, 37), (33, 8), (5, 3)] {
                let f =
                    |i: usize, s: usize| (((i * 2654435761 + s) >> 7) % 1999) as f32 / 999.0 - 1.0;
                let q: Vec<f32> = (0..d).map(|i| f(i, 1)).collect();
                let k: Vec<f32> = (0..n * d).map(|i| f(i, 2)).collect();
                let v: Vec<f32> = (0..n * d).map(|i| f(i, 3)).collect();
                let b: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { 0.7 } else { 0.0 }).collect();
                let (mut w1, mut o1, mut w2, mut o2) =
                    (vec![0f64; n], vec![0f32; d], vec![0f64; n], vec![0f32; d]);
                let z1 = attend_biased_generic(&q, &k, &v, &b, 0.3, &mut w1, &mut o1);
                // SAFETY: AVX2 checked above.
                let z2 = unsafe { attend_biased_avx2(&q, &k, &v, &b, 0.3, &mut w2, &mut o2) };
                assert_eq!(z1.to_bits(), z2.to_bits(), "z n={n} d={d}");
                assert_eq!(w1, w2, "w n={n} d={d}");
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&o1), bits(&o2), "out n={n} d={d}");
            }
        }
    }

    #[test]
    fn attend_biased_multi_equals_one_query_at_a_time_bit_for_bit() {
        for (nq, n, d) in [
            (3usize, 10usize, 64usize),
            (9, 17, 64),
            (2, 5, 32),
            (4, 6, 20),
            (1, 1, 64),
        ] {
            let f = |i: usize, s: usize| (((i * 2654435761 + s) >> 7) % 1999) as f32 / 999.0 - 1.0;
            let q: Vec<f32> = (0..nq * d).map(|i| f(i, 1)).collect();
            let k: Vec<f32> = (0..n * d).map(|i| f(i, 2)).collect();
            let v: Vec<f32> = (0..n * d).map(|i| f(i, 3)).collect();
            let b: Vec<f32> = (0..n)
                .map(|i| if i % 4 == 1 { -0.4 } else { 0.0 })
                .collect();
            let (mut w, mut z, mut o) = (vec![0f64; nq * n], vec![0f64; nq], vec![0f32; nq * d]);
            attend_biased_multi(&q, &k, &v, &b, 0.2, &mut w, &mut z, &mut o);
            for i in 0..nq {
                let (mut w1, mut o1) = (vec![0f64; n], vec![0f32; d]);
                let z1 = attend_biased(&q[i * d..(i + 1) * d], &k, &v, &b, 0.2, &mut w1, &mut o1);
                assert_eq!(
                    z[i].to_bits(),
                    z1.to_bits(),
                    "z nq={nq} n={n} d={d} query {i}"
                );
                assert_eq!(&w[i * n..(i + 1) * n], &w1[..], "w query {i}");
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&o[i * d..(i + 1) * d]), bits(&o1), "out query {i}");
            }
        }
    }
}
