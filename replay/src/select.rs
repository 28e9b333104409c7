//! The shared selection: which positions a score keeps, which entry a score
//! evicts, and the tie rule, written once for every policy.
//!
//! Scores are compared numerically (−0 = +0, as IEEE equality) and NaN is
//! ordered by `f32::total_cmp` (a NaN never panics and always sorts the same
//! way), so selection is a total order on any input. Ties follow SEMANTICS.md:
//! by default the later position is kept (the earlier one evicted); AhaKV's
//! code keeps the earlier one ([`Tie::KeepEarlier`]).

use std::cmp::Ordering;

/// Numeric order of two scores: IEEE comparison, NaN placed by `total_cmp`.
pub fn cmp_f32(a: f32, b: f32) -> Ordering {
    a.partial_cmp(&b).unwrap_or_else(|| a.total_cmp(&b))
}

/// As [`cmp_f32`] for f64.
pub fn cmp_f64(a: f64, b: f64) -> Ordering {
    a.partial_cmp(&b).unwrap_or_else(|| a.total_cmp(&b))
}

/// A score the selection compares: f32 (most policies) or f64 (D2O's and
/// KVMerger's accumulated attention, EMS's global-local scores).
pub trait Score: Copy {
    fn cmp_score(self, other: Self) -> Ordering;
}

impl Score for f32 {
    fn cmp_score(self, other: f32) -> Ordering {
        cmp_f32(self, other)
    }
}

impl Score for f64 {
    fn cmp_score(self, other: f64) -> Ordering {
        cmp_f64(self, other)
    }
}

/// Which of two equally scored positions survives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tie {
    /// The later position is kept, the earlier evicted (SEMANTICS.md default).
    #[default]
    KeepLater,
    /// The earlier position is kept (AhaKV's reference code).
    KeepEarlier,
}

impl Tie {
    /// Order of positions `a`, `b` from most to least worth keeping at equal score.
    fn keep_order(self, a: usize, b: usize) -> Ordering {
        match self {
            Tie::KeepLater => b.cmp(&a),
            Tie::KeepEarlier => a.cmp(&b),
        }
    }
}

/// The `k` best of `candidates` (score descending, then the tie rule),
/// returned ascending. `pos` maps a candidate to its position.
pub fn top_k<S: Score>(
    scores: &[S],
    candidates: impl IntoIterator<Item = usize>,
    k: usize,
    pos: impl Fn(usize) -> usize,
    tie: Tie,
) -> Vec<usize> {
    let mut c: Vec<usize> = candidates.into_iter().collect();
    if k == 0 {
        return Vec::new();
    }
    // Positions are distinct, so the order is total and the best k are one
    // set: partition them off (linear time), then sort only those.
    let order = |a: &usize, b: &usize| {
        scores[*b]
            .cmp_score(scores[*a])
            .then(tie.keep_order(pos(*a), pos(*b)))
    };
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, order);
        c.truncate(k);
    }
    c.sort_unstable();
    c
}

/// The entry to evict among `candidates`: the lowest score, then the tie rule.
pub fn victim<S: Score>(
    scores: &[S],
    candidates: impl Iterator<Item = usize>,
    pos: impl Fn(usize) -> usize,
    tie: Tie,
) -> Option<usize> {
    // the minimum of "worth keeping": lowest score, then the one the tie rule drops
    candidates.min_by(|&a, &b| {
        scores[a]
            .cmp_score(scores[b])
            .then(tie.keep_order(pos(b), pos(a)))
    })
}

/// Every candidate, from most to least worth keeping (score descending, then
/// the tie rule): for rules that take consecutive ranks (EMS's centres, then
/// its to-be-merged band).
pub fn ranked<S: Score>(
    scores: &[S],
    candidates: impl IntoIterator<Item = usize>,
    pos: impl Fn(usize) -> usize,
    tie: Tie,
) -> Vec<usize> {
    let mut c: Vec<usize> = candidates.into_iter().collect();
    c.sort_by(|&a, &b| {
        scores[b]
            .cmp_score(scores[a])
            .then(tie.keep_order(pos(a), pos(b)))
    });
    c
}

/// Positions a scorer keeps whatever their score, inside the budget: the first
/// `sinks` and the last `recent` (already clamped so that sinks + recent <= B).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Protect {
    pub sinks: usize,
    pub recent: usize,
}

impl Protect {
    /// Sinks first, then a recent window, both inside `b`.
    pub fn new(sinks: usize, recent: usize, b: usize) -> Protect {
        let sinks = sinks.min(b);
        Protect {
            sinks,
            recent: recent.min(b - sinks),
        }
    }
    pub fn total(self) -> usize {
        self.sinks + self.recent
    }
}

/// Prompt positions kept from `p`: the protected ones plus the `count` best of
/// the rest by `scores` (indexed by position; only candidates are read).
pub fn keep_positions<S: Score>(
    p: usize,
    prot: Protect,
    scores: &[S],
    count: usize,
    tie: Tie,
) -> Vec<usize> {
    let (s, r) = (prot.sinks.min(p), prot.recent.min(p - prot.sinks.min(p)));
    let mut keep: Vec<usize> = (0..s).collect();
    keep.extend(top_k(scores, s..p - r, count, |i| i, tie));
    keep.extend(p - r..p);
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_follow_the_rule_both_ways() {
        let s = [1.0, 3.0, 3.0, 2.0, 3.0];
        assert_eq!(top_k(&s, 0..5, 2, |i| i, Tie::KeepLater), vec![2, 4]);
        assert_eq!(top_k(&s, 0..5, 2, |i| i, Tie::KeepEarlier), vec![1, 2]);
        assert_eq!(top_k(&s, 0..5, 4, |i| i, Tie::KeepLater), vec![1, 2, 3, 4]);
        assert_eq!(
            victim(&[2.0, 1.0, 1.0], 0..3, |i| i, Tie::KeepLater),
            Some(1)
        );
        assert_eq!(
            victim(&[2.0, 1.0, 1.0], 0..3, |i| i, Tie::KeepEarlier),
            Some(2)
        );
        assert_eq!(
            top_k(&s, 0..5, 0, |i| i, Tie::KeepLater),
            Vec::<usize>::new()
        );
        assert_eq!(ranked(&s, 0..5, |i| i, Tie::KeepLater), vec![4, 2, 1, 3, 0]);
        assert_eq!(
            ranked(&s, 0..5, |i| i, Tie::KeepEarlier),
            vec![1, 2, 4, 3, 0]
        );
        let d = [1.0f64, 3.0, 3.0];
        assert_eq!(top_k(&d, 0..3, 1, |i| i, Tie::KeepEarlier), vec![1]);
    }

    #[test]
    fn nan_scores_order_totally_and_never_panic() {
        // positive NaN sorts above every number, so it is kept first
        let s = [1.0, f32::NAN, 0.5, -0.0, 0.0];
        assert_eq!(top_k(&s, 0..5, 1, |i| i, Tie::KeepLater), vec![1]);
        assert_eq!(victim(&s, 0..5, |i| i, Tie::KeepLater), Some(3));
        // −0 and +0 are one score: the tie rule decides
        assert_eq!(victim(&[0.0, -0.0], 0..2, |i| i, Tie::KeepLater), Some(0));
    }

    #[test]
    fn protection_clamps_inside_the_budget() {
        assert_eq!(
            Protect::new(4, 100, 10),
            Protect {
                sinks: 4,
                recent: 6
            }
        );
        assert_eq!(
            Protect::new(12, 3, 10),
            Protect {
                sinks: 10,
                recent: 0
            }
        );
        // sinks 0..2, recent 8..10, best 2 of 2..8 by score
        let s = [0.0, 0.0, 5.0, 1.0, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let k = keep_positions(10, Protect::new(2, 2, 6), &s, 2, Tie::KeepLater);
        assert_eq!(k, vec![0, 1, 2, 4, 8, 9]);
    }
}
