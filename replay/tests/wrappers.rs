//! The allocation and merge wrappers over every registered scorer, and the
//! shared selection they all go through, on hand-built layers.

mod common;

use std::collections::BTreeSet;

use common::{random_layer, simple_layer};
use kvreplay_replay::policies::{find, scorer_names, Build};
use kvreplay_replay::spec::parse_one;
use kvreplay_replay::{LayerData, PolicySpec, PrefillCtx, Scorer, Unit};

/// The scorer `spec` (a registered scorer with parameters) built on its own.
fn scorer(spec: &str) -> std::sync::Arc<dyn Scorer> {
    let p = parse_one(spec).unwrap();
    match find(p.policy).unwrap().build {
        Build::Scorer(f) => f(&p).unwrap(),
        _ => panic!("{spec} is not a scorer"),
    }
}

/// Kept prompt positions per cache after prefill.
fn kept(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<usize>> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    let (caches, _) = policy.prefill(&PrefillCtx::new(data, budget)).unwrap();
    caches.iter().map(|c| c.positions()).collect()
}

/// An independent top-`k` of `candidates` by (score desc, later position first).
fn best(
    scores: &[f32],
    candidates: std::ops::Range<usize>,
    k: usize,
    later: bool,
) -> BTreeSet<usize> {
    let mut c: Vec<usize> = candidates.collect();
    c.sort_by(|&a, &b| {
        scores[b]
            .partial_cmp(&scores[a])
            .unwrap()
            .then(if later { b.cmp(&a) } else { a.cmp(&b) })
    });
    c.into_iter().take(k).collect()
}

/// The pyramid's selected count of `layer`, written out from PyramidKV's
/// rule: P = B − w; T < 2P: uniform; else min = ⌊P/β⌋, max = 2P − min,
/// capped at T − w, step = ⌊(max − min)/(L − 1)⌋.
fn pyramid(t: usize, b: usize, w: usize, beta: usize, layer: usize, n_layers: usize) -> usize {
    let avg = b - w;
    if t < 2 * avg {
        return avg;
    }
    let (mut lo, mut hi) = (avg / beta, 2 * avg - avg / beta);
    if hi >= t - w {
        hi = t - w;
        lo = 2 * avg - hi;
    }
    hi - layer * ((hi - lo) / (n_layers - 1))
}

fn layers(n: usize, p: usize) -> Vec<LayerData> {
    (0..n)
        .map(|l| {
            let mut d = random_layer(40 + l as u64, 4, 2, 8, p, p + 4);
            (d.layer, d.n_layers) = (l, n);
            d
        })
        .collect()
}

#[test]
fn pyramidkv_gives_every_scorer_per_layer_budgets() {
    // 4 layers, P = 40, B = 16, β = 2: every scorer's own selection with the
    // pyramid's count per layer, its protected positions kept.
    let (p, b, n) = (40, 16, 4);
    let data = layers(n, p);
    for name in scorer_names() {
        let base = match name {
            "knorm" => "knorm:skip_layers=none".to_string(),
            "snapkv" => "snapkv:w=8".to_string(),
            _ => name.to_string(),
        };
        let s = scorer(&base);
        let prot = s.protect(b).unwrap();
        let spec = format!(
            "pyramidkv:scorer={name},beta=2{}",
            &base[name.len()..].replace(':', ",")
        );
        let mut counts = Vec::new();
        for d in &data {
            let got = kept(&spec, d, b);
            let want_n = if prot.total() >= b {
                0
            } else {
                pyramid(p, b, prot.total(), 2, d.layer, n)
            };
            let ctx = PrefillCtx::new(d, b);
            for (g, pos) in got.iter().enumerate() {
                let unit = Unit {
                    kv_head: g,
                    heads: 2 * g..2 * g + 2,
                };
                let scores = s.score(&ctx, &unit);
                let later = s.tie() == kvreplay_replay::select::Tie::KeepLater;
                let mut want = best(&scores, prot.sinks..p - prot.recent, want_n, later);
                want.extend((0..prot.sinks).chain(p - prot.recent..p));
                assert_eq!(
                    pos.iter().copied().collect::<BTreeSet<_>>(),
                    want,
                    "{spec} layer {}",
                    d.layer
                );
            }
            counts.push(got[0].len());
        }
        // shallow layers keep more, whatever the scorer (unless nothing is selected)
        if prot.total() < b {
            assert!(
                counts.windows(2).all(|w| w[0] >= w[1]) && counts[0] > counts[n - 1],
                "{spec}: {counts:?}"
            );
        }
    }
    // Known numbers: w = 8 -> P = 8, T = 40: min 4, max 12, step 2 -> 12, 10, 8, 6 (+ 8 window)
    let sizes: Vec<usize> = data
        .iter()
        .map(|d| kept("pyramidkv:beta=2", d, 16)[0].len())
        .collect();
    assert_eq!(sizes, vec![20, 18, 16, 14]);
}

#[test]
fn adakv_gives_every_scorer_per_head_budgets() {
    // KV head 0's scores dominate on a hand-built layer, so with alpha = 0 it
    // takes more of the layer's 2·(B − w) selections; every scorer's per-head
    // choice is its own top B_h, and the total is the layer's budget.
    let (p, b) = (40, 16);
    let data = layers(1, p).remove(0);
    for name in scorer_names() {
        let base = match name {
            "knorm" => "knorm:skip_layers=none",
            "snapkv" => "snapkv:w=8",
            _ => name,
        };
        let s = scorer(base);
        let prot = s.protect(b).unwrap();
        let spec = format!(
            "adakv:scorer={name},alpha=0{}",
            &base[name.len()..].replace(':', ",")
        );
        let got = kept(&spec, &data, b);
        let avg = b.saturating_sub(prot.total());
        if avg == 0 {
            continue;
        }
        // the cross-head form (SnapKV: window means) decides
        let cross = s.across_heads().unwrap_or(s.clone());
        let ctx = PrefillCtx::new(&data, b);
        let scores: Vec<Vec<f32>> = (0..2)
            .map(|g| {
                cross.score(
                    &ctx,
                    &Unit {
                        kv_head: g,
                        heads: 2 * g..2 * g + 2,
                    },
                )
            })
            .collect();
        // independent global top 2·avg of (head, position) pairs
        let mut pairs: Vec<(f32, usize, usize)> = (0..2)
            .flat_map(|g| (prot.sinks..p - prot.recent).map(move |i| (g, i)))
            .map(|(g, i)| (scores[g][i], i, g))
            .collect();
        pairs.sort_by(|x, y| {
            y.0.partial_cmp(&x.0)
                .unwrap()
                .then(y.1.cmp(&x.1))
                .then(x.2.cmp(&y.2))
        });
        let n_h: Vec<usize> = (0..2)
            .map(|g| pairs.iter().take(2 * avg).filter(|x| x.2 == g).count())
            .collect();
        for g in 0..2 {
            let later = s.tie() == kvreplay_replay::select::Tie::KeepLater;
            let mut want = best(&scores[g], prot.sinks..p - prot.recent, n_h[g], later);
            want.extend((0..prot.sinks).chain(p - prot.recent..p));
            assert_eq!(
                got[g].iter().copied().collect::<BTreeSet<_>>(),
                want,
                "{spec} head {g}"
            );
        }
        assert_eq!(n_h[0] + n_h[1], 2 * avg, "{spec}");
    }
    // Known answer: KV head 0's attention is flat (column sums 2.45, 1.45,
    // .95, .62, .37, .17), KV head 1's sits on a sink at 0 (≈ 5.9 there, the
    // rest ≈ 0). H2O scores with recent = 1 and B = 3: 2 heads × 2 selections
    // go to (h1, 0), (h0, 0), (h0, 1), (h0, 2), so head 0 selects 3 and head 1 one.
    let data = simple_layer(
        &[vec![0.0; 7], vec![5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
        1,
        6,
        0,
        1,
    );
    let got = kept("adakv:scorer=h2o,recent=1,alpha=0", &data, 3);
    assert_eq!(got, vec![vec![0, 1, 2, 5], vec![0, 5]]);
    // alpha = 1: every head keeps ⌊1·2⌋ = 2 (the uniform split): head 1 its sink and 1
    let got = kept("adakv:scorer=h2o,recent=1,alpha=1", &data, 3);
    assert_eq!(got, vec![vec![0, 1, 5], vec![0, 1, 5]]);
}

#[test]
fn cam_merges_for_any_scorer_and_keeps_the_scorers_selection() {
    // CaM changes values, never which positions stay: for every scorer the
    // kept positions equal the scorer's own, and values of kept entries after
    // an evicted one change only where a merge reached them.
    let data = layers(1, 30).remove(0);
    for name in scorer_names() {
        let base = if name == "knorm" {
            "knorm:skip_layers=none"
        } else {
            name
        };
        let plain = kept(base, &data, 12);
        let spec = format!(
            "cam:scorer={name},expected=true{}",
            &base[name.len()..].replace(':', ",")
        );
        let policy = PolicySpec::parse(&spec).unwrap().build().unwrap();
        let (caches, _) = policy.prefill(&PrefillCtx::new(&data, 12)).unwrap();
        for (g, c) in caches.iter().enumerate() {
            assert_eq!(c.positions(), plain[g], "{spec}");
            assert_eq!(
                c.keys,
                PrefillCtx::new(&data, 12).exact_cache(g, &plain[g]).keys,
                "{spec}: keys never change"
            );
        }
    }
}

#[test]
fn random_keeps_the_first_b_of_a_seeded_permutation() {
    // The SplitMix64 Fisher-Yates draw of (seed 0, layer 0, KV head 0) over 10
    // positions, written out independently: its first 4 draws are kept.
    let data = simple_layer(&[vec![0.0; 11]], 1, 10, 0, 1);
    // SplitMix64, written out: one step of the generator
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    // for_head(seed 0, layer 0, head 0): SplitMix64(0 ^ golden ratio) gives the
    // next generator's state (xor layer·C = 0), whose first output seeds the
    // head's generator (xor head·C = 0)
    let mut s1 = 0x9E37_79B9_7F4A_7C15u64;
    let mut s2 = next(&mut s1);
    let mut s3 = next(&mut s2);
    let mut below =
        |n: usize| (((next(&mut s3) >> 11) as f64 / (1u64 << 53) as f64) * n as f64) as usize;
    let mut idx: Vec<usize> = (0..10).collect();
    for i in 0..4 {
        let j = i + below(10 - i);
        idx.swap(i, j);
    }
    let mut want = idx[..4].to_vec();
    want.sort_unstable();
    assert_eq!(kept("random", &data, 4), vec![want.clone()]);
    assert_ne!(
        kept("random:seed=1", &data, 4),
        vec![want],
        "another seed, another draw"
    );
    assert_eq!(kept("random", &data, 10), vec![(0..10).collect::<Vec<_>>()]);
}

/// Sliding-window layers (docs/methods/sliding.md) on a hand-built layer:
/// 2 query heads over 1 KV head, d = 4, 6 prompt + 2 decode positions,
/// window W = 3. By default the layer keeps its window uncompressed (zero
/// error; memory and retention count the W entries visible at the last
/// position); `h2o:recent=0,decode_evict=false+sliding` compresses it (the
/// two heaviest prompt positions, both before the window), and each decode query then
/// attends only to the kept entries inside its window. Both checked against
/// a straightforward windowed attention written here.
#[test]
fn sliding_layers_keep_their_window_unless_the_policy_says_sliding() {
    use kvreplay_replay::engine::replay_layer;
    let mut data = random_layer(11, 2, 1, 4, 6, 8);
    data.window = Some(3);
    let (w, p, t, d) = (3usize, 6usize, 8usize, 4usize);
    let entry_bytes = (2 * d * 16 / 8) as u64; // f16 key and value
                                               // o of head h at step pos over `visible` positions, in f64
    let attend = |h: usize, pos: usize, visible: &[usize]| -> Vec<f64> {
        let q = data.q_row(h, pos);
        let logits: Vec<f64> = visible
            .iter()
            .map(|&j| {
                let k = data.k_row(0, j);
                q.iter()
                    .zip(k)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * data.scale as f64
            })
            .collect();
        let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|x| (x - mx).exp()).sum();
        let mut o = vec![0f64; d];
        for (&j, x) in visible.iter().zip(&logits) {
            for (oi, vi) in o.iter_mut().zip(data.v_row(0, j)) {
                *oi += (x - mx).exp() / z * *vi as f64;
            }
        }
        o
    };
    let window = |pos: usize| -> Vec<usize> { (pos + 1 - w..=pos).collect() };

    // default: uncompressed window, zero error, W entries of memory
    let h2o = "h2o:recent=0,decode_evict=false";
    let plain_h2o = PolicySpec::parse(h2o).unwrap().build().unwrap();
    let r = replay_layer(&data, plain_h2o.as_ref(), 2).unwrap();
    for m in &r.metrics {
        assert_eq!(
            (m.rel_l2, m.kl, m.attn_mass),
            (0.0, 0.0, 1.0),
            "head {}",
            m.head
        );
    }
    assert_eq!(r.bytes, w as u64 * entry_bytes);
    assert_eq!(r.full_bytes, w as u64 * entry_bytes);
    // at the last position (7) the window holds 5, 6, 7: prompt position 5 only
    let kept_positions: Vec<usize> = r.retained.iter().map(|x| x.position).collect();
    assert_eq!(kept_positions, [5]);

    // h2o+sliding: h2o keeps 2 prompt entries; queries see them only in the window
    let k2 = kept(h2o, &data, 2)[0].clone();
    assert!(
        k2.iter().all(|&j| j + w <= p),
        "{k2:?}: both before the window"
    );
    let wrapped = PolicySpec::parse(&format!("{h2o}+sliding"))
        .unwrap()
        .build()
        .unwrap();
    let r = replay_layer(&data, wrapped.as_ref(), 2).unwrap();
    for h in 0..2 {
        let mut err = 0.0;
        for pos in p..t {
            let full = attend(h, pos, &window(pos));
            let cache: Vec<usize> = k2.iter().copied().chain(p..=pos).collect();
            let visible: Vec<usize> = cache.into_iter().filter(|&j| j + w > pos).collect();
            let comp = attend(h, pos, &visible);
            let num: f64 = comp.iter().zip(&full).map(|(a, b)| (a - b).powi(2)).sum();
            let den: f64 = full.iter().map(|x| x * x).sum();
            err += (num / den).sqrt() / (t - p) as f64;
        }
        // f32 accumulation in the engine against f64 here
        let got = r.metrics[h].rel_l2;
        assert!(
            (got - err).abs() < 1e-5,
            "head {h}: engine {got}, by hand {err}"
        );
    }
    let visible_at_end = k2.iter().filter(|&&j| j + w > t - 1).count() + (t - p);
    assert_eq!(r.bytes, visible_at_end as u64 * entry_bytes);
    // without a window the same policy would see every kept entry: a different error
    data.window = None;
    let plain = replay_layer(&data, wrapped.as_ref(), 2).unwrap();
    assert_ne!(plain.metrics[0].rel_l2, r.metrics[0].rel_l2);
}

/// MiniCache on Gemma 3's layer pattern (18 layers, every sixth full): with
/// start=0 it pairs (0,1), (2,3), ... and (4,5), (10,11), (16,17) mix a
/// sliding and a full layer. Without +sliding those are split: the sliding
/// layer alone, the full one alone (no two full layers are adjacent); the
/// pure pairs stay. With +sliding the policy's own pairs stand.
#[test]
fn mixed_cross_layer_groups_are_split_unless_sliding() {
    use kvreplay_replay::engine::replay_groups;
    let sliding: Vec<bool> = (0..18).map(|l| l % 6 != 5).collect();
    let mc = PolicySpec::parse("minicache:start=0")
        .unwrap()
        .build()
        .unwrap();
    let own = mc.layer_groups(18, 64, 1000);
    assert_eq!(own.len(), 9);
    let split = replay_groups(mc.as_ref(), &sliding, 64, 1000);
    let mut want: Vec<Vec<usize>> = Vec::new();
    for l in (0..18).step_by(2) {
        if sliding[l] && sliding[l + 1] {
            want.push(vec![l, l + 1]);
        } else {
            want.push(vec![l]);
            want.push(vec![l + 1]);
        }
    }
    assert_eq!(split, want);
    let wrapped = PolicySpec::parse("minicache:start=0+sliding")
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(replay_groups(wrapped.as_ref(), &sliding, 64, 1000), own);
    // a model without sliding layers keeps the policy's groups
    assert_eq!(replay_groups(mc.as_ref(), &[false; 18], 64, 1000), own);
}

/// `preset=kvpress` is kvpress 0.5.x's AdaKVPress: each head first keeps its
/// own top ⌊α·B⌋ (protected entries first), then the rest of the layer's
/// budget goes to the global top-k, instead of AdaKV's blend
/// round((1 − α)·n_h + ⌊α·P⌋).
#[test]
fn adakv_kvpress_preset_reserves_each_heads_top_before_the_global_top_k() {
    // KnormPress scores −‖k‖ (no protected entries), two KV heads, P = 8, B = 4,
    // α = 0.5. Head 0 norms [10, 11, 12, 13, 13.5, 13.6, 20, 20], head 1 norms
    // [14, 15, 16, 17, 18, 19, 20, 20].
    // Blend: the layer's top 8 are head 0's first six and head 1's first two,
    // n = (6, 2); B_h = round(0.5·6 + ⌊0.5·4⌋) = 5 and round(0.5·2 + 2) = 3.
    // Reserve: ⌊0.5·4⌋ = 2 per head first ({0, 1} each), then the best 4 of
    // the rest are head 0's 12, 13, 13.5, 13.6 (head 1's best left is 16):
    // head 0 keeps 6, head 1 keeps 2.
    let data = simple_layer(
        &[
            vec![10.0, 11.0, 12.0, 13.0, 13.5, 13.6, 20.0, 20.0],
            vec![14.0, 15.0, 16.0, 17.0, 18.0, 19.0, 20.0, 20.0],
        ],
        1,
        8,
        0,
        1,
    );
    assert_eq!(
        kept("adakv:scorer=knorm,skip_layers=none,alpha=0.5", &data, 4),
        vec![vec![0, 1, 2, 3, 4], vec![0, 1, 2]]
    );
    // (knorm's own kvpress preset compresses layer 0 too)
    assert_eq!(
        kept("adakv:scorer=knorm,preset=kvpress,alpha=0.5", &data, 4),
        vec![vec![0, 1, 2, 3, 4, 5], vec![0, 1]]
    );
    // the preset selects the scorer's kvpress preset (SnapKVPress by default)
    assert_eq!(
        PolicySpec::parse("adakv:preset=kvpress")
            .unwrap()
            .canonical(),
        "adakv:alpha=0.2,group_mean=after_pool,k=5,normalize=false,pool=avg,preset=kvpress,\
         safeguard=reserve,scorer=snapkv,snapkv.preset=kvpress,w=64"
    );
}

/// `preset=kvpress` is kvpress 0.5.x's PyramidKVPress: its float schedule with
/// Python's round, the protected window counted inside each layer's entries,
/// and uniform budgets when the pyramid is infeasible.
#[test]
fn pyramidkv_kvpress_preset_uses_the_float_schedule_and_falls_back_to_uniform() {
    // 3 layers, P = 20, B = 7, β = 2, KnormPress scores (no window):
    // Factory: min = ⌊7/2⌋ = 3, max = 14 − 3 = 11, step = ⌊8/2⌋ = 4 -> 11, 7, 3.
    // kvpress: min = 3.5, max = 10.5, 20 ≥ 10.5 ≥ 3.5 ≥ 0, step = 3.5 ->
    // round(10.5) = 10, round(7) = 7, round(3.5) = 4 (half to even).
    let layers: Vec<LayerData> = (0..3)
        .map(|l| {
            let s: Vec<f32> = (0..20).map(|i| ((i * 7) % 20) as f32 + 1.0).collect();
            simple_layer(&[s], 1, 20, l, 3)
        })
        .collect();
    let counts =
        |spec: &str| -> Vec<usize> { layers.iter().map(|d| kept(spec, d, 7)[0].len()).collect() };
    assert_eq!(
        counts("pyramidkv:scorer=knorm,skip_layers=none,beta=2"),
        vec![11, 7, 3]
    );
    assert_eq!(
        counts("pyramidkv:scorer=knorm,preset=kvpress,beta=2"),
        vec![10, 7, 4]
    );
    // SnapKV with w = 4: kvpress's min = 3.5 < w, so every layer keeps B = 7
    // (window included). Factory: P' = 3, min = 1, max = 5, step = 2 ->
    // 5, 3, 1 selected + the window = 9, 7, 5.
    assert_eq!(counts("pyramidkv:w=4,beta=2"), vec![9, 7, 5]);
    assert_eq!(counts("pyramidkv:preset=kvpress,w=4,beta=2"), vec![7, 7, 7]);
}
