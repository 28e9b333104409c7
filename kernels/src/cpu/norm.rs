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

/// GeGLU with the tanh approximation of GELU (HF `gelu_pytorch_tanh`, ggml
/// `gelu`): gate[i] = gelu(gate[i]) * up[i], in place on `gate`, where
/// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))), in f32.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    const SQRT_2_OVER_PI: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
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
