//! Replay-side kernels: attention of decode queries over a (compressed) cache
//! with per-entry logit bias, causal scoring rows, and top-k selection.

/// `f()`, compiled for AVX2 when the CPU has it: pass a closure marked
/// `#[inline(always)]` whose callees are too, so that its body is compiled
/// inside this function. Same results: Rust fuses no multiply-add and
/// vectorised loops keep every sum's order.
#[inline(always)]
pub fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Run `body` compiled for AVX2 when the CPU has it ([`with_avx2`]).
macro_rules! with_avx2 {
    ($generic:ident ( $($arg:expr),* )) => {{
        with_avx2(#[inline(always)] || $generic($($arg),*))
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
    let mut z = [0f64];
    attend_biased_multi(q, keys, values, bias, scale, w, &mut z, out);
    z[0]
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
    thread_local! {
        static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = Default::default();
    }
    SCRATCH.with(|s| {
        let (x, p) = &mut *s.borrow_mut();
        x.resize(w.len(), 0.0);
        p.resize(w.len(), 0.0);
        attend_biased_probs(q, keys, values, bias, scale, w, z, out, x, p);
    })
}

/// [`attend_biased_multi`] that also returns, per query and entry, the
/// shifted logit `x` = logit − max in f32 (so w = exp(x as f64) exactly) and
/// the probability `p` = (w / z) as f32, the weight the output sums with:
/// `x`, `p` (nq, n).
#[allow(clippy::too_many_arguments)]
pub fn attend_biased_probs(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    z: &mut [f64],
    out: &mut [f32],
    x: &mut [f32],
    p: &mut [f32],
) {
    let (nq, n) = (z.len(), bias.len());
    let d = q.len() / nq.max(1);
    assert!(
        q.len() == nq * d
            && keys.len() == n * d
            && values.len() == n * d
            && w.len() == nq * n
            && x.len() == nq * n
            && p.len() == nq * n
            && out.len() == nq * d,
        "attend_biased: shapes do not match (nq={nq}, n={n}, d={d})"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && d.is_multiple_of(8) && d > 0 {
        // 1. every (query, entry) dot product, 8 at a time, a block of keys
        // at a time: every query reads the block while it is in cache
        let block = block_rows(d);
        for e0 in (0..n).step_by(block) {
            let e1 = (e0 + block).min(n);
            // SAFETY: AVX2 is present; shapes were checked above, and
            // x[j·n + e0 ..] holds e1 − e0 elements per query j.
            unsafe { dots_avx2(q, &keys[e0 * d..e1 * d], d, &mut x[e0..], n) };
        }
        // SAFETY: AVX2 is present; shapes were checked above.
        unsafe { softmax_rows_avx2(x, w, z, p, bias, scale) };
        // 4. out = Σ_e p_e v_e in entry order, up to three queries at a time
        for q0 in (0..nq).step_by(3) {
            let m = (nq - q0).min(3);
            // SAFETY: AVX2 is present; shapes were checked above.
            unsafe {
                weighted_values_avx2(
                    &p[q0 * n..(q0 + m) * n],
                    values,
                    d,
                    &mut out[q0 * d..(q0 + m) * d],
                )
            };
        }
        return;
    }
    for j in 0..nq {
        let (wj, xj, pj) = (
            &mut w[j * n..(j + 1) * n],
            &mut x[j * n..(j + 1) * n],
            &mut p[j * n..(j + 1) * n],
        );
        let (zj, mx) = attend_biased_generic(
            &q[j * d..(j + 1) * d],
            keys,
            values,
            bias,
            scale,
            wj,
            &mut out[j * d..(j + 1) * d],
            xj,
        );
        z[j] = zj;
        xj.iter_mut().for_each(|l| *l -= mx);
        pj.iter_mut()
            .zip(wj.iter())
            .for_each(|(pe, we)| *pe = (we / zj) as f32);
    }
}

/// Steps 2 and 3 of [`attend_biased_probs`] for every query: `x` holds the
/// dot products (nq, n) on entry and the shifted logits on return; `w`, `z`,
/// `p` as there. Compiled for AVX2 (the loops vectorise; the maximum keeps
/// `f32::max`'s rule of passing over NaN).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_rows_avx2(
    x: &mut [f32],
    w: &mut [f64],
    z: &mut [f64],
    p: &mut [f32],
    bias: &[f32],
    scale: f32,
) {
    use std::arch::x86_64::*;
    let n = bias.len();
    for j in 0..z.len() {
        let (xj, wj) = (&mut x[j * n..(j + 1) * n], &mut w[j * n..(j + 1) * n]);
        // logits and their maximum (max_ps(l, m) keeps m where l is NaN)
        let mut m8 = _mm256_set1_ps(f32::NEG_INFINITY);
        let (sc, body) = (_mm256_set1_ps(scale), n - n % 8);
        for e in (0..body).step_by(8) {
            let l = _mm256_add_ps(
                _mm256_mul_ps(_mm256_loadu_ps(xj.as_ptr().add(e)), sc),
                _mm256_loadu_ps(bias.as_ptr().add(e)),
            );
            _mm256_storeu_ps(xj.as_mut_ptr().add(e), l);
            m8 = _mm256_max_ps(l, m8);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m8);
        let mut mx = lanes.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        for e in body..n {
            xj[e] = xj[e] * scale + bias[e];
            mx = mx.max(xj[e]);
        }
        crate::cpu::exp::exp_shifted(xj, mx, wj);
        xj.iter_mut().for_each(|l| *l -= mx);
    }
    // the normalisers in entry order (the queries' sums interleaved, each in
    // its own order), then each entry's probability
    sums_in_order(w, n, z);
    for (j, zj) in z.iter().enumerate() {
        p[j * n..(j + 1) * n]
            .iter_mut()
            .zip(&w[j * n..(j + 1) * n])
            .for_each(|(pe, we)| *pe = (we / zj) as f32);
    }
}

/// `z[j] = 0 + w[j, 0] + w[j, 1] + ...` for the rows of `w` (m, n), each sum
/// in entry order, four rows at a time so their additions overlap.
#[inline(always)]
fn sums_in_order(w: &[f64], n: usize, z: &mut [f64]) {
    let m = z.len();
    let mut j0 = 0;
    while j0 < m {
        let k = (m - j0).min(4);
        let mut acc = [0f64; 4];
        for e in 0..n {
            for (r, a) in acc.iter_mut().enumerate().take(k) {
                *a += w[(j0 + r) * n + e];
            }
        }
        z[j0..j0 + k].copy_from_slice(&acc[..k]);
        j0 += k;
    }
}

/// Rows of keys or values (of `d` floats) per block that replay's attention
/// reads while it stays in L1: 16 KiB, at least 8 rows.
fn block_rows(d: usize) -> usize {
    ((16 << 10) / (4 * d.max(1))).max(8)
}

/// `out[i · ldo + j] = dot(a_i, b_j)` for the rows of `a` (na, d) and `b`
/// (nb, d), d a multiple of 8: [`dot`]'s arithmetic exactly (eight lanes,
/// products then sums, its final reduction), eight pairs per pass: tiles of
/// 2 rows of `a` × 4 rows of `b` (a last odd row of `a` against 8 rows of
/// `b`), and [`dot`] itself for the few pairs at the edges. `ldo` ≥ nb: the
/// stride of `out`'s rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dots_avx2(a: &[f32], b: &[f32], d: usize, out: &mut [f32], ldo: usize) {
    let (na, nb) = (a.len() / d, b.len() / d);
    assert!(ldo >= nb && (na == 0 || out.len() >= (na - 1) * ldo + nb));
    debug_assert!(d.is_multiple_of(8));
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut i = 0;
    while i + 2 <= na {
        let mut j = 0;
        while j + 4 <= nb {
            let r = tile::<2, 4>(ap.add(i * d), bp.add(j * d), d);
            out[i * ldo + j..i * ldo + j + 4].copy_from_slice(&r[..4]);
            out[(i + 1) * ldo + j..(i + 1) * ldo + j + 4].copy_from_slice(&r[4..]);
            j += 4;
        }
        for jj in j..nb {
            for ii in i..i + 2 {
                out[ii * ldo + jj] = dot(&a[ii * d..(ii + 1) * d], &b[jj * d..(jj + 1) * d]);
            }
        }
        i += 2;
    }
    if i < na {
        let mut j = 0;
        while j + 8 <= nb {
            let r = tile::<1, 8>(ap.add(i * d), bp.add(j * d), d);
            out[i * ldo + j..i * ldo + j + 8].copy_from_slice(&r);
            j += 8;
        }
        for jj in j..nb {
            out[i * ldo + jj] = dot(&a[i * d..(i + 1) * d], &b[jj * d..(jj + 1) * d]);
        }
    }
}

/// The 8 dot products of `R` rows at `a` with `C` rows at `b` (R·C = 8,
/// rows of `d` floats), in the order (r, c) ↦ r·C + c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tile<const R: usize, const C: usize>(a: *const f32, b: *const f32, d: usize) -> [f32; 8] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < d {
        let mut bv = [_mm256_setzero_ps(); C];
        for (c, v) in bv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(b.add(c * d + i));
        }
        for r in 0..R {
            let av = _mm256_loadu_ps(a.add(r * d + i));
            for c in 0..C {
                acc[r * C + c] = _mm256_add_ps(acc[r * C + c], _mm256_mul_ps(av, bv[c]));
            }
        }
        i += 8;
    }
    // [`dot`]'s reduction of eight accumulators at once: lanes i and i + 4
    // added (s0..s3), then (s0 + s1) + (s2 + s3); `hadd` adds neighbours.
    let half = |x: __m256, y: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(x, y),
            _mm256_permute2f128_ps::<0x31>(x, y),
        )
    };
    let t1 = _mm256_hadd_ps(half(acc[0], acc[4]), half(acc[1], acc[5]));
    let t2 = _mm256_hadd_ps(half(acc[2], acc[6]), half(acc[3], acc[7]));
    let mut r = [0f32; 8];
    _mm256_storeu_ps(r.as_mut_ptr(), _mm256_hadd_ps(t1, t2));
    r
}

/// `out[j] = Σ_e p[j, e] v_e` for up to three queries, entries in order,
/// f32 products then sums (as the portable code): `p` (m, n), `out` (m, d).
/// Columns go in passes of 64 (one query), 32 (two) or 24 and 16 (three), so
/// that enough independent sums are in flight without spilling registers;
/// any width gives the same sums.
///
/// Entries go in blocks of [`block_rows`], every column pass over a block
/// before the next (the sums carried in `out`: the same additions in the
/// same order), so each block of values is read from memory once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn weighted_values_avx2(p: &[f32], values: &[f32], d: usize, out: &mut [f32]) {
    let m = out.len() / d;
    let n = p.len() / m.max(1);
    let block = block_rows(d);
    let mut e0 = 0;
    loop {
        let e1 = (e0 + block).min(n);
        weighted_block(p, n, values, d, out, m, e0..e1);
        if e1 >= n {
            break;
        }
        e0 = e1;
    }
}

/// Entries `es` of [`weighted_values_avx2`]; the first block starts its
/// sums at zero, a later one from `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn weighted_block(
    p: &[f32],
    n: usize,
    values: &[f32],
    d: usize,
    out: &mut [f32],
    m: usize,
    es: std::ops::Range<usize>,
) {
    let mut t0 = 0;
    while t0 < d {
        // at most 9 accumulators, so that they, a values row and the
        // broadcast weights fit AVX2's 16 registers (three queries × 32
        // columns, 12 accumulators, spilled and ran 1.4x slower)
        t0 += match (m, d - t0) {
            (1, 64..) => {
                weighted_pass::<1, 8>(p, n, values, d, out, t0, es.clone());
                64
            }
            (1, 32..) => {
                weighted_pass::<1, 4>(p, n, values, d, out, t0, es.clone());
                32
            }
            (2, 32..) => {
                weighted_pass::<2, 4>(p, n, values, d, out, t0, es.clone());
                32
            }
            (3, 40..) => {
                weighted_pass::<3, 3>(p, n, values, d, out, t0, es.clone());
                24
            }
            (3, 16..) => {
                weighted_pass::<3, 2>(p, n, values, d, out, t0, es.clone());
                16
            }
            (1, _) => {
                weighted_pass::<1, 1>(p, n, values, d, out, t0, es.clone());
                8
            }
            (2, _) => {
                weighted_pass::<2, 1>(p, n, values, d, out, t0, es.clone());
                8
            }
            _ => {
                weighted_pass::<3, 1>(p, n, values, d, out, t0, es.clone());
                8
            }
        };
    }
}

/// Columns t0 .. t0 + 8W of [`weighted_values_avx2`] for M queries over
/// entries `es` (`p` (M, n)): from zero when `es` starts at entry 0, else
/// continuing the sums in `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
#[allow(clippy::needless_range_loop)] // lanes index several arrays
unsafe fn weighted_pass<const M: usize, const W: usize>(
    p: &[f32],
    n: usize,
    values: &[f32],
    d: usize,
    out: &mut [f32],
    t0: usize,
    es: std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    debug_assert!(p.len() == M * n && es.end <= n && values.len() >= n * d);
    let vp = values.as_ptr().add(t0);
    let op = out.as_mut_ptr();
    let mut acc = [[_mm256_setzero_ps(); W]; M];
    if es.start > 0 {
        for j in 0..M {
            for r in 0..W {
                acc[j][r] = _mm256_loadu_ps(op.add(j * d + t0 + 8 * r));
            }
        }
    }
    for e in es {
        let row = vp.add(e * d);
        for j in 0..M {
            let pe = _mm256_set1_ps(*p.get_unchecked(j * n + e));
            for r in 0..W {
                acc[j][r] = _mm256_add_ps(
                    acc[j][r],
                    _mm256_mul_ps(pe, _mm256_loadu_ps(row.add(8 * r))),
                );
            }
        }
    }
    for j in 0..M {
        for r in 0..W {
            _mm256_storeu_ps(op.add(j * d + t0 + 8 * r), acc[j][r]);
        }
    }
}

/// The portable body of [`attend_biased`] (shapes checked by the caller):
/// also writes each entry's logit into `logits` (n,); returns (z, max logit).
#[allow(clippy::too_many_arguments)]
fn attend_biased_generic(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    scale: f32,
    w: &mut [f64],
    out: &mut [f32],
    logits: &mut [f32],
) -> (f64, f32) {
    let d = q.len();
    let n = bias.len();
    let mut mx = f32::NEG_INFINITY;
    let row = |e: usize| &keys[e * d..(e + 1) * d];
    let quads = n - n % 4;
    for e in (0..quads).step_by(4) {
        let s = dot4(q, [row(e), row(e + 1), row(e + 2), row(e + 3)]);
        for j in 0..4 {
            let l = s[j] * scale + bias[e + j];
            logits[e + j] = l;
            mx = mx.max(l);
        }
    }
    for e in quads..n {
        let l = dot(q, row(e)) * scale + bias[e];
        logits[e] = l;
        mx = mx.max(l);
    }
    let mut z = 0f64;
    for (we, l) in w.iter_mut().zip(logits.iter()) {
        *we = ((l - mx) as f64).exp();
        z += *we;
    }
    out.fill(0.0);
    for (e, we) in w.iter().enumerate() {
        let p = (we / z) as f32;
        for (o, v) in out.iter_mut().zip(&values[e * d..(e + 1) * d]) {
            *o += p * v;
        }
    }
    (z, mx)
}

/// All pairwise [`dot`] products of the rows of `a` (na, d) and `b` (nb, d):
/// `out[i * nb + j] = dot(a_i, b_j)`, bit-identical to calling `dot`.
pub fn dot_rows(a: &[f32], b: &[f32], d: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && d.is_multiple_of(8) && d > 0 {
        let (na, nb) = (a.len() / d, b.len() / d);
        assert!(
            a.len() == na * d && b.len() == nb * d && out.len() == na * nb,
            "dot_rows: shapes do not match (na={na}, nb={nb}, d={d})"
        );
        // SAFETY: AVX2 is present; shapes were checked above.
        unsafe { dots_avx2(a, b, d, out, nb) };
        return;
    }
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
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && d.is_multiple_of(8) && d > 0 {
        let (r, n) = (lens.len(), keys.len() / d);
        assert!(
            q.len() == r * d && gains.len() == r && out.len() == r * n && keys.len() == n * d,
            "attention_rows: shapes do not match (r={r}, n={n}, d={d})"
        );
        // every row's dot products with the keys its longest row reads, then
        // each row as the portable code finishes it
        let m = lens.iter().copied().max().unwrap_or(0);
        assert!(m <= n, "attention_rows: a row attends to {m} > {n} keys");
        let mut dots = vec![0f32; r * m];
        // SAFETY: AVX2 is present; shapes were checked above.
        unsafe { dots_avx2(q, &keys[..m * d], d, &mut dots, m) };
        for (i, row) in out.chunks_exact_mut(n).enumerate() {
            let (live, rest) = row.split_at_mut(lens[i]);
            for (x, dt) in live.iter_mut().zip(&dots[i * m..]) {
                *x = dt * scale * gains[i];
            }
            softmax_in_place(live);
            rest.fill(0.0);
        }
        return;
    }
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
    fn the_vectorised_attention_equals_the_generic_code_bit_for_bit() {
        let f = |i: usize, s: usize| (((i * 2654435761 + s) >> 7) % 1999) as f32 / 999.0 - 1.0;
        for (nq, n, d) in [
            (1usize, 1usize, 64usize),
            (1, 7, 64),
            (3, 9, 64),
            (3, 2112, 64),
            (2, 33, 8),
            (4, 13, 16),
            (9, 31, 256),
            // three queries: every pass width of `weighted_values_avx2`
            (3, 11, 8),
            (3, 6, 24),
            (3, 17, 40),
            (1, 9, 37),
            (3, 5, 3),
            // blocks of entries (`block_rows`): a partial last block, one
            // entry past a block, two blocks and a bit of d = 8
            (3, 2111, 64),
            (3, 130, 64),
            (1, 65, 64),
            (2, 1300, 8),
        ] {
            let q: Vec<f32> = (0..nq * d).map(|i| f(i, 1) * 3.0).collect();
            let k: Vec<f32> = (0..n * d).map(|i| f(i, 2) * 3.0).collect();
            let v: Vec<f32> = (0..n * d).map(|i| f(i, 3)).collect();
            let b: Vec<f32> = (0..n)
                .map(|i| match i % 5 {
                    0 => 0.7,
                    3 => f32::NEG_INFINITY,
                    // weights near e^-740: tiny, subnormal or zero (the exp's special lanes)
                    4 if i % 3 == 0 => -740.0,
                    _ => 0.0,
                })
                .collect();
            let (mut w, mut z, mut o) = (vec![0f64; nq * n], vec![0f64; nq], vec![0f32; nq * d]);
            let (mut x, mut p) = (vec![0f32; nq * n], vec![0f32; nq * n]);
            attend_biased_probs(&q, &k, &v, &b, 0.3, &mut w, &mut z, &mut o, &mut x, &mut p);
            for j in 0..nq {
                let (mut w1, mut o1, mut l1) = (vec![0f64; n], vec![0f32; d], vec![0f32; n]);
                let (z1, mx) = attend_biased_generic(
                    &q[j * d..(j + 1) * d],
                    &k,
                    &v,
                    &b,
                    0.3,
                    &mut w1,
                    &mut o1,
                    &mut l1,
                );
                let what = format!("nq={nq} n={n} d={d} query {j}");
                assert_eq!(z[j].to_bits(), z1.to_bits(), "z {what}");
                let bits64 = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits64(&w[j * n..(j + 1) * n]), bits64(&w1), "w {what}");
                assert_eq!(bits(&o[j * d..(j + 1) * d]), bits(&o1), "out {what}");
                let x1: Vec<f32> = l1.iter().map(|l| l - mx).collect();
                assert_eq!(bits(&x[j * n..(j + 1) * n]), bits(&x1), "x {what}");
                let p1: Vec<f32> = w1.iter().map(|we| (we / z1) as f32).collect();
                assert_eq!(bits(&p[j * n..(j + 1) * n]), bits(&p1), "p {what}");
                // w is exp of x, exactly
                for (we, xe) in w1.iter().zip(&x1) {
                    assert_eq!(we.to_bits(), (*xe as f64).exp().to_bits(), "exp(x) {what}");
                }
            }
        }
    }

    #[test]
    fn attention_rows_equal_the_portable_code_bit_for_bit() {
        let f = |i: usize, s: usize| (((i * 2654435761 + s) >> 7) % 1999) as f32 / 399.0 - 2.5;
        for (r, n, d) in [
            (1usize, 1usize, 64usize),
            (5, 37, 64),
            (32, 300, 64),
            (3, 9, 8),
            (4, 10, 5),
        ] {
            let q: Vec<f32> = (0..r * d).map(|i| f(i, 1)).collect();
            let k: Vec<f32> = (0..n * d).map(|i| f(i, 2)).collect();
            let lens: Vec<usize> = (0..r).map(|i| n - r + i + 1).collect();
            let gains: Vec<f32> = (0..r).map(|i| 1.0 + i as f32 * 0.1).collect();
            let (mut a, mut b) = (vec![0f32; r * n], vec![0f32; r * n]);
            attention_rows(&q, &k, d, &lens, &gains, 0.125, &mut a);
            attention_rows_generic(&q, &k, d, &lens, &gains, 0.125, &mut b);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "r={r} n={n} d={d}");
        }
    }

    #[test]
    fn dot_rows_equals_dot_bit_for_bit_on_every_tile_edge() {
        let f = |i: usize, s: usize| (((i * 2654435761 + s) >> 7) % 1999) as f32 / 99.0 - 10.0;
        for (na, nb, d) in [
            (1usize, 1usize, 8usize),
            (3, 9, 64),
            (5, 13, 16),
            (2, 8, 64),
            (7, 31, 24),
            (4, 4, 5),
        ] {
            let a: Vec<f32> = (0..na * d).map(|i| f(i, 1)).collect();
            let b: Vec<f32> = (0..nb * d).map(|i| f(i, 2)).collect();
            let mut out = vec![0f32; na * nb];
            dot_rows(&a, &b, d, &mut out);
            for i in 0..na {
                for j in 0..nb {
                    let want = dot(&a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]);
                    assert_eq!(
                        out[i * nb + j].to_bits(),
                        want.to_bits(),
                        "({i}, {j}) of {na}x{nb}, d={d}"
                    );
                }
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
