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
    with_avx2!(attend_biased_generic(q, keys, values, bias, scale, w, out))
}

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
    assert!(
        keys.len() == n * d && values.len() == n * d && w.len() == n && out.len() == d,
        "attend_biased: shapes do not match (n={n}, d={d})"
    );
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

/// The `k` best items by (score descending, position descending), as indices
/// into `scores`, ascending. Positions must be distinct. NaN scores rank last.
pub fn top_k(scores: &[f32], pos: &[u32], k: usize) -> Vec<usize> {
    assert_eq!(
        scores.len(),
        pos.len(),
        "top_k: scores and positions differ in length"
    );
    let key = |i: usize| {
        if scores[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            scores[i]
        }
    };
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| {
        key(b)
            .partial_cmp(&key(a))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(pos[b].cmp(&pos[a]))
    });
    idx.truncate(k);
    idx.sort_unstable();
    idx
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
    fn top_k_breaks_ties_towards_later_positions() {
        let s = [1.0, 3.0, 3.0, f32::NAN, 2.0];
        let p = [0, 1, 2, 3, 4];
        assert_eq!(top_k(&s, &p, 2), vec![1, 2]);
        assert_eq!(top_k(&s, &p, 1), vec![2]);
        assert_eq!(top_k(&s, &p, 4), vec![0, 1, 2, 4]);
    }
}
