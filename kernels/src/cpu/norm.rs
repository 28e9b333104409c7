//! Element-wise and row-wise helpers of the llama block.

/// RMSNorm of each row of `x` (rows, dim) in place: x * w / sqrt(mean(x²) + eps).
/// The mean square is accumulated in f64.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert_eq!(x.len() % dim, 0, "rms_norm: x is not (rows, dim)");
    for row in x.chunks_exact_mut(dim) {
        let ms = row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / dim as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    }
}

/// SwiGLU: gate[i] = silu(gate[i]) * up[i], in place on `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
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
    fn argmax_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }
}
