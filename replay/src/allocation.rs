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
    let hk = scores.len();
    let mut pairs: Vec<(f32, usize, usize)> = Vec::new(); // (score, position, head)
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
    // (score desc, position desc, head asc)
    pairs.sort_by(|a, b| cmp_f32(b.0, a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
    let mut n_h = vec![0usize; hk];
    for &(_, _, h) in pairs.iter().take(hk * per_head) {
        n_h[h] += 1;
    }
    let floor = (alpha * per_head as f64).floor();
    n_h.iter()
        .map(|&n| ((1.0 - alpha) * n as f64 + floor).round() as usize)
        .collect()
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
    }
}
