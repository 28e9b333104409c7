//! `verify`: sizes, checksums, then an independent recomputation of the
//! attention output from the stored q/k/v at a sample of positions.

use std::path::Path;

use crate::{Dtype, Trace, TraceError};

#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// Positions recomputed per layer (spread over the trace; the last prompt
    /// position and the last position are always included).
    pub positions_per_layer: usize,
    /// Relative L2 tolerance for the recomputed `o`; `None` picks it from the dtype.
    pub tolerance: Option<f64>,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            positions_per_layer: 8,
            tolerance: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct VerifyReport {
    pub files_checked: usize,
    pub bytes_checked: u64,
    pub positions_checked: usize,
    pub max_rel_err: f64,
    pub tolerance: f64,
}

/// Tolerance on the relative L2 error of `o` recomputed from stored q/k/v.
/// The recomputation reads rounded q, k and v: a relative rounding of u on
/// each moves a logit by about 2u|q||k|/sqrt(d), which on this model's largest
/// logits (|logit| ~ 30) shifts probabilities by up to ~60u. With u = 2^-11
/// (f16) that is ~3e-2 in the worst head, 2^-8 (bf16) ~0.2; f32 is exact up to
/// summation order. Corruption (wrong layout, wrong head) gives errors near 1.
pub fn default_tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 1e-4,
        Dtype::F16 => 5e-2,
        Dtype::Bf16 => 0.3,
    }
}

pub fn verify(dir: &Path, opts: &VerifyOptions) -> Result<VerifyReport, TraceError> {
    // sizes, sha256 of every file and finite values: a verified open
    let trace = Trace::open(dir)?;
    let bytes_checked = trace.manifest.files.iter().map(|f| f.size).sum();
    let m = &trace.manifest;
    let tol = opts
        .tolerance
        .unwrap_or_else(|| default_tolerance(m.capture.dtype));
    // a lean trace stores q and o from query_start on: its positions are sampled there
    let qs = m.query_start();
    let positions: Vec<usize> = sample_positions(
        m.total_len() - qs,
        m.prompt_len() - qs,
        opts.positions_per_layer,
    )
    .into_iter()
    .map(|t| t + qs)
    .collect();
    let d = m.model.head_dim;
    let scale = m.model.attn_scale;
    let mut max_rel_err = 0.0f64;
    let (mut q, mut o) = (vec![0f32; d], vec![0f32; d]);
    for l in 0..trace.n_layers() {
        let layer = trace.layer(l);
        // Sliding-window layers: the query at t sees keys t-W+1 ..= t.
        let window = m.model.window(l);
        let ks: Vec<Vec<f32>> = (0..m.model.n_kv_heads)
            .map(|g| layer.k(g).to_f32())
            .collect();
        let vs: Vec<Vec<f32>> = (0..m.model.n_kv_heads)
            .map(|g| layer.v(g).to_f32())
            .collect();
        for h in 0..m.model.n_heads {
            let g = m.kv_head_of(h);
            for &t in &positions {
                layer.q(h).row_into(t, &mut q);
                layer.o(h).row_into(t, &mut o);
                let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
                let got = naive_attention_row(&q, &ks[g], &vs[g], lo, t + 1, d, scale);
                let err = rel_l2(&got, &o);
                max_rel_err = max_rel_err.max(err);
                if err > tol || !err.is_finite() {
                    return Err(TraceError::Recompute {
                        path: layer.path().to_path_buf(),
                        layer: l,
                        head: h,
                        position: t,
                        rel_err: err,
                        tol,
                    });
                }
            }
        }
    }
    Ok(VerifyReport {
        files_checked: trace.manifest.files.len(),
        bytes_checked,
        positions_checked: positions.len() * m.model.n_heads * m.model.n_layers,
        max_rel_err,
        tolerance: tol,
    })
}

/// Up to `n` distinct positions spread over `0..t`, always including
/// `prompt_len - 1` and `t - 1`.
fn sample_positions(t: usize, prompt_len: usize, n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n.max(2))
        .map(|i| i * (t - 1) / (n.max(2) - 1))
        .collect();
    v.push(prompt_len - 1);
    v.push(t - 1);
    v.sort_unstable();
    v.dedup();
    v
}

/// softmax(scale * q·k_j, lo <= j < n) · v in f64: deliberately the plainest form.
fn naive_attention_row(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    lo: usize,
    n: usize,
    d: usize,
    scale: f64,
) -> Vec<f64> {
    let logits: Vec<f64> = (lo..n)
        .map(|j| {
            let kj = &k[j * d..(j + 1) * d];
            scale
                * q.iter()
                    .zip(kj)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
        })
        .collect();
    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut out = vec![0f64; d];
    for (j, wj) in (lo..n).zip(&w) {
        for (o, x) in out.iter_mut().zip(&v[j * d..(j + 1) * d]) {
            *o += wj / z * *x as f64;
        }
    }
    out
}

fn rel_l2(a: &[f64], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - *y as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| x * x).sum();
    (num / den.max(1e-30)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn window_drops_the_keys_before_it() {
        // d = 1, keys 0..3 with v = [100, 1, 2]; window 2 at t = 2 sees keys
        // 1 and 2 only, equal logits (q·k = 0): o = (1 + 2) / 2.
        let (q, k, v) = ([1.0f32], [0.0f32; 3], [100.0f32, 1.0, 2.0]);
        let o = naive_attention_row(&q, &k, &v, 1, 3, 1, 1.0);
        assert_eq!(o, vec![1.5]);
        let o = naive_attention_row(&q, &k, &v, 0, 3, 1, 1.0);
        assert!((o[0] - 103.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn sample_positions_cover_ends() {
        assert_eq!(sample_positions(10, 4, 3), vec![0, 3, 4, 9]);
        assert_eq!(sample_positions(1, 1, 8), vec![0]);
    }
}
