//! Known-answer tests of the kvpress presses expected_attention, think,
//! simlayerkv, compactor and finch on hand-built layers; each expected answer
//! is derived by hand in the comments.

mod common;

use common::{explicit_layer, run_steps};
use kvreplay_kernels::cpu::{RopeParams, RopeStyle};
use kvreplay_replay::policies::compactor::chunked_attention;
use kvreplay_replay::policies::expected_attention::mean_rotation;
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::{HeadCache, PolicySpec};

/// Kept prompt positions per cache after prefill.
fn kept(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<usize>> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    let (caches, _) = policy.prefill(&PrefillCtx::new(data, budget)).unwrap();
    caches.iter().map(|c| c.positions()).collect()
}

fn prefill(spec: &str, data: &LayerData, budget: usize) -> Vec<HeadCache> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    policy.prefill(&PrefillCtx::new(data, budget)).unwrap().0
}

fn rows(x: &[[f32; 2]]) -> Vec<Vec<f32>> {
    x.iter().map(|r| r.to_vec()).collect()
}

#[test]
fn expected_attention_scores_by_the_query_statistics() {
    // No RoPE (R = I), d = 2, n_sink = 1: the statistics use the queries of
    // positions 1..4: (1, 2), (1, −2), (1, 2), (1, −2), so μ = (1, 0) and
    // Σ = diag(0, 4) (divided by 4); the sink's query (9, 9) is left out.
    // z_i = k_i·μ/√2 + k_iᵀΣk_i/(2·2) = k_x/√2 + k_y².
    // Keys 1..4: (√2, 0), (0, 1), (0, 0), (−√2, 1) → z = 1, 1, 0, 0;
    // softmax ∝ e, e, 1, 1; value norms 1, 2, 3, 0.5 → scores ∝ e, 2e, 3, 0.5:
    // rank 2 > 3 > 1 > 4, the sink 0 always kept.
    let s2 = std::f32::consts::SQRT_2;
    let q = vec![rows(&[
        [9.0, 9.0],
        [1.0, 2.0],
        [1.0, -2.0],
        [1.0, 2.0],
        [1.0, -2.0],
        [0.0, 0.0],
    ])];
    let k = vec![rows(&[
        [5.0, 5.0],
        [s2, 0.0],
        [0.0, 1.0],
        [0.0, 0.0],
        [-s2, 1.0],
        [0.0, 0.0],
    ])];
    let v = vec![rows(&[
        [0.0, 0.0],
        [1.0, 0.0],
        [0.0, 2.0],
        [3.0, 0.0],
        [0.0, 0.5],
        [1.0, 1.0],
    ])];
    let data = explicit_layer(&q, &k, &v, 5, 1.0);
    let spec = "expected_attention:n_sink=1";
    assert_eq!(kept(spec, &data, 2), vec![vec![0, 2]]);
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 2, 3]]);
    assert_eq!(kept(spec, &data, 4), vec![vec![0, 1, 2, 3]]);
    // without the covariance z = 1, 0, 0, −1: scores ∝ e, 2, 3, 0.5/e → 3 > 1 > 2 > 4
    let spec = "expected_attention:n_sink=1,use_covariance=false";
    assert_eq!(kept(spec, &data, 2), vec![vec![0, 3]]);
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 1, 3]]);
    // without the value norms: e, e, 1, 1; the tie of 1 and 2 keeps the later
    let spec = "expected_attention:n_sink=1,use_vnorm=false";
    assert_eq!(kept(spec, &data, 2), vec![vec![0, 2]]);
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 1, 2]]);
    // epsilon is added before the norms: with ε = 100 the norms decide (3 > 2 > 1 > 4)
    let spec = "expected_attention:n_sink=1,epsilon=100";
    assert_eq!(kept(spec, &data, 2), vec![vec![0, 3]]);
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 2, 3]]);
    // the default 4 sinks leave one position to score: B = 4 keeps the sinks
    assert_eq!(kept("expected_attention", &data, 4), vec![vec![0, 1, 2, 3]]);
}

#[test]
fn expected_attention_averages_softmaxes_over_the_gqa_group() {
    // Two query heads on one KV head, n_sink = 1, no covariance (the queries of
    // each head are constant): head A's queries (1, 0), head B's (−1, 0).
    // Keys 1..3 (√2, 0), (0, 0), (−√2, 0): z_A = 1, 0, −1, z_B = −1, 0, 1.
    // Mean of the two softmaxes ∝ cosh 1 = 1.543, 1, 1.543; value norms 1,
    // 1.3, 1.01 → 1.543, 1.3, 1.559: B = 2 keeps the sink and 3, B = 3 adds 1.
    // (Averaging the logits instead gives 0, 0, 0 → 1, 1.3, 1.01 and keeps 2;
    // head A alone, e, 1.3, 1.01/e, keeps 1.)
    let s2 = std::f32::consts::SQRT_2;
    let qa = rows(&[[1.0, 0.0]; 5]);
    let qb = rows(&[[-1.0, 0.0]; 5]);
    let k = vec![rows(&[
        [0.0, 0.0],
        [s2, 0.0],
        [0.0, 0.0],
        [-s2, 0.0],
        [0.0, 0.0],
    ])];
    let v = vec![rows(&[
        [1.0, 0.0],
        [1.0, 0.0],
        [1.3, 0.0],
        [0.0, 1.01],
        [1.0, 0.0],
    ])];
    let data = explicit_layer(&[qa, qb], &k, &v, 4, 1.0);
    let spec = "expected_attention:n_sink=1,use_covariance=false";
    assert_eq!(kept(spec, &data, 2), vec![vec![0, 3]]);
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 1, 3]]);
}

#[test]
fn expected_attention_averages_the_rope_rotation_over_future_positions() {
    // d = 2, θ such that pair 0 turns by 1 rad per position: over positions 0
    // and 1 the mean rotation is [[(1 + cos 1)/2, −sin 1/2], [sin 1/2, (1 + cos 1)/2]].
    let rope = RopeParams {
        theta: 10000.0,
        style: RopeStyle::Neox,
        rotated_dims: 2,
        linear_factor: 1.0,
        llama3: None,
    };
    let r = mean_rotation(Some(&rope), 2, 0, 2);
    let (c, s) = ((1.0 + 1f64.cos()) / 2.0, 1f64.sin() / 2.0);
    let want = [c, -s, s, c];
    for (a, b) in r.iter().zip(want) {
        assert!((a - b).abs() < 1e-15, "{r:?}");
    }
    // one position is that position's rotation; d = 3 leaves the tail alone
    let r = mean_rotation(Some(&rope), 3, 5, 1);
    let want = [
        5f64.cos(),
        -5f64.sin(),
        0.0,
        5f64.sin(),
        5f64.cos(),
        0.0,
        0.0,
        0.0,
        1.0,
    ];
    for (a, b) in r.iter().zip(want) {
        assert!((a - b).abs() < 1e-15, "{r:?}");
    }
    // no RoPE: the identity
    assert_eq!(mean_rotation(None, 2, 7, 3), vec![1.0, 0.0, 0.0, 1.0]);
}

/// The think layer: one KV head read by two query heads, d = 4, P = 4, one decode step.
fn think_layer() -> LayerData {
    let q4 = |x: [f32; 4]| x.to_vec();
    // the window (w = 2) is rows 2 and 3; rows 0 and 1 must not count
    let qa = vec![
        q4([0.0; 4]),
        q4([0.0; 4]),
        q4([1.0; 4]),
        q4([1.0; 4]),
        q4([1.0; 4]),
    ];
    let qb = vec![
        q4([5.0, 0.0, 0.0, 0.0]),
        q4([5.0, 0.0, 0.0, 0.0]),
        q4([0.0, 0.0, 4.0, 0.0]),
        q4([0.0, 0.0, 4.0, 0.0]),
        q4([0.0, 0.0, 4.0, 0.0]),
    ];
    let k = vec![vec![
        q4([2.0, 0.0, 0.0, 1.0]),
        q4([2.0, 0.0, 0.0, 1.0]),
        q4([0.0, 1.0, 0.5, 1.0]),
        q4([0.0, 1.0, 0.5, 1.0]),
        q4([3.0, 3.0, 3.0, 3.0]),
    ]];
    let v = vec![(0..5).map(|i| q4([i as f32, 1.0, 2.0, 3.0])).collect()];
    explicit_layer(&[qa, qb], &k, &v, 4, 1.0)
}

#[test]
fn think_prunes_the_least_queried_key_channels() {
    // Window rows 2, 3: q̄² = (1, 1, 1, 1) for head A and (0, 0, 16, 0) for
    // head B; group mean (0.5, 0.5, 8.5, 0.5). Mean squared keys over the 4
    // prompt entries: (2, 0.5, 0.125, 1). Products (1, 0.25, 1.0625, 0.5):
    // ratio 0.5 prunes 2 channels, the smallest: 1 and 3. (Head A alone would
    // prune 2 and 1; the rows 0, 1 of head B would weigh channel 0.)
    let data = think_layer();
    let c = prefill("think:w=2", &data, 4);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].positions(), vec![0, 1, 2, 3]);
    assert_eq!(c[0].key(0), &[2.0, 0.0, 0.0, 0.0]);
    assert_eq!(c[0].key(3), &[0.0, 0.0, 0.5, 0.0]);
    assert_eq!(c[0].value(2), &[2.0, 1.0, 2.0, 3.0]);
    // each prompt entry stores 8 − 2 numbers of 16 bits
    assert_eq!(c[0].bits, vec![96; 4]);
    // the decode entry is appended whole
    let steps = run_steps("think:w=2", &data, 4);
    assert_eq!(steps[1][0].key(4), &[3.0, 3.0, 3.0, 3.0]);
    assert_eq!(steps[1][0].bits[4], HeadCache::exact_bits(4));
    assert_eq!(steps[1][0].key(1), &[2.0, 0.0, 0.0, 0.0]);
    // ratio 0.25 prunes one channel (1); ratio 0 prunes nothing
    let c = prefill("think:w=2,ratio=0.25", &data, 4);
    assert_eq!(c[0].key(2), &[0.0, 0.0, 0.5, 1.0]);
    assert_eq!(c[0].bits, vec![112; 4]);
    let c = prefill("think:w=2,ratio=0", &data, 4);
    assert_eq!(c[0].key(2), &[0.0, 1.0, 0.5, 1.0]);
    assert!(PolicySpec::parse("think:ratio=1.5")
        .unwrap()
        .build()
        .is_err());
}

#[test]
fn think_composed_weighs_the_channels_over_the_kept_keys() {
    // snapkv (w = 1, no pooling) at B = 2 keeps the window 3 and the key the
    // last row's group-mean attention favours: head A's logits over keys 0..3
    // are 3, 3, 2.5, 2.5 → 0.311, 0.311, 0.189; head B's are 0, 0, 2, 2 →
    // 0.060, 0.060, 0.440; means 0.185, 0.185, 0.315: key 2. Over the kept keys
    // 2, 3 the mean squared key is (0, 1, 0.25, 1); products with
    // (0.5, 0.5, 8.5, 0.5): (0, 0.5, 2.125, 0.5) → prune 0 and 1 (the tie of
    // 1 and 3 prunes the lower channel).
    let data = think_layer();
    let c = prefill("snapkv:w=1,k=1,pool=none+think:w=2", &data, 2);
    assert_eq!(c[0].positions(), vec![2, 3]);
    assert_eq!(c[0].key(0), &[0.0, 0.0, 0.5, 1.0]);
    assert_eq!(c[0].bits, vec![96; 2]);
}

/// One layer for simlayerkv: P = 8, one-hot keys (d = 8), one query head per
/// KV head; the last prompt query of head h has logits `logits[h]`.
fn sim_layer(layer: usize, logits: [[f32; 8]; 2]) -> LayerData {
    let onehot = |i: usize| {
        (0..8)
            .map(|c| if c == i { 1.0 } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let q: Vec<Vec<Vec<f32>>> = logits
        .iter()
        .map(|l| {
            let mut rows = vec![vec![0.0; 8]; 9];
            rows[7] = l.to_vec();
            rows
        })
        .collect();
    let k: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|_| (0..9).map(|i| onehot(i % 8)).collect())
        .collect();
    let v = k.clone();
    let mut d = explicit_layer(&q, &k, &v, 8, 1.0);
    d.layer = layer;
    d.n_layers = 2;
    d
}

#[test]
fn simlayerkv_compresses_only_lazy_layers() {
    // B = 4, n_initial = 1, n_last = 1: n_recent = B − n_initial + n_last = 4;
    // P = 8 > 1 + 4 + 1. The last query (7) counts its mass on key 0 and keys
    // 3..7 (the n_recent keys before it, itself excluded).
    // Head "lazy": weights ∝ 5, 1, 1, 1, 1, 1, 1, 1 → (5 + 4)/12 = 0.75;
    // head "busy": ∝ 1, 5, 5, 1, 1, 1, 1, 1 → (1 + 4)/16 = 0.3125.
    let l5 = 5f32.ln();
    let lazy = [l5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let busy = [0.0, l5, l5, 0.0, 0.0, 0.0, 0.0, 0.0];
    let spec = "simlayerkv:n_initial=1,lazy_threshold=0.5";
    // a lazy layer keeps key 0 and the last B − 1 = 3 (5, 6, 7) in both KV heads
    let lazy_layer = sim_layer(0, [lazy, lazy]);
    assert_eq!(kept(spec, &lazy_layer, 4), vec![vec![0, 5, 6, 7]; 2]);
    let busy_layer = sim_layer(1, [busy, busy]);
    assert_eq!(
        kept(spec, &busy_layer, 4),
        vec![(0..8).collect::<Vec<_>>(); 2]
    );
    // the layer decides as a whole: mean over its query heads (0.75 + 0.3125)/2 = 0.53125
    let mixed = sim_layer(0, [lazy, busy]);
    assert_eq!(kept(spec, &mixed, 4), vec![vec![0, 5, 6, 7]; 2]);
    let spec55 = "simlayerkv:n_initial=1,lazy_threshold=0.55";
    assert_eq!(kept(spec55, &mixed, 4), vec![(0..8).collect::<Vec<_>>(); 2]);
    // threshold 1 (kvpress's dataclass default) compresses nothing
    assert_eq!(
        kept("simlayerkv:n_initial=1,lazy_threshold=1", &lazy_layer, 4),
        vec![(0..8).collect::<Vec<_>>(); 2]
    );
    // B = 6: 1 + 6 + 1 = 8 >= P, too short to compress (kvpress's min_length)
    assert_eq!(
        kept(spec, &lazy_layer, 6),
        vec![(0..8).collect::<Vec<_>>(); 2]
    );
    // the default n_initial = 4, B = 5: n_recent = 2, keys 0..4 and 5, 6 count:
    // lazy head (5 + 3 + 2)/12 = 0.83 > 0.5 → keep 0..4 and the last 1
    assert_eq!(
        kept("simlayerkv:lazy_threshold=0.5", &lazy_layer, 5),
        vec![vec![0, 1, 2, 3, 7]; 2]
    );
    assert!(PolicySpec::parse("simlayerkv:lazy_threshold=2")
        .unwrap()
        .build()
        .is_err());
}

#[test]
fn compactor_blends_leverage_with_chunked_attention() {
    // Non-causal chunked attention, chunk 2, d = 4, every query (1, 0, 0, 0),
    // keys 0, (ln 3, 0, 0, 0), (ln 3, 0, 0, 0): logits q·k unscaled.
    // Chunk {0, 1}: both queries weigh (1/4, 3/4) → column sums 0.5, 1.5.
    // Chunk {2} padded by one: its query weighs key 2 vs the padded key
    // (logit −1e-9 ≈ 0) 3 : 1 → 0.75; the padded query weighs key 2 with
    // logit 0 against −1e-9 → 0.5: total 1.25 (masking the padding would give 1).
    let l3 = 3f32.ln();
    let q = vec![vec![vec![1.0, 0.0, 0.0, 0.0]; 4]];
    let k = vec![vec![
        vec![0.0; 4],
        vec![l3, 0.0, 0.0, 0.0],
        vec![l3, 0.0, 0.0, 0.0],
        vec![0.0; 4],
    ]];
    let data = explicit_layer(&q, &k, &k, 3, 0.5);
    let ctx = PrefillCtx::new(&data, 3);
    let a = chunked_attention(&ctx, 0, 0..3, 2);
    for (x, want) in a.iter().zip([0.5, 1.5, 1.25]) {
        assert!((x - want).abs() < 1e-6, "{a:?}");
    }

    // Blending 0: the attention part alone. P = 6, sinks 1 at each end, one
    // chunk of the middle 1..5; keys orthogonal to the queries, so every
    // query weighs the 4 middle keys 1/4 and each column sums to 1; value
    // norms 3, 0, 0, 1 → pooled (avg, kernel 3, zeros counted): 1, 1, 1/3, 1/3.
    // B = 3 keeps 0, 5 and position 2 (tie with 1: the later); B = 4 adds 1;
    // B = 5 adds 4 (tie with 3).
    let e = |i: usize| {
        (0..4)
            .map(|c| if c == i { 1.0 } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let q = vec![vec![e(0); 7]];
    let k = vec![vec![e(0), e(1), e(2), e(3), e(1), e(2), e(0)]];
    let v = vec![vec![
        e(0),
        vec![3.0, 0.0, 0.0, 0.0],
        vec![0.0; 4],
        vec![0.0; 4],
        e(1),
        e(2),
        e(3),
    ]];
    let data = explicit_layer(&q, &k, &v, 6, 0.5);
    let spec = "compactor:sink_start=1,sink_end=1,chunk=4,blending=0";
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 2, 5]]);
    assert_eq!(kept(spec, &data, 4), vec![vec![0, 1, 2, 5]]);
    assert_eq!(kept(spec, &data, 5), vec![vec![0, 1, 2, 4, 5]]);

    // A large blending: the leverage part decides. The keys of leverage's
    // known-answer test (shifted by (50, 50), which the centring removes) have
    // leverage .75, .083 ×3, .5, .5 (see leverage_keeps_the_outlying_keys), so
    // without sinks B = 1 keeps 0 and B = 3 keeps 0, 4, 5.
    let keys = [
        [30.0, 0.0],
        [-10.0, 0.0],
        [-10.0, 0.0],
        [-10.0, 0.0],
        [0.0, 10.0],
        [0.0, -10.0],
    ]
    .map(|[a, b]| vec![a + 50.0, b + 50.0]);
    let mut kk: Vec<Vec<f32>> = keys.to_vec();
    kk.push(vec![0.0, 0.0]);
    let q = vec![vec![vec![0.01, 0.0]; 7]];
    let v = vec![vec![vec![1.0, 0.0]; 7]];
    let data = explicit_layer(&q, &[kk], &v, 6, 1.0);
    let spec = "compactor:sink_start=0,sink_end=0,blending=1000";
    assert_eq!(kept(spec, &data, 1), vec![vec![0]]);
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 4, 5]]);
}

#[test]
fn finch_weights_question_rows_by_position() {
    // P = 5, question w = 2 (rows 3 and 4), one-hot keys (d = 5, scale 1):
    // row 3 weighs keys 0..3 ∝ 4, 1, 2, 1 → 0.5, 0.125, 0.25; row 4 weighs
    // keys 0..4 ∝ 2, 6, 2, 1, 1 → 1/6, 1/2, 1/6. kvpress multiplies row j by
    // j (3 and 4), then averages the rows:
    // key 0: (1.5 + 0.667)/2 = 1.083, key 1: (0.375 + 2)/2 = 1.1875,
    // key 2: (0.75 + 0.667)/2 = 0.708 → B = 3 keeps 1 and the question 3, 4.
    // Without the weighting: 0.333, 0.3125, 0.208 → keeps 0.
    let onehot = |i: usize| {
        (0..5)
            .map(|c| if c == i { 1.0 } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let (l2, l4, l6) = (2f32.ln(), 4f32.ln(), 6f32.ln());
    let mut qrows = vec![vec![0.0; 5]; 6];
    qrows[3] = vec![l4, 0.0, l2, 0.0, 0.0];
    qrows[4] = vec![l2, l6, l2, 0.0, 0.0];
    let k = vec![(0..6).map(|i| onehot(i % 5)).collect::<Vec<_>>()];
    let data = explicit_layer(&[qrows], &k, &k, 5, 1.0);
    assert_eq!(kept("finch:question=2", &data, 3), vec![vec![1, 3, 4]]);
    assert_eq!(
        kept("finch:question=2,normalize=false", &data, 3),
        vec![vec![0, 3, 4]]
    );
    assert_eq!(kept("finch:question=2", &data, 4), vec![vec![0, 1, 3, 4]]);
    // B <= w keeps the last B
    assert_eq!(kept("finch:question=2", &data, 2), vec![vec![3, 4]]);
}
