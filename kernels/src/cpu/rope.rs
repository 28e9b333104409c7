//! Rotary position embedding.

/// How rotated dimensions are paired within a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// i with i + rotated/2 (HF "rotate_half", GPT-NeoX).
    Neox,
    /// 2i with 2i + 1 (GPT-J, llama.cpp's default for llama GGUFs).
    Interleaved,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub theta: f64,
    pub style: RopeStyle,
    /// Leading dimensions of each head that are rotated.
    pub rotated_dims: usize,
    /// Linear position scaling: angle = pos / factor * inv_freq (1.0 = none).
    pub linear_factor: f64,
    /// Llama 3 frequency scaling of the inverse frequencies (None = none).
    pub llama3: Option<Llama3Rope>,
}

/// Llama 3.x RoPE scaling (HF `rope_scaling.rope_type = "llama3"`): inverse
/// frequencies whose wavelength exceeds `original_max_position_embeddings /
/// low_freq_factor` are divided by `factor`, those with wavelength below
/// `original_max_position_embeddings / high_freq_factor` are kept, and those
/// in between are interpolated (transformers' `_compute_llama3_parameters`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl Llama3Rope {
    /// The scaled inverse frequency, exactly as transformers computes it
    /// (there in f32, here in f64).
    pub fn scale(&self, inv_freq: f64) -> f64 {
        let old = self.original_max_position_embeddings;
        let low_freq_wavelen = old / self.low_freq_factor;
        let high_freq_wavelen = old / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen > low_freq_wavelen {
            inv_freq / self.factor
        } else if wavelen < high_freq_wavelen {
            inv_freq
        } else {
            let smooth = (old / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

impl RopeParams {
    /// Rotation angle of pair `i` at position `pos`, computed in f64.
    pub fn angle(&self, pos: usize, i: usize) -> f64 {
        let mut inv_freq = self
            .theta
            .powf(-((2 * i) as f64) / self.rotated_dims as f64);
        if let Some(l3) = &self.llama3 {
            inv_freq = l3.scale(inv_freq);
        }
        pos as f64 / self.linear_factor * inv_freq
    }
}

/// Rotate `x` (rows, n_heads, head_dim) in place; row r is at position `pos0 + r`.
pub fn apply_rope(x: &mut [f32], n_heads: usize, head_dim: usize, pos0: usize, p: &RopeParams) {
    rotate(x, n_heads, head_dim, pos0, p, 1.0)
}

/// Undo [`apply_rope`]: rotate every row back by its position's angles.
pub fn unapply_rope(x: &mut [f32], n_heads: usize, head_dim: usize, pos0: usize, p: &RopeParams) {
    rotate(x, n_heads, head_dim, pos0, p, -1.0)
}

fn rotate(x: &mut [f32], n_heads: usize, head_dim: usize, pos0: usize, p: &RopeParams, sign: f64) {
    let rows = x.len() / (n_heads * head_dim).max(1);
    let table = rope_table(rows, pos0, p, sign);
    rotate_with_table(x, n_heads, head_dim, p.style, p.rotated_dims, &table);
}

/// (cos, sin) of every rotation angle, `sign`·angle(pos0 + r, i), computed in
/// f64 and rounded to f32: (rows, rotated_dims / 2, 2). Shared by the CPU and
/// CUDA rotations so both rotate by bit-identical angles.
pub fn rope_table(rows: usize, pos0: usize, p: &RopeParams, sign: f64) -> Vec<f32> {
    let half = p.rotated_dims / 2;
    let mut t = Vec::with_capacity(rows * half * 2);
    for r in 0..rows {
        for i in 0..half {
            let a = sign * p.angle(pos0 + r, i);
            t.push(a.cos() as f32);
            t.push(a.sin() as f32);
        }
    }
    t
}

/// (cos, sin) rows per position, computed on first use and kept: for code
/// that rotates single vectors at scattered positions many times. Positions
/// below [`with_positions`](Self::with_positions)' count are read without a
/// lock.
pub struct RopeCache {
    p: RopeParams,
    /// Rows of positions 0 .. n, computed up front.
    table: Vec<f32>,
    /// Rows of positions n .. (grown on demand).
    rows: std::sync::Mutex<Vec<f32>>,
}

impl RopeCache {
    pub fn new(p: RopeParams) -> RopeCache {
        RopeCache::with_positions(p, 0)
    }

    /// A cache with the rows of positions 0 .. n computed now (the same
    /// values as computing them on demand).
    pub fn with_positions(p: RopeParams, n: usize) -> RopeCache {
        RopeCache {
            table: rope_table(n, 0, &p, 1.0),
            p,
            rows: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub fn params(&self) -> &RopeParams {
        &self.p
    }

    /// Rotate one head vector `x` (head_dim,) at `pos` by `sign` (1.0
    /// applies, -1.0 undoes); the same result as [`apply_rope`] /
    /// [`unapply_rope`] on that vector (cos is even and sin odd in libm).
    pub fn rotate(&self, x: &mut [f32], pos: usize, sign: f64) {
        let w = self.p.rotated_dims; // (half, 2) per position
        let mut buf = [0f32; 256];
        let mut heap = Vec::new();
        let row: &mut [f32] = if w <= buf.len() {
            &mut buf[..w]
        } else {
            heap.resize(w, 0.0);
            &mut heap
        };
        let n0 = self.table.len() / w.max(1);
        if pos < n0 {
            row.copy_from_slice(&self.table[pos * w..(pos + 1) * w]);
        } else {
            let mut rows = self.rows.lock().expect("rope cache lock");
            let have = n0 + rows.len() / w.max(1);
            if pos >= have {
                let more = rope_table(pos + 1 - have, have, &self.p, 1.0);
                rows.extend_from_slice(&more);
            }
            row.copy_from_slice(&rows[(pos - n0) * w..(pos - n0 + 1) * w]);
        }
        if sign < 0.0 {
            row.iter_mut().skip(1).step_by(2).for_each(|s| *s = -*s);
        }
        rotate_with_table(x, 1, x.len(), self.p.style, self.p.rotated_dims, row);
    }
}

/// Rotate `x` (rows, n_heads, head_dim) in place by a [`rope_table`].
pub fn rotate_with_table(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    style: RopeStyle,
    rotated_dims: usize,
    table: &[f32],
) {
    assert!(
        rotated_dims <= head_dim && rotated_dims.is_multiple_of(2),
        "rope: bad rotated_dims"
    );
    let row_len = n_heads * head_dim;
    assert_eq!(
        x.len() % row_len,
        0,
        "rope: x is not (rows, n_heads, head_dim)"
    );
    let half = rotated_dims / 2;
    assert_eq!(
        table.len(),
        x.len() / row_len * half * 2,
        "rope: table is not (rows, half, 2)"
    );
    for (row, cs) in x
        .chunks_exact_mut(row_len)
        .zip(table.chunks_exact(half * 2))
    {
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (cos, sin) = (cs[2 * i], cs[2 * i + 1]);
                let (a, b) = match style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x1 * cos + x0 * sin;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(style: RopeStyle) -> RopeParams {
        RopeParams {
            theta: 10000.0,
            style,
            rotated_dims: 4,
            linear_factor: 1.0,
            llama3: None,
        }
    }

    #[test]
    fn rope_cache_equals_direct_rotation_bit_for_bit() {
        let p = RopeParams {
            theta: 10000.0,
            style: RopeStyle::Neox,
            rotated_dims: 8,
            linear_factor: 1.0,
            llama3: None,
        };
        let cache = RopeCache::new(p);
        let table = RopeCache::with_positions(p, 20);
        for pos in [5usize, 0, 3000, 17, 19, 20, 21, 2000] {
            for sign in [1.0, -1.0] {
                let x0: Vec<f32> = (0..8).map(|i| (i as f32 - 3.3) * 0.7).collect();
                let (mut a, mut b, mut c) = (x0.clone(), x0.clone(), x0.clone());
                cache.rotate(&mut a, pos, sign);
                table.rotate(&mut c, pos, sign);
                assert_eq!(a, c, "with_positions, pos {pos} sign {sign}");
                if sign > 0.0 {
                    apply_rope(&mut b, 1, 8, pos, &p);
                } else {
                    unapply_rope(&mut b, 1, 8, pos, &p);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "pos {pos} sign {sign}");
            }
        }
    }

    #[test]
    fn position_zero_is_identity_and_known_rotation() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        apply_rope(&mut x, 1, 4, 0, &params(RopeStyle::Neox));
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
        // Position 1, pair 0 (inv_freq 1): (x0, x2) = (1, 3) rotated by 1 rad.
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        apply_rope(&mut x, 1, 4, 1, &params(RopeStyle::Neox));
        let (c, s) = (1f32.cos(), 1f32.sin());
        assert!((x[0] - (c - 3.0 * s)).abs() < 1e-6 && (x[2] - (3.0 * c + s)).abs() < 1e-6);
    }

    /// Interleaved RoPE on a vector equals NEOX RoPE on the same vector with its
    /// pairs de-interleaved: the identity capture relies on when it converts
    /// llama GGUF weights (stored interleaved) to the HF layout.
    #[test]
    fn interleaved_equals_neox_after_permutation() {
        let d = 8;
        let p_i = RopeParams {
            theta: 500.0,
            style: RopeStyle::Interleaved,
            rotated_dims: d,
            linear_factor: 1.0,
            llama3: None,
        };
        let p_n = RopeParams {
            style: RopeStyle::Neox,
            ..p_i
        };
        let v: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.37).sin()).collect(); // 2 heads
        let deinterleave = |x: &[f32]| -> Vec<f32> {
            let mut o = vec![0.0; x.len()];
            for h in 0..2 {
                for i in 0..d / 2 {
                    o[h * d + i] = x[h * d + 2 * i];
                    o[h * d + d / 2 + i] = x[h * d + 2 * i + 1];
                }
            }
            o
        };
        let mut a = v.clone();
        apply_rope(&mut a, 2, d, 7, &p_i);
        let mut b = deinterleave(&v);
        apply_rope(&mut b, 2, d, 7, &p_n);
        assert_eq!(deinterleave(&a), b);
    }

    #[test]
    fn unapply_inverts_apply() {
        let p = RopeParams {
            theta: 10000.0,
            style: RopeStyle::Neox,
            rotated_dims: 8,
            linear_factor: 1.0,
            llama3: None,
        };
        let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut y = x.clone();
        apply_rope(&mut y, 1, 8, 1234, &p);
        unapply_rope(&mut y, 1, 8, 1234, &p);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn partial_rotation_leaves_tail() {
        let p = RopeParams {
            theta: 10000.0,
            style: RopeStyle::Neox,
            rotated_dims: 2,
            linear_factor: 1.0,
            llama3: None,
        };
        let mut x = vec![1.0, 0.0, 5.0, 6.0];
        apply_rope(&mut x, 1, 4, 3, &p);
        assert_eq!(&x[2..], &[5.0, 6.0]);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn llama3_scaling_keeps_high_divides_low_and_interpolates_between() {
        // Llama 3.1's parameters: factor 8, low 1, high 4, original context 8192.
        let l3 = Llama3Rope {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let tau = 2.0 * std::f64::consts::PI;
        // wavelength 100 < 8192 / 4: kept
        assert_eq!(l3.scale(tau / 100.0), tau / 100.0);
        // wavelength 10,000 > 8192: divided by 8
        assert_eq!(l3.scale(tau / 10_000.0), tau / 10_000.0 / 8.0);
        // wavelength 4096: smooth = (8192 / 4096 - 1) / 3 = 1/3
        let f = tau / 4096.0;
        let want = (1.0 - 1.0 / 3.0) * f / 8.0 + f / 3.0;
        assert!((l3.scale(f) - want).abs() < 1e-15 * want.abs().max(1.0));
        // the angle uses it
        let p = RopeParams {
            theta: 500_000.0,
            style: RopeStyle::Neox,
            rotated_dims: 128,
            linear_factor: 1.0,
            llama3: Some(l3),
        };
        let inv = 500_000f64.powf(-(2.0 * 40.0) / 128.0);
        assert_eq!(p.angle(7, 40), 7.0 * l3.scale(inv));
    }
}
