//! Budget allocation: how many entries each layer (PyramidKV) or each KV
//! head (AdaKV) selects, around any scorer. Pure functions of the counts and
//! scores, used by the shared selection (`scorer::TopK`).

use crate::select::cmp_f32;

/// Selected entries (window excluded) of `layer` of `n_layers`, in the
/// reference's integer arithmetic; None = no compression.
pub fn layer_count(
    p_len: usize,
    b: usize,
    w: usize,
    beta: usize,
    layer: usize,
    n_layers: usize,
) -> Option<usize> {
    if p_len < b {
        return None;
    }
    let avg = b - w;
    if p_len < 2 * avg || n_layers < 2 {
        return Some(avg);
    }
    let mut min = avg / beta;
    let mut max = 2 * avg - min;
    if max >= p_len - w {
        max = p_len - w;
        min = 2 * avg - max;
    }
    let step = (max - min) / (n_layers - 1);
    Some(max - layer * step)
}

/// Per-head selection counts B_h from per-head scores (each over the same
/// candidates 0..n), `per_head` = P selected entries per head on average.
pub fn head_budgets(scores: &[&[f32]], per_head: usize, alpha: f64, normalize: bool) -> Vec<usize> {
    let n_h = global_counts(
        &ranked_pairs(scores, per_head, normalize),
        scores.len(),
        scores.len() * per_head,
    );
    let floor = (alpha * per_head as f64).floor();
    n_h.iter()
        .map(|&n| ((1.0 - alpha) * n as f64 + floor).round() as usize)
        .collect()
}

/// kvpress AdaKVPress's per-head selection counts: each head first keeps its
/// own top `reserve` candidates, then the layer's remaining
/// H·(`per_head` − `reserve`) selections go to the best of every head's other
/// candidates. Head h then keeps its top count, as the reserve is its top.
pub fn head_budgets_reserved(
    scores: &[&[f32]],
    per_head: usize,
    reserve: usize,
    normalize: bool,
) -> Vec<usize> {
    let hk = scores.len();
    let reserve = reserve.min(per_head);
    let mut pairs = ranked_pairs(scores, per_head, normalize);
    // each head's top `reserve` are its first pairs in the ranking
    let mut seen = vec![0usize; hk];
    pairs.retain(|&(_, _, h)| {
        seen[h] += 1;
        seen[h] > reserve
    });
    global_counts(&pairs, hk, hk * (per_head - reserve))
        .into_iter()
        .zip(&seen)
        .map(|(n, &s)| n + reserve.min(s))
        .collect()
}

/// (score, position, head) of every candidate of every head, best first:
/// score descending, then position descending, then head ascending. With
/// `normalize`, head h's scores are scaled by the share of its mass in its
/// top `per_head`.
fn ranked_pairs(scores: &[&[f32]], per_head: usize, normalize: bool) -> Vec<(f32, usize, usize)> {
    let mut pairs: Vec<(f32, usize, usize)> = Vec::new();
    for (h, s) in scores.iter().enumerate() {
        let f = if normalize {
            let mut sorted = s.to_vec();
            sorted.sort_by(|a, b| cmp_f32(*b, *a));
            let top: f32 = sorted.iter().take(per_head).sum();
            let all: f32 = sorted.iter().sum();
            if all > 0.0 {
                top / all
            } else {
                1.0
            }
        } else {
            1.0
        };
        pairs.extend(s.iter().enumerate().map(|(i, x)| (x * f, i, h)));
    }
    pairs.sort_by(|a, b| cmp_f32(b.0, a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
    pairs
}

/// How many of the first `take` ranked pairs fall on each of `hk` heads.
fn global_counts(pairs: &[(f32, usize, usize)], hk: usize, take: usize) -> Vec<usize> {
    let mut n_h = vec![0usize; hk];
    for &(_, _, h) in pairs.iter().take(take) {
        n_h[h] += 1;
    }
    n_h
}

/// kvpress PyramidKVPress's entries kept in `layer` of `n_layers`, protected
/// window included (its `get_layer_budget`), with `b` = P·(1 − ratio) and `w`
/// its window: float arithmetic, Python's round (half to even), and uniform
/// budgets `b` whenever the pyramid is infeasible (not P >= max >= min >= w).
pub fn layer_count_kvpress(
    p_len: usize,
    b: usize,
    w: usize,
    beta: usize,
    layer: usize,
    n_layers: usize,
) -> usize {
    let (p, a, w) = (p_len as f64, b as f64, w as f64);
    let mut min = a / beta.max(1) as f64;
    let mut max = 2.0 * a - min;
    if max >= p - w {
        max = p - w;
        min = 2.0 * a - max;
    }
    if !(p >= max && max >= min && min >= w) || n_layers < 2 {
        return b;
    }
    let step = (max - min) / (n_layers - 1) as f64;
    (max - layer as f64 * step).round_ties_even() as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_hand_computation() {
        // B = 72, w = 8 -> P = 64; T_p = 1000, L = 5, beta = 20:
        // min = 3, max = 125, step = (125 - 3) / 4 = 30 -> 125, 95, 65, 35, 5
        let counts: Vec<usize> = (0..5)
            .map(|l| layer_count(1000, 72, 8, 20, l, 5).unwrap())
            .collect();
        assert_eq!(counts, vec![125, 95, 65, 35, 5]);
        // T_p < 2P: uniform
        assert_eq!(layer_count(100, 72, 8, 20, 3, 5), Some(64));
        // max capped at T_p - w: T_p = 130 -> max = 122, min = 6, step = 29
        let counts: Vec<usize> = (0..5)
            .map(|l| layer_count(130, 72, 8, 20, l, 5).unwrap())
            .collect();
        assert_eq!(counts, vec![122, 93, 64, 35, 6]);
        assert_eq!(layer_count(50, 72, 8, 20, 0, 5), None);
    }

    #[test]
    fn budgets_follow_where_the_top_scores_fall() {
        // Two heads, P = 2 per head: the layer's top 4 scores are 9, 8, 7 (head 0)
        // and 6 (head 1) -> n = (3, 1). alpha = 0.5: B_h = round(0.5 n + ⌊0.5·2⌋) = (2.5 -> 3, 1.5 -> 2)
        let s: Vec<&[f32]> = vec![&[9.0, 8.0, 7.0, 0.0], &[6.0, 1.0, 0.5, 0.0]];
        assert_eq!(head_budgets(&s, 2, 0.5, false), vec![3, 2]);
        // alpha = 0: the pure top-k split
        assert_eq!(head_budgets(&s, 2, 0.0, false), vec![3, 1]);
        // alpha = 1: uniform
        assert_eq!(head_budgets(&s, 2, 1.0, false), vec![2, 2]);
        // kvpress: reserve 1 per head (9 and 6), then the best 2 of the rest
        // (8, 7, both head 0): (3, 1); reserve 2 = uniform
        assert_eq!(head_budgets_reserved(&s, 2, 1, false), vec![3, 1]);
        assert_eq!(head_budgets_reserved(&s, 2, 2, false), vec![2, 2]);
        assert_eq!(head_budgets_reserved(&s, 2, 0, false), vec![3, 1]);
    }

    #[test]
    fn kvpress_schedule_matches_hand_computation() {
        // P = 1000, B = 500, w = 64, β = 20, L = 30: min = 25, max = 975 ≥ 936
        // -> max = 936, min = 64; 1000 ≥ 936 ≥ 64 ≥ 64, step = 872/29
        assert_eq!(layer_count_kvpress(1000, 500, 64, 20, 0, 30), 936);
        assert_eq!(layer_count_kvpress(1000, 500, 64, 20, 29, 30), 64);
        // 936 − 872·15/29 = 484.97 -> 485
        assert_eq!(layer_count_kvpress(1000, 500, 64, 20, 15, 30), 485);
        // B = 250: min = 12.5 < w -> uniform
        assert_eq!(layer_count_kvpress(1000, 250, 64, 20, 0, 30), 250);
        // half to even: P = 20, B = 7, β = 2, L = 3 -> 10.5, 7, 3.5 -> 10, 7, 4
        let c: Vec<usize> = (0..3)
            .map(|l| layer_count_kvpress(20, 7, 0, 2, l, 3))
            .collect();
        assert_eq!(c, vec![10, 7, 4]);
    }
}
