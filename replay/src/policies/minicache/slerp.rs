//! MiniCache's merge of one position's pair of vectors: SLERP of their unit
//! directions with the norms kept (and the angular distance that decides
//! retention), or the Mean-KV baseline.

use kvreplay_kernels::cpu::l2_norm_f32;

/// One position's merge of a pair of vectors.
#[derive(Clone, Debug)]
pub struct Merged {
    /// Unit direction (f16-rounded, renormalised), or the mean vector for Mean-KV.
    pub e: Vec<f32>,
    /// Norms (f16-rounded).
    pub na: f32,
    pub nb: f32,
    /// Ω/π, None when a norm is zero.
    pub dist: Option<f64>,
    /// Must be retained (zero norm, antipodal).
    pub forced: bool,
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// SLERP merge of `a` (shallower) and `b` (deeper) with weight `t` on `b`.
pub fn merge_token(a: &[f32], b: &[f32], t: f32) -> Merged {
    let (na, nb) = (l2_norm_f32(a), l2_norm_f32(b));
    let unit = |x: &[f32], n: f32| -> Vec<f32> { x.iter().map(|v| v / n).collect() };
    let (mut e, dist, forced) = if na < 1e-8 || nb < 1e-8 {
        let e = if na >= 1e-8 {
            unit(a, na)
        } else if nb >= 1e-8 {
            unit(b, nb)
        } else {
            vec![0.0; a.len()]
        };
        (e, None, true)
    } else {
        let (ua, ub) = (unit(a, na), unit(b, nb));
        let diff: Vec<f32> = ua.iter().zip(&ub).map(|(x, y)| x - y).collect();
        let sum: Vec<f32> = ua.iter().zip(&ub).map(|(x, y)| x + y).collect();
        let omega = 2.0 * l2_norm_f32(&diff).atan2(l2_norm_f32(&sum));
        let pi = std::f32::consts::PI;
        if omega < 1e-6 {
            (
                ua.iter()
                    .zip(&ub)
                    .map(|(x, y)| (1.0 - t) * x + t * y)
                    .collect(),
                Some((omega / pi) as f64),
                false,
            )
        } else if pi - omega < 1e-6 {
            (
                if t >= 0.5 { ub } else { ua },
                Some((omega / pi) as f64),
                true,
            )
        } else {
            let (s0, s1, s) = (((1.0 - t) * omega).sin(), (t * omega).sin(), omega.sin());
            (
                ua.iter()
                    .zip(&ub)
                    .map(|(x, y)| (s0 * x + s1 * y) / s)
                    .collect(),
                Some((omega / pi) as f64),
                false,
            )
        }
    };
    // Store at f16 and renormalise, as the restore does.
    e.iter_mut().for_each(|v| *v = f16r(*v));
    let n = l2_norm_f32(&e);
    if n > 0.0 {
        e.iter_mut().for_each(|v| *v /= n);
    }
    Merged {
        e,
        na: f16r(na),
        nb: f16r(nb),
        dist,
        forced,
    }
}

/// Mean-KV: the mean of the two vectors (stored at f16).
pub(super) fn mean_merge(a: &[f32], b: &[f32]) -> Merged {
    Merged {
        e: a.iter().zip(b).map(|(x, y)| f16r((x + y) / 2.0)).collect(),
        na: 0.0,
        nb: 0.0,
        dist: None,
        forced: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slerp_round_trip_and_guards() {
        // Identical directions: the merge restores each vector from its own norm exactly
        // (up to f16 storage of the direction and norms).
        let a = [3.0f32, 4.0];
        let b = [6.0f32, 8.0];
        let m = merge_token(&a, &b, 0.6);
        assert_eq!(m.dist, Some(0.0));
        assert!((m.na - 5.0).abs() < 1e-3 && (m.nb - 10.0).abs() < 1e-2);
        assert!((m.e[0] - 0.6).abs() < 1e-3 && (m.e[1] - 0.8).abs() < 1e-3);
        // Orthogonal unit vectors at t = 0.5: the midpoint direction (1, 1)/√2, Ω/π = 1/2.
        let m = merge_token(&[1.0, 0.0], &[0.0, 1.0], 0.5);
        assert!((m.dist.unwrap() - 0.5).abs() < 1e-6);
        assert!(
            (m.e[0] - m.e[1]).abs() < 1e-3
                && (m.e[0] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-3
        );
        // t weights the deeper layer: at t = 0.6 the direction leans to b (angle 0.6·90°).
        let m = merge_token(&[1.0, 0.0], &[0.0, 1.0], 0.6);
        assert!((m.e[1].atan2(m.e[0]) - 0.6 * std::f32::consts::FRAC_PI_2).abs() < 1e-3);
        // Antipodal and zero-norm pairs are forced into the retention set.
        assert!(merge_token(&[1.0, 0.0], &[-1.0, 0.0], 0.6).forced);
        assert!(merge_token(&[0.0, 0.0], &[1.0, 0.0], 0.6).forced);
    }
}
