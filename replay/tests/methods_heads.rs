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
    assert_eq!(head_scores(&ctx, SpanChoice::Prompt).retrieval, vec![1.0, 0.0, 0.5, 0.0]);

    // top ⌈frac·n⌉ with positive scores, ties to the lower index: 1.0
    // (index 1), then the tie at 0.5 goes to index 0
    assert_eq!(top_heads(&[0.5, 1.0, 0.5, 0.0], 0.5), vec![true, true, false, false]);
    assert_eq!(top_heads(&[0.0, 0.0, 0.5, 0.0], 1.0), vec![false, false, true, false]);

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
    assert_eq!(c1.members, vec![vec![0], vec![1, 2, 3], vec![4], vec![5]]);
    let third = 1.0f32 / 3.0;
    for (x, want) in c1.key(1).iter().zip([0.0, third, third, third, 0.0, 0.0, 0.0, 0.0]) {
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
    let c = prefill("razor:frac=0,echo_frac=0,n_sink=1,compensate=false", &data, 4);
    assert_eq!(c[0].positions(), vec![0, 3, 4, 5]);
    // B = 1: the compensation entry alone stands for the whole prompt
    let c = prefill("razor:frac=0,echo_frac=0", &data, 1);
    assert_eq!(c[0].members, vec![vec![0, 1, 2, 3, 4, 5]]);
    assert_eq!(c[0].value(0)[0], 2.5);

    // Eq. 5: when the dropped keys are equal, the compensation entry with
    // its + ln N_d logit is exact: the output over the compressed cache
    // equals the full attention (softmax with N_d equal logits = one logit
    // + ln N_d, and the mean value is then the weighted value).
    let d = 4;
    let keys = [[1.0, 0.0, 0.0, 0.0], [0.2, 0.5, 0.0, 0.0], [0.2, 0.5, 0.0, 0.0], [0.2, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]];
    let k = vec![keys.iter().map(|r| r.to_vec()).collect::<Vec<_>>()];
    let v = vec![(0..6).map(|j| vec![j as f32, 1.0, -(j as f32), 0.5]).collect::<Vec<_>>()];
    let q = vec![(0..6).map(|j| vec![0.3 * j as f32, 1.0, 0.5, -0.2]).collect::<Vec<_>>()];
    let eq = explicit_layer(&q, &k, &v, 5, 0.7);
    let c = prefill("razor:frac=0,echo_frac=0,n_sink=1", &eq, 3);
    assert_eq!(c[0].members, vec![vec![0], vec![1, 2, 3], vec![4]]);
    let (mut full, mut comp) = (eq_cache(&eq, d), c[0].clone());
    full.push_exact(5, &keys[5], &v[0][5]);
    comp.push_exact(5, &keys[5], &v[0][5]);
    let qd = &q[0][5];
    let (o_full, _, _) = kvreplay_replay::engine::attend(qd, &full, 0.7, &Default::default()).unwrap();
    let (o_comp, _, _) = kvreplay_replay::engine::attend(qd, &comp, 0.7, &Default::default()).unwrap();
    for (a, b) in o_full.iter().zip(&o_comp) {
        // f32 accumulation of 6 vs 4 terms
        assert!((a - b).abs() < 1e-5, "{o_full:?} vs {o_comp:?}");
    }
}

fn eq_cache(data: &LayerData, _d: usize) -> HeadCache {
    PrefillCtx::new(data, data.prompt_len).full_cache(0)
}
