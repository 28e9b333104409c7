//! Known-answer tests of kvcrush, lazyeviction and xkv on hand-built layers
//! (each expected answer derived by hand in the comments).

mod common;

use common::{explicit_layer, run_steps, simple_layer};
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::PolicySpec;

/// Kept prompt positions per cache after prefill.
fn kept(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<usize>> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    let (caches, _) = policy.prefill(&PrefillCtx::new(data, budget)).unwrap();
    caches.iter().map(|c| c.positions()).collect()
}

#[test]
fn kvcrush_keeps_one_representative_per_hamming_bucket() {
    use kvreplay_replay::policies::kvcrush::{pick_ranks, Pick};
    use kvreplay_replay::policy::SplitMix64;

    // Every case: P = 8, B = 4, inner scorer H2O with recent = 0 (its column
    // sums, set here), share = .5: A = 4, R = 2, the scorer's top 2 kept and
    // the n = 6 evicted positions E sorted by (Hamming distance, position);
    // pick=step keeps ranks 0 and ⌊6/2⌋ = 3, pick=linspace ranks 0 and 5.
    let spec = |rest: &str| format!("kvcrush:recent=0,share=0.5,{rest}");

    // Layer A: one KV head read by two query heads h0, h1:
    //   pos   0   1   2   3   4   5   6   7
    //   h0   10   1   6   0   7   2   0   8
    //   h1   10   9   0   1   7   2   3   0
    //   mean 10   5   3  .5   7   2 1.5   4
    // top 2 by the mean: {0, 4}; E = {1, 2, 3, 5, 6, 7}.
    let mut a = simple_layer(&[vec![0.0; 10]], 2, 8, 0, 1);
    a.colsum = vec![
        10.0, 1.0, 6.0, 0.0, 7.0, 2.0, 0.0, 8.0, //
        10.0, 9.0, 0.0, 1.0, 7.0, 2.0, 3.0, 0.0,
    ];
    // bits_per=kv (default): one bit, the top 4 of the mean {0, 4, 1, 7};
    // E's bits 1: 1, 2: 0, 3: 0, 5: 0, 6: 0, 7: 1.
    //   zeros: (0,2) (0,3) (0,5) (0,6) (1,1) (1,7) → ranks 0, 3: 2, 6
    //   ones:  (0,1) (0,7) (1,2) (1,3) (1,5) (1,6) → 1, 3
    //   mean / inv_mean: the bit is set on exactly 4 of the 8 candidates,
    //   neither a strict majority nor a strict minority → 0 → as zeros
    assert_eq!(kept(&spec("anchor=zeros"), &a, 4), vec![vec![0, 2, 4, 6]]);
    assert_eq!(kept(&spec("anchor=ones"), &a, 4), vec![vec![0, 1, 3, 4]]);
    assert_eq!(kept(&spec("anchor=mean"), &a, 4), vec![vec![0, 2, 4, 6]]);
    assert_eq!(
        kept(&spec("anchor=inv_mean"), &a, 4),
        vec![vec![0, 2, 4, 6]]
    );
    // bits_per=query: bit h = head h's top 4 of the 8 candidates: h0
    // {0, 2, 4, 7}, h1 {0, 1, 4, 6}; signatures (h0, h1) of E:
    //   1: 01, 2: 10, 3: 00, 5: 00, 6: 01, 7: 10.
    //   zeros: (0,3) (0,5) (1,1) (1,2) (1,6) (1,7) → 3, 2
    //   ones:  (1,1) (1,2) (1,6) (1,7) (2,3) (2,5) → 1, 7
    //   mean over all candidates: each bit on 4 of 8 → 00 → as zeros
    //   (the evicted set alone would give 00 too: 2 of 6)
    //   alternate (h1 set): (0,1) (0,6) (1,3) (1,5) (2,2) (2,7) → 1, 5
    let q = |rest: &str| spec(&format!("bits_per=query,{rest}"));
    assert_eq!(kept(&q("anchor=zeros"), &a, 4), vec![vec![0, 2, 3, 4]]);
    assert_eq!(kept(&q("anchor=ones"), &a, 4), vec![vec![0, 1, 4, 7]]);
    assert_eq!(kept(&q("anchor=mean"), &a, 4), vec![vec![0, 2, 3, 4]]);
    assert_eq!(kept(&q("anchor=alternate"), &a, 4), vec![vec![0, 1, 4, 5]]);
    // bits_per=query, bit=mean: h0's mean 4.25 → {0, 2, 4, 7} (4 of 8);
    // h1's mean 4 → {0, 1, 4} (3 of 8, a strict minority). E's signatures
    // 1: 01, 2: 10, 3: 00, 5: 00, 6: 00, 7: 10.
    //   zeros = mean (00): (0,3) (0,5) (0,6) (1,1) (1,2) (1,7) → 3, 1
    //   inv_mean (01): (0,1) (1,3) (1,5) (1,6) (2,2) (2,7) → 1, 6
    assert_eq!(
        kept(&q("anchor=zeros,bit=mean"), &a, 4),
        vec![vec![0, 1, 3, 4]]
    );
    assert_eq!(
        kept(&q("anchor=mean,bit=mean"), &a, 4),
        vec![vec![0, 1, 3, 4]]
    );
    assert_eq!(
        kept(&q("anchor=inv_mean,bit=mean"), &a, 4),
        vec![vec![0, 1, 4, 6]]
    );
    // share = 0 is the inner scorer alone: top 4 by the mean {0, 4, 1, 7}
    assert_eq!(
        kept("kvcrush:recent=0,share=0", &a, 4),
        kept("h2o:recent=0,decode_evict=false", &a, 4)
    );
    assert_eq!(
        kept("kvcrush:recent=0,share=0", &a, 4),
        vec![vec![0, 1, 4, 7]]
    );

    // Layer B: two KV heads (caches), two query heads each; KV head 0 reads
    // h0, h1 as in layer A, KV head 1 reads
    //   pos   0   1   2   3   4   5   6   7
    //   h2    0   8   2   6   1   9   4   2
    //   h3    0   6   2   4   1   7   4   4
    //   mean  0   7   2   5   1   8   4   3
    // Cache 0: top {0, 4}, E0 = {1, 2, 3, 5, 6, 7}; cache 1: top {5, 1},
    // E1 = {0, 2, 3, 4, 6, 7}.
    // bits_per=kv, bit=half: bit 0 = KV head 0's top 4 {0, 1, 4, 7}, bit 1
    // = KV head 1's top 4 {5, 1, 3, 6}; signatures (b0, b1):
    //   0: 10, 1: 11, 2: 00, 3: 01, 4: 10, 5: 01, 6: 01, 7: 10.
    //   zeros, cache 0: (0,2) (1,3) (1,5) (1,6) (1,7) (2,1) → step 2, 6;
    //     linspace 2, 1
    //   zeros, cache 1: (0,2) (1,0) (1,3) (1,4) (1,6) (1,7) → step 2, 4;
    //     linspace 2, 7
    //   alternate (01): cache 0 (0,3) (0,5) (0,6) (1,1) (1,2) (2,7) → 3, 1;
    //     cache 1 (0,3) (0,6) (1,2) (2,0) (2,4) (2,7) → 3, 0
    //   anchor 10: cache 0 (0,7) (1,1) (1,2) (2,3) (2,5) (2,6) → 7, 3;
    //     cache 1 (0,0) (0,4) (0,7) (1,2) (2,3) (2,6) → 0, 2
    //   ones (11): cache 0 (0,1) (1,3) (1,5) (1,6) (1,7) (2,2) → 1, 6;
    //     cache 1 (1,0) (1,3) (1,4) (1,6) (1,7) (2,2) → 0, 6
    let mut b = simple_layer(&[vec![0.0; 10], vec![0.0; 10]], 2, 8, 0, 1);
    b.colsum = vec![
        10.0, 1.0, 6.0, 0.0, 7.0, 2.0, 0.0, 8.0, //
        10.0, 9.0, 0.0, 1.0, 7.0, 2.0, 3.0, 0.0, //
        0.0, 8.0, 2.0, 6.0, 1.0, 9.0, 4.0, 2.0, //
        0.0, 6.0, 2.0, 4.0, 1.0, 7.0, 4.0, 4.0,
    ];
    let by_anchor = [
        vec![vec![0, 2, 4, 6], vec![1, 2, 4, 5]], // 00
        vec![vec![0, 1, 3, 4], vec![0, 1, 3, 5]], // 01
        vec![vec![0, 3, 4, 7], vec![0, 1, 2, 5]], // 10
        vec![vec![0, 1, 4, 6], vec![0, 1, 5, 6]], // 11
    ];
    assert_eq!(kept(&spec("anchor=zeros"), &b, 4), by_anchor[0]);
    assert_eq!(kept(&spec("anchor=alternate"), &b, 4), by_anchor[1]);
    assert_eq!(kept(&spec("anchor=ones"), &b, 4), by_anchor[3]);
    assert_eq!(
        kept(&spec("anchor=zeros,pick=linspace"), &b, 4),
        vec![vec![0, 1, 2, 4], vec![1, 2, 5, 7]]
    );
    // mean / inv_mean with bit=half: each bit is on exactly 4 of 8 → 00
    assert_eq!(kept(&spec("anchor=mean"), &b, 4), by_anchor[0]);
    assert_eq!(kept(&spec("anchor=inv_mean"), &b, 4), by_anchor[0]);
    // bits_per=kv, bit=mean: KV head 0's mean 4.125 → {0, 1, 4} (3 of 8, a
    // strict minority); KV head 1's mean 3.75 → {1, 3, 5, 6} (exactly half).
    // Signatures 0: 10, 1: 11, 2: 00, 3: 01, 4: 10, 5: 01, 6: 01, 7: 00.
    //   mean over all of C = 00: cache 0 (0,2) (0,7) (1,3) (1,5) (1,6)
    //   (2,1) → 2, 5; cache 1 (0,2) (0,7) (1,0) (1,3) (1,4) (1,6) → 2, 3.
    //   (Over E0 alone bit 1 would be a majority, 4 of 6: anchor 01 and
    //   cache 0 would keep 3, 1 instead.)
    //   inv_mean = 10: cache 0 (1,1) (1,2) (1,7) (2,3) (2,5) (2,6) → 1, 3;
    //   cache 1 (0,0) (0,4) (1,2) (1,7) (2,3) (2,6) → 0, 7.
    assert_eq!(
        kept(&spec("anchor=mean,bit=mean"), &b, 4),
        vec![vec![0, 2, 4, 5], vec![1, 2, 3, 5]]
    );
    assert_eq!(
        kept(&spec("anchor=inv_mean,bit=mean"), &b, 4),
        vec![vec![0, 1, 3, 4], vec![0, 1, 5, 7]]
    );
    // random: one anchor per layer, bit u = the top bit of the u-th draw of
    // SplitMix64 seeded by (seed, layer 0), shared by both caches
    let mut seen = std::collections::HashSet::new();
    for seed in 0..16u64 {
        let mut rng = SplitMix64::for_head(seed, 0, 0);
        let (b0, b1) = (rng.next_u64() >> 63, rng.next_u64() >> 63);
        let want = &by_anchor[(2 * b0 + b1) as usize];
        assert_eq!(
            &kept(&spec(&format!("seed={seed}")), &b, 4),
            want,
            "seed {seed}"
        );
        seen.insert(want.clone());
    }
    assert!(seen.len() >= 2, "the seed changes the anchor: {seen:?}");

    // pick: of n ranks, k kept. step: i·⌊n/k⌋. linspace: PyTorch's integer
    // linspace truncates (not rounds): n = 11, k = 4: step 10/3, values 0,
    // 3.33, 10 − 3.33 = 6.67, 10 → 0, 3, 6, 10 (rounding would give 7);
    // n = 6, k = 3: step 2.5, the middle value counted from the end
    // 5 − 2.5 = 2.5 → 2.
    assert_eq!(pick_ranks(Pick::Step, 11, 4), vec![0, 2, 4, 6]);
    assert_eq!(pick_ranks(Pick::Linspace, 11, 4), vec![0, 3, 6, 10]);
    assert_eq!(pick_ranks(Pick::Linspace, 10, 4), vec![0, 3, 6, 9]);
    assert_eq!(pick_ranks(Pick::Linspace, 6, 3), vec![0, 2, 5]);
    assert_eq!(pick_ranks(Pick::Linspace, 6, 1), vec![0]);
    assert_eq!(pick_ranks(Pick::Linspace, 6, 0), Vec::<usize>::new());

    // the references' windowed inner scores: SnapKV as the scorer
    assert!(PolicySpec::parse("kvcrush:scorer=snapkv,w=8")
        .and_then(|s| s.build())
        .is_ok());
    // a decode-time inner scorer is refused
    assert!(PolicySpec::parse("kvcrush:decode_evict=true")
        .and_then(|s| s.build())
        .is_err());
}

#[test]
fn lazyeviction_keeps_recurring_tokens_and_evicts_once_per_window() {
    // Importance (docs/methods/lazyeviction.md), σ the logistic:
    //   s = 2σ(−(1 + silence/(MRI + 1e-5))) + [MRI > 0]·2σ(−(MRI − 1)),
    // silence = t − last. Values used below (2σ(−x) = 2/(1 + e^x)):
    //   MRI 1, silence 0: .5379 + 1 = 1.5379   MRI 1, silence 1: .2384 + 1 = 1.2384
    //   MRI 1, silence 2: .0949 + 1 = 1.0949   MRI 1, silence 3: .0360 + 1 = 1.0360
    //   MRI 2, silence 0: .5379 + .5379 = 1.0758  MRI 2, silence 2: .2384 + .5379 = .7763
    //   MRI 3, silence 0: .5379 + .2384 = .7763   MRI 6, silence 1: .4749 + .0134 = .4883
    //   MRI 0 (never attended): e^(1 + silence·1e5) overflows, s = 0.
    // Queries are 20·(sum of one-hot keys of a set S): each key of S gets
    // 1/|S| (up to e^−20), every other key < 1e-8; α = 0.3 (absolute
    // threshold a >= α), so exactly the keys of S with |S| <= 3 are attended.
    let onehot = |d: usize, set: &[usize], x: f32| {
        let mut r = vec![0.0; d];
        set.iter().for_each(|&i| r[i] = x);
        r
    };
    let keys = |t: usize| (0..t).map(|i| onehot(t, &[i], 1.0)).collect::<Vec<_>>();
    // values (i, 1, 0, …) of the keys' dimension
    let vals = |t: usize| {
        (0..t)
            .map(|i| {
                let mut v = onehot(t, &[1], 1.0);
                v[0] = i as f32;
                v
            })
            .collect::<Vec<_>>()
    };

    // Prefill: one head, P = 8, rows = all (row j is step j + 1; position i
    // starts at last = i, the step before its own, MRI 0), W = 1, t = 8.
    //   S per row: 0 {0}, 1..3 {1}, 4 {1, 2}, 5 {1}, 6 {0}, 7 {2}
    //   pos 0: step 1 → MRI 1, last 1; step 7 → MRI 6, last 7
    //   pos 1: steps 2..6 → MRI 1, last 6 (attended at its own step: MRI 1)
    //   pos 2: step 5 → MRI 3, last 5; step 8 → MRI 3, last 8
    //   pos 3..6: never (MRI 0); pos 7: the window
    // Official at t = 8: 1 (MRI 1, silent 2) 1.0949 > 2 (MRI 3, just
    // attended) .7763 > 0 .4883 > 3..6 (0, ties: the later kept).
    // score=ratio, −silence/(MRI + 1): 2 0 > 0 −1/7 > 1 −1 > 6 −2 > … > 3 −5.
    let sets: [&[usize]; 8] = [&[0], &[1], &[1], &[1], &[1, 2], &[1], &[0], &[2]];
    let q = vec![sets.iter().map(|s| onehot(8, s, 20.0)).collect()];
    let data = explicit_layer(&q, &[keys(8)], &[vals(8)], 8, 1.0);
    let off = "lazyeviction:window=1,alpha=0.3,rows=all";
    let ratio = "lazyeviction:window=1,alpha=0.3,rows=all,score=ratio";
    assert_eq!(kept(off, &data, 2), vec![vec![1, 7]]);
    assert_eq!(kept(ratio, &data, 2), vec![vec![2, 7]]);
    assert_eq!(kept(off, &data, 3), vec![vec![1, 2, 7]]);
    assert_eq!(kept(ratio, &data, 3), vec![vec![0, 2, 7]]);
    assert_eq!(kept(off, &data, 4), vec![vec![0, 1, 2, 7]]);
    assert_eq!(kept(ratio, &data, 4), vec![vec![0, 1, 2, 7]]);
    assert_eq!(kept(off, &data, 5), vec![vec![0, 1, 2, 6, 7]]);
    // rows = 2 observes rows 6, 7 as steps 1, 2 (positions 0..6 start at
    // last 0, position 7 at 1): 0 MRI 1 last 1 → 1.2384; 2 MRI 2 last 2 →
    // 1.0758; the rest 0 → B = 2 {0, 7}, B = 3 {0, 2, 7}, B = 4 {0, 2, 6, 7}
    let two = "lazyeviction:window=1,alpha=0.3,rows=2";
    assert_eq!(kept(two, &data, 2), vec![vec![0, 7]]);
    assert_eq!(kept(two, &data, 3), vec![vec![0, 2, 7]]);
    assert_eq!(kept(two, &data, 4), vec![vec![0, 2, 6, 7]]);

    // Decode, GQA and the new entry's start. One KV head read by two query
    // heads, P = 4, T = 7, B = 4, W = 2, rows = 1: row 3 is step 1 (every
    // prompt position starts at last 0), decode position pos is step pos − 2;
    // the entry of step t starts at last t − 1, MRI 0.
    //   step 1 (row 3): h0 S {0}, h1 S {3}
    //   step 2 (pos 4): h0 S {0, 1, 4} (1/3 each), h1 S {1, 4}
    //   step 3 (pos 5): S {5}; step 4 (pos 6): S {6} (both heads)
    // Per head (MRI, last) after step 2:
    //   h0: 0 (1, 2), 1 (2, 2), 2 (0, 0), 3 (0, 0), 4 (1, 2)
    //   h1: 0 (0, 0), 1 (2, 2), 2 (0, 0), 3 (1, 1), 4 (1, 2)
    // Step 2: 5 entries > B: keep the window {3, 4}, evict 2 of {0, 1, 2} by
    // the heads' mean: 0 (1.5379 + 0)/2 = .7689, 1 1.0758, 2 0 → {1, 3, 4}.
    // (Tracking the group-mean attention instead, 0's weight at step 2 is
    // 1/6 < α: 0 would be MRI 1, last 1, 1.2384, and survive.)
    // Step 3: {1, 3, 4, 5}. Step 4 (t = 4): window {5, 6}; 1 (2, 2): .7763;
    // 3: (0 + 1.0360)/2 = .5180; 4 (1, 2) in both: 1.0949 → {4, 5, 6}: the
    // token attended at its own step has MRI 1 (starting it at its own step
    // with MRI 0 would leave it MRI 0, importance 0, and evict it).
    let dsets: [[&[usize]; 2]; 7] = [
        [&[0], &[0]],
        [&[1], &[1]],
        [&[2], &[2]],
        [&[0], &[3]],
        [&[0, 1, 4], &[1, 4]],
        [&[5], &[5]],
        [&[6], &[6]],
    ];
    let q: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|h| dsets.iter().map(|s| onehot(7, s[h], 20.0)).collect())
        .collect();
    let data = explicit_layer(&q, &[keys(7)], &[vals(7)], 4, 1.0);
    let pos = |spec: &str| -> Vec<Vec<Vec<usize>>> {
        run_steps(spec, &data, 4)
            .iter()
            .map(|cs| cs.iter().map(|c| c.positions()).collect())
            .collect()
    };
    let spec = "lazyeviction:window=2,alpha=0.3,rows=1";
    assert_eq!(
        pos(spec),
        vec![
            vec![vec![0, 1, 2, 3]],
            vec![vec![1, 3, 4]],
            vec![vec![1, 3, 4, 5]],
            vec![vec![4, 5, 6]],
        ]
    );
    // per_query_head: a cache per head on its own importance. Step 2: h0
    // keeps 0 (1.5379 over 1 1.0758), h1 keeps 1. Step 4: h0 {0, 3, 4}: 0 and
    // 4 tie at 1.0949 (MRI 1, last 2; the earlier goes), 3 is 0 → {4, 5, 6};
    // h1 {1, 3, 4}: .7763, 1.0360, 1.0949 → {4, 5, 6}.
    assert_eq!(
        pos(&format!("{spec},per_query_head=true")),
        vec![
            vec![vec![0, 1, 2, 3], vec![0, 1, 2, 3]],
            vec![vec![0, 3, 4], vec![1, 3, 4]],
            vec![vec![0, 3, 4, 5], vec![1, 3, 4, 5]],
            vec![vec![4, 5, 6], vec![4, 5, 6]],
        ]
    );

    // Lazily: every logit 0 (uniform attention) and α = 2: nothing is ever
    // attended, every importance is 0 and the tie rule alone decides (the
    // later kept at prefill, the earlier evicted at decode).
    // P = 4, T = 8, B = 3, W = 2: prefill keeps the window {2, 3} and 1.
    //   step 4: 4 entries > 3 → evict W = 2 outside the window {3, 4}: 1, 2
    //   step 5: {3, 4, 5} (no eviction); step 6: 4 entries → {5, 6}
    //   step 7: {5, 6, 7}: eviction every W = 2 steps, W entries at a time.
    let data = simple_layer(&[vec![0.0; 8]], 1, 4, 0, 1);
    let steps = run_steps("lazyeviction:window=2,alpha=2", &data, 3);
    let pos: Vec<Vec<usize>> = steps.iter().map(|c| c[0].positions()).collect();
    assert_eq!(
        pos,
        vec![
            vec![1, 2, 3],
            vec![3, 4],
            vec![3, 4, 5],
            vec![5, 6],
            vec![5, 6, 7]
        ]
    );
    // W = 1 evicts one entry at every step
    let steps = run_steps("lazyeviction:window=1,alpha=2", &data, 3);
    let pos: Vec<Vec<usize>> = steps.iter().map(|c| c[0].positions()).collect();
    assert_eq!(
        pos,
        vec![
            vec![1, 2, 3],
            vec![2, 3, 4],
            vec![3, 4, 5],
            vec![4, 5, 6],
            vec![5, 6, 7]
        ]
    );
    // the uniform threshold (a > α/n) with α = 2 attends nothing either
    let steps = run_steps("lazyeviction:window=2,alpha=2,threshold=uniform", &data, 3);
    assert_eq!(steps[4][0].positions(), vec![5, 6, 7]);
}

#[test]
fn xkv_reconstructs_the_shared_rank_r_basis_and_charges_its_factors() {
    // Two layers in one group (G = 2), one KV head, d = 2, P = 3, T = 4, no
    // RoPE. Concatenated over the layers, X is P × n with n = 2·1·2 = 4:
    //   keys   [[2, 0 | 0, 0], [0, 0 | 0, 1], [0, 0 | 0, 0]]: σ = 2, 1
    //   values [[3, 0 | 3, 0], [0, 1 | 0, 1], [0, 0 | 0, 0]]: σ = 3√2, √2
    // Rank 1 keeps the top component, u = e_0 and F = the first row (both
    // exact in f16): keys → layer 0 (2, 0), 0, 0 and layer 1 all zero;
    // values → (3, 0) at position 0 in both layers, zero elsewhere (the
    // basis is shared: one token direction serves both layers).
    let row = |x: f32, y: f32| vec![x, y];
    let zero = || row(0.0, 0.0);
    let q = vec![vec![row(1.0, 0.0); 4]];
    let layer = |l: usize, keys: Vec<Vec<f32>>, vals: Vec<Vec<f32>>| {
        let mut d = explicit_layer(&q, &[keys], &[vals], 3, 1.0);
        (d.layer, d.n_layers) = (l, 2);
        d
    };
    let l0 = layer(
        0,
        vec![row(2.0, 0.0), zero(), zero(), row(5.0, 5.0)],
        vec![row(3.0, 0.0), row(0.0, 1.0), zero(), row(7.0, 7.0)],
    );
    let l1 = layer(
        1,
        vec![zero(), row(0.0, 1.0), zero(), row(6.0, 6.0)],
        vec![row(3.0, 0.0), row(0.0, 1.0), zero(), row(8.0, 8.0)],
    );
    let datas = [l0, l1];
    let steps = common::run_group_steps("xkv:group=2,rank_k=1,rank_v=1", &datas, 2);
    let (a, b) = (&steps[0][0][0], &steps[0][1][0]);
    assert_eq!(a.keys, vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(b.keys, vec![0.0; 6]);
    assert_eq!(a.values, vec![3.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(b.values, vec![3.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    // every position kept; factor bits 16·(r_k + r_v)·(P + n) = 16·2·7 = 224
    // over the group's 6 prompt entries: 37 each, the first 2 one more
    assert_eq!(a.positions(), vec![0, 1, 2]);
    assert_eq!(a.bits, vec![38, 38, 37]);
    assert_eq!(b.bits, vec![37, 37, 37]);
    // the decode entry is appended exact, at full cost
    let (a, b) = (&steps[1][0][0], &steps[1][1][0]);
    assert_eq!(
        (a.key(3), a.value(3), a.bits[3]),
        (&[5.0, 5.0][..], &[7.0, 7.0][..], 64)
    );
    assert_eq!((b.key(3), b.value(3)), (&[6.0, 6.0][..], &[8.0, 8.0][..]));
    // rank 2 is exact (every factor exact in f16)
    let steps = common::run_group_steps("xkv:group=2,rank_k=2,rank_v=2", &datas, 2);
    assert_eq!(steps[0][1][0].keys, vec![0.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
    assert_eq!(steps[0][1][0].values, vec![3.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
    // P ≤ B: nothing compressed, exact bits
    let steps = common::run_group_steps("xkv:group=2", &datas, 3);
    assert_eq!(steps[0][0][0].keys, vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(steps[0][0][0].bits, vec![64; 3]);

    // Budget → ranks (SmolLM2 on the real trace: P = 348, G = 4, 3 KV heads,
    // d = 64, n = 768): R = ⌊2·B·n / (P + n)⌋, r_k = ⌊0.4·R⌋, r_v = R − r_k.
    //   B = 32: R = ⌊49152 / 1116⌋ = 44 → (17, 27)
    //   B = 128: R = ⌊196608 / 1116⌋ = 176 → (70, 106)
    let x = kvreplay_replay::policies::xkv::Xkv {
        group: 4,
        rank_k: None,
        rank_v: None,
        v_share: 0.6,
    };
    assert_eq!(x.ranks(348, 32, 768), (17, 27));
    assert_eq!(x.ranks(348, 128, 768), (70, 106));
    // groups of G adjacent layers from layer 0, the top one smaller
    use kvreplay_replay::Policy;
    assert_eq!(
        x.layer_groups(10, 32, 348),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
}

#[test]
fn triforce_retrieves_chunks_by_the_previous_query() {
    // One head, d = 2, scale 1, P = 8, chunk c = 2: chunks {0,1} {2,3} {4,5}
    // {6,7} with mean keys (0,0) (2,0) (0,2) (0,0) (keys (0,0) (0,0) | (1,0)
    // (3,0) | (0,1) (0,3) | (1,1) (−1,−1)); decode keys (0,0). Chunk 0 is
    // always first, then the others by q·mean (the later chunk on ties).
    // Prefill, by the last prompt query q_7 = (1, 0): scores 2, 0, 0 →
    //   order 0, 1, 3, 2 → B = 4 keeps {0, 1, 2, 3}.
    // After step 8 (q_8 = (0, 1): scores 0, 2, 0 → order 0, 2, 3, 1), one
    //   decode entry takes a slot: 3 prompt slots → {0, 1, 4} + {8}.
    // After step 9 (q_9 = (−1, −1): scores −2, −2, 0 → order 0, 3, 2, 1),
    //   2 slots → {0, 1} + {8, 9}.
    // After step 10 (q_10 = (1, 0)), 1 slot → {0} + {8, 9, 10}.
    let row = |x: f32, y: f32| vec![x, y];
    let mut q = vec![row(0.0, 0.0); 11];
    q[7] = row(1.0, 0.0);
    q[8] = row(0.0, 1.0);
    q[9] = row(-1.0, -1.0);
    q[10] = row(1.0, 0.0);
    let mut keys = vec![row(0.0, 0.0); 11];
    keys[2] = row(1.0, 0.0);
    keys[3] = row(3.0, 0.0);
    keys[4] = row(0.0, 1.0);
    keys[5] = row(0.0, 3.0);
    keys[6] = row(1.0, 1.0);
    keys[7] = row(-1.0, -1.0);
    let vals: Vec<Vec<f32>> = (0..11).map(|i| row(i as f32, 1.0)).collect();
    let data = explicit_layer(
        std::slice::from_ref(&q),
        std::slice::from_ref(&keys),
        std::slice::from_ref(&vals),
        8,
        1.0,
    );
    let positions = |spec: &str| -> Vec<Vec<usize>> {
        run_steps(spec, &data, 4)
            .iter()
            .map(|c| c[0].positions())
            .collect()
    };
    assert_eq!(
        positions("triforce:chunk=2"),
        vec![
            vec![0, 1, 2, 3],
            vec![0, 1, 4, 8],
            vec![0, 1, 8, 9],
            vec![0, 8, 9, 10]
        ]
    );
    // refresh = 2: step 8 keeps the prefill order (0, 1, 3, 2) → {0, 1, 2};
    // step 9 re-retrieves with q_9 → {0, 1}; step 10 keeps that order → {0}
    assert_eq!(
        positions("triforce:chunk=2,refresh=2"),
        vec![
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 8],
            vec![0, 1, 8, 9],
            vec![0, 8, 9, 10]
        ]
    );
    // decode_evict = false: retrieved once, decode entries appended
    assert_eq!(
        positions("triforce:chunk=2,decode_evict=false")[3],
        vec![0, 1, 2, 3, 8, 9, 10]
    );
    // GQA: two query heads on the KV head, last prompt queries (1, 0) and
    // (0, 3): summed scores 2, 6, 0 → order 0, 2, 1, 3 → {0, 1, 4, 5};
    // one cache per query head: head 0 as above {0, 1, 2, 3}, head 1 scores
    // 0, 6, 0 → order 0, 2, 3, 1 → {0, 1, 4, 5}
    let mut q1 = q.clone();
    q1[7] = row(0.0, 3.0);
    let data = explicit_layer(&[q, q1], &[keys], &[vals], 8, 1.0);
    assert_eq!(kept("triforce:chunk=2", &data, 4), vec![vec![0, 1, 4, 5]]);
    assert_eq!(
        kept("triforce:chunk=2,per_query_head=true", &data, 4),
        vec![vec![0, 1, 2, 3], vec![0, 1, 4, 5]]
    );
}
