//! Causal softmax attention for one query head, with the statistics a trace records.

use super::linear::matmul_strided;

/// Optional by-products of [`causal_attention_head`].
#[derive(Default)]
pub struct AttentionStats<'a> {
    /// (n_tracked,): `colsum[j] += Σ_i P[i, j]` over this call's queries, for j < n_tracked.
    pub colsum: Option<&'a mut [f32]>,
    /// (c, n_keys): each query's probabilities over all keys (zero above the diagonal).
    pub probs: Option<&'a mut [f32]>,
}

/// `out = softmax(scale · q kᵀ + causal mask) · v` for one head.
///
/// - `q`: (c, d), queries at positions `pos0 .. pos0 + c`
/// - `k`, `v`: (n_keys, d) with n_keys >= pos0 + c; key j is at position j
/// - `out`: (c, d)
///
/// Query i attends to keys `0 ..= pos0 + i`. Probabilities are normalised in
/// f32 after an f64 sum of the max-shifted exponentials.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    pos0: usize,
    scale: f32,
    out: &mut [f32],
    stats: AttentionStats<'_>,
) {
    windowed_attention_head(q, k, v, d, pos0, None, scale, out, stats)
}

/// [`causal_attention_head`] with an optional sliding window of `W` keys: the
/// query at position t attends to keys `max(0, t - W + 1) ..= t` (W keys
/// counting itself, W - 1 before it), as HF transformers' sliding-window mask
/// (`kv_idx > q_idx - W`) and llama.cpp (`q - k >= W` masked) define it.
/// Masked keys get probability exactly 0. With `None` (or W >= t + 1) the
/// computation is the plain causal one, operation for operation.
#[allow(clippy::too_many_arguments)]
pub fn windowed_attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    pos0: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    mut stats: AttentionStats<'_>,
) {
    assert!(window != Some(0), "attention: a window of 0 keys");
    let c = q.len() / d;
    let n = pos0 + c;
    assert_eq!(q.len(), c * d, "attention: q is not (c, d)");
    assert!(
        k.len() >= n * d && v.len() >= n * d,
        "attention: k/v shorter than pos0 + c"
    );
    assert_eq!(out.len(), c * d, "attention: out is not (c, d)");
    let mut p = vec![0f32; c * n];
    // S = q · k[0..n]ᵀ  (c, n)
    matmul_strided(q, d, &k[..n * d], d, true, &mut p, n, c, d, n);
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        let valid = pos0 + i + 1;
        let lo = window.map_or(0, |w| valid.saturating_sub(w));
        let (row, masked) = row.split_at_mut(valid);
        let (before, live) = row.split_at_mut(lo);
        before.fill(0.0);
        let mx = live.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x)) * scale;
        let mut z = 0f64;
        for x in live.iter_mut() {
            *x = (*x * scale - mx).exp();
            z += *x as f64;
        }
        let inv = (1.0 / z) as f32;
        live.iter_mut().for_each(|x| *x *= inv);
        masked.fill(0.0);
    }
    // out = P · v[0..n]  (c, d)
    matmul_strided(&p, n, &v[..n * d], d, false, out, d, c, n, d);
    if let Some(colsum) = stats.colsum.as_deref_mut() {
        let m = colsum.len().min(n);
        for row in p.chunks_exact(n) {
            for (s, x) in colsum[..m].iter_mut().zip(row) {
                *s += x;
            }
        }
    }
    if let Some(probs) = stats.probs.as_deref_mut() {
        probs.copy_from_slice(&p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// softmax(scale q·k) v in f64, one query at a time.
    fn naive(q: &[f32], k: &[f32], v: &[f32], d: usize, pos0: usize, scale: f64) -> Vec<f64> {
        let c = q.len() / d;
        let mut out = vec![0f64; c * d];
        for i in 0..c {
            let n = pos0 + i + 1;
            let l: Vec<f64> = (0..n)
                .map(|j| {
                    scale
                        * (0..d)
                            .map(|t| q[i * d + t] as f64 * k[j * d + t] as f64)
                            .sum::<f64>()
                })
                .collect();
            let mx = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = l.iter().map(|x| (x - mx).exp()).sum();
            for j in 0..n {
                let w = (l[j] - mx).exp() / z;
                for t in 0..d {
                    out[i * d + t] += w * v[j * d + t] as f64;
                }
            }
        }
        out
    }

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.731).sin() * 2.0)
            .collect()
    }

    #[test]
    fn matches_naive_with_offset_and_stats() {
        let (d, pos0, c) = (8, 5, 4);
        let n = pos0 + c;
        let (q, k, v) = (data(c * d, 0.1), data(n * d, 0.2), data(n * d, 0.3));
        let mut out = vec![0f32; c * d];
        let mut colsum = vec![0f32; 6];
        let mut probs = vec![0f32; c * n];
        let stats = AttentionStats {
            colsum: Some(&mut colsum),
            probs: Some(&mut probs),
        };
        causal_attention_head(&q, &k, &v, d, pos0, 0.5, &mut out, stats);
        let want = naive(&q, &k, &v, d, pos0, 0.5);
        for (a, b) in out.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
        for i in 0..c {
            let row = &probs[i * n..(i + 1) * n];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(row[pos0 + i + 1..].iter().all(|x| *x == 0.0), "causal mask");
        }
        for j in 0..6 {
            let s: f32 = (0..c).map(|i| probs[i * n + j]).sum();
            assert!((colsum[j] - s).abs() < 1e-6);
        }
    }

    #[test]
    fn window_keeps_the_last_w_keys_counting_the_query() {
        // Window 3 at positions 0..6: the query at t sees keys t-2, t-1, t.
        let (d, pos0, c, w) = (4, 2, 4, 3);
        let n = pos0 + c;
        let (q, k, v) = (data(c * d, 0.4), data(n * d, 0.5), data(n * d, 0.6));
        let mut out = vec![0f32; c * d];
        let mut probs = vec![0f32; c * n];
        let stats = AttentionStats {
            colsum: None,
            probs: Some(&mut probs),
        };
        windowed_attention_head(&q, &k, &v, d, pos0, Some(w), 1.0, &mut out, stats);
        for i in 0..c {
            let t = pos0 + i;
            let row = &probs[i * n..(i + 1) * n];
            for (j, p) in row.iter().enumerate() {
                let live = j <= t && j + w > t;
                assert_eq!(*p > 0.0, live, "query {t} key {j}: {p}");
            }
            // Hand-computed: the output equals full causal attention over the
            // window's keys alone (positions t-2..=t as a 3-key sequence).
            let lo = t + 1 - w;
            let mut o1 = vec![0f32; d];
            causal_attention_head(
                &q[i * d..(i + 1) * d],
                &k[lo * d..(t + 1) * d],
                &v[lo * d..(t + 1) * d],
                d,
                w - 1,
                1.0,
                &mut o1,
                AttentionStats::default(),
            );
            for (a, b) in out[i * d..(i + 1) * d].iter().zip(&o1) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        }
        // Two keys, window 1: each query attends to itself only.
        let (q, k, v) = (data(2 * d, 1.0), data(2 * d, 2.0), data(2 * d, 3.0));
        let mut out = vec![0f32; 2 * d];
        windowed_attention_head(
            &q,
            &k,
            &v,
            d,
            0,
            Some(1),
            1.0,
            &mut out,
            AttentionStats::default(),
        );
        assert_eq!(out, v);
    }

    #[test]
    fn a_window_wider_than_the_sequence_is_plain_causal_attention() {
        let (d, pos0, c) = (8, 3, 5);
        let n = pos0 + c;
        let (q, k, v) = (data(c * d, 0.7), data(n * d, 0.8), data(n * d, 0.9));
        let (mut a, mut b) = (vec![0f32; c * d], vec![0f32; c * d]);
        causal_attention_head(&q, &k, &v, d, pos0, 0.3, &mut a, AttentionStats::default());
        windowed_attention_head(
            &q,
            &k,
            &v,
            d,
            pos0,
            Some(n),
            0.3,
            &mut b,
            AttentionStats::default(),
        );
        assert_eq!(a, b);
    }

    #[test]
    fn first_position_attends_only_to_itself() {
        let d = 4;
        let (q, k, v) = (data(d, 1.0), data(d, 2.0), data(d, 3.0));
        let mut out = vec![0f32; d];
        causal_attention_head(&q, &k, &v, d, 0, 1.0, &mut out, AttentionStats::default());
        assert_eq!(out, v);
    }
}
