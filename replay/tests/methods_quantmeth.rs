//! Known-answer tests for the quantisation / sparse-approximation methods of
//! branch `quantmeth` (MiKV, Mustafar, ZipCache, GEAR, KVQuant): hand-built
//! layers whose numbers are chosen so that every quantisation step is exact
//! (scales that are powers of two or small integers, hence exact in f16), so
//! the expected dequantised vectors and bit costs are derived by hand in the
//! comments.
#![allow(clippy::needless_range_loop)] // entries are compared to expected rows by index

mod common;

use common::explicit_layer;
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::{HeadCache, PolicySpec};

fn prefill(spec: &str, data: &LayerData, budget: usize) -> Vec<HeadCache> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    policy.prefill(&PrefillCtx::new(data, budget)).unwrap().0
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-6, "{what}: {a:?} vs {b:?}");
    }
}

/// One query head, one KV head, d = 4, scale 1, every query `q`; keys and
/// values given row by row (the prompt is all rows but the last).
fn layer(q: [f32; 4], keys: &[[f32; 4]], values: &[[f32; 4]]) -> LayerData {
    let t = keys.len();
    let rows = |x: &[[f32; 4]]| vec![x.iter().map(|r| r.to_vec()).collect::<Vec<_>>()];
    explicit_layer(
        &[vec![q.to_vec(); t]],
        &rows(keys),
        &rows(values),
        t - 1,
        1.0,
    )
}

// ---------------------------------------------------------------- MiKV

/// Logits are key channel 0 (queries (1, 0, 0, 0)): s = (2, 0, 0, 1.25, 0, 0).
/// Column sums of the causal softmax (row j: e^{s_i} / Σ_{i'≤j} e^{s_i'}):
/// position 0 ≈ 4.16, 3 ≈ 0.76 (rows 3–5 at e^1.25/(e^2+2+e^1.25+k)), 1 ≈ 0.43,
/// 2 ≈ 0.31, 4 ≈ 0.13. H2O at B = 3 keeps its recent ⌊B/2⌋ = 1 (position 5)
/// and the top 2 of 0..4 by column sum, {0, 3}: those are quantised at
/// hi_bits = 4, positions 1, 2, 4 at lo_bits = 2, nothing is dropped.
/// Every vector is one group of 4 channels. The high rows span [0, 15]
/// (scale 15/15 = 1, zero 0) and the low rows [0, 3] or [−1, 2] (scale 1),
/// so dequantisation is rounding to integers on the grid.
#[test]
fn mikv_keeps_dropped_tokens_at_low_precision() {
    let keys = [
        [2.0, 0.0, 15.0, 7.3],  // hi: → (2, 0, 15, 7)
        [0.0, 0.0, 3.0, 1.4],   // lo: → (0, 0, 3, 1)
        [0.0, -1.0, 2.0, 0.7],  // lo: zero −1 → (0, −1, 2, 1)
        [1.25, 0.0, 15.0, 7.3], // hi: 1.25 → 1
        [0.0, 0.0, 3.0, 0.6],   // lo: → (0, 0, 3, 1)
        [0.0, 0.0, 15.0, 9.6],  // hi (recent): → (0, 0, 15, 10)
        [0.0, 0.0, 0.0, 0.0],   // decode row
    ];
    let values = [
        [0.0, 15.0, 3.4, 8.0], // hi → (0, 15, 3, 8)
        [1.0, 0.0, 3.0, 0.4],  // lo → (1, 0, 3, 0)
        [2.2, 0.0, 3.0, 1.0],  // lo → (2, 0, 3, 1)
        [0.0, 15.0, 5.6, 1.0], // hi → (0, 15, 6, 1)
        [0.0, 3.0, 2.6, 1.0],  // lo → (0, 3, 3, 1)
        [15.0, 0.0, 0.2, 4.5], // hi → (15, 0, 0, 5): 4.5 rounds half away from zero
        [0.0; 4],
    ];
    let data = layer([1.0, 0.0, 0.0, 0.0], &keys, &values);
    let c = &prefill("mikv:hi_bits=4,lo_bits=2,balance=false", &data, 3)[0];
    assert_eq!(c.positions(), vec![0, 1, 2, 3, 4, 5], "nothing is evicted");
    let want_k = [
        [2.0, 0.0, 15.0, 7.0],
        [0.0, 0.0, 3.0, 1.0],
        [0.0, -1.0, 2.0, 1.0],
        [1.0, 0.0, 15.0, 7.0],
        [0.0, 0.0, 3.0, 1.0],
        [0.0, 0.0, 15.0, 10.0],
    ];
    let want_v = [
        [0.0, 15.0, 3.0, 8.0],
        [1.0, 0.0, 3.0, 0.0],
        [2.0, 0.0, 3.0, 1.0],
        [0.0, 15.0, 6.0, 1.0],
        [0.0, 3.0, 3.0, 1.0],
        [15.0, 0.0, 0.0, 5.0],
    ];
    for e in 0..6 {
        close(c.key(e), &want_k[e], &format!("key {e}"));
        close(c.value(e), &want_v[e], &format!("value {e}"));
    }
    // hi entry: 2 · (4 bits · 4 + 2 · 16 scale/zero) = 96; lo: 2 · (2 · 4 + 32) = 80
    assert_eq!(c.bits, vec![96, 80, 80, 96, 80, 96]);

    // The balancer: b_c = √(max|q_c| / max|k_c|) in f16; only channel 0 has
    // a query component: b_0 = √(1/2) → f16 0.70703125, the others 1 (no
    // query there). Key 0 becomes (1.4140625, 0, 15, 7.3) → rounds to
    // (1, 0, 15, 7) → divided back: (1/0.70703125, 0, 15, 7). Key 3:
    // 1.25 · 0.70703125 = 0.884 → 1 → 1/0.70703125 as well. The balancer's
    // 4 f16 numbers (64 bits) are charged to entry 0; values are untouched.
    let c = &prefill("mikv:hi_bits=4,lo_bits=2", &data, 3)[0];
    let inv = 1.0 / 0.70703125f32;
    close(c.key(0), &[inv, 0.0, 15.0, 7.0], "balanced key 0");
    close(c.key(3), &[inv, 0.0, 15.0, 7.0], "balanced key 3");
    close(c.key(1), &[0.0, 0.0, 3.0, 1.0], "balanced key 1");
    close(c.value(5), &want_v[5], "values are not balanced");
    assert_eq!(c.bits, vec![96 + 64, 80, 80, 96, 80, 96]);

    // A budget covering the prompt: every position high precision; hi_bits=16
    // leaves the important ones exact, f16 cost.
    let c = &prefill("mikv:hi_bits=4,lo_bits=2,balance=false", &data, 6)[0];
    assert_eq!(c.bits, vec![96; 6]);
    let c = &prefill("mikv:hi_bits=16,lo_bits=2,balance=false", &data, 3)[0];
    assert_eq!(c.key(3), data.k_row(0, 3));
    assert_eq!(c.bits, vec![128, 80, 80, 128, 80, 128]);
    // another scorer picks the high set: streaming_llm with 1 sink keeps {0, 4, 5}
    let c = &prefill(
        "mikv:scorer=streaming_llm,n_sink=1,hi_bits=16,lo_bits=2,balance=false",
        &data,
        3,
    )[0];
    assert_eq!(c.bits, vec![128, 80, 80, 80, 128, 128]);
    // bad parameters are typed errors
    assert!(PolicySpec::parse("mikv:group=0").unwrap().build().is_err());
}

// ---------------------------------------------------------------- ZipCache

/// Logits s = (0, 0, 0, 0, 2, 0) (queries (0.5, 0, 0, 0), key channel 0 =
/// 2·s). Row j spreads 1/(j+1) evenly, except that position 4 weighs e² in
/// rows 4 and 5. Normalised saliency s_i = colsum_i / (6 − i):
/// s_4 = (e²/(4+e²) + e²/(5+e²))/2 ≈ 0.623, s_0 = (1 + 1/2 + 1/3 + 1/4 +
/// 1/(4+e²) + 1/(5+e²))/6 ≈ 0.375, s_1 ≈ 0.250, s_2 ≈ 0.188, s_3 ≈ 0.140,
/// s_5 ≈ 0.081. At B = 2 the salient positions are {4, 0}; raw column sums
/// would have picked {0, 1} (2.252, 1.252 > 1.245 for position 4).
/// Channel scales c_j = √(max_i |x_ij|) = (√4, √225, √1, √1) = (2, 15, 1, 1);
/// each row divided by c is quantised as one group (salient rows span
/// [0, 15] at 4 bits, the others span 3 at 2 bits: scale 1), then multiplied
/// back. Values equal keys here, so they are expected equal too.
#[test]
fn zipcache_quantises_salient_tokens_at_high_bits() {
    let rows = [
        [0.0, 225.0, 1.0, 0.4], // salient: /c (0, 15, 1, 0.4) → (0, 15, 1, 0)
        [0.0, 45.0, 1.0, 0.4],  // /c (0, 3, 1, 0.4) → (0, 3, 1, 0)
        [0.0, 30.0, -1.0, 0.7], // /c (0, 2, −1, 0.7), zero −1 → (0, 2, −1, 1)
        [0.0, 45.0, 0.2, 0.9],  // → (0, 3, 0, 1)
        [4.0, 225.0, 0.0, 0.7], // salient: /c (2, 15, 0, 0.7) → (2, 15, 0, 1)
        [0.0, 45.0, 1.0, 1.0],  // → exact
        [0.0; 4],
    ];
    let want = [
        [0.0, 225.0, 1.0, 0.0],
        [0.0, 45.0, 1.0, 0.0],
        [0.0, 30.0, -1.0, 1.0],
        [0.0, 45.0, 0.0, 1.0],
        [4.0, 225.0, 0.0, 1.0],
        [0.0, 45.0, 1.0, 1.0],
    ];
    let data = layer([0.5, 0.0, 0.0, 0.0], &rows, &rows);
    let c = &prefill("zipcache", &data, 2)[0];
    assert_eq!(c.positions(), vec![0, 1, 2, 3, 4, 5]);
    for e in 0..6 {
        close(c.key(e), &want[e], &format!("key {e}"));
        close(c.value(e), &want[e], &format!("value {e}"));
    }
    // salient: 2 · (4·4 + 32) = 96; other: 2 · (2·4 + 32) = 80; the two
    // channel-scale vectors (2 · 4 f16 = 128 bits) on entry 0
    assert_eq!(c.bits, vec![96 + 128, 80, 80, 80, 96, 80]);
    // a fraction of the prompt instead of B: ⌊0.5 · 6⌋ = 3 salient, {4, 0, 1}
    let c = &prefill("zipcache:salient=0.5", &data, 2)[0];
    assert_eq!(c.bits, vec![96 + 128, 96, 80, 80, 96, 80]);
    assert!(PolicySpec::parse("zipcache:salient=1.5")
        .unwrap()
        .build()
        .is_err());
}

// ---------------------------------------------------------------- Mustafar

/// d = 4, sparsity 0.5: each pruned vector keeps its 2 largest-magnitude
/// elements (ties: the lower channel). window = 2 on a 6-token prompt: keys
/// 4 and 5 stay dense, values are pruned in whole groups of 2 (6 mod 2 = 0
/// dense). window = 4: keys 2..5 dense, values 4 and 5 (6 mod 4 = 2) dense.
/// Cost of a pruned vector: one 64-bit tile bitmap + its 2 kept values padded
/// up to 8 f16 numbers = 64 + 128 = 192 bits (more than dense at d = 4: the
/// format pays off at the real head sizes, checked below); dense: 64 bits.
#[test]
fn mustafar_prunes_each_vector_to_its_largest_elements() {
    let keys = [
        [2.0, -1.0, 1.0, 0.5], // tie |−1| = |1|: channel 1 first → (2, −1, 0, 0)
        [0.1, -3.0, 0.2, 2.5], // → (0, −3, 0, 2.5)
        [1.0, 2.0, 3.0, 4.0],  // → (0, 0, 3, 4)
        [-4.0, 0.0, 0.0, 1.0], // → (−4, 0, 0, 1)
        [1.0, 1.0, 1.0, 1.0],  // dense at window 2; all tie → (1, 1, 0, 0)
        [0.3, 0.2, 0.1, 0.0],
        [0.0; 4],
    ];
    let values = [
        [0.5, 0.6, -0.7, 0.1],  // → (0, 0.6, −0.7, 0)
        [1.0, 0.0, 0.0, 0.0],   // → (1, 0, 0, 0): the tie among zeros keeps channel 1
        [3.0, -3.0, 3.0, 1.0],  // → (3, −3, 0, 0)
        [0.0, 0.0, 0.2, 0.1],   // → (0, 0, 0.2, 0.1)
        [5.0, 4.0, 3.0, 2.0],   // → (5, 4, 0, 0)
        [-1.0, 2.0, -3.0, 4.0], // → (0, 0, −3, 4)
        [0.0; 4],
    ];
    let data = layer([1.0, 0.0, 0.0, 0.0], &keys, &values);
    let c = &prefill("mustafar:sparsity=0.5,window=2", &data, 100)[0];
    let pk = [
        [2.0, -1.0, 0.0, 0.0],
        [0.0, -3.0, 0.0, 2.5],
        [0.0, 0.0, 3.0, 4.0],
        [-4.0, 0.0, 0.0, 1.0],
    ];
    let pv = [
        [0.0, 0.6, -0.7, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [3.0, -3.0, 0.0, 0.0],
        [0.0, 0.0, 0.2, 0.1],
        [5.0, 4.0, 0.0, 0.0],
        [0.0, 0.0, -3.0, 4.0],
    ];
    for e in 0..4 {
        close(c.key(e), &pk[e], &format!("key {e}"));
    }
    close(c.key(4), &keys[4], "dense key 4");
    close(c.key(5), &keys[5], "dense key 5");
    for e in 0..6 {
        close(c.value(e), &pv[e], &format!("value {e}"));
    }
    assert_eq!(c.bits, vec![384, 384, 384, 384, 192 + 64, 192 + 64]);
    let c = &prefill("mustafar:sparsity=0.5,window=4", &data, 100)[0];
    close(c.key(2), &keys[2], "dense key 2");
    close(c.value(4), &values[4], "dense value 4");
    close(c.value(3), &pv[3], "pruned value 3");
    assert_eq!(c.bits, vec![384, 384, 64 + 192, 64 + 192, 128, 128]);
    // d = 64 at the default 70%: keeps 64 − ⌊44.8⌋ = 20 → 64 + 24 · 16 = 448
    // bits per vector against 1024 dense (the paper's ≈45% of dense).
    let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.1).collect();
    assert_eq!(kvreplay_replay::policies::mustafar::prune(&mut x, 20), 448);
    assert_eq!(x.iter().filter(|v| **v != 0.0).count(), 20);
    assert!(PolicySpec::parse("mustafar:sparsity=1")
        .unwrap()
        .build()
        .is_err());
    assert!(PolicySpec::parse("mustafar:window=0")
        .unwrap()
        .build()
        .is_err());
}

// ---------------------------------------------------------------- GEAR

/// d = 2, P = 4, 2 bits, group 4 (one key group per channel, one value group
/// per token), outliers 0.2: ⌊0.2 · 8⌋ = 1 outlier per matrix.
/// Keys: the outlier is 100 at (0, 1); D = X − S has channel 0 = (0, 1, 2.4, 3)
/// → scale 1, zero 0 → (0, 1, 2, 3) and channel 1 = (0, 0, 3, 2) → exact.
/// At rank 0: X̂ = Q(D) + S = (0, 100), (1, 0), (2, 3), (3, 2). The residual
/// R = D − Q(D) has one non-zero, 0.4 at (2, 0): rank 1, so at rank 1 the
/// keys come back exactly. Values: the outlier is 50 at (3, 0); every row
/// spans a range whose third is exact in f16, two elements per group, so the
/// quantised values are exact and R = 0.
/// Bits at rank 0: keys 2·2 = 4 per entry, the 2 channel groups' scale and
/// zero 2·2·16 = 64 and the outlier 16 + 32 = 48 on entry 0; values 4 + 32
/// per entry, the outlier's 48 on entry 3. Rank 1 adds, for keys and for
/// values, 16 per entry (left factor) and 2·16 = 32 on entry 0 (right factor).
#[test]
fn gear_restores_outliers_and_the_low_rank_residual() {
    let keys = [[0.0, 100.0], [1.0, 0.0], [2.4, 3.0], [3.0, 2.0], [0.0, 0.0]];
    let values = [[0.0, 3.0], [1.5, 0.0], [-1.0, 2.0], [50.0, 0.0], [0.0, 0.0]];
    let rows = |x: &[[f32; 2]]| vec![x.iter().map(|r| r.to_vec()).collect::<Vec<_>>()];
    let data = explicit_layer(
        &[vec![vec![1.0, 0.0]; 5]],
        &rows(&keys),
        &rows(&values),
        4,
        1.0,
    );
    let c = &prefill("gear:bits=2,group=4,outliers=0.2,rank=0", &data, 2)[0];
    let want_k = [[0.0, 100.0], [1.0, 0.0], [2.0, 3.0], [3.0, 2.0]];
    for e in 0..4 {
        close(c.key(e), &want_k[e], &format!("key {e}"));
        close(c.value(e), &values[e], &format!("value {e}"));
    }
    assert_eq!(c.bits, vec![116 + 36, 4 + 36, 4 + 36, 4 + 36 + 48]);
    let c = &prefill("gear:bits=2,group=4,outliers=0.2,rank=1", &data, 2)[0];
    for e in 0..4 {
        close(c.key(e), &keys[e], &format!("rank-1 key {e}"));
        close(c.value(e), &values[e], &format!("rank-1 value {e}"));
    }
    assert_eq!(c.bits, vec![152 + 96, 40 + 32, 40 + 32, 88 + 32]);
    // the budget is ignored
    assert_eq!(
        &prefill("gear:bits=2,group=4,outliers=0.2,rank=1", &data, 4)[0],
        c
    );
    // full rank reproduces any matrix (up to f32 rounding)
    let data = common::random_layer(3, 2, 1, 8, 30, 32);
    let c = &prefill("gear:bits=2,rank=8", &data, 4)[0];
    for e in 0..30 {
        for (a, b) in c.key(e).iter().zip(data.k_row(0, e)) {
            assert!((a - b).abs() < 1e-4, "full-rank key {e}: {a} vs {b}");
        }
    }
    assert!(PolicySpec::parse("gear:group=0").unwrap().build().is_err());
    assert!(PolicySpec::parse("gear:outliers=2")
        .unwrap()
        .build()
        .is_err());
}

// ---------------------------------------------------------------- KVQuant

/// d = 2, P = 5, 2 bits (4 centroids), n_sink 1, outliers 0.125: position 0
/// stays f16; ⌊0.125 · 8⌋ = 1 outlier among the other 8 entries of each matrix.
/// Keys (pre-RoPE), per channel: the outlier is 30 at (4, 0). Channel 0's
/// inliers −1, 1, 0.2 → centre 0, half-range 1; channel 1's 2, 4, 3.2, 2.5 →
/// centre 3, half-range 1. Normalised pool (−1, 1, 0.2, −1, 1, 0.2, −0.5);
/// k-means from (−1, −⅓, ⅓, 1): −0.5 → −⅓, 0.2 → ⅓, so one Lloyd step gives
/// (−1, −0.5, 0.2, 1), a fixed point; in f16 0.2 is 0.199951171875.
/// Dequantised: (−1, 2), (1, 4), (0.19995, 3.19995), (30, 2.5).
/// Values, per token: (1, 3), (0.5, −0.5), (−2, 2) normalise to ±1; the
/// outlier 40 leaves its token's 2 alone (half-range 0 → 1, z = 0, which
/// pulls the nearer of ±⅓ (⅓, by f64 rounding of the grid) to 0): every value
/// is exact. Bits: keys 2·2 = 4 per entry, values 4 + 2·16 (centre,
/// half-range); each outlier 16 + 32; on entry 1 the keys' 2·2 centres and
/// half-ranges (64) and both codebooks (2 · 4 · 16 = 128); the sink 2·2·16 = 64.
#[test]
fn kvquant_quantises_pre_rope_keys_with_a_kmeans_codebook() {
    use kvreplay_kernels::cpu::{apply_rope, unapply_rope, RopeParams, RopeStyle};
    let pre = [
        [9.0, 9.0],
        [-1.0, 2.0],
        [1.0, 4.0],
        [0.2, 3.2],
        [30.0, 2.5],
        [0.0, 0.0],
    ];
    let values = [
        [7.0, 7.0],
        [1.0, 3.0],
        [0.5, -0.5],
        [40.0, 2.0],
        [-2.0, 2.0],
        [0.0, 0.0],
    ];
    // 0.2 in f16: 1638 / 8192 = 0.199951171875
    let c02 = 1638.0 / 8192.0;
    let want = [
        [9.0, 9.0],
        [-1.0, 2.0],
        [1.0, 4.0],
        [c02, 3.0 + c02],
        [30.0, 2.5],
    ];
    let rows = |x: &[[f32; 2]]| vec![x.iter().map(|r| r.to_vec()).collect::<Vec<_>>()];
    let spec = "kvquant:bits=2,outliers=0.125,n_sink=1";
    // without RoPE the stored keys are quantised as they are
    let data = explicit_layer(
        &[vec![vec![1.0, 0.0]; 6]],
        &rows(&pre),
        &rows(&values),
        5,
        1.0,
    );
    let c = &prefill(spec, &data, 2)[0];
    for e in 0..5 {
        close(c.key(e), &want[e], &format!("key {e}"));
        close(c.value(e), &values[e], &format!("value {e}"));
    }
    assert_eq!(
        c.bits,
        vec![64, 4 + 192 + 36, 4 + 36, 4 + 36 + 48, 4 + 48 + 36]
    );
    // with RoPE: the stored keys are the rotated pre-RoPE rows; the policy
    // quantises the pre-RoPE rows and rotates back (round trip in f32)
    let rope = RopeParams {
        theta: 10000.0,
        style: RopeStyle::Neox,
        rotated_dims: 2,
        linear_factor: 1.0,
        llama3: None,
    };
    let mut post: Vec<f32> = pre.iter().flatten().copied().collect();
    apply_rope(&mut post, 1, 2, 0, &rope);
    let post: Vec<[f32; 2]> = post.chunks(2).map(|r| [r[0], r[1]]).collect();
    let mut data = explicit_layer(
        &[vec![vec![1.0, 0.0]; 6]],
        &rows(&post),
        &rows(&values),
        5,
        1.0,
    );
    data.rope = Some(rope);
    let c = &prefill(spec, &data, 2)[0];
    let mut got = c.keys.clone();
    unapply_rope(&mut got, 1, 2, 0, &rope);
    for e in 0..5 {
        for (a, b) in got[2 * e..2 * e + 2].iter().zip(&want[e]) {
            assert!(
                (a - b).abs() < 1e-4,
                "pre-RoPE key {e}: {:?} vs {:?}",
                &got[2 * e..2 * e + 2],
                want[e]
            );
        }
    }
    assert_eq!(c.key(0), data.k_row(0, 0), "the sink is untouched");
    assert!(PolicySpec::parse("kvquant:iters=0")
        .unwrap()
        .build()
        .is_err());
}
