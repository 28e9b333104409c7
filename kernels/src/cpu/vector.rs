//! Small vector math shared by the policies: one definition each, so every
//! policy rounds the same way.

/// ‖x‖₂ with the squares accumulated in f64.
#[inline]
pub fn l2_norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|v| (*v as f64) * (*v as f64))
        .sum::<f64>()
        .sqrt()
}

/// ‖x‖₂ accumulated in f32 (MiniCache's reference computes its norms so).
#[inline]
pub fn l2_norm_f32(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}

/// Cosine similarity in f64 (0 when either vector is zero).
#[inline]
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += *x as f64 * *y as f64;
        aa += (*x as f64).powi(2);
        bb += (*y as f64).powi(2);
    }
    ab / (aa.sqrt() * bb.sqrt()).max(1e-12)
}

/// Max-shifted softmax in place with exp and normalisation in f64 (for
/// scoring rows, where probabilities far below the maximum still matter).
#[inline]
pub fn softmax_f64_norm(x: &mut [f32]) {
    let mx = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut w = vec![0f64; x.len()];
    super::exp::exp_shifted(x, mx, &mut w);
    let sum: f64 = w.iter().sum();
    x.iter_mut()
        .zip(&w)
        .for_each(|(v, we)| *v = (we / sum) as f32);
}

/// Asymmetric min-max quantisation of `x` as one group to `bits` bits, and
/// back (KIVI's rule: scale (max − min)/(2^b − 1) and the minimum, both
/// rounded to f16; round, clamp). The caller accounts the storage cost.
#[inline]
pub fn fake_quant(x: &mut [f32], bits: u32) {
    let levels = ((1u32 << bits) - 1) as f32;
    let mn = x.iter().fold(f32::INFINITY, |m, v| m.min(*v));
    let mx = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let scale = half::f16::from_f32((mx - mn) / levels).to_f32();
    let zero = half::f16::from_f32(mn).to_f32();
    for v in x.iter_mut() {
        *v = if scale > 0.0 {
            ((*v - zero) / scale).round().clamp(0.0, levels) * scale + zero
        } else {
            zero
        };
    }
}

/// Softmax of f64 values (max-shifted; D2O's layer shares).
#[inline]
pub fn softmax_f64(x: &[f64]) -> Vec<f64> {
    let mx = x.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = x.iter().map(|y| (y - mx).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|y| y / z).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_quant_known_values() {
        // 2 bits over [0, 3]: scale 1, levels 0..3 -> exact integers survive
        let mut x = vec![0.0, 1.0, 2.0, 3.0, 1.4, 2.6];
        fake_quant(&mut x, 2);
        assert_eq!(x, vec![0.0, 1.0, 2.0, 3.0, 1.0, 3.0]);
        // constant group: scale 0 -> every value is the min
        let mut c = vec![0.5; 4];
        fake_quant(&mut c, 4);
        assert_eq!(c, vec![0.5; 4]);
    }

    #[test]
    fn known_values() {
        assert_eq!(l2_norm(&[3.0, 4.0]), 5.0);
        assert_eq!(l2_norm_f32(&[3.0, 4.0]), 5.0);
        assert_eq!(cosine(&[1.0, 0.0], &[0.0, 2.0]), 0.0);
        assert!((cosine(&[1.0, 1.0], &[2.0, 2.0]) - 1.0).abs() < 1e-15);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
        // logits 0 and ln 3: probabilities 1/4 and 3/4
        let mut x = [0.0f32, 3f32.ln()];
        softmax_f64_norm(&mut x);
        assert!((x[0] - 0.25).abs() < 1e-7 && (x[1] - 0.75).abs() < 1e-7);
        let y = softmax_f64(&[0.0, 3f64.ln()]);
        assert!((y[0] - 0.25).abs() < 1e-15 && (y[1] - 0.75).abs() < 1e-15);
    }
}
