//! KVMerger's collapse of one set into an entry: the pivot, the Gaussian
//! weights around it and the value scaled for the set's size.

use super::config::{KvMerger, Pivot, Sigma, ValueMode, Weighting};
use crate::policy::{PrefillCtx, SplitMix64};

impl KvMerger {
    /// (k̂, v̂, bias) of one set.
    pub(super) fn merge(
        &self,
        ctx: &PrefillCtx,
        g: usize,
        s: &[usize],
        a: &[f64],
        rng: &mut SplitMix64,
    ) -> (Vec<f32>, Vec<f32>, f32) {
        let d = ctx.head_dim();
        let p = match self.pivot {
            Pivot::LastIndex => *s.last().unwrap(),
            Pivot::Random => s[rng.below(s.len())],
            Pivot::WithinSet => {
                // attention each member receives from the set's own queries (full causal rows)
                let mut sc = vec![0f64; s.len()];
                for h in g * ctx.group()..(g + 1) * ctx.group() {
                    let rows = ctx.attn_rows(h, s[0]..s[s.len() - 1] + 1);
                    let pl = ctx.prompt_len();
                    for (ri, q) in (s[0]..=s[s.len() - 1]).enumerate() {
                        for (mi, &t) in s.iter().enumerate() {
                            if q >= t {
                                sc[mi] += rows[ri * pl + t] as f64;
                            }
                        }
                    }
                }
                argmax_last(s, &sc)
            }
            Pivot::AttnArgmax => argmax_last(s, &s.iter().map(|&t| a[t]).collect::<Vec<_>>()),
        };
        let kp = ctx.key(g, p);
        let dist: Vec<f64> = s
            .iter()
            .map(|&t| {
                ctx.key(g, t)
                    .iter()
                    .zip(kp)
                    .map(|(x, y)| ((x - y) as f64).powi(2))
                    .sum::<f64>()
            })
            .collect();
        let denom = 2f64.sqrt()
            * if self.exclude_pivot {
                (s.len() - 1).max(1)
            } else {
                s.len()
            } as f64;
        let sigma = match self.sigma {
            Sigma::Fixed => self.sigma0,
            Sigma::AdaptiveSq => dist.iter().sum::<f64>() / denom,
            Sigma::Adaptive => dist.iter().map(|x| x.sqrt()).sum::<f64>() / denom,
        };
        let gw: Vec<f64> = if self.weighting == Weighting::Equal || sigma == 0.0 {
            vec![1.0; s.len()]
        } else {
            dist.iter()
                .map(|x| (-x / (2.0 * sigma * sigma)).exp())
                .collect()
        };
        let z: f64 = gw.iter().sum();
        let (mut k, mut v) = (vec![0f64; d], vec![0f64; d]);
        for (&t, w) in s.iter().zip(&gw) {
            // (w / z) · x per element, as written `w / z * x`: the weight
            // once per member, the rows as slices (a loop that vectorises)
            let wz = w / z;
            let (kr, vr) = (ctx.key(g, t), ctx.value(g, t));
            for ((kc, vc), (x, y)) in k.iter_mut().zip(v.iter_mut()).zip(kr.iter().zip(vr)) {
                *kc += wz * *x as f64;
                *vc += wz * *y as f64;
            }
        }
        let n = s.len() as f64;
        let (vs, bias) = match self.value_mode {
            ValueMode::ScaleBySetSize => (n, 0.0),
            ValueMode::LogcountBias => (1.0, n.ln() as f32),
            ValueMode::Plain => (1.0, 0.0),
        };
        (
            k.iter().map(|x| *x as f32).collect(),
            v.iter().map(|x| (x * vs) as f32).collect(),
            bias,
        )
    }
}

/// The member with the largest score; ties go to the larger position.
fn argmax_last(s: &[usize], score: &[f64]) -> usize {
    let mut best = 0;
    for i in 1..s.len() {
        if score[i] >= score[best] {
            best = i;
        }
    }
    s[best]
}
