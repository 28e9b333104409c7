//! Known-answer tests for the head-level methods (retrieval_head, razor,
//! compresskv, windowkv): hand-built layers whose expected retrieval scores,
//! kept positions, merged entries and bit costs are derived by hand in the
//! comments.

mod common;

use std::sync::Arc;

use common::explicit_layer;
use kvreplay_replay::policies::retrieval_head::{head_scores, top_heads, SpanChoice};
use kvreplay_replay::policy::{LayerData, PrefillCtx, TraceTokens};
use kvreplay_replay::{HeadCache, PolicySpec};

fn prefill(spec: &str, data: &LayerData, budget: usize) -> Vec<HeadCache> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    policy.prefill(&PrefillCtx::new(data, budget)).unwrap().0
}

fn onehot(d: usize, i: usize, x: f32) -> Vec<f32> {
    let mut v = vec![0.0; d];
    v[i] = x;
    v
}

/// 4 query heads, 2 KV heads (G = 2), d = 8, P = 6, T = 8. Every key is
/// one-hot (key of position j = e_j, both KV heads), so a query 5·e_j attends
/// most to position j. Tokens: prompt [10, 11, 12, 13, 11, 14], continuation
/// [12, 13]. Steps: the query at 5 (input 14) produces 12, the query at 6
/// (input 12) produces 13. Each head's most-attended position per step:
///   head 0 (KV 0): 5 → 2 (holds 12 = produced: copy), 6 → 3 (13: copy)
///       retrieval 2/2 = 1, echo 0
///   head 1 (KV 0): 5 → 0 (10: nothing), 6 → 2 (12 = its input, 2 < 6: echo)
///       retrieval 0, echo 1/2
///   head 2 (KV 1): 5 → 2 (copy), 6 → 6 (a decode position: nothing)
///       retrieval 1/2, echo 0
///   head 3 (KV 1): 5 → 5 (14, neither), 6 → 0 (10, neither): 0, 0
/// Values: v_j = (j, 1, 0, ...) in both KV heads.
fn heads_layer() -> LayerData {
    let (d, t, p) = (8, 8, 6);
    let targets = [[2, 3], [0, 2], [2, 6], [5, 0]];
    let q: Vec<Vec<Vec<f32>>> = targets
        .iter()
        .map(|tg| {
            (0..t)
                .map(|pos| match pos {
                    5 => onehot(d, tg[0], 5.0),
                    6 => onehot(d, tg[1], 5.0),
                    _ => vec![0.0; d],
                })
                .collect()
        })
        .collect();
    let k: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|_| (0..t).map(|j| onehot(d, j, 1.0)).collect())
        .collect();
    let v: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|_| {
            (0..t)
                .map(|j| {
                    let mut r = vec![0.0; d];
                    r[0] = j as f32;
                    r[1] = 1.0;
                    r
                })
                .collect()
        })
        .collect();
    let mut data = explicit_layer(&q, &k, &v, p, 1.0);
    data.tokens = Some(Arc::new(TraceTokens {
        ids: vec![10, 11, 12, 13, 11, 14, 12, 13],
        spans: vec![],
    }));
    data
}

#[test]
fn retrieval_head_scores_count_copies_and_keep_whole_heads() {
    let data = heads_layer();
    let ctx = PrefillCtx::new(&data, 4);
    let s = head_scores(&ctx, SpanChoice::Auto);
    assert_eq!(s.retrieval, vec![1.0, 0.0, 0.5, 0.0]);
    assert_eq!(s.echo, vec![0.0, 0.5, 0.0, 0.0]);

    // A needle span [3, 6): only head 0's second copy (position 3) counts.
    let mut needle = heads_layer();
    needle.tokens = Some(Arc::new(TraceTokens {
        ids: vec![10, 11, 12, 13, 11, 14, 12, 13],
        spans: vec![("needle".into(), 3..6)],
    }));
    let ctx = PrefillCtx::new(&needle, 4);
    let s = head_scores(&ctx, SpanChoice::Auto);
    assert_eq!(s.retrieval, vec![0.5, 0.0, 0.0, 0.0]);
    assert_eq!(s.echo, vec![0.0; 4]);
    // span=prompt ignores the needle
    assert_eq!(
        head_scores(&ctx, SpanChoice::Prompt).retrieval,
        vec![1.0, 0.0, 0.5, 0.0]
    );

    // top ⌈frac·n⌉ with positive scores, ties to the lower index: 1.0
    // (index 1), then the tie at 0.5 goes to index 0
    assert_eq!(
        top_heads(&[0.5, 1.0, 0.5, 0.0], 0.5),
        vec![true, true, false, false]
    );
    assert_eq!(
        top_heads(&[0.0, 0.0, 0.5, 0.0], 1.0),
        vec![false, false, true, false]
    );

    // frac 0.25 of 4 heads: head 0 → KV head 0 whole (6 entries); KV head 1
    // keeps 1 sink and the 3 most recent: {0, 3, 4, 5}.
    let c = prefill("retrieval_head:frac=0.25,n_sink=1", &data, 4);
    assert_eq!(c[0].positions(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(c[1].positions(), vec![0, 3, 4, 5]);
    // frac 0.5: heads 0 and 2 → both KV heads whole (any query head of the group)
    let c = prefill("retrieval_head:frac=0.5,n_sink=1", &data, 4);
    assert_eq!(c[1].positions(), vec![0, 1, 2, 3, 4, 5]);
    // frac 1: only the two heads with a positive score, the same as 0.5
    let c = prefill("retrieval_head:frac=1,n_sink=1", &data, 4);
    assert_eq!(c[1].len(), 6);
    // no token ids (a layer replayed without its trace): no retrieval head
    let mut bare = heads_layer();
    bare.tokens = None;
    let c = prefill("retrieval_head:frac=1,n_sink=1", &bare, 4);
    assert_eq!(c[0].positions(), vec![0, 3, 4, 5]);
    // B ≥ P keeps everything
    let c = prefill("retrieval_head:frac=0", &data, 6);
    assert_eq!(c[1].len(), 6);
}

#[test]
fn razor_keeps_retrieval_heads_whole_and_merges_the_dropped_middle() {
    let data = heads_layer();
    // frac 0.25 → head 0 → KV 0 whole. KV 1 at B = 4, n_sink 1: 1 sink, one
    // compensation entry, the 4 − 1 − 1 = 2 most recent {4, 5}; dropped
    // {1, 2, 3}: k̂ = mean(e1, e2, e3) = (0, 1/3, 1/3, 1/3, 0, ...),
    // v̂ = (mean(1, 2, 3), 1, 0, ...) = (2, 1, 0, ...), bias ln 3, cost
    // 2·8·16 + 16 = 272 bits.
    let c = prefill("razor:frac=0.25,echo_frac=0,n_sink=1", &data, 4);
    assert_eq!(c[0].len(), 6);
    let c1 = &c[1];
    assert_eq!(
        c1.member_lists(),
        vec![vec![0], vec![1, 2, 3], vec![4], vec![5]]
    );
    let third = 1.0f32 / 3.0;
    for (x, want) in c1
        .key(1)
        .iter()
        .zip([0.0, third, third, third, 0.0, 0.0, 0.0, 0.0])
    {
        assert!((x - want).abs() < 1e-7, "{:?}", c1.key(1));
    }
    assert_eq!(c1.value(1), &[2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(c1.bias, vec![0.0, 3f32.ln(), 0.0, 0.0]);
    assert_eq!(c1.bits, vec![256, 272, 256, 256]);
    assert_eq!(c1.key(0), onehot(8, 0, 1.0).as_slice());

    // echo heads: frac 0, echo_frac 0.25 → head 1 (echo 1/2) → KV 0 whole
    let c = prefill("razor:frac=0,echo_frac=0.25,n_sink=1", &data, 4);
    assert_eq!(c[0].len(), 6);
    assert_eq!(c[1].len(), 4);
    // neither: both KV heads compressed; compensate=false drops the middle
    let c = prefill(
        "razor:frac=0,echo_frac=0,n_sink=1,compensate=false",
        &data,
        4,
    );
    assert_eq!(c[0].positions(), vec![0, 3, 4, 5]);
    // B = 1: the compensation entry alone stands for the whole prompt
    let c = prefill("razor:frac=0,echo_frac=0", &data, 1);
    assert_eq!(c[0].member_lists(), vec![vec![0, 1, 2, 3, 4, 5]]);
    assert_eq!(c[0].value(0)[0], 2.5);

    // Eq. 5: when the dropped keys are equal, the compensation entry with
    // its + ln N_d logit is exact: the output over the compressed cache
    // equals the full attention (softmax with N_d equal logits = one logit
    // + ln N_d, and the mean value is then the weighted value).
    let d = 4;
    let keys = [
        [1.0, 0.0, 0.0, 0.0],
        [0.2, 0.5, 0.0, 0.0],
        [0.2, 0.5, 0.0, 0.0],
        [0.2, 0.5, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 1.0],
    ];
    let k = vec![keys.iter().map(|r| r.to_vec()).collect::<Vec<_>>()];
    let v = vec![(0..6)
        .map(|j| vec![j as f32, 1.0, -(j as f32), 0.5])
        .collect::<Vec<_>>()];
    let q = vec![(0..6)
        .map(|j| vec![0.3 * j as f32, 1.0, 0.5, -0.2])
        .collect::<Vec<_>>()];
    let eq = explicit_layer(&q, &k, &v, 5, 0.7);
    let c = prefill("razor:frac=0,echo_frac=0,n_sink=1", &eq, 3);
    assert_eq!(c[0].member_lists(), vec![vec![0], vec![1, 2, 3], vec![4]]);
    let (mut full, mut comp) = (eq_cache(&eq, d), c[0].clone());
    full.push_exact(5, &keys[5], &v[0][5]);
    comp.push_exact(5, &keys[5], &v[0][5]);
    let qd = &q[0][5];
    let (o_full, _, _) =
        kvreplay_replay::engine::attend(qd, &full, 0.7, &Default::default()).unwrap();
    let (o_comp, _, _) =
        kvreplay_replay::engine::attend(qd, &comp, 0.7, &Default::default()).unwrap();
    for (a, b) in o_full.iter().zip(&o_comp) {
        // f32 accumulation of 6 vs 4 terms
        assert!((a - b).abs() < 1e-5, "{o_full:?} vs {o_comp:?}");
    }
}

fn eq_cache(data: &LayerData, _d: usize) -> HeadCache {
    PrefillCtx::new(data, data.prompt_len).full_cache(0)
}

/// One KV head, two query heads, d = T = 13, P = 12, keys one-hot (k_i = e_i)
/// and both observation rows (10, 11) of head h with q = ln w_h (scale 1),
/// so their softmax is w_h / Σ w_h on 0..9 (positions 10, 11 get logit −30:
/// weight ~1e-13, too small to move a rank). With suffix 2, the review part
/// is 0..9 in windows of 3: W0 = 0..2, W1 = 3..5, W2 = 6..8, W3 = {9}.
///   head 0: w = [1,1,1, 8,1,1, 1,1,1, 4], Σ = 20: A0 = 2w/20 = w/10
///   head 1: w = [1,1,1, 1,1,1, 3,3,3, 1], Σ = 16: A1 = w/8
/// average (mean over both heads and the window): W0 (.3 + .375)/6 = .1125,
///   W1 (1.0 + .375)/6 = .2292, W2 (.3 + 1.125)/6 = .2375, W3 (.4 + .125)/2 = .2625
/// max (each head's top ⌊3/2⌋ = 1, mean over heads): W0 .1125,
///   W1 (.8 + .125)/2 = .4625, W2 (.1 + .375)/2 = .2375, W3 .2625
fn windows_layer(layer: usize, silent: bool) -> LayerData {
    let (p, t) = (12, 13);
    let w = [
        [1.0f32, 1.0, 1.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 1.0],
    ];
    let q: Vec<Vec<Vec<f32>>> = w
        .iter()
        .map(|wh| {
            (0..t)
                .map(|pos| {
                    if silent || !(10..12).contains(&pos) {
                        return vec![0.0; t];
                    }
                    let mut r: Vec<f32> = wh.iter().map(|x| x.ln()).collect();
                    r.extend([-30.0, -30.0, 0.0]);
                    r
                })
                .collect()
        })
        .collect();
    let k = vec![(0..t).map(|j| onehot(t, j, 1.0)).collect::<Vec<_>>()];
    let v = vec![(0..t).map(|j| onehot(t, j, 1.0)).collect::<Vec<_>>()];
    let mut d = explicit_layer(&q, &k, &v, p, 1.0);
    d.layer = layer;
    d.n_layers = 2;
    d
}

#[test]
fn windowkv_keeps_whole_windows_and_shares_them_within_a_group() {
    let base = "windowkv:suffix=2,window=3,group=2,schedule=uniform";
    let group = |spec: &str, b: usize| -> Vec<Vec<usize>> {
        let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
        let (l0, l1) = (windows_layer(0, false), windows_layer(1, true));
        let ctxs = [PrefillCtx::new(&l0, b), PrefillCtx::new(&l1, b)];
        let (caches, _) = policy.prefill_group(&ctxs).unwrap();
        // one set per layer, the same for every KV head
        caches.iter().map(|c| c[0].positions()).collect()
    };
    // B = 6: R = 4, ⌈(10 − 4)/3⌉ = 2 windows dropped.
    // average keeps W3 and W2; max keeps W1 and W3; the suffix {10, 11} always;
    // layer 1 (no attention of its own) reuses layer 0's positions.
    let avg = group(&format!("{base},select=average"), 6);
    assert_eq!(avg, vec![vec![6, 7, 8, 9, 10, 11]; 2]);
    let max = group(&format!("{base},select=max"), 6);
    assert_eq!(max, vec![vec![3, 4, 5, 9, 10, 11]; 2]);
    // task=qa (the default) selects max; task=other selects average
    assert_eq!(group(&format!("{base},task=other"), 6), avg);
    assert_eq!(group(base, 6), max);
    // B = 9: R = 7, one window dropped: the lowest, W0
    assert_eq!(
        group(&format!("{base},select=average"), 9)[1],
        (3..12).collect::<Vec<_>>()
    );
    // B = 2 ≤ suffix: the last two positions only
    assert_eq!(group(base, 2)[0], vec![10, 11]);
    // B ≥ P: everything
    assert_eq!(group(base, 12)[0], (0..12).collect::<Vec<_>>());
    // groups of `group` consecutive layers
    let p = PolicySpec::parse("windowkv:group=8")
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(
        p.layer_groups(30, 64, 1000)[3],
        (24..30).collect::<Vec<_>>()
    );

    // arithmetic schedule, R = 100, 30 layers in 4 groups of 8 (the last of
    // 6), β = 14: last = ⌊100·8/14⌋ = 57, first = 200 − 57 = 143, step =
    // ⌊(143 − 57)/3⌋ = 28: groups get 143, 115, 87, 57.
    let wk = kvreplay_replay::policies::windowkv::WindowKv {
        window: 8,
        select: kvreplay_replay::policies::windowkv::Select::Max,
        suffix: 32,
        group: 8,
        arithmetic: true,
        beta: 14,
    };
    let got: Vec<usize> = [0, 7, 8, 16, 24, 29]
        .iter()
        .map(|&l| wk.review_budget(100, l, 30))
        .collect();
    assert_eq!(got, vec![143, 143, 115, 87, 57, 57]);
}

/// One KV head, two query heads, d = T = 12, P = 10 (two decode steps),
/// keys and values one-hot (k_j = v_j = e_j), scale 1. The window rows 8
/// and 9 of head h have logits ln w_h on 0..7 and −30 on 8, 9 (weight
/// ~1e-13), so both give p_h = w_h / Σ w_h on 0..7:
///   head 0: w = [1, 1, 1, 9, 1, 5, 1, 1], p0 = w/20, A0 = 2·p0 = w/10
///   head 1: w = [6, 1, 1, 1, 1, 1, 1, 4], p1 = w/16, A1 = w/8
/// Tokens: prompt 20..29, continuation [23, 25]. Head 0's row 9 peaks at 3
/// (token 23 = produced) and its decode query 5·e5 at 5 (25 = produced):
/// copy score 1; head 1's row 9 peaks at 0 (20) and its decode query 5·e10
/// at the decode position 10: 0.
fn compress_layer(layer: usize) -> LayerData {
    let (p, t) = (10, 12);
    let w = [
        [1.0f32, 1.0, 1.0, 9.0, 1.0, 5.0, 1.0, 1.0],
        [6.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0],
    ];
    let dec = [5, 10];
    let q: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|h| {
            (0..t)
                .map(|pos| match pos {
                    8 | 9 => {
                        let mut r: Vec<f32> = w[h].iter().map(|x| x.ln()).collect();
                        r.extend([-30.0, -30.0, 0.0, 0.0]);
                        r
                    }
                    10 => onehot(t, dec[h], 5.0),
                    _ => vec![0.0; t],
                })
                .collect()
        })
        .collect();
    let k = vec![(0..t).map(|j| onehot(t, j, 1.0)).collect::<Vec<_>>()];
    let mut d = explicit_layer(&q, &k.clone(), &k, p, 1.0);
    d.layer = layer;
    d.tokens = Some(Arc::new(TraceTokens {
        ids: (20..30).chain([23, 25]).collect(),
        spans: vec![],
    }));
    d
}

#[test]
fn compresskv_scores_with_retrieval_heads_and_allocates_by_layer_error() {
    use kvreplay_replay::policies::compresskv::{allocate, CompressKv};
    let data = compress_layer(0);
    let ctx = PrefillCtx::new(&data, 4);
    let s = head_scores(&ctx, SpanChoice::Auto);
    assert_eq!(s.retrieval, vec![1.0, 0.0]);
    // srh (span = the prompt; both produced tokens occur in it): step 9 puts
    // all its mass on the prompt; step 10 puts (e⁵ + 9)/(e⁵ + 10) (head 0)
    // and 10/(e⁵ + 10) (head 1) there; divided by the 2 steps.
    let e5 = 5f64.exp();
    for (got, want) in s.srh.iter().zip([
        (1.0 + (e5 + 9.0) / (e5 + 10.0)) / 2.0,
        (1.0 + 10.0 / (e5 + 10.0)) / 2.0,
    ]) {
        assert!((got - want).abs() < 1e-6, "{:?}", s.srh);
    }
    let kept = |spec: &str, b: usize| prefill(spec, &data, b)[0].positions();
    let base = "compresskv:w=2,kernel=1,alloc=uniform";
    // heads=1 → head 0 scores: top 2 of A0 on 0..7 are 3 (.9) and 5 (.5), + window {8, 9}
    assert_eq!(kept(&format!("{base},heads=1"), 4), vec![3, 5, 8, 9]);
    assert_eq!(
        kept(&format!("{base},heads=1,score=srh"), 4),
        vec![3, 5, 8, 9]
    );
    // heads=2 → mean of A0, A1: 0 → .425, 3 → .5125, 5 → .3125, 7 → .3: {0, 3}
    assert_eq!(kept(&format!("{base},heads=2"), 4), vec![0, 3, 8, 9]);
    // B ≤ w: the last B; B ≥ P: everything
    assert_eq!(kept(&format!("{base},heads=1"), 2), vec![8, 9]);
    assert_eq!(kept(&format!("{base},heads=1"), 10).len(), 10);

    // The layer error at B = 4 with heads=1 (kept {3, 5, 8, 9}), O over both
    // query heads' two window rows, v one-hot so o = p and o_c = p on the
    // kept set renormalised:
    //   head 0 row: Σ_K p0 = .45 + .25 = .7; err² = 6·.05² + (.45·(1/.7 − 1))²
    //     + (.25·(1/.7 − 1))² = .0636735; ‖o‖² = 6·.05² + .45² + .25² = .28
    //   head 1 row: Σ_K p1 = .125, o_c = .5 at 3 and 5; err² = .375² + 4·.0625²
    //     + .25² + 2·(.5 − .0625)² = .6015625; ‖o‖² = .375² + 6·.0625² + .25² = .2265625
    //   e = √(2·(.0636735 + .6015625)) / (√(2·(.28 + .2265625)) + 1e-5) = 1.1459536
    let ck = CompressKv {
        heads: 1,
        w: 2,
        kernel: 1,
        srh: false,
        span: SpanChoice::Auto,
        error_alloc: true,
    };
    let e = ck.layer_error(&ctx, 4);
    assert!((e - 1.145953588200438).abs() < 1e-6, "{e}");

    // allocation (the reference code's rule): importance [.5, .3, .2], total
    // 300, min 25: 225 to share, round(112.5) = 112 (ties to even), 67.5 →
    // 68, 45 → 137, 93, 70 (sum 300).
    assert_eq!(allocate(&[0.5, 0.3, 0.2], 300, 25, 300), vec![137, 93, 70]);
    // [.9, .05, .05], max 150: 227 clipped to 150, 36, 36 (sum 222); the 78
    // missing go one at a time to the layers below the max, most important
    // first (ties by index): 39 each → 150, 75, 75.
    assert_eq!(
        allocate(&[0.9, 0.05, 0.05], 300, 25, 150),
        vec![150, 75, 75]
    );

    // Error-aware budgets through the group: two copies of the layer have
    // equal errors, so equal importance → B each.
    let (l0, l1) = (compress_layer(0), compress_layer(1));
    let policy = PolicySpec::parse("compresskv:w=2,kernel=1,heads=1")
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(policy.layer_groups(2, 4, 10), vec![vec![0, 1]]);
    let (caches, _) = policy
        .prefill_group(&[PrefillCtx::new(&l0, 4), PrefillCtx::new(&l1, 4)])
        .unwrap();
    assert_eq!(caches[1][0].positions(), vec![3, 5, 8, 9]);
}
