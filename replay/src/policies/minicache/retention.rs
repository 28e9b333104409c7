//! MiniCache's retention: the distance threshold, frozen at prefill, above
//! which (or, by rule, below which) a pair keeps its original vectors.

use super::config::{MiniCache, Rule};
use super::slerp::Merged;
use crate::select::cmp_f64;

/// A retention threshold frozen at prefill.
#[derive(Clone, Copy, Debug)]
pub(super) enum Threshold {
    /// retained if dist > τ
    Above(f64),
    /// retained if dist <= τ'
    AtMost(f64),
    /// retained if dist >= τ_ρ
    AtLeast(f64),
}

impl Threshold {
    pub(super) fn retains(&self, m: &Merged) -> bool {
        if m.forced {
            return true;
        }
        let d = m.dist.expect("non-forced merges have a distance");
        match *self {
            Threshold::Above(t) => d > t,
            Threshold::AtMost(t) => d <= t,
            Threshold::AtLeast(t) => d >= t,
        }
    }
}

impl MiniCache {
    /// The threshold for a set of prefill merges (positions in order).
    pub(super) fn threshold(&self, ms: &[&Merged]) -> Threshold {
        let ds: Vec<f64> = ms
            .iter()
            .filter(|m| !m.forced)
            .filter_map(|m| m.dist)
            .collect();
        let (mn, mx) = ds
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), d| {
                (a.min(*d), b.max(*d))
            });
        match self.rule {
            Rule::LiteralLow if !ds.is_empty() => Threshold::AtMost(mn + self.gamma * (mx - mn)),
            Rule::LiteralLow => Threshold::AtMost(f64::NEG_INFINITY),
            Rule::TopFraction => {
                let n = (self.rho * ms.len() as f64).ceil() as usize;
                let mut idx: Vec<(f64, usize)> = ms
                    .iter()
                    .enumerate()
                    .map(|(i, m)| (if m.forced { 1.0 } else { m.dist.unwrap_or(1.0) }, i))
                    .collect();
                idx.sort_by(|x, y| cmp_f64(y.0, x.0).then(y.1.cmp(&x.1)));
                Threshold::AtLeast(
                    idx.iter()
                        .take(n)
                        .map(|x| x.0)
                        .fold(f64::INFINITY, f64::min),
                )
            }
            Rule::MostDivergent if !ds.is_empty() => Threshold::Above(mx - self.gamma * (mx - mn)),
            Rule::MostDivergent => Threshold::Above(f64::INFINITY),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::{Merge, Scope};
    use super::*;

    #[test]
    fn retention_rule_keeps_the_top_gamma_of_the_range() {
        let c = MiniCache {
            start: Some(0.0),
            t: 0.6,
            gamma: 0.25,
            rule: Rule::MostDivergent,
            rho: 0.05,
            scope: Scope::PerHead,
            shared_from_k: false,
            merge_decode: true,
            compact: false,
            merge: Merge::Slerp,
            merge_k: true,
            merge_v: true,
            b_dir: 16,
            b_norm: 16,
        };
        let ms: Vec<Merged> = [0.1, 0.2, 0.3, 0.5]
            .iter()
            .map(|d| Merged {
                e: vec![],
                na: 1.0,
                nb: 1.0,
                dist: Some(*d),
                forced: false,
            })
            .collect();
        let refs: Vec<&Merged> = ms.iter().collect();
        // τ = 0.5 − 0.25·0.4 = 0.4: only dist 0.5 is retained
        let th = c.threshold(&refs);
        assert_eq!(ms.iter().filter(|m| th.retains(m)).count(), 1);
        // literal_low keeps the most similar: τ' = 0.1 + 0.1 = 0.2 -> dist 0.1 and 0.2
        let lit = MiniCache {
            rule: Rule::LiteralLow,
            ..c.clone()
        };
        let th = lit.threshold(&refs);
        assert_eq!(ms.iter().filter(|m| th.retains(m)).count(), 2);
        // top_fraction with rho = 0.5 keeps the 2 largest
        let top = MiniCache {
            rule: Rule::TopFraction,
            rho: 0.5,
            ..c
        };
        let th = top.threshold(&refs);
        assert_eq!(ms.iter().filter(|m| th.retains(m)).count(), 2);
    }
}
