//! Known-answer tests for the seed methods (EMS, AhaKV, D2O, KVMerger,
//! MiniCache): hand-built layers of a few positions whose expected caches
//! (kept positions, merged keys and values, bit costs) are computed here
//! independently, in f64, from the rules in docs/methods.

mod common;

use common::{explicit_layer, run_group_steps, run_steps, simple_layer};
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::{HeadCache, PolicySpec};
use std::sync::Arc;

// ---------------------------------------------------------------- helpers

/// An expected entry: (members, key, value, bias).
type Expected = (Vec<u32>, Vec<f64>, Vec<f64>, f64);
/// A sigma case: (spec, pivot, σ from the member distances).
type SigmaCase<'a> = (&'a str, usize, &'a dyn Fn(&[f64]) -> f64);

fn prefill(spec: &str, data: &LayerData, budget: usize) -> Vec<HeadCache> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    policy.prefill(&PrefillCtx::new(data, budget)).unwrap().0
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn norm(a: &[f64]) -> f64 {
    dot(a, a).sqrt()
}

fn unit(a: &[f64]) -> Vec<f64> {
    let n = norm(a);
    a.iter().map(|x| x / n).collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    dot(a, b) / (norm(a) * norm(b))
}

fn cos_plus(a: &[f64], b: &[f64]) -> f64 {
    cosine(a, b).max(0.0)
}

fn scaled(a: &[f64], s: f64) -> Vec<f64> {
    a.iter().map(|x| x * s).collect()
}

fn softmax(logits: &[f64]) -> Vec<f64> {
    let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = logits.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|v| *v as f64).collect()
}

/// Rows of 2-d vectors as the `Vec<Vec<f32>>` a head of `explicit_layer` takes.
fn rows(x: &[[f32; 2]]) -> Vec<Vec<f32>> {
    x.iter().map(|r| r.to_vec()).collect()
}

/// A unit 2-d vector at `deg` degrees.
fn deg(a: f64) -> [f32; 2] {
    [a.to_radians().cos() as f32, a.to_radians().sin() as f32]
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{what}: got {got:?}, want {want:?} (tolerance {tol})"
        );
    }
}

// ---------------------------------------------------------------------- EMS

/// The EMS layer: one head, d = 2, scale 1, P = 8, two decode steps. Queries
/// (0, 1) except the last decode one, so the prefill's local window (L_win = 1:
/// the last prompt row) scores key j by its second coordinate.
fn ems_layer() -> LayerData {
    let k = [
        [2.0, 0.0],
        [0.0, 1.0],
        [1.0, 1.0],
        [1.2, 0.9],
        [0.9, 0.8],
        [0.5, 3.0],
        [0.1, 0.4],
        [1.0, -0.3],
        [-1.0, -1.0],
        [0.3, 0.2],
    ];
    let v = [
        [1.0, 0.0],
        [-0.5, 1.0],
        [1.0, 1.0],
        [2.0, 1.5],
        [1.2, 1.0],
        [0.5, 1.0],
        [1.0, 2.2],
        [1.0, -0.2],
        [-1.0, -0.5],
        [0.2, 0.1],
    ];
    let mut q = [[0.0f32, 1.0]; 10];
    q[9] = [1.0, 0.0];
    let mut data = explicit_layer(&[rows(&q)], &[rows(&k)], &[rows(&v)], 8, 1.0);
    // s_glo: hand-set column sums (a sink-like 0, the rest small)
    data.colsum = vec![4.0, 0.5, 1.0, 0.3, 0.6, 0.2, 0.4, 0.05];
    data
}

/// (s_glo, s_loc, s) of the EMS layer's prompt, computed from ems.md §2.2:
/// s_loc = the last L_win = 1 prompt row, α = mean(s_loc)/mean(s_glo),
/// s = max(α·s_glo, s_loc).
fn ems_scores(data: &LayerData) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let p = data.prompt_len;
    let glo = f64s(&data.colsum);
    let q = f64s(data.q_row(0, p - 1));
    let loc = softmax(
        &(0..p)
            .map(|j| dot(&q, &f64s(data.k_row(0, j))))
            .collect::<Vec<_>>(),
    );
    let alpha = (loc.iter().sum::<f64>() / p as f64) / (glo.iter().sum::<f64>() / p as f64);
    // Rows sum to one: α = L_win / Σ s_glo at prefill (ems.md §2.2).
    assert!((alpha - 1.0 / glo.iter().sum::<f64>()).abs() < 1e-12);
    let s = (0..p).map(|j| (alpha * glo[j]).max(loc[j])).collect();
    (glo, loc, s)
}

const EMS_SPEC: &str = "ems:window=1,gamma=1.5,tau=0.7,kernel=1,merge_space=post_rope";

/// Per slot: 16 norm bits + ⌈log2(N_budget + 1)⌉ = 3 index bits (B = 4);
/// the stored entry's 2·d·16 bits go to its first slot (ems.md §2.5, §2.8).
const EMS_AUX: u64 = 16 + 3;

/// B = 4, L_win = 1: N_imp = 3 centres, N_tbm = ⌊0.5·4⌋ = 2 to-be-merged,
/// candidates 0..7, window {7}. The combined score s = max(α·s_glo, s_loc)
/// picks 5 through its local score (the last row's attention) and 0, 2 through
/// the rescaled global one; neither score alone gives the same centres.
/// TBM = {4, 1}: 4 joins centre 2 (R = 0.994 beats centre 5's 0.713, both
/// above τ = 0.7); 1 reaches only R = 0.59 and goes to the zero class. The
/// merged entry's direction and value are the s-weighted means of its members.
#[test]
fn ems_global_local_scores_pick_the_centres_and_weight_the_merge() {
    let data = ems_layer();
    let (glo, loc, s) = ems_scores(&data);
    // the test exercises both sides of the max
    let alpha = 1.0 / glo.iter().sum::<f64>();
    assert!(loc[5] > 10.0 * alpha * glo[5] && s[5] == loc[5]);
    assert!(alpha * glo[0] > loc[0] && alpha * glo[2] > loc[2]);
    let mut order: Vec<usize> = (0..7).collect();
    order.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap().then(a.cmp(&b)));
    assert_eq!(order, vec![5, 0, 2, 4, 1, 3, 6]);
    let by = |x: &[f64]| {
        let mut o: Vec<usize> = (0..7).collect();
        o.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap().then(a.cmp(&b)));
        let mut top = o[..3].to_vec();
        top.sort_unstable();
        top
    };
    assert_eq!(by(&glo), vec![0, 2, 4], "global alone picks other centres");
    assert_eq!(by(&loc), vec![1, 2, 5], "local alone picks other centres");
    let k = |j: usize| f64s(data.k_row(0, j));
    let v = |j: usize| f64s(data.v_row(0, j));
    let r = |i: usize, c: usize| cos_plus(&k(i), &k(c)) * cos_plus(&v(i), &v(c));
    assert!(r(4, 2) > 0.99 && r(4, 5) > 0.7 && r(4, 5) < r(4, 2) && r(4, 0) < 0.7);
    assert!([0, 2, 5].iter().all(|&c| r(1, c) < 0.6));

    let c = &prefill(EMS_SPEC, &data, 4)[0];
    assert_eq!(c.positions(), vec![0, 2, 4, 5, 7]);
    // centre 2 with member 4: weights s_j / (s_2 + s_4) (unpooled s, A6)
    let (w2, w4) = (s[2] / (s[2] + s[4]), s[4] / (s[2] + s[4]));
    let dir: Vec<f64> = unit(
        &(0..2)
            .map(|x| w2 * k(2)[x] / norm(&k(2)) + w4 * k(4)[x] / norm(&k(4)))
            .collect::<Vec<_>>(),
    );
    let val: Vec<f64> = (0..2).map(|x| w2 * v(2)[x] + w4 * v(4)[x]).collect();
    // f32 attention rows, f32 storage of an f64 computation, and the policy's
    // ε = 1e-6 added to every norm it divides by (ems.md §2.7)
    let tol = 1e-5;
    assert_close(c.value(1), &val, tol, "merged value at slot 2");
    assert_close(c.value(2), &val, tol, "merged value at slot 4");
    // each member keeps its own norm along the shared direction
    assert_close(c.key(1), &scaled(&dir, norm(&k(2))), tol, "key of slot 2");
    assert_close(c.key(2), &scaled(&dir, norm(&k(4))), tol, "key of slot 4");
    // singletons reproduce their key (up to the unit·norm round trip) and value
    for (e, j) in [(0, 0), (3, 5), (4, 7)] {
        assert_close(c.key(e), &k(j), tol, "singleton key");
        assert_eq!(f64s(c.value(e)), v(j));
    }
    assert_eq!(c.bias, vec![0.0; 5]);
    let entry = HeadCache::exact_bits(2) + EMS_AUX;
    assert_eq!(c.bits, vec![entry, entry, EMS_AUX, entry, entry]);

    // Mean pooling (kernel 3, zero padding, divisor 3) ranks by the pooled
    // score: centres {1, 4, 5}, TBM {6, 0}; 6 joins 5 (R = 0.996), 0 reaches 0.57.
    // The merge weights stay the unpooled s.
    let pooled: Vec<f64> = (0..7)
        .map(|j: usize| {
            (j.saturating_sub(1)..(j + 2).min(7))
                .map(|i| s[i])
                .sum::<f64>()
                / 3.0
        })
        .collect();
    let mut order: Vec<usize> = (0..7).collect();
    order.sort_by(|&a, &b| pooled[b].partial_cmp(&pooled[a]).unwrap().then(a.cmp(&b)));
    assert_eq!(order[..5], [1, 4, 5, 6, 0]);
    assert!(r(6, 5) > 0.99 && [1, 4, 5].iter().all(|&c| r(0, c) < 0.6));
    let c = &prefill(&EMS_SPEC.replace("kernel=1", "kernel=3"), &data, 4)[0];
    assert_eq!(c.positions(), vec![1, 4, 5, 6, 7]);
    let (w5, w6) = (s[5] / (s[5] + s[6]), s[6] / (s[5] + s[6]));
    let val: Vec<f64> = (0..2).map(|x| w5 * v(5)[x] + w6 * v(6)[x]).collect();
    assert_close(c.value(2), &val, tol, "merged value of centre 5 (kernel 3)");
    assert_close(c.value(3), &val, tol, "merged value of slot 6 (kernel 3)");
}

/// Decode (ems.md §2.6), continuing the prefill above (slots 0, 2, 4, 5, 7; 2
/// and 4 share an entry). L_win = 1, so each step's attention becomes the local
/// score. Step 8: the window holds 7 and 8, so 7 leaves it and becomes a
/// centre; four centres exceed N_imp = 3 and the one with the smallest cluster
/// sum of sgl = max(α·s_glo, s_loc) is demoted: 7. Its most redundant centre is
/// 0 (R = 0.94 ≥ τ): 0's direction becomes normalize(S_0·dir_0 + S_7·dir_7),
/// its value (S_0·v_0 + S_7·v_7)/(S_0 + S_7), and slot 7 now expands entry 0
/// (at its own norm). Step 9: 8 leaves the window and is demoted in turn; no
/// centre is similar (R = 0), so it goes to the zero class and its slot is freed.
#[test]
fn ems_decode_demotes_the_window_leaver_and_merges_or_frees_it() {
    let data = ems_layer();
    let (glo, loc, s) = ems_scores(&data);
    let k = |j: usize| f64s(data.k_row(0, j));
    let v = |j: usize| f64s(data.v_row(0, j));
    // Entries after prefill (dir, val) and slots (position, entry, s_glo, s_loc).
    let (w2, w4) = (s[2] / (s[2] + s[4]), s[4] / (s[2] + s[4]));
    let dir2 = unit(
        &(0..2)
            .map(|x| w2 * k(2)[x] / norm(&k(2)) + w4 * k(4)[x] / norm(&k(4)))
            .collect::<Vec<_>>(),
    );
    let val2: Vec<f64> = (0..2).map(|x| w2 * v(2)[x] + w4 * v(4)[x]).collect();
    let mut dirs: Vec<Vec<f64>> = vec![unit(&k(0)), dir2, unit(&k(5)), unit(&k(7))];
    let mut vals: Vec<Vec<f64>> = vec![v(0), val2, v(5), v(7)];
    let mut slots: Vec<(usize, usize, f64, f64)> = [(0, 0), (2, 1), (4, 1), (5, 2), (7, 3)]
        .iter()
        .map(|&(j, e)| (j, e, glo[j], loc[j]))
        .collect();
    // One step: add the new window entry, attend, accumulate (the local score
    // becomes this step's attention, L_win = 1), and return sgl per slot.
    let step = |pos: usize,
                dirs: &mut Vec<Vec<f64>>,
                vals: &mut Vec<Vec<f64>>,
                slots: &mut Vec<(usize, usize, f64, f64)>|
     -> Vec<f64> {
        dirs.push(unit(&k(pos)));
        vals.push(v(pos));
        slots.push((pos, dirs.len() - 1, 0.0, 0.0));
        let q = f64s(data.q_row(0, pos));
        let a = softmax(
            &slots
                .iter()
                .map(|sl| dot(&q, &scaled(&dirs[sl.1], norm(&k(sl.0)))))
                .collect::<Vec<_>>(),
        );
        for (sl, x) in slots.iter_mut().zip(&a) {
            sl.2 += x;
            sl.3 = *x;
        }
        let n = slots.len() as f64;
        let alpha = (slots.iter().map(|x| x.3).sum::<f64>() / n)
            / (slots.iter().map(|x| x.2).sum::<f64>() / n);
        slots.iter().map(|x| (alpha * x.2).max(x.3)).collect()
    };
    let cluster = |slots: &[(usize, usize, f64, f64)], sgl: &[f64], e: usize| -> f64 {
        slots
            .iter()
            .zip(sgl)
            .filter(|(x, _)| x.1 == e)
            .map(|(_, s)| s)
            .sum()
    };
    let steps = run_steps(EMS_SPEC, &data, 4);
    assert_eq!(steps[0][0].positions(), vec![0, 2, 4, 5, 7]);

    // step at position 8: centres are entries 0, 1 (pos 2), 2 (pos 5) and 3 (pos 7, demoted from the window)
    let sgl = step(8, &mut dirs, &mut vals, &mut slots);
    let sums: Vec<f64> = (0..4).map(|e| cluster(&slots, &sgl, e)).collect();
    let weakest = (0..4)
        .min_by(|&a, &b| sums[a].partial_cmp(&sums[b]).unwrap())
        .unwrap();
    assert_eq!(
        weakest, 3,
        "the token that left the window is the weakest centre: {sums:?}"
    );
    // 7's small column sum puts its sgl on the local side of the max, so the
    // merge weight below depends on the local score (this step's attention)
    assert_eq!(slots[4].0, 7);
    assert_eq!(sgl[4], slots[4].3);
    assert!(sums[3] < 0.5 * sums[1..3].iter().cloned().fold(f64::MAX, f64::min));
    let r: Vec<f64> = (0..3)
        .map(|e| cos_plus(&dirs[3], &dirs[e]) * cos_plus(&vals[3], &vals[e]))
        .collect();
    assert!(r[0] > 0.9 && r[1] < 0.7 && r[2] < 0.7, "{r:?}");
    let (s0, s7) = (sums[0], sums[3]);
    let dir0 = unit(
        &(0..2)
            .map(|x| s0 * dirs[0][x] + s7 * dirs[3][x])
            .collect::<Vec<_>>(),
    );
    let val0: Vec<f64> = (0..2)
        .map(|x| (s0 * vals[0][x] + s7 * vals[3][x]) / (s0 + s7))
        .collect();
    let c = &steps[1][0];
    assert_eq!(c.positions(), vec![0, 2, 4, 5, 7, 8]);
    let tol = 1e-5; // f32 attention over f32 expanded keys, accumulated twice
    assert_close(c.value(0), &val0, tol, "centre 0 after absorbing 7");
    assert_close(c.value(4), &val0, tol, "slot 7 reads centre 0's value");
    assert_close(c.key(0), &scaled(&dir0, norm(&k(0))), tol, "slot 0 key");
    assert_close(
        c.key(4),
        &scaled(&dir0, norm(&k(7))),
        tol,
        "slot 7 key at its own norm",
    );
    assert_close(c.key(5), &k(8), tol, "the new window entry is exact");
    let entry = HeadCache::exact_bits(2) + EMS_AUX;
    assert_eq!(
        c.bits,
        vec![entry, entry, EMS_AUX, entry, EMS_AUX, entry],
        "4 stored entries, 6 slots"
    );
    dirs[0] = dir0;
    vals[0] = val0.clone();
    for sl in slots.iter_mut().filter(|x| x.1 == 3) {
        sl.1 = 0;
    }

    // step at position 9: centres 0 (with 7), 1 (with 4), 2 and 4 (pos 8, demoted)
    let sgl = step(9, &mut dirs, &mut vals, &mut slots);
    let sums: Vec<f64> = [0, 1, 2, 4]
        .iter()
        .map(|&e| cluster(&slots, &sgl, e))
        .collect();
    assert!(
        sums[3] < 0.5 * sums[..3].iter().cloned().fold(f64::MAX, f64::min),
        "8 is the weakest centre: {sums:?}"
    );
    assert!(
        (0..3).all(|e| cos_plus(&dirs[4], &dirs[e]) * cos_plus(&vals[4], &vals[e]) == 0.0),
        "8 is similar to no centre"
    );
    let c = &steps[2][0];
    assert_eq!(c.positions(), vec![0, 2, 4, 5, 7, 9], "8's slot is freed");
    assert_close(c.value(0), &val0, tol, "centre 0 unchanged");
    assert_close(c.value(3), &v(5), tol, "centre 5 unchanged");
    assert_eq!(
        c.bits,
        vec![entry, entry, EMS_AUX, entry, EMS_AUX, entry],
        "8's entry is deleted: still 4 stored entries"
    );
}

// -------------------------------------------------------------------- AhaKV

/// The AhaKV layer: one head, d = 2, scale 1, P = 10, one decode step.
/// Observation rows (B_r = 2): 8 with q = (1, 0) and 9 with q = (0, 1).
/// Candidates: 1 peaks in row 8 (logit 2.4), 5 in row 9 (1.8), 3 is moderate in
/// both (1.55, 1.55). Values: |v| = 0.7 at 0..2, 1 elsewhere.
fn ahakv_layer() -> LayerData {
    let mut k = [[0.0f32, 0.0]; 11];
    k[1] = [2.4, 0.0];
    k[3] = [1.55, 1.55];
    k[5] = [0.0, 1.8];
    k[8] = [-1.0, -1.0];
    k[10] = [-0.4, -0.4];
    let mut v = [[1.0f32, 0.0]; 11];
    for row in v.iter_mut().take(3) {
        *row = [0.7, 0.0];
    }
    let mut q = [[1.0f32, 0.0]; 11];
    q[9] = [0.0, 1.0];
    q[10] = [-0.5, -0.5];
    explicit_layer(&[rows(&q)], &[rows(&k)], &[rows(&v)], 10, 1.0)
}

/// ahakv.md §2.1-2.2 with B = 4, B_r = 2 (k = B in the gain): the prefill score
/// F̂ = γ̄·F, F summing the observation rows' SG-softmax (gain g(c) at c = i + 1
/// visible keys), γ̄ the valid-count 7-wide mean of ‖v‖² over its maximum.
fn ahakv_scores(data: &LayerData, sg: bool, vpe: bool) -> Vec<f64> {
    let (n, b) = (data.prompt_len, 4.0);
    let gain = |c: usize| {
        if sg {
            (2.0 * (c as f64 / b).ln().max(0.0)).sqrt()
        } else {
            1.0
        }
    };
    let mut f = vec![0f64; n];
    for i in n - 2..n {
        let q = f64s(data.q_row(0, i));
        let p = softmax(
            &(0..=i)
                .map(|j| gain(i + 1) * dot(&q, &f64s(data.k_row(0, j))))
                .collect::<Vec<_>>(),
        );
        f.iter_mut().zip(&p).for_each(|(a, x)| *a += x);
    }
    if vpe {
        let nu: Vec<f64> = (0..n)
            .map(|j| dot(&f64s(data.v_row(0, j)), &f64s(data.v_row(0, j))))
            .collect();
        let gamma: Vec<f64> = (0..n)
            .map(|j| {
                let w = &nu[j.saturating_sub(3)..(j + 4).min(n)];
                w.iter().sum::<f64>() / w.len() as f64
            })
            .collect();
        let mx = gamma.iter().cloned().fold(0.0, f64::max);
        f.iter_mut().zip(&gamma).for_each(|(a, g)| *a *= g / mx);
    }
    f
}

/// The two best candidates (0..P − B_r) by score, ties to the smaller
/// position, plus the window, and the score gap between the 2nd and 3rd.
fn ahakv_keep(f: &[f64]) -> (Vec<usize>, f64) {
    let mut c: Vec<usize> = (0..8).collect();
    c.sort_by(|&a, &b| f[b].partial_cmp(&f[a]).unwrap().then(a.cmp(&b)));
    let gap = f[c[1]] - f[c[2]];
    let mut keep = c[..2].to_vec();
    keep.sort_unstable();
    keep.extend([8, 9]);
    (keep, gap)
}

/// Prefill with step gain and value prior on (B = 4, B_r = 2): the gains
/// g(9) = √(2 ln 2.25) ≈ 1.27 and g(10) ≈ 1.35 sharpen the rows, which favours
/// the single-row peaks 1 and 5 over 3 (moderate in both rows); the value prior
/// (3's window holds the three small values) favours 5 over 3 as well. Either
/// component alone is not enough: without the gain, or without the prior, 3 is
/// kept instead of 5.
#[test]
fn ahakv_step_gain_and_value_prior_choose_the_prefill_set() {
    let data = ahakv_layer();
    let kept = |spec: &str| prefill(spec, &data, 4)[0].positions();
    for (spec, sg, vpe, want) in [
        ("ahakv:recent=2", true, true, vec![1, 5, 8, 9]),
        ("ahakv:recent=2,use_sg=false", false, true, vec![1, 3, 8, 9]),
        (
            "ahakv:recent=2,use_vpe=false",
            true,
            false,
            vec![1, 3, 8, 9],
        ),
    ] {
        let f = ahakv_scores(&data, sg, vpe);
        let (keep, gap) = ahakv_keep(&f);
        assert_eq!(keep, want, "{spec}: independent scores {f:?}");
        // far from a tie in f32 (the policy's rows are f32)
        assert!(gap > 0.015, "{spec}: gap {gap}");
        assert_eq!(kept(spec), want, "{spec}");
    }
    let f = ahakv_scores(&data, true, true);
    // the known answer, to three decimals
    let want = [0.4505, 0.4216, 0.3993];
    for (x, w) in [f[1], f[5], f[3]].iter().zip(want) {
        assert!((x - w).abs() < 5e-4, "{f:?}");
    }
}

/// Decode step 10 (k = B = 4, c = 11: g = √(2 ln 2.75) ≈ 1.42): the cache is
/// {1, 5, 8, 9} + 10 with scores F̂ for the prompt entries and 0 for 10; the
/// step adds its SG-softmax row; the victim is the lowest sum outside the 2
/// newest. Entry 8 has the highest logit (the sharpened row gives it 0.56 of
/// the mass), enough to overtake 5: 5 is evicted. With the plain softmax 8
/// would be evicted, with the step's row alone 1, with the old scores alone 8.
#[test]
fn ahakv_decode_eviction_adds_the_step_gain_row_to_the_accumulated_score() {
    let data = ahakv_layer();
    let f = ahakv_scores(&data, true, true);
    let entries = [1usize, 5, 8, 9, 10];
    let old: Vec<f64> = entries
        .iter()
        .map(|&p| if p < 10 { f[p] } else { 0.0 })
        .collect();
    let q = f64s(data.q_row(0, 10));
    let row = |g: f64| {
        softmax(
            &entries
                .iter()
                .map(|&p| g * dot(&q, &f64s(data.k_row(0, p))))
                .collect::<Vec<_>>(),
        )
    };
    // victim among entries 0..3 (not the B_r = 2 newest); ties would go to the larger position
    let victim = |s: &[f64]| -> (usize, f64) {
        let mut c: Vec<usize> = (0..3).collect();
        c.sort_by(|&a, &b| s[a].partial_cmp(&s[b]).unwrap().then(b.cmp(&a)));
        (entries[c[0]], s[c[1]] - s[c[0]])
    };
    let g = (2.0 * (11.0f64 / 4.0).ln()).sqrt();
    let sum = |r: &[f64]| -> Vec<f64> { old.iter().zip(r).map(|(a, b)| a + b).collect() };
    let (v, gap) = victim(&sum(&row(g)));
    assert_eq!(v, 5);
    assert!(gap > 0.01, "gap {gap}");
    assert_eq!(
        victim(&sum(&row(1.0))).0,
        8,
        "the plain softmax would evict 8"
    );
    assert_eq!(victim(&row(g)).0, 1, "the step's row alone would evict 1");
    assert_eq!(victim(&old).0, 8, "the prefill scores alone would evict 8");

    let steps = run_steps("ahakv:recent=2", &data, 4);
    assert_eq!(steps[0][0].positions(), vec![1, 5, 8, 9]);
    assert_eq!(steps[1][0].positions(), vec![1, 8, 9, 10]);
    let c = &steps[1][0];
    assert_eq!(c.key(0), data.k_row(0, 1), "eviction keeps entries exact");
    assert_eq!(c.value(3), data.v_row(0, 10));
    assert_eq!(c.bits, vec![HeadCache::exact_bits(2); 4]);
}

// ---------------------------------------------------------------------- D2O

/// Layer budgets (d2o.md §2.1) over L = 3 layers of P = 20 positions, three
/// query heads on one KV head, B = 8 per layer on average. Column sums per head:
/// a peak at position 0 and a small ramp 0.1·(1 + j mod 5) elsewhere; the peaks
/// differ between heads, so the head variances do. Layer 0's heads are equal
/// (s_0 = 0), layers 1 and 2 spread (s_1 ≈ 0.42, s_2 ≈ 0.59); φ = softmax(−s)
/// gives r = L·B·φ/P ≈ (0.543, 0.356, 0.301), so N = ⌊0.75·r·P⌋ = (8, 5, 4)
/// and M = ⌊0.25·r·P⌋ = (2, 1, 1): 10, 6 and 5 entries. Uniform allocation
/// gives every layer r = 0.4: 8 entries.
#[test]
fn d2o_layer_budgets_follow_the_inverse_variance_softmax() {
    let (p, b, l_n, f) = (20usize, 8usize, 3usize, 0.75f64);
    let head = |peak: f32| -> Vec<f32> {
        (0..p)
            .map(|j| {
                if j == 0 {
                    peak
                } else {
                    0.1 * (1 + j % 5) as f32
                }
            })
            .collect()
    };
    let peaks = [[4.0, 4.0, 4.0], [2.0, 5.0, 9.0], [2.0, 8.0, 9.0]];
    let colsums: Vec<Vec<f32>> = peaks
        .iter()
        .map(|ps| ps.iter().flat_map(|&x| head(x)).collect())
        .collect();
    let all = Arc::new(colsums.clone());
    let layers: Vec<LayerData> = (0..l_n)
        .map(|l| {
            let mut d = simple_layer(&[vec![0.0; p + 1]], 3, p, l, l_n);
            d.colsum = colsums[l].clone();
            d.all_colsum = Some(all.clone());
            d
        })
        .collect();
    // the formula, by hand
    let var = |c: &[f32]| {
        let m = c.iter().map(|x| *x as f64).sum::<f64>() / c.len() as f64;
        c.iter().map(|x| (*x as f64 - m).powi(2)).sum::<f64>() / (c.len() - 1) as f64
    };
    let s: Vec<f64> = colsums
        .iter()
        .map(|c| {
            let v: Vec<f64> = (0..3).map(|h| var(&c[h * p..(h + 1) * p])).collect();
            let (mn, mx) = (
                v.iter().cloned().fold(f64::MAX, f64::min),
                v.iter().cloned().fold(f64::MIN, f64::max),
            );
            v.iter().map(|x| (x - mn) / (mx - mn + 1e-6)).sum::<f64>() / 3.0
        })
        .collect();
    let z: f64 = s.iter().map(|x| (-x).exp()).sum();
    let counts: Vec<(usize, usize)> = s
        .iter()
        .map(|x| {
            let r = (l_n as f64 * b as f64 * (-x).exp() / z / p as f64).clamp(0.01, 1.0);
            let (n, m) = (r * f * p as f64, r * (1.0 - f) * p as f64);
            // away from the floors' steps
            assert!(n.fract() > 0.1 && n.fract() < 0.9 && m.fract() > 0.1 && m.fract() < 0.9);
            (n.floor() as usize, m.floor() as usize)
        })
        .collect();
    assert_eq!(counts, vec![(8, 2), (5, 1), (4, 1)], "s = {s:?}");
    for (l, data) in layers.iter().enumerate() {
        let c = &prefill("d2o", data, b)[0];
        let (n, m) = counts[l];
        assert_eq!(c.len(), n + m, "layer {l}");
        // sinks 0..4 inside N, the top N − 4 of the rest by the group's summed
        // column sums (ties: earlier), the last M
        let a: Vec<f64> = (0..p)
            .map(|j| (0..3).map(|h| colsums[l][h * p + j] as f64).sum())
            .collect();
        let mut cand: Vec<usize> = (4..p - m).collect();
        cand.sort_by(|&x, &y| a[y].partial_cmp(&a[x]).unwrap().then(x.cmp(&y)));
        let mut want: Vec<usize> = (0..4).chain(cand[..n - 4].iter().copied()).collect();
        want.sort_unstable();
        want.extend(p - m..p);
        assert_eq!(c.positions(), want, "layer {l}");
        // every evicted position merged or dropped, none duplicated
        let covered: usize = c.members.iter().map(|x| x.len()).sum();
        assert!((n + m..=p).contains(&covered));
        let c = &prefill("d2o:allocation=uniform", data, b)[0];
        assert_eq!(c.len(), 8, "uniform: layer {l}");
    }
}

/// The D2O EMA layer: one head, d = 4, zero queries (uniform decode attention),
/// P = 8, four decode steps. Prompt keys 0..6 are unit vectors in dims 0-1 (the
/// first-compression layout of policies.rs); key 7 and every decode key are unit
/// vectors in dims 2-3 at angles 0°, 78.5°, 143°, 187.4°, 240.5°, orthogonal to
/// the prompt. Values (i, 1, i/2, −1).
fn d2o_ema_layer() -> LayerData {
    let k: Vec<Vec<f32>> = [180.0, 8.0, 0.0, 90.0, 115.84]
        .iter()
        .chain(&[270.0, 270.0])
        .map(|&a| {
            let u = deg(a);
            vec![u[0], u[1], 0.0, 0.0]
        })
        .chain([0.0, 78.5, 143.0, 187.4, 240.5].iter().map(|&a| {
            let u = deg(a);
            vec![0.0, 0.0, u[0], u[1]]
        }))
        .collect();
    let v: Vec<Vec<f32>> = (0..12)
        .map(|i| vec![i as f32, 1.0, i as f32 / 2.0, -1.0])
        .collect();
    let q = vec![vec![0.0f32; 4]; 12];
    let mut data = explicit_layer(&[q], &[k], &[v], 8, 1.0);
    data.colsum = vec![9.0, 1.0, 5.0, 4.0, 1.0, 1.0, 1.0, 1.0];
    data
}

/// D2O's EMA threshold with β = 0.3 (d2o.md §2.3-2.4): B = 4 on one layer gives
/// N = 3, M = 1 (one sink). The first compression keeps {0, 2, 3, 7}, folds 1
/// into 2 and 4 into 3, drops 5 and 6, and sets τ₀ = mean best cosine = 0.4726.
/// Each decode step evicts the previous token (the lowest score outside the
/// sink and the newest entry); its best match is the new token, cosine μ:
/// step  μ      τ = 0.3·μ + 0.7·τ_prev   outcome
///   8   0.199  0.391                    dropped (7)
///   9   0.431  0.403                    8 merges into 9
///  10   0.395  0.400                    9 (holding 8) dropped
///  11   0.600  0.460                    10 merges into 11
/// A fixed τ₀ would drop 8 at step 9; β and 1 − β swapped would merge at 10.
#[test]
fn d2o_ema_threshold_decides_each_decode_merge() {
    let data = d2o_ema_layer();
    let (beta, e1) = (0.3f64, 1f64.exp());
    let k = |j: usize| f64s(data.k_row(0, j));
    let v = |j: usize| f64s(data.v_row(0, j));
    // the first compression: evicted 1, 4, 5, 6 against kept 0, 2, 3, 7
    let kept = [0usize, 2, 3, 7];
    let best = |i: usize| -> (usize, f64) {
        kept.iter()
            .map(|&c| (c, cosine(&k(i), &k(c))))
            .fold((0, f64::MIN), |a, x| if x.1 > a.1 { x } else { a })
    };
    let mus: Vec<(usize, f64)> = [1, 4, 5, 6].iter().map(|&i| best(i)).collect();
    let mut tau = mus.iter().map(|x| x.1).sum::<f64>() / 4.0;
    assert!((tau - 0.4726).abs() < 1e-4);
    assert_eq!((mus[0].0, mus[1].0), (2, 3));
    assert!(mus[0].1 >= tau && mus[1].1 >= tau && mus[2].1 < tau && mus[3].1 < tau);
    let fold = |c: &[f64], x: &[f64], u: f64| -> Vec<f64> {
        c.iter()
            .zip(x)
            .map(|(a, b)| (e1 * a + u.exp() * b) / (e1 + u.exp()))
            .collect()
    };
    // entries: (members, key, value, score)
    let mut entries: Vec<Expected> = vec![
        (vec![0], k(0), v(0), 9.0),
        (
            vec![1, 2],
            fold(&k(2), &k(1), mus[0].1),
            fold(&v(2), &v(1), mus[0].1),
            5.0,
        ),
        (
            vec![3, 4],
            fold(&k(3), &k(4), mus[1].1),
            fold(&v(3), &v(4), mus[1].1),
            4.0,
        ),
        (vec![7], k(7), v(7), 1.0),
    ];
    let steps = run_steps("d2o:n_sink=1,beta=0.3", &data, 4);
    let check = |c: &HeadCache, entries: &[Expected], at: &str| {
        assert_eq!(
            c.member_lists(),
            entries.iter().map(|e| e.0.clone()).collect::<Vec<_>>(),
            "{at}"
        );
        for (i, e) in entries.iter().enumerate() {
            // f32 storage; cosines carry the policy's +1e-6 in the denominator
            assert_close(c.key(i), &e.1, 1e-5, at);
            assert_close(c.value(i), &e.2, 1e-5, at);
        }
    };
    check(&steps[0][0], &entries, "first compression");
    let (tau_fixed, mut tau_swapped) = (tau, tau);
    let mut merged = Vec::new();
    for pos in 8..12 {
        entries.push((vec![pos as u32], k(pos), v(pos), 0.0));
        let n = entries.len() as f64;
        entries.iter_mut().for_each(|e| e.3 += 1.0 / n); // zero queries: uniform attention
                                                         // victim: lowest score outside the sink (entry 0) and the newest entry
        let victim = (1..entries.len() - 1)
            .min_by(|&a, &b| entries[a].3.partial_cmp(&entries[b].3).unwrap())
            .unwrap();
        assert_eq!(victim, entries.len() - 2, "step {pos}: the previous token");
        let others: Vec<usize> = (0..entries.len()).filter(|&e| e != victim).collect();
        let (target, mu) = others
            .iter()
            .map(|&e| (e, cosine(&entries[victim].1, &entries[e].1)))
            .fold((0, f64::MIN), |a, x| if x.1 > a.1 { x } else { a });
        tau = beta * mu + (1.0 - beta) * tau;
        let swapped = (1.0 - beta) * mu + beta * tau_swapped;
        let m = mu >= tau;
        // the decision is never a near tie, and the alternatives are what the doc says
        assert!((mu - tau).abs() > 2e-3, "step {pos}: μ {mu} τ {tau}");
        match pos {
            9 => assert!(mu < tau_fixed && m, "a fixed τ₀ would drop"),
            10 => assert!(mu >= swapped && !m, "β swapped would merge"),
            _ => {}
        }
        tau_swapped = swapped;
        if m {
            let (vk, vv, vm) = (
                entries[victim].1.clone(),
                entries[victim].2.clone(),
                entries[victim].0.clone(),
            );
            let t = &mut entries[target];
            t.1 = fold(&t.1, &vk, mu);
            t.2 = fold(&t.2, &vv, mu);
            t.0.extend(vm);
            t.0.sort_unstable();
        }
        entries.remove(victim);
        merged.push(m);
        check(&steps[pos - 7][0], &entries, &format!("step {pos}"));
    }
    assert_eq!(merged, vec![false, true, false, true]);
    assert_eq!(
        steps[4][0].member_lists(),
        vec![vec![0], vec![1, 2], vec![3, 4], vec![10, 11]]
    );
}

// ----------------------------------------------------------------- KVMerger

/// The KVMerger layer: one head, d = 2, scale 1, P = 4. Keys (1, 0), (1, 0.5),
/// (1, 0.2), (−1, 0): adjacent cosines 0.894 and 0.965 (> ε = 0.75), then
/// negative, so the pool (no recent window, no heavy hitters) splits into the
/// sets {0, 1, 2} and {3}. Values (i, 1); column sums (0.2, 0.9, 0.5, 0.1).
/// Queries (1, 0): every prompt row is uniform over the keys with logit 1.
fn kvmerger_layer() -> LayerData {
    let k = [[1.0, 0.0], [1.0, 0.5], [1.0, 0.2], [-1.0, 0.0], [0.0, 0.0]];
    let v: Vec<[f32; 2]> = (0..5).map(|i| [i as f32, 1.0]).collect();
    let q = [[1.0f32, 0.0]; 5];
    let mut data = explicit_layer(&[rows(&q)], &[rows(&k)], &[rows(&v)], 4, 1.0);
    data.colsum = vec![0.2, 0.9, 0.5, 0.1];
    data
}

/// kvmerger.md §2.3 step 5 for the set {0, 1, 2} with pivot `p` and kernel
/// width `sigma(distances to the pivot)`: g_t = exp(−‖k_t − k_p‖²/(2σ²)),
/// w = g/Σg, k̂ = Σ w_t k_t, v̂ = |S|·Σ w_t v_t.
fn kvmerger_expected(
    data: &LayerData,
    p: usize,
    sigma: &dyn Fn(&[f64]) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let set = [0usize, 1, 2];
    let k = |j: usize| f64s(data.k_row(0, j));
    let v = |j: usize| f64s(data.v_row(0, j));
    let dist: Vec<f64> = set
        .iter()
        .map(|&t| {
            norm(
                &k(t)
                    .iter()
                    .zip(k(p))
                    .map(|(a, b)| a - b)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let s = sigma(&dist);
    let g: Vec<f64> = dist
        .iter()
        .map(|x| (-x * x / (2.0 * s * s)).exp())
        .collect();
    let z: f64 = g.iter().sum();
    let (mut kh, mut vh) = (vec![0f64; 2], vec![0f64; 2]);
    for (&t, gt) in set.iter().zip(&g) {
        for c in 0..2 {
            kh[c] += gt / z * k(t)[c];
            vh[c] += 3.0 * gt / z * v(t)[c];
        }
    }
    (kh, vh)
}

/// Every σ and pivot variant merges {0, 1, 2} into one entry whose key and
/// value are the Gaussian-weighted means around the pivot (soft budget, no
/// protected tokens). Pivots: attn_argmax → 1 (column sum 0.9); within_set → 0
/// (the set's own rows give 0 the attention of three rows: 1 + 1/2 + 1/3);
/// last_index → 2. Distances to pivot 1: 0.5, 0, 0.3. σ: adaptive = Σ‖·‖/(√2·3),
/// exclude_pivot = Σ‖·‖/(√2·2), adaptive_sq = Σ‖·‖²/(√2·3), fixed = σ0 = 0.4.
#[test]
fn kvmerger_sigma_and_pivot_variants_give_the_exact_gaussian_merge() {
    let data = kvmerger_layer();
    let base = "kvmerger:budget_mode=soft,recent_ratio=0,hh_ratio=0";
    let r2 = 2f64.sqrt();
    let adaptive = |d: &[f64]| d.iter().sum::<f64>() / (r2 * 3.0);
    let excl = |d: &[f64]| d.iter().sum::<f64>() / (r2 * 2.0);
    let sq = |d: &[f64]| d.iter().map(|x| x * x).sum::<f64>() / (r2 * 3.0);
    let fixed = |_: &[f64]| 0.4;
    // within_set pivot: attention each member receives from the set's own
    // queries (rows 0..=2, full causal softmax), computed here from q and k
    let within: Vec<f64> = (0..3)
        .map(|t| {
            (t..3)
                .map(|q| {
                    let qv = f64s(data.q_row(0, q));
                    softmax(
                        &(0..=q)
                            .map(|j| dot(&qv, &f64s(data.k_row(0, j))))
                            .collect::<Vec<_>>(),
                    )[t]
                })
                .sum()
        })
        .collect();
    assert!((within[0] - 11.0 / 6.0).abs() < 1e-12 && within[0] > within[1]);
    let cases: [SigmaCase; 7] = [
        ("", 1, &adaptive),
        (",sigma=adaptive", 1, &adaptive),
        (",exclude_pivot_in_sigma=true", 1, &excl),
        (",sigma=adaptive_sq", 1, &sq),
        (",sigma=fixed,sigma0=0.4", 1, &fixed),
        (",pivot=within_set", 0, &adaptive),
        (",pivot=last_index", 2, &adaptive),
    ];
    let mut seen: Vec<Vec<f64>> = Vec::new();
    for (variant, pivot, sigma) in cases {
        let spec = format!("{base}{variant}");
        let c = &prefill(&spec, &data, 1)[0];
        assert_eq!(c.member_lists(), vec![vec![0, 1, 2], vec![3]], "{spec}");
        let (kh, vh) = kvmerger_expected(&data, pivot, sigma);
        // an f64 computation stored in f32
        assert_close(c.key(0), &kh, 1e-6, &spec);
        assert_close(c.value(0), &vh, 1e-6, &spec);
        assert_eq!(
            c.key(1),
            data.k_row(0, 3),
            "{spec}: the singleton is verbatim"
        );
        assert_eq!(c.value(1), data.v_row(0, 3), "{spec}");
        assert_eq!(c.bias, vec![0.0, 0.0], "{spec}");
        assert_eq!(c.bits, vec![HeadCache::exact_bits(2); 2], "{spec}");
        if variant != ",sigma=adaptive" {
            // each variant changes the merged key: this case tests it
            assert!(
                seen.iter().all(|s| (s[0] - kh[1]).abs() > 1e-3),
                "{spec}: {kh:?} repeats an earlier case"
            );
            seen.push(vec![kh[1]]);
        }
    }
    // Random pivot: a uniform draw per (seed, layer, head), the same for the
    // same seed; each result is the adaptive merge around one member, and over
    // 24 seeds every member is drawn.
    let around: Vec<(Vec<f64>, Vec<f64>)> = (0..3)
        .map(|p| kvmerger_expected(&data, p, &adaptive))
        .collect();
    let mut drawn = [0usize; 3];
    for seed in 0..24 {
        let spec = format!("{base},pivot=random,seed={seed}");
        let c = &prefill(&spec, &data, 1)[0];
        assert_eq!(c, &prefill(&spec, &data, 1)[0], "{spec}: reproducible");
        let close = |(kh, vh): &(Vec<f64>, Vec<f64>)| {
            c.key(0)
                .iter()
                .zip(kh)
                .all(|(a, b)| (*a as f64 - b).abs() < 1e-6)
                && c.value(0)
                    .iter()
                    .zip(vh)
                    .all(|(a, b)| (*a as f64 - b).abs() < 1e-6)
        };
        let hits: Vec<usize> = (0..3).filter(|&p| close(&around[p])).collect();
        assert_eq!(hits.len(), 1, "{spec}: {:?} {:?}", c.key(0), c.value(0));
        drawn[hits[0]] += 1;
    }
    assert!(drawn.iter().all(|&n| n > 0), "{drawn:?}");
}

// ---------------------------------------------------------------- MiniCache

/// A pair of layers (a = 0, b = 1), one head, d = 2, P = 4, two decode steps;
/// each key and value given as (norm, angle in degrees). Angles between the
/// layers: keys 10°, 20°, 150°, 15° on the prompt, 171° and 153° at decode;
/// values 20°, 160°, 5°, 10° on the prompt, 10° and 20° at decode. The norms
/// are not f16 numbers, so their f16 storage shows in the restored vectors.
fn minicache_pair() -> [LayerData; 2] {
    let polar = |x: &[(f64, f64)]| -> Vec<Vec<f32>> {
        x.iter()
            .map(|&(n, a)| deg(a).iter().map(|c| (n * *c as f64) as f32).collect())
            .collect()
    };
    #[allow(clippy::approx_constant)] // 3.14 is a key norm here, not π
    let ka = [
        (2.3, 0.0),
        (1.37, 30.0),
        (0.91, 100.0),
        (3.14, 200.0),
        (1.07, 45.0),
        (2.21, 300.0),
    ];
    let kb = [
        (4.07, 10.0),
        (1.13, 50.0),
        (1.93, 250.0),
        (2.57, 215.0),
        (0.53, 216.0),
        (1.09, 93.0),
    ];
    let va = [
        (1.03, 0.0),
        (2.11, 0.0),
        (0.97, 90.0),
        (1.19, 180.0),
        (1.01, 10.0),
        (2.07, 270.0),
    ];
    let vb = [
        (2.03, 20.0),
        (1.09, 160.0),
        (1.17, 95.0),
        (3.03, 170.0),
        (0.93, 20.0),
        (1.11, 250.0),
    ];
    let q = vec![vec![1.0f32, 0.0]; 6];
    let mut a = explicit_layer(
        std::slice::from_ref(&q),
        &[polar(&ka)],
        &[polar(&va)],
        4,
        1.0,
    );
    let mut b = explicit_layer(&[q], &[polar(&kb)], &[polar(&vb)], 4, 1.0);
    a.n_layers = 2;
    b.n_layers = 2;
    b.layer = 1;
    [a, b]
}

/// landscape.md A2 for one position and half: SLERP of the unit vectors with
/// weight t = 0.6 on the deeper layer, the direction stored at f16 and
/// re-normalised, the norms stored at f16; returns the two restored vectors
/// and the angular distance Ω/π.
fn minicache_merge(xa: &[f32], xb: &[f32]) -> (Vec<f64>, Vec<f64>, f64) {
    let f16 = |x: f64| half::f16::from_f32(x as f32).to_f64();
    let (a, b) = (f64s(xa), f64s(xb));
    let (ua, ub) = (unit(&a), unit(&b));
    let omega = dot(&ua, &ub).clamp(-1.0, 1.0).acos();
    let t = 0.6;
    let e: Vec<f64> = (0..2)
        .map(|c| f16((((1.0 - t) * omega).sin() * ua[c] + (t * omega).sin() * ub[c]) / omega.sin()))
        .collect();
    let e = unit(&e);
    (
        scaled(&e, f16(norm(&a))),
        scaled(&e, f16(norm(&b))),
        omega / std::f64::consts::PI,
    )
}

/// Bits one half (K or V) of a position costs in layer a and in layer b
/// (landscape.md A2 "Memory", d = 2): a stores the f16 direction (d·16) and its
/// norm, b its norm; a retained half adds the f16 original in both layers and a
/// 32-bit index in a.
fn minicache_half_bits(retained: bool) -> (u64, u64) {
    if retained {
        (32 + 16 + 32 + 32, 16 + 32)
    } else {
        (32 + 16, 16)
    }
}

/// Prefill of the pair (start = 0, γ = 0.05, t = 0.6): per half the retention
/// threshold is τ = d_max − γ·(d_max − d_min) over the prompt's angular
/// distances: keys (0.056, 0.111, 0.833, 0.083) keep position 2, values
/// (0.111, 0.889, 0.028, 0.056) keep position 1. A retained half is the
/// original, bit for bit; a merged half is its own f16 norm times the shared
/// f16 SLERP direction.
#[test]
fn minicache_restores_retained_positions_exactly_and_merged_ones_from_norm_and_direction() {
    let [a, b] = minicache_pair();
    let p = PolicySpec::parse("minicache:start=0")
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(p.layer_groups(2, 4, 4), vec![vec![0, 1]]);
    let (caches, _) = p
        .prefill_group(&[PrefillCtx::new(&a, 4), PrefillCtx::new(&b, 4)])
        .unwrap();
    let (ca, cb) = (&caches[0][0], &caches[1][0]);
    assert_eq!(ca.positions(), vec![0, 1, 2, 3]);
    let mut bits = (vec![0u64; 4], vec![0u64; 4]);
    for (half, want_kept) in [("K", 2usize), ("V", 1)] {
        let row = |d: &LayerData, e: usize| {
            if half == "K" {
                d.k_row(0, e).to_vec()
            } else {
                d.v_row(0, e).to_vec()
            }
        };
        let got = |c: &HeadCache, e: usize| {
            if half == "K" {
                c.key(e).to_vec()
            } else {
                c.value(e).to_vec()
            }
        };
        let merged: Vec<_> = (0..4)
            .map(|e| minicache_merge(&row(&a, e), &row(&b, e)))
            .collect();
        let d: Vec<f64> = merged.iter().map(|m| m.2).collect();
        let (mn, mx) = (
            d.iter().cloned().fold(f64::MAX, f64::min),
            d.iter().cloned().fold(f64::MIN, f64::max),
        );
        let tau = mx - 0.05 * (mx - mn);
        let kept: Vec<usize> = (0..4).filter(|&e| d[e] > tau).collect();
        assert_eq!(kept, vec![want_kept], "{half}: distances {d:?}, τ {tau}");
        #[allow(clippy::needless_range_loop)] // e indexes both layers' caches and `merged`
        for e in 0..4 {
            let at = format!("{half} of position {e}");
            if e == want_kept {
                assert_eq!(got(ca, e), row(&a, e), "{at}: layer a keeps the original");
                assert_eq!(got(cb, e), row(&b, e), "{at}: layer b keeps the original");
            } else {
                // f32 arithmetic on f16-stored direction and norms (emulated here)
                assert_close(&got(ca, e), &merged[e].0, 1e-5, &format!("{at}, layer a"));
                assert_close(&got(cb, e), &merged[e].1, 1e-5, &format!("{at}, layer b"));
            }
            let (ba, bb) = minicache_half_bits(e == want_kept);
            bits.0[e] += ba;
            bits.1[e] += bb;
        }
    }
    assert_eq!(ca.bits, bits.0);
    assert_eq!(cb.bits, bits.1);
    assert_eq!(ca.bits, vec![96, 160, 160, 96]);
    assert_eq!(cb.bits, vec![32, 64, 64, 32]);
}

/// Decode with merge_decode = true: after each step the new position is merged
/// across the pair against the thresholds frozen at prefill (τ_K = 0.794,
/// τ_V = 0.846). Step 4: keys 171° apart (0.95) are retained, values 10° apart
/// are merged. Step 5: keys 153° apart (0.85) are retained (a threshold
/// recomputed over the positions seen so far, 0.905 after step 4, would merge
/// them), values 20° apart are merged. Prompt entries are not touched again.
/// With merge_decode = false the decode positions stay exact at full cost.
#[test]
fn minicache_merges_decode_positions_across_the_pair() {
    let pair = minicache_pair();
    let steps = run_group_steps("minicache:start=0", &pair, 4);
    assert_eq!(steps.len(), 3);
    let [a, b] = &pair;
    // frozen thresholds, from the prompt distances
    let frozen = |f: &dyn Fn(&LayerData, usize) -> Vec<f32>| {
        let d: Vec<f64> = (0..4)
            .map(|e| minicache_merge(&f(a, e), &f(b, e)).2)
            .collect();
        let (mn, mx) = (
            d.iter().cloned().fold(f64::MAX, f64::min),
            d.iter().cloned().fold(f64::MIN, f64::max),
        );
        mx - 0.05 * (mx - mn)
    };
    let key = |d: &LayerData, e: usize| d.k_row(0, e).to_vec();
    let val = |d: &LayerData, e: usize| d.v_row(0, e).to_vec();
    let (tau_k, tau_v) = (frozen(&key), frozen(&val));
    let (k4, k5) = (
        minicache_merge(&key(a, 4), &key(b, 4)),
        minicache_merge(&key(a, 5), &key(b, 5)),
    );
    assert!(k4.2 > tau_k && k5.2 > tau_k);
    let dk: Vec<f64> = (0..5)
        .map(|e| minicache_merge(&key(a, e), &key(b, e)).2)
        .collect();
    let recomputed = dk[4] - 0.05 * (dk[4] - dk.iter().cloned().fold(f64::MAX, f64::min));
    assert!(
        k5.2 < recomputed,
        "a recomputed threshold would merge position 5's keys"
    );
    let (v4, v5) = (
        minicache_merge(&val(a, 4), &val(b, 4)),
        minicache_merge(&val(a, 5), &val(b, 5)),
    );
    assert!(v4.2 < tau_v && v5.2 < tau_v);
    for (step, pos, v) in [(1usize, 4usize, &v4), (2, 5, &v5)] {
        let (ca, cb) = (&steps[step][0][0], &steps[step][1][0]);
        assert_eq!(ca.positions(), (0..=pos).collect::<Vec<_>>());
        assert_eq!(
            ca.key(pos),
            a.k_row(0, pos),
            "step {pos}: key retained in a"
        );
        assert_eq!(
            cb.key(pos),
            b.k_row(0, pos),
            "step {pos}: key retained in b"
        );
        assert_close(
            ca.value(pos),
            &v.0,
            1e-5,
            &format!("step {pos}: merged value, a"),
        );
        assert_close(
            cb.value(pos),
            &v.1,
            1e-5,
            &format!("step {pos}: merged value, b"),
        );
        let (kr, vm) = (minicache_half_bits(true), minicache_half_bits(false));
        assert_eq!(ca.bits[pos], kr.0 + vm.0, "step {pos}");
        assert_eq!(cb.bits[pos], kr.1 + vm.1, "step {pos}");
        for e in 0..4 {
            assert_eq!(ca.key(e), steps[0][0][0].key(e));
            assert_eq!(cb.value(e), steps[0][1][0].value(e));
        }
    }
    // merged at their own step, not later
    assert_eq!(steps[1][0][0].value(4), steps[2][0][0].value(4));
    let steps = run_group_steps("minicache:start=0,merge_decode=false", &pair, 4);
    for pos in [4, 5] {
        for (l, d) in pair.iter().enumerate() {
            let c = &steps[2][l][0];
            assert_eq!(c.value(pos), d.v_row(0, pos));
            assert_eq!(c.key(pos), d.k_row(0, pos));
            assert_eq!(c.bits[pos], HeadCache::exact_bits(2));
        }
    }
}
