//! KVMerger's merging sets: a run of adjacent pool tokens split where the
//! key cosine drops to ε (the paper), or linked pair by pair down to the hard
//! budget's count.

use crate::policy::cosine;
use crate::select::cmp_f64;

/// Merging sets of `run` (ascending positions): scan from the last token back,
/// joining while the cosine with the reference key exceeds `eps`.
pub fn sets_of_run(
    run: &[usize],
    key: &dyn Fn(usize) -> Vec<f32>,
    eps: f64,
    anchor: bool,
) -> Vec<Vec<usize>> {
    let mut sets = Vec::new();
    let mut cur = vec![*run.last().expect("non-empty run")];
    let mut anchor_t = cur[0];
    for w in run.windows(2).rev() {
        let (t, nxt) = (w[0], w[1]);
        let r = if anchor { anchor_t } else { nxt };
        if cosine(&key(t), &key(r)) > eps {
            cur.insert(0, t);
        } else {
            sets.push(std::mem::take(&mut cur));
            cur = vec![t];
            anchor_t = t;
        }
    }
    sets.push(cur);
    sets.reverse();
    sets
}

/// Hard budget: from singletons, link adjacent same-run pairs by decreasing
/// cosine (ties: larger position first) until `m` sets remain; if the runs
/// alone exceed `m`, drop whole runs by increasing max accumulated attention.
pub(super) fn hard_sets(
    runs: &[Vec<usize>],
    key: &dyn Fn(usize) -> Vec<f32>,
    m: usize,
    a: &[f64],
) -> Vec<Vec<usize>> {
    let mut runs: Vec<Vec<usize>> = runs.to_vec();
    if runs.len() > m {
        let mut order: Vec<usize> = (0..runs.len()).collect();
        let mx = |r: &Vec<usize>| r.iter().map(|&i| a[i]).fold(f64::MIN, f64::max);
        order.sort_by(|&x, &y| cmp_f64(mx(&runs[x]), mx(&runs[y])).then(x.cmp(&y)));
        let drop: std::collections::HashSet<usize> =
            order.into_iter().take(runs.len() - m).collect();
        runs = runs
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !drop.contains(i))
            .map(|(_, r)| r)
            .collect();
        return runs;
    }
    // Candidate links (cos, position of the pair's second member, run, index in run).
    let mut links: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (ri, r) in runs.iter().enumerate() {
        for j in 0..r.len().saturating_sub(1) {
            links.push((cosine(&key(r[j]), &key(r[j + 1])), r[j + 1], ri, j));
        }
    }
    links.sort_by(|x, y| cmp_f64(y.0, x.0).then(y.1.cmp(&x.1)));
    let total: usize = runs.iter().map(|r| r.len()).sum();
    let need = total.saturating_sub(m);
    let mut linked: Vec<Vec<bool>> = runs
        .iter()
        .map(|r| vec![false; r.len().saturating_sub(1)])
        .collect();
    for &(_, _, ri, j) in links.iter().take(need) {
        linked[ri][j] = true;
    }
    let mut sets = Vec::new();
    for (ri, r) in runs.iter().enumerate() {
        let mut cur = vec![r[0]];
        for j in 0..r.len() - 1 {
            if linked[ri][j] {
                cur.push(r[j + 1]);
            } else {
                sets.push(std::mem::take(&mut cur));
                cur = vec![r[j + 1]];
            }
        }
        sets.push(cur);
    }
    sets
}
