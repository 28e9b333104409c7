//! D2O's layer operation: each layer's share φ_l of the budget from the
//! variance of its heads' attention, its ratio r_l of the prompt and its
//! counts (N important, M recent).

use super::config::{Allocation, D2o};

impl D2o {
    /// φ over layers from every layer's per-head column sums (each (n_heads·P)).
    pub fn layer_shares(&self, colsums: &[&[f32]], n_heads: usize, p: usize) -> Vec<f64> {
        let l = colsums.len();
        if p < 2 || self.allocation == Allocation::Uniform {
            return vec![1.0 / l as f64; l];
        }
        let var = |c: &[f32]| {
            let m = c.iter().map(|x| *x as f64).sum::<f64>() / c.len() as f64;
            c.iter().map(|x| (*x as f64 - m).powi(2)).sum::<f64>() / (c.len() - 1) as f64
        };
        let v: Vec<Vec<f64>> = colsums
            .iter()
            .map(|c| (0..n_heads).map(|h| var(&c[h * p..(h + 1) * p])).collect())
            .collect();
        let softmax = |x: Vec<f64>| kvreplay_kernels::cpu::softmax_f64(&x);
        let raw: Vec<f64> = v
            .iter()
            .map(|vh| vh.iter().sum::<f64>() / vh.len() as f64)
            .collect();
        match self.allocation {
            Allocation::Reciprocal => {
                let r: Vec<f64> = raw.iter().map(|x| 1.0 / x.max(1e-12)).collect();
                let z: f64 = r.iter().sum();
                r.iter().map(|x| x / z).collect()
            }
            Allocation::ExpDecay => softmax(raw.iter().map(|x| -x).collect()),
            Allocation::InvVarSoftmaxRaw => {
                softmax(raw.iter().map(|x| 1.0 / x.max(1e-12)).collect())
            }
            // (uniform returned above)
            Allocation::InvVarSoftmax | Allocation::Uniform => {
                let s: Vec<f64> = v
                    .iter()
                    .map(|vh| {
                        let (mn, mx) = vh
                            .iter()
                            .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
                        vh.iter().map(|x| (x - mn) / (mx - mn + 1e-6)).sum::<f64>()
                            / vh.len() as f64
                    })
                    .collect();
                softmax(s.iter().map(|x| -x).collect())
            }
        }
    }
}

/// r_l = clamp(L·B·φ_l/P, 0.01, 1): the layer's share of the prompt.
pub fn layer_ratio(phi: f64, n_layers: usize, b: usize, p: usize) -> f64 {
    (n_layers as f64 * b as f64 * phi / p as f64).clamp(0.01, 1.0)
}

/// (N, M) for a layer ratio `r` over `len` positions.
pub fn counts(r: f64, len: usize, f: f64) -> (usize, usize) {
    (
        (r * f * len as f64).floor() as usize,
        (r * (1.0 - f) * len as f64).floor() as usize,
    )
}

/// (N, M) of a layer for an average budget `b` per layer.
pub fn layer_counts(phi: f64, n_layers: usize, b: usize, p: usize, f: f64) -> (usize, usize) {
    counts(layer_ratio(phi, n_layers, b, p), p, f)
}

#[cfg(test)]
mod tests {
    use super::super::config::{MatchOn, Merge, SinkSlot, Threshold};
    use super::*;

    #[test]
    fn layer_budgets_stay_within_a_factor_e_squared() {
        // Budget B = 100 of P = 1000 (α = 0.1) over 4 layers: r_l = 4·0.1·φ_l and
        // φ_l ∝ exp(−s_l) with s_l ∈ [0, 1], so r_l ∈ [α/e, α·e].
        let cs: Vec<Vec<f32>> = (0..4)
            .map(|l| {
                (0..2 * 1000)
                    .map(|i| ((i * (l + 1)) % 97) as f32 * (1.0 + l as f32 * (i % 2) as f32))
                    .collect()
            })
            .collect();
        let d = D2o {
            f: 0.75,
            beta: 0.7,
            n_sink: 4,
            sink_slot: SinkSlot::Important,
            threshold: Threshold::Ema,
            merge: Merge::Weighted,
            match_on: MatchOn::Keys,
            allocation: Allocation::InvVarSoftmax,
            protect_layers: false,
            per_query_head: false,
            budget_per_cache: false,
            defer_first: false,
            shared_tau: false,
            fp16_scores: false,
        };
        let phi = d.layer_shares(
            &cs.iter().map(|v| v.as_slice()).collect::<Vec<_>>(),
            2,
            1000,
        );
        assert!((phi.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        for x in &phi {
            let r = 4.0 * 0.1 * x;
            assert!(
                (0.1 / std::f64::consts::E - 1e-12..=0.1 * std::f64::consts::E + 1e-12)
                    .contains(&r),
                "{r}"
            );
        }
        let (n, m) = layer_counts(0.25, 4, 100, 1000, 0.75);
        assert_eq!((n, m), (75, 25));
    }
}
