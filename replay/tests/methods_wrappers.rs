//! The kvpress wrapper presses (chunkkv, chunk, block, criticalkv,
//! criticaladakv, keyrerotation) on hand-built layers: expected kept
//! positions and keys derived by hand in the comments.

mod common;

use common::{random_layer, simple_layer};
use kvreplay_kernels::cpu::{RopeParams, RopeStyle};
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::{HeadCache, PolicySpec};

/// Prefill caches of `spec` at `budget`.
fn caches(spec: &str, data: &LayerData, budget: usize) -> Vec<HeadCache> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    policy.prefill(&PrefillCtx::new(data, budget)).unwrap().0
}

/// Kept prompt positions per cache after prefill.
fn kept(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<usize>> {
    caches(spec, data, budget)
        .iter()
        .map(|c| c.positions())
        .collect()
}

/// `data` cut down to `positions` as a layer of its own, written out
/// independently of `PrefillCtx::restricted` (queries, keys and values
/// gathered; column sums left empty: the scorers used with it read none).
fn sliced(data: &LayerData, positions: &[usize]) -> LayerData {
    let (d, t, n) = (data.d, data.total_len, positions.len());
    let mut q = Vec::new();
    for h in 0..data.n_heads {
        for &i in positions {
            q.extend_from_slice(&data.q[(h * t + i) * d..(h * t + i + 1) * d]);
        }
    }
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for g in 0..data.n_kv_heads {
        for &i in positions {
            k.extend_from_slice(&data.k[(g * t + i) * d..(g * t + i + 1) * d]);
            v.extend_from_slice(&data.v[(g * t + i) * d..(g * t + i + 1) * d]);
        }
    }
    LayerData {
        prompt_len: n,
        total_len: n,
        q,
        k,
        v,
        colsum: Vec::new(),
        memo: None,
        rope: None,
        all_colsum: None,
        backend: Default::default(),
        ..*data_header(data)
    }
}

/// The scalar fields of `data` (a LayerData with empty tensors).
fn data_header(data: &LayerData) -> Box<LayerData> {
    Box::new(LayerData {
        layer: data.layer,
        n_layers: data.n_layers,
        n_heads: data.n_heads,
        n_kv_heads: data.n_kv_heads,
        d: data.d,
        scale: data.scale,
        prompt_len: 0,
        total_len: 0,
        q_start: 0,
        q: Vec::new(),
        k: Vec::new(),
        v: Vec::new(),
        colsum: Vec::new(),
        window: None,
        all_colsum: None,
        rope: None,
        memo: None,
        backend: Default::default(),
        tokens: None,
    })
}

#[test]
fn chunkkv_keeps_whole_chunks_by_their_mean_summed_score() {
    // KNorm scores −|s_i| (key (s_i, 0)). Two KV heads, P = 10, L = 3:
    // chunks {0,1,2} {3,4,5} {6,7,8} {9}.
    //   head 0 |s|: 5 5 5  1 1 1  3 3 3  0
    //   head 1 |s|: 5 5 5  1 1 1  3 3 3  4
    // summed over heads and averaged per chunk: −10, −2, −6, −4.
    // B = 5: k = ⌊4·5/10⌋ = 2 chunks: {3,4,5} (−2) then {9} (−4), 4 <= 5.
    let s = vec![
        vec![5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 0.0],
        vec![5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 4.0],
    ];
    let data = simple_layer(&s, 1, 10, 0, 1);
    let spec = "chunkkv:scorer=knorm,skip_layers=none,chunk_length=3";
    let c = vec![3, 4, 5, 9];
    assert_eq!(kept(spec, &data, 5), vec![c.clone(), c.clone()]);
    // B = 7: still ⌊28/10⌋ = 2 chunks (kvpress's count, 3 entries unused)
    assert_eq!(kept(spec, &data, 7), vec![c.clone(), c]);
    // B = 8: ⌊32/10⌋ = 3: then {6,7,8} (−6) fits in the 4 left
    let c: Vec<usize> = (3..10).collect();
    assert_eq!(kept(spec, &data, 8), vec![c.clone(), c]);
    // B = 2: k = max(1, 0) = 1; {3,4,5} does not fit in 2 and is skipped,
    // {9} is taken
    assert_eq!(kept(spec, &data, 2), vec![vec![9], vec![9]]);

    // The scorer's window is kept inside B. SnapKV (w = 2, no pooling) on
    // equal logits: every unprotected position scores 1/9 + 1/10, the
    // window takes the layer maximum (the same), so every chunk mean is
    // equal and the later chunk goes first. B = 6: room 6 − 2 = 4,
    // k = ⌊24/10⌋ = 2: {9} (nothing new, counts), {6,7,8} (6, 7 new).
    let flat = simple_layer(&[vec![0.0; 10]], 1, 10, 0, 1);
    let spec = "chunkkv:scorer=snapkv,w=2,k=1,pool=none,chunk_length=3";
    assert_eq!(kept(spec, &flat, 6), vec![vec![6, 7, 8, 9]]);
    // B = 8: k = 3, room 6: {9}, {6,7,8} (2 new), {3,4,5} (3 new)
    assert_eq!(kept(spec, &flat, 8), vec![(3..10).collect::<Vec<_>>()]);
    // B >= P: everything
    assert_eq!(kept(spec, &flat, 10), vec![(0..10).collect::<Vec<_>>()]);
    // no complete chunk (P = 10 < L = 12): the scorer's own selection
    let spec = "chunkkv:scorer=knorm,skip_layers=none,chunk_length=12";
    assert_eq!(
        kept(spec, &data, 5),
        kept("knorm:skip_layers=none", &data, 5)
    );
}

#[test]
fn chunk_compresses_each_chunk_alone_to_the_same_ratio() {
    // KNorm (−|s|), one KV head, P = 10, L = 4: chunks [0,4) [4,8) [8,10),
    // B = 5: n_j = ⌊4·5/10⌋ = 2, 2, ⌊2·5/10⌋ = 1.
    //   |s|: 1 2 3 4 | 9 8 7 6 | 5 0
    // chunk 0 keeps {0, 1}, chunk 1 {6, 7} (7 and 6 the smallest there),
    // chunk 2 {9}. KNorm over the whole prompt would keep {0,1,2,3,9}.
    let s = vec![vec![1.0, 2.0, 3.0, 4.0, 9.0, 8.0, 7.0, 6.0, 5.0, 0.0]];
    let data = simple_layer(&s, 1, 10, 0, 1);
    let spec = "chunk:scorer=knorm,skip_layers=none,chunk_length=4";
    assert_eq!(kept(spec, &data, 5), vec![vec![0, 1, 6, 7, 9]]);
    assert_eq!(
        kept("knorm:skip_layers=none", &data, 5),
        vec![vec![0, 1, 2, 3, 9]]
    );
    // B = 2: n_j = 0, 0, 0 → kvpress's max(1, ·) while the total <= B:
    // chunk 0 keeps {0}, chunk 1 {7}, chunk 2 nothing
    assert_eq!(kept(spec, &data, 2), vec![vec![0, 7]]);

    // The scorer sees only its chunk: SnapKV (w = 2) on each chunk equals
    // SnapKV run on a layer made of that chunk alone (built independently),
    // at the chunk's count n_j = ⌊6·6/12⌋ = 3.
    let data = random_layer(7, 4, 2, 8, 12, 12);
    let got = kept("chunk:scorer=snapkv,w=2,chunk_length=6", &data, 6);
    for (g, got) in got.iter().enumerate() {
        let mut want = Vec::new();
        for start in [0, 6] {
            let positions: Vec<usize> = (start..start + 6).collect();
            let sub = sliced(&data, &positions);
            let k = kept("snapkv:w=2", &sub, 3);
            want.extend(k[g].iter().map(|i| start + i));
        }
        assert_eq!(got, &want, "KV head {g}");
    }
}

#[test]
fn block_cuts_back_to_b_after_every_block_and_equals_keydiff() {
    // KeyDiff one-shot inside the block process, B = 2, block 2, P = 6
    // (the keydiff test's layer): keys
    //   0 (1,0)  1 (0,1)  2 (1,0)  3 (1,0)  4 (0,1)  5 (0,1)
    // {0,1} + {2,3}: anchor (3,1)/4, the (0,1) key is the odd one, then the
    // latest of the equal (1,0) keys: {1, 3}; + {4, 5}: anchor (1,3)/4,
    // now 3 is the odd one, then the latest (0,1) key: {3, 5}. The one-shot
    // rule on the whole prompt keeps {4, 5}.
    let keys = [
        [1.0, 0.0],
        [0.0, 1.0],
        [1.0, 0.0],
        [1.0, 0.0],
        [0.0, 1.0],
        [0.0, 1.0],
    ];
    let mut data = simple_layer(&[vec![0.0; 6]], 1, 6, 0, 1);
    for (i, k) in keys.iter().enumerate() {
        data.k[2 * i..2 * i + 2].copy_from_slice(k);
    }
    assert_eq!(
        kept("block:scorer=keydiff,preset=kvpress,block_size=2", &data, 2),
        vec![vec![3, 5]]
    );
    assert_eq!(kept("keydiff:preset=kvpress", &data, 2), vec![vec![4, 5]]);
    // A score that ignores the rest of the set (KNorm) loses nothing to the
    // blocks: |s| = 3 1 2 .5 4 .1 5, B = 2, block 2: {0,1} → {1,3} → {3,5}
    // → {3,5}, the global two smallest.
    let s = vec![vec![3.0, 1.0, 2.0, 0.5, 4.0, 0.1, 5.0]];
    let d2 = simple_layer(&s, 1, 7, 0, 1);
    assert_eq!(
        kept("block:scorer=knorm,skip_layers=none,block_size=2", &d2, 2),
        vec![vec![3, 5]]
    );
    // The default (KeyDiff, 128-position blocks) is KeyDiff's own default,
    // which runs the same shared process: equal at every budget.
    let r = random_layer(3, 4, 2, 8, 300, 300);
    for b in [1, 17, 64, 128, 200, 299, 300] {
        assert_eq!(kept("block", &r, b), kept("keydiff", &r, b), "B = {b}");
    }
    // A window scorer keeps its window: the prompt's last w positions
    // are each set's last ones when the last block arrives.
    let k = kept("block:scorer=snapkv,w=4,block_size=8", &r, 32);
    for c in &k {
        assert_eq!(c.len(), 32);
        assert!((296..300).all(|i| c.contains(&i)), "{c:?}");
    }
}

/// One KV head (group 1) with column sums giving ObservedAttention scores
/// `s` (colsum_i = s_i·(P − i)) and values (n_i, 0): ‖v_i‖₁ = n_i.
fn scored_layer(s: &[&[f32]], norms: &[&[f32]]) -> LayerData {
    let p = s[0].len();
    let mut data = simple_layer(&vec![vec![0.0; p]; s.len()], 1, p, 0, 1);
    data.colsum = s
        .iter()
        .flat_map(|s| s.iter().enumerate().map(move |(i, x)| x * (p - i) as f32))
        .collect();
    for (g, n) in norms.iter().enumerate() {
        for (i, x) in n.iter().enumerate() {
            data.v[(g * p + i) * 2..(g * p + i) * 2 + 2].copy_from_slice(&[*x, 0.0]);
        }
    }
    data
}

#[test]
fn criticalkv_fills_the_second_stage_by_score_times_value_norm() {
    // s = .9 .8 .1 .2 .3 .05, ‖v‖₁ = 1 1 10 1 2 100, P = 6.
    // B = 4: stage 1 keeps ⌊4·0.5⌋ = 2 by s: {0, 1}; stage 2 ranks the rest
    // by (s + 1e-4)·‖v‖₁: 2: 1.001, 3: .2001, 4: .6002, 5: 5.01 → {5, 2}.
    // The scorer alone keeps {0, 1, 3, 4}.
    let data = scored_layer(
        &[&[0.9, 0.8, 0.1, 0.2, 0.3, 0.05]],
        &[&[1.0, 1.0, 10.0, 1.0, 2.0, 100.0]],
    );
    let spec = "criticalkv:scorer=observed_attention";
    assert_eq!(kept(spec, &data, 4), vec![vec![0, 1, 2, 5]]);
    assert_eq!(kept("observed_attention", &data, 4), vec![vec![0, 1, 3, 4]]);
    // B = 3: stage 1 ⌊1.5⌋ = 1: {0}; stage 2 two of 1: .8001, 2: 1.001,
    // 3: .2001, 4: .6002, 5: 5.01 → {5, 2}
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 2, 5]]);
    // first_stage_ratio = 1: the scorer alone
    assert_eq!(
        kept(&format!("{spec},first_stage_ratio=1"), &data, 4),
        vec![vec![0, 1, 3, 4]]
    );
    // A window scorer's window counts first in stage 1 and is kept.
    let r = random_layer(5, 4, 2, 8, 40, 40);
    for c in kept("criticalkv:scorer=snapkv,w=4", &r, 10) {
        assert_eq!(c.len(), 10);
        assert!((36..40).all(|i| c.contains(&i)), "{c:?}");
    }
}

#[test]
fn criticaladakv_spreads_b_over_heads_then_runs_two_stages() {
    // Two KV heads, P = 6, B = 3.
    //   head 0 s: .9 .8 .7 .6 .01 .02   ‖v‖₁: 1 1 1 1 100 1
    //   head 1 s: .05 .04 .03 .5 .02 .01  ‖v‖₁: 1 1 1 1 1 50
    // α = 0.2: safeguard ⌊0.6⌋ = 0; the layer's top 6 scores: .9 .8 .7 .6
    // (head 0), .5, .05 (head 1): B_0 = 4, B_1 = 2.
    // Head 0: stage 1 ⌊4·.5⌋ = 2: {0, 1}; stage 2 of 2..5 by (s + 1e-4)·‖v‖₁:
    //   .7001, .6001, 1.01, .0201 → {4, 2}: {0, 1, 2, 4}.
    // Head 1: stage 1 ⌊2·.5⌋ = 1: {3}; stage 2 of 0,1,2,4,5: .0501, .0401,
    //   .0301, .0201, .505 → {5}: {3, 5}.
    let data = scored_layer(
        &[
            &[0.9, 0.8, 0.7, 0.6, 0.01, 0.02],
            &[0.05, 0.04, 0.03, 0.5, 0.02, 0.01],
        ],
        &[
            &[1.0, 1.0, 1.0, 1.0, 100.0, 1.0],
            &[1.0, 1.0, 1.0, 1.0, 1.0, 50.0],
        ],
    );
    let spec = "criticaladakv:scorer=observed_attention";
    assert_eq!(kept(spec, &data, 3), vec![vec![0, 1, 2, 4], vec![3, 5]]);
    // α = 0.7: safeguard ⌊2.1⌋ = 2 per head ({0,1} and {3,0}), then the best
    // 2 of the rest (.7, .6 on head 0): B_0 = 4, B_1 = 2 again. Head 1's
    // stage 1 keeps its safeguard {0, 3}, which fills B_1: stage 2 adds
    // nothing (5 no longer makes it).
    assert_eq!(
        kept(&format!("{spec},alpha=0.7"), &data, 3),
        vec![vec![0, 1, 2, 4], vec![0, 3]]
    );
}

#[test]
fn keyrerotation_moves_kept_keys_to_consecutive_positions() {
    // d = 2, RoPE θ = 10000 on both dimensions (Neox): the pair's angle at
    // position p is p radians. Key p is r_p·(cos p, sin p), the rotation of
    // (r_p, 0) at p; |r| = 1 5 2 5 3 5, so KNorm at B = 3 keeps {0, 2, 4}.
    // Moved to positions 0, 1, 2 they become r·(cos e, sin e):
    // (1, 0), 2·(cos 1, sin 1), 3·(cos 2, sin 2); values untouched.
    let r = [1.0f32, 5.0, 2.0, 5.0, 3.0, 5.0];
    let mut data = simple_layer(&[vec![0.0; 6]], 1, 6, 0, 1);
    for (p, x) in r.iter().enumerate() {
        let a = p as f64;
        data.k[2 * p..2 * p + 2]
            .copy_from_slice(&[(*x as f64 * a.cos()) as f32, (*x as f64 * a.sin()) as f32]);
    }
    data.rope = Some(RopeParams {
        theta: 10000.0,
        style: RopeStyle::Neox,
        rotated_dims: 2,
        linear_factor: 1.0,
        llama3: None,
    });
    let c = &caches("knorm:skip_layers=none+keyrerotation", &data, 3)[0];
    assert_eq!(c.positions(), vec![0, 2, 4]);
    for (e, x) in [1.0f64, 2.0, 3.0].iter().enumerate() {
        let want = [x * (e as f64).cos(), x * (e as f64).sin()];
        for (got, want) in c.key(e).iter().zip(want) {
            // two f32 rotations of an f32 key: a few ulps of |k| <= 3
            assert!(
                (*got as f64 - want).abs() < 1e-5,
                "entry {e}: {got} vs {want}"
            );
        }
        assert_eq!(c.value(e), &[[0.0, 2.0, 4.0][e], 1.0]);
    }
    // nothing evicted, nothing moved: bit-identical keys
    let full = &caches("keyrerotation", &data, 3)[0];
    assert_eq!(full.keys, data.k[..12].to_vec());
    // without RoPE parameters the wrapper refuses
    data.rope = None;
    let p = PolicySpec::parse("snapkv+keyrerotation")
        .unwrap()
        .build()
        .unwrap();
    assert!(p.prefill(&PrefillCtx::new(&data, 3)).is_err());
}

/// Kept positions per step (after prefill, then after each decode step) of
/// the single cache of `data`.
fn steps(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<usize>> {
    common::run_steps(spec, data, budget)
        .iter()
        .map(|c| c[0].positions())
        .collect()
}

#[test]
fn decoding_compresses_every_interval_with_the_buffered_queries() {
    // One KV head, keys (s_i, 0), P = 4, four decode steps, layer 2 of 3
    // (KNorm's default skips layers 0 and 1).
    //   |s|: 5 1 4 2 | 3 .5 6 .1
    // KNorm keeps the smallest |s|. Interval 2, B = 3: the prompt is kept
    // whole; after step 5 the cache {0..5} is cut to {5 (.5), 1 (1), 3 (2)};
    // step 6 appends; after step 7 {1,3,5,6,7} is cut to {7, 5, 1}.
    let s = vec![vec![5.0, 1.0, 4.0, 2.0, 3.0, 0.5, 6.0, 0.1]];
    let data = simple_layer(&s, 1, 4, 2, 3);
    let want: Vec<Vec<usize>> = vec![
        vec![0, 1, 2, 3],
        vec![0, 1, 2, 3, 4],
        vec![1, 3, 5],
        vec![1, 3, 5, 6],
        vec![1, 5, 7],
    ];
    assert_eq!(
        steps("decoding:scorer=knorm,compression_interval=2", &data, 3),
        want
    );
    // kvpress's default interval (512 steps): nothing happens in four
    assert_eq!(
        steps("decoding:scorer=knorm", &data, 3)[4],
        (0..8).collect::<Vec<_>>()
    );
    // target_size overrides B: after step 5 the 4 smallest of {0..5}
    assert_eq!(
        steps(
            "decoding:scorer=knorm,compression_interval=2,target_size=4",
            &data,
            3
        )[2],
        vec![1, 3, 4, 5]
    );
    // a layer the scorer skips is never compressed
    let layer0 = simple_layer(&s, 1, 4, 0, 3);
    assert_eq!(
        steps("decoding:scorer=knorm,compression_interval=2", &layer0, 3)[4],
        (0..8).collect::<Vec<_>>()
    );
    // A scorer that reads queries reads the buffered ones: TOVA scores by
    // the newest query's attention, every query (1, 0), so logit = s: the
    // largest s are kept. After step 5: {0 (5), 2 (4), 4 (3)}; after step
    // 7, of {0,2,4,6,7}: {6 (6), 0 (5), 2 (4)}.
    let s = vec![vec![5.0, 1.0, 4.0, 2.0, 3.0, 0.5, 6.0, 0.1]];
    let data = simple_layer(&s, 2, 4, 0, 1);
    let got = steps("decoding:scorer=tova,compression_interval=2", &data, 3);
    assert_eq!((&got[2], &got[4]), (&vec![0, 2, 4], &vec![0, 2, 6]));
    // a compression holds min(interval, buffer + 1) queries: a scorer that
    // reads more is refused when the spec is built
    for bad in [
        "decoding:scorer=snapkv,hidden_states_buffer_size=8",
        "decoding:scorer=snapkv,compression_interval=16",
        "decoding:compression_interval=0",
        "decoding:target_size=0",
    ] {
        assert!(
            PolicySpec::parse(bad).and_then(|p| p.build()).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn prefilldecoding_selects_at_prefill_and_compresses_during_decode() {
    // The decoding test's layer: KNorm at prefill keeps the three smallest
    // |s| of the prompt 5 1 4 2: {1, 2, 3}; step 4 appends; after step 5
    // {1,2,3,4,5} is cut to {5, 1, 3}; step 6 appends; after step 7
    // {1,3,5,6,7} is cut to {7, 5, 1}.
    let s = vec![vec![5.0, 1.0, 4.0, 2.0, 3.0, 0.5, 6.0, 0.1]];
    let data = simple_layer(&s, 1, 4, 2, 3);
    let spec = "prefilldecoding:scorer=knorm,compression_interval=2";
    let want: Vec<Vec<usize>> = vec![
        vec![1, 2, 3],
        vec![1, 2, 3, 4],
        vec![1, 3, 5],
        vec![1, 3, 5, 6],
        vec![1, 5, 7],
    ];
    assert_eq!(steps(spec, &data, 3), want);
    // the same as composing KNorm at prefill with `+decoding`
    assert_eq!(
        steps(
            "knorm+decoding:scorer=knorm,compression_interval=2",
            &data,
            3
        ),
        want
    );
    // the scorer's parameters reach both phases: skip_layers=2 leaves the
    // layer whole at prefill and during decode
    assert_eq!(
        steps(&format!("{spec},skip_layers=2"), &data, 3)[4],
        (0..8).collect::<Vec<_>>()
    );
}
