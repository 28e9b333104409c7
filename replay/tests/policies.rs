//! Each policy on hand-built layers where the right answer is known, plus the
//! engine's exactness guarantees.

mod common;

use common::{explicit_layer, random_layer, run_steps, simple_layer};
use kvreplay_replay::engine::replay_layer;
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::{HeadCache, PolicySpec, REGISTRY};

/// Kept prompt positions per KV head after prefill.
fn kept(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<usize>> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    let (caches, _) = policy.prefill(&PrefillCtx::new(data, budget)).unwrap();
    caches.iter().map(|c| c.positions()).collect()
}

#[test]
fn streaming_llm_keeps_sinks_and_recent_and_evicts_oldest_non_sink() {
    let data = simple_layer(&[vec![0.0; 12]], 1, 10, 0, 1);
    assert_eq!(
        kept("streaming_llm:n_sink=2", &data, 6),
        vec![vec![0, 1, 6, 7, 8, 9]]
    );
    let steps = run_steps("streaming_llm:n_sink=2", &data, 6);
    assert_eq!(steps[1][0].positions(), vec![0, 1, 7, 8, 9, 10]);
    assert_eq!(steps[2][0].positions(), vec![0, 1, 8, 9, 10, 11]);
    // prefill-only form appends decode entries on top
    let steps = run_steps("streaming_llm:n_sink=2,decode_evict=false", &data, 6);
    assert_eq!(steps[2][0].positions(), vec![0, 1, 6, 7, 8, 9, 10, 11]);
}

#[test]
fn h2o_uses_the_group_mean_and_prefers_later_positions_on_ties() {
    // Two query heads share one KV head. Group mean of the column sums:
    // [5, 1, 1, 2, 2, 1, 1, 1]. B = 4 -> r = 2 recent {6, 7}; the heavy 2 of
    // 0..6 are position 0 and, of the tie at 2.0 between 3 and 4, position 4.
    let mut data = simple_layer(&[vec![0.0; 9]], 2, 8, 0, 1);
    data.colsum = [
        [5.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0],
        [5.0, 1.0, 1.0, 0.0, 3.0, 1.0, 1.0, 1.0],
    ]
    .concat();
    assert_eq!(kept("h2o", &data, 4), vec![vec![0, 4, 6, 7]]);
    assert_eq!(kept("h2o:recent=1", &data, 4), vec![vec![0, 3, 4, 7]]);
}

#[test]
fn h2o_decode_evicts_the_lowest_accumulated_score_outside_the_window() {
    // Keys give logits [0, -5, -5, 0, 0]; prompt column sums set to [3, .1, .2, 1].
    // Prefill (B = 3, recent = 1): {3} + top 2 of {0, 1, 2} = {0, 2, 3}, scores (3, .2, 1).
    // Step 4 attends over {0, 2, 3, 4} with probabilities ~(.33, .002, .33, .33):
    // scores become (3.33, .202, 1.33, .33) -> position 2 is the victim.
    let mut data = simple_layer(&[vec![0.0, -5.0, -5.0, 0.0, 0.0]], 1, 4, 0, 1);
    data.colsum = vec![3.0, 0.1, 0.2, 1.0];
    let steps = run_steps("h2o:recent=1", &data, 3);
    assert_eq!(steps[0][0].positions(), vec![0, 2, 3]);
    assert_eq!(steps[1][0].positions(), vec![0, 3, 4]);
}

#[test]
fn snapkv_pools_window_votes_and_breaks_ties_late() {
    // P = 12, w = 4: candidates 0..8. Key 4 has logit 5, every other 0, so the
    // window votes are equal except at 4. Max pooling (k = 3) spreads the peak to
    // 3, 4, 5; the tie goes to the later positions: {4, 5} + window 8..12.
    let mut s = vec![0.0f32; 13];
    s[4] = 5.0;
    let data = simple_layer(&[s], 1, 12, 0, 1);
    assert_eq!(
        kept("snapkv:w=4,k=3", &data, 6),
        vec![vec![4, 5, 8, 9, 10, 11]]
    );
    // without pooling the second pick is the latest of the equal rest: 7
    assert_eq!(
        kept("snapkv:w=4,k=3,pool=none", &data, 6),
        vec![vec![4, 7, 8, 9, 10, 11]]
    );
    // B <= w (our choice): the B most recent positions
    assert_eq!(kept("snapkv:w=4", &data, 3), vec![vec![9, 10, 11]]);
}

#[test]
fn tova_scores_with_the_mean_over_all_heads_of_the_layer() {
    // Last prompt row: KV head 0 peaks at 1 (p ≈ .78), KV head 1 at 2 (p ≈ .81);
    // both give position 4 about .1. Layer mean: p2 ≈ .425 > p1 ≈ .406 > p4 ≈ .098.
    let data = simple_layer(
        &[
            vec![0.0, 3.0, 0.0, 0.0, 1.0, 0.0],
            vec![0.0, 0.0, 3.2, 0.0, 1.0, 0.0],
        ],
        1,
        5,
        0,
        1,
    );
    assert_eq!(kept("tova", &data, 2), vec![vec![1, 2], vec![1, 2]]);
    assert_eq!(
        kept("tova:per_kv_head=true", &data, 2),
        vec![vec![1, 4], vec![2, 4]]
    );
}

#[test]
fn knorm_keeps_the_smallest_keys_and_skips_layers() {
    // key i = (s_i, 0): norms 0.5, 3, 1, 0.2, 2
    let data = simple_layer(&[vec![0.5, -3.0, 1.0, 0.2, 2.0, 0.0]], 1, 5, 2, 4);
    assert_eq!(kept("knorm", &data, 2), vec![vec![0, 3]]);
    let data0 = simple_layer(&[vec![0.5, -3.0, 1.0, 0.2, 2.0, 0.0]], 1, 5, 0, 4);
    assert_eq!(
        kept("knorm", &data0, 2),
        vec![vec![0, 1, 2, 3, 4]],
        "layer 0 is skipped by default"
    );
    assert_eq!(kept("knorm:skip_layers=none", &data0, 2), vec![vec![0, 3]]);
}

#[test]
fn scissorhands_counts_pivotal_rows() {
    // Logits [2, 0, 0, 2, 0, 0], uniform threshold 1/6 (masked zeros counted):
    // position 0 is pivotal in all 6 rows, position 3 in rows 3..6, no other ever.
    // r = 1 keeps 5; the top 2 counts are 0 (6) and 3 (3).
    let data = simple_layer(&[vec![2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]], 1, 6, 0, 1);
    assert_eq!(
        kept("scissorhands:w_h=6,r=1,threshold=uniform", &data, 3),
        vec![vec![0, 3, 5]]
    );
}

#[test]
fn cam_merges_evicted_values_forward_with_the_gate() {
    // n_sink 1, m 2, P 5, B 3: keep {0, 3, 4}; evict 1 then 2. Values v_i = (i, 1).
    // Ā = [1, .1, .2, .2, .1]. e = 1: W = {2, 3}, gate .1/.2 = .5 -> v2, v3 += .25·v1.
    // e = 2: W = {3, 4}, gate .2/.15 -> 1 -> v3, v4 += v2'/2 with v2' = (2.25, 1.25).
    let mut data = simple_layer(&[vec![0.0; 6]], 1, 5, 0, 1);
    data.colsum = vec![1.0, 0.1, 0.2, 0.2, 0.1];
    let policy = PolicySpec::parse("cam:n_sink=1,m=2,expected=true")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = policy.prefill(&PrefillCtx::new(&data, 3)).unwrap();
    let c = &caches[0];
    assert_eq!(c.positions(), vec![0, 3, 4]);
    let close = |a: &[f32], b: [f32; 2]| (a[0] - b[0]).abs() < 1e-6 && (a[1] - b[1]).abs() < 1e-6;
    assert!(close(c.value(0), [0.0, 1.0]), "{:?}", c.value(0));
    assert!(close(c.value(1), [4.375, 1.875]), "{:?}", c.value(1));
    assert!(close(c.value(2), [5.125, 1.625]), "{:?}", c.value(2));
    assert_eq!(c.key(1), &[0.0, 0.0], "keys are never changed");
}

#[test]
fn quant_charges_real_bits() {
    // d = 8, group 4, residual 4, 4 bits, P = 10 entries on the full cache:
    // keys: 8 quantised in two groups of 4 (32 bits each + 2·16·8 scale/min bits
    // on each group's first entry), the newest 2 stay f16 (128 bits);
    // values: the oldest 6 quantised per token (32 bits + 2 groups · 32 bits),
    // the newest 4 f16 (128 bits).
    let data = random_layer(7, 2, 1, 8, 10, 12);
    let policy = PolicySpec::parse("quant:bits=4,group=4,residual=4")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = policy.prefill(&PrefillCtx::new(&data, 100)).unwrap();
    let keys = 8 * 32 + 2 * 256 + 2 * 128;
    let values = 6 * 96 + 4 * 128;
    assert_eq!(caches[0].total_bits(), keys + values);
    // the f16 tail is untouched; quantised keys moved
    assert_eq!(caches[0].key(9), data.k_row(0, 9));
    assert_ne!(caches[0].key(0), data.k_row(0, 0));
}

/// AhaKV with recent accumulation, step gain and value prior all off is H2O
/// (same window, G = 1): same prefill set and the same eviction at every step.
#[test]
fn ahakv_without_its_three_components_is_h2o() {
    let data = random_layer(21, 2, 2, 8, 40, 48);
    for b in [8, 13, 20] {
        let a = run_steps(
            "ahakv:use_ra=false,use_sg=false,use_vpe=false,recent=4",
            &data,
            b,
        );
        let h = run_steps("h2o:recent=4", &data, b);
        for (step, (x, y)) in a.iter().zip(&h).enumerate() {
            for g in 0..2 {
                assert_eq!(
                    x[g].positions(),
                    y[g].positions(),
                    "B = {b}, step {step}, head {g}"
                );
            }
        }
    }
}

/// AhaKV's recent accumulation: only the last B_r rows vote, so early keys
/// gain nothing from the early rows that cannot see later keys.
#[test]
fn ahakv_scores_with_recent_rows_only() {
    // Logits: key 0 = 0.5, key 6 = 0.6, every other 0. Summed over all rows, key 0
    // collects attention from 10 rows and key 6 from 4, so key 0 wins; summed over
    // the last B_r = 2 rows only, key 6 wins. B = 3 keeps one of them plus {8, 9}.
    let mut s = vec![0.0f32; 11];
    s[0] = 0.5;
    s[6] = 0.6;
    let data = simple_layer(&[s], 1, 10, 0, 1);
    assert_eq!(
        kept("ahakv:recent=2,use_sg=false,use_vpe=false", &data, 3),
        vec![vec![6, 8, 9]]
    );
    assert_eq!(
        kept(
            "ahakv:recent=2,use_sg=false,use_vpe=false,use_ra=false",
            &data,
            3
        ),
        vec![vec![0, 8, 9]]
    );
}

/// AhaKV breaks selection ties towards the smaller position (its own rule).
#[test]
fn ahakv_ties_go_to_the_smaller_position() {
    let mut s = vec![0.0f32; 11];
    s[2] = 1.0;
    s[5] = 1.0;
    let data = simple_layer(&[s], 1, 10, 0, 1);
    assert_eq!(
        kept("ahakv:recent=2,use_sg=false,use_vpe=false", &data, 3),
        vec![vec![2, 8, 9]]
    );
}

/// `full` is exact: zero error, full attention mass, zero KL, every byte.
#[test]
fn full_has_zero_error_and_full_bytes() {
    let data = random_layer(3, 4, 2, 8, 30, 36);
    let p = PolicySpec::parse("full").unwrap().build().unwrap();
    let r = replay_layer(&data, p.as_ref(), 5).unwrap();
    for m in &r.metrics {
        assert_eq!((m.rel_l2, m.kl, m.attn_mass), (0.0, 0.0, 1.0), "{m:?}");
    }
    assert_eq!(r.bytes, r.full_bytes);
    assert_eq!(r.full_bytes, 2 * 36 * 2 * 8 * 2);
}

/// Every policy (every eviction, merging and allocation rule) equals `full`
/// when its budget covers the whole trace; prefill-only forms already when it
/// covers the prompt. Replayed on a four-layer trace, so cross-layer policies
/// (MiniCache) could merge if their budget mapping let them.
#[test]
fn every_policy_at_a_covering_budget_equals_full() {
    let tmp = tempfile::tempdir().unwrap();
    let layers: Vec<LayerData> = (0..4)
        .map(|l| {
            let mut d = random_layer(5 + l as u64, 4, 2, 8, 40, 46);
            (d.layer, d.n_layers) = (l, 4);
            d
        })
        .collect();
    let trace = kvreplay_traces::Trace::open(common::write_trace(tmp.path(), &layers)).unwrap();
    let replay = |spec: &str, b: usize| {
        let p = PolicySpec::parse(spec).unwrap().build().unwrap();
        kvreplay_replay::replay(&trace, p.as_ref(), kvreplay_replay::Budget::Entries(b)).unwrap()
    };
    // Policies that re-express entries whatever the budget are excluded by
    // their capabilities: quant changes values at any budget, and so do the
    // mixed-precision, sparse and low-rank stores (mikv, mustafar, zipcache,
    // gear, kvquant: every position kept, each re-expressed); d2o clamps every
    // layer's capacity at the prompt length (d2o.md: r_l <= 1), so it holds P
    // entries during decode whatever the budget (its prefill keeps everything,
    // checked below); ems re-expands every key from a stored direction and
    // norm, exact only up to f32 rounding (ems_singletons_reproduce_full_attention);
    // think prunes key channels at any budget.
    for info in REGISTRY.iter().filter(|i| i.caps.exact_when_covering) {
        let r = replay(info.name, 46);
        for m in r.metrics() {
            assert_eq!(
                (m.rel_l2, m.kl, m.attn_mass),
                (0.0, 0.0, 1.0),
                "{} at B = T: {m:?}",
                info.name
            );
        }
        assert_eq!(r.bytes(), r.full_bytes(), "{}", info.name);
    }
    let excluded: Vec<&str> = REGISTRY
        .iter()
        .filter(|i| !i.caps.exact_when_covering)
        .map(|i| i.name)
        .collect();
    assert_eq!(
        excluded,
        ["d2o", "ems", "quant", "mikv", "mustafar", "zipcache", "gear", "kvquant", "think"],
        "which policies are exempt is deliberate"
    );
    assert_eq!(kept("d2o", &layers[0], 40)[0], (0..40).collect::<Vec<_>>());
    // prefill-only forms equal full once B covers the prompt
    for info in REGISTRY.iter().filter(|i| i.caps.exact_when_covering) {
        // the prefill-only form of a policy that holds a capacity during decode
        let spec = if info.caps.holds_capacity
            && info.caps.phase != kvreplay_replay::policies::Phase::Decode
        {
            format!("{}:decode_evict=false", info.name)
        } else {
            info.name.to_string()
        };
        let r = replay(&spec, 40);
        assert!(r.metrics().all(|m| m.rel_l2 == 0.0), "{spec} at B = P");
    }
}

#[test]
fn errors_grow_as_the_budget_shrinks_on_structured_data() {
    let data = random_layer(11, 4, 2, 16, 64, 72);
    for spec in [
        "streaming_llm",
        "h2o",
        "snapkv:w=8",
        "tova",
        "knorm:skip_layers=none",
    ] {
        let p = PolicySpec::parse(spec).unwrap().build().unwrap();
        let err = |b| {
            replay_layer(&data, p.as_ref(), b)
                .unwrap()
                .metrics
                .iter()
                .map(|m| m.rel_l2)
                .sum::<f64>()
        };
        let (small, large) = (err(12), err(48));
        assert!(
            small > large,
            "{spec}: error at B=12 {small} <= at B=48 {large}"
        );
    }
}

mod invariants {
    use super::*;
    use kvreplay_replay::policies::{find, Build, Family};
    use kvreplay_replay::spec::parse_one;
    use proptest::prelude::*;

    /// The scorer inside a scorer-style spec (a scorer or a scorer wrapper).
    fn scorer_of(spec: &str) -> Option<std::sync::Arc<dyn kvreplay_replay::Scorer>> {
        let p = parse_one(spec).unwrap();
        match find(p.policy).unwrap().build {
            Build::Scorer(f) => Some(f(&p).unwrap()),
            Build::ScorerWrapper { .. } => {
                let sp = p.scorer_params().unwrap();
                match find(sp.policy).unwrap().build {
                    Build::Scorer(f) => Some(f(&sp).unwrap()),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        /// Every registered policy, at every step: entries in position order
        /// (unless merged), each position represented at most once and never beyond the step
        /// (causal); no more entries than the policy's budget (B for those
        /// that hold a capacity, B plus the appended decode entries for
        /// prefill-only ones, per-head or per-layer counts for the allocation
        /// wrappers); protected sinks and windows kept; and, for policies
        /// that store exact entries, bytes equal entries.
        #[test]
        fn every_policy_respects_its_budget_and_protections(seed in 0u64..1000, p in 12usize..40, b in 4usize..40) {
            let t = p + 4;
            // RoPE recorded, as in every real trace (EMS un-rotates keys)
            let data = with_rope(random_layer(seed, 4, 2, 8, p, t));
            for info in REGISTRY {
                // knorm's default skips layers 0 and 1: compress this one
                let spec = if info.name == "knorm" { "knorm:skip_layers=none".to_string() } else { info.name.to_string() };
                let steps = run_steps(&spec, &data, b);
                let caps = info.caps;
                let n_caches = steps[0].len() as isize;
                for (i, caches) in steps.iter().enumerate() {
                    let mut total = 0isize;
                    for c in caches {
                        let pos = c.positions();
                        // entries follow the positions that created them; a merged
                        // entry may also stand for earlier positions
                        if !caps.merges {
                            prop_assert!(pos.windows(2).all(|w| w[0] < w[1]), "{spec}: entries out of order {pos:?}");
                        }
                        let mut seen = std::collections::HashSet::new();
                        for m in &c.members {
                            for &x in m {
                                prop_assert!((x as usize) < p + i, "{spec}: step {i} holds future position {x}");
                                prop_assert!(seen.insert(x), "{spec}: position {x} in two entries");
                            }
                        }
                        // EMS counts entries that cost a full key and value; its
                        // zero-cost slots are bounded by γ·B (γ = 4)
                        let entries = if info.name == "ems" {
                            prop_assert!(c.len() <= 4 * b + 1, "{spec}: {} slots", c.len());
                            c.bits.iter().filter(|x| **x >= HeadCache::exact_bits(8)).count()
                        } else {
                            c.len()
                        };
                        let bound = match caps.family {
                            // full, a wrapper alone (quant, sliding: over full), MiniCache on one layer: nothing dropped
                            _ if info.is_wrapper() => p + i,
                            Family::Reference | Family::Quantisation | Family::LowRank | Family::CrossLayer => p + i,
                            // SimLayerKV keeps every position of a layer that is not lazy
                            _ if info.name == "simlayerkv" => p + i,
                            _ if caps.holds_capacity => b,
                            _ => b.min(p) + i,
                        };
                        if caps.family != Family::Allocation || info.is_wrapper() {
                            prop_assert!(entries <= bound, "{spec}: {entries} entries > {bound} after step {i}");
                        }
                        total += entries as isize;
                        // exact entries cost exactly f16 (low-rank / sparse stores re-express
                        // them, think stores fewer key channels, xkv's entries carry their
                        // share of the factors' bits)
                        if !caps.merges && !caps.quantises && caps.family != Family::LowRank {
                            prop_assert_eq!(c.total_bits(), c.len() as u64 * HeadCache::exact_bits(8));
                        }
                    }
                    if caps.family == Family::Allocation && !info.is_wrapper() {
                        // per-head rounding may add one entry per cache
                        let bound = n_caches * (b.min(p) + i) as isize + n_caches;
                        prop_assert!(total <= bound, "{spec}: {total} entries > {bound} after step {i}");
                    }
                }
                if let (Some(s), true) = (scorer_of(&spec), p > b) {
                    let prot = s.protect(b).unwrap();
                    for c in &steps[0] {
                        let pos = c.positions();
                        for x in (0..prot.sinks).chain(p - prot.recent..p) {
                            prop_assert!(pos.contains(&x), "{spec}: protected {x} dropped: {pos:?}");
                        }
                    }
                }
            }
        }
    }
}

/// A one-head layer with the given 2-d keys, values (i, 1) and column sums.
fn keyed_layer(keys: &[[f32; 2]], colsum: Vec<f32>, extra: usize) -> LayerData {
    let mut data = simple_layer(&[vec![0.0; keys.len() + extra]], 1, keys.len(), 0, 1);
    for (i, k) in keys.iter().enumerate() {
        data.k[2 * i..2 * i + 2].copy_from_slice(k);
    }
    data.colsum = colsum;
    data
}

#[test]
fn kvmerger_sets_follow_adjacent_cosine() {
    // keys a a a b b c (a ⟂ b, c opposite to b), soft mode with no protection:
    // sets {0, 1, 2}, {3, 4}, {5}
    let (a, b, c) = ([1.0, 0.0], [0.0, 1.0], [0.0, -1.0]);
    let data = keyed_layer(&[a, a, a, b, b, c], vec![1.0; 6], 1);
    let p = PolicySpec::parse("kvmerger:budget_mode=soft,recent_ratio=0,hh_ratio=0")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 1)).unwrap();
    assert_eq!(
        caches[0].member_lists(),
        vec![vec![0, 1, 2], vec![3, 4], vec![5]]
    );
    // soft mode represents every prompt position
    assert_eq!(caches[0].members.iter().map(|m| m.len()).sum::<usize>(), 6);
}

#[test]
fn kvmerger_soft_mode_represents_every_prompt_position_once() {
    // the paper's defaults (recent window and heavy hitters kept apart): every
    // prompt position sits in exactly one entry of each KV head's cache
    // (this was claim K10 of `kvreplay claims`, true by construction)
    for seed in 0..4 {
        let data = random_layer(seed, 4, 2, 8, 60, 60);
        let p = PolicySpec::parse("kvmerger:budget_mode=soft")
            .unwrap()
            .build()
            .unwrap();
        let (caches, _) = p.prefill(&PrefillCtx::new(&data, 1)).unwrap();
        assert_eq!(caches.len(), 2);
        for c in &caches {
            let mut seen: Vec<u32> = c.members.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..60u32).collect::<Vec<_>>(), "seed {seed}");
        }
    }
}

#[test]
fn kvmerger_gaussian_weights_and_value_scaling() {
    // Two similar keys: k0 = (1, 0), k1 = (1, 0.5) (cos 0.894 > 0.75). Pivot = the
    // larger accumulated attention: position 1. Distances 0.5 and 0, adaptive
    // σ = 0.5 / (√2·2): g0 = exp(-0.25 / (2σ²)) = e^-4, g1 = 1.
    // k̂ = (k1 + e^-4 k0) / (1 + e^-4); v̂ = 2·(v1 + e^-4 v0) / (1 + e^-4).
    let data = keyed_layer(&[[1.0, 0.0], [1.0, 0.5]], vec![0.2, 0.9], 1);
    let p = PolicySpec::parse("kvmerger:budget_mode=soft,recent_ratio=0,hh_ratio=0")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 1)).unwrap();
    let c = &caches[0];
    assert_eq!(c.member_lists(), vec![vec![0, 1]]);
    let e = (-4.0f64).exp();
    let w0 = e / (1.0 + e);
    assert!(
        (c.key(0)[1] as f64 - 0.5 * (1.0 - w0)).abs() < 1e-6,
        "{:?}",
        c.key(0)
    );
    // values v_i = (i, 1): v̂ = 2·((1 - w0)·(1, 1) + w0·(0, 1))
    assert!(
        (c.value(0)[0] as f64 - 2.0 * (1.0 - w0)).abs() < 1e-5
            && (c.value(0)[1] - 2.0).abs() < 1e-5,
        "{:?}",
        c.value(0)
    );
    assert_eq!(c.bias[0], 0.0);
    // logcount_bias keeps the plain weighted value and adds ln 2
    let p = PolicySpec::parse(
        "kvmerger:budget_mode=soft,recent_ratio=0,hh_ratio=0,value_mode=logcount_bias",
    )
    .unwrap()
    .build()
    .unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 1)).unwrap();
    assert!((caches[0].bias[0] - 2f32.ln()).abs() < 1e-6);
    assert_eq!(caches[0].bits[0], HeadCache::exact_bits(2) + 16);
}

#[test]
fn kvmerger_hard_mode_respects_the_budget() {
    // 40 keys on a slowly turning circle (every adjacent cosine > 0.99). B = 10 with
    // the paper's split (r_rec/β = 0.34, r_hh/β = 0.24): R = {37, 38, 39}, H = the two
    // largest column sums {7, 20}; the pool splits into the runs 0..7, 8..20, 21..37.
    let keys: Vec<[f32; 2]> = (0..40)
        .map(|i| {
            let t = i as f32 * 0.05 + (i as f32 * 0.01).powi(2);
            [t.cos(), t.sin()]
        })
        .collect();
    let colsum: Vec<f32> = (0..40)
        .map(|i| {
            if i == 7 || i == 20 {
                5.0
            } else {
                1.0 / (i + 1) as f32
            }
        })
        .collect();
    let data = keyed_layer(&keys, colsum, 2);
    let run = |spec: &str| {
        PolicySpec::parse(spec)
            .unwrap()
            .build()
            .unwrap()
            .prefill(&PrefillCtx::new(&data, 10))
            .unwrap()
            .0
            .remove(0)
    };
    // ε = 0.75 merges each run whole: 3 sets <= m = 5, so the budget is under-filled (as in the paper).
    let c = run("kvmerger");
    assert_eq!(c.len(), 8);
    assert_eq!(
        c.members
            .iter()
            .filter(|m| m.len() > 1)
            .map(|m| (m[0], m.len()))
            .collect::<Vec<_>>(),
        vec![(0, 7), (8, 12), (21, 16)]
    );
    // ε = 0.99999 links no pair: 35 singletons > m, so pairs are linked by decreasing
    // cosine until exactly m = 5 sets remain (3 runs, split twice more).
    let c = run("kvmerger:eps=0.99999");
    assert_eq!(c.len(), 10);
    for protected in [7, 20, 37, 38, 39] {
        assert!(
            c.member_lists().contains(&vec![protected]),
            "{protected} not verbatim: {:?}",
            c.members
        );
    }
    assert_eq!(
        c.members.iter().map(|m| m.len()).sum::<usize>(),
        40,
        "every position is represented"
    );
    // The angle step grows with i, so the least similar pairs are the last ones of each
    // run: the two extra cuts fall at the end of the longest run.
    let sets: Vec<(u32, usize)> = c
        .members
        .iter()
        .filter(|m| !(m.len() == 1 && [7, 20, 37, 38, 39].contains(&m[0])))
        .map(|m| (m[0], m.len()))
        .collect();
    assert_eq!(sets, vec![(0, 7), (8, 12), (21, 14), (35, 1), (36, 1)]);
}

#[test]
fn d2o_first_compression_merges_tokens_at_least_as_similar_as_the_mean() {
    // P = 8, one layer, B = 4: r = 0.5, N = 3, M = 1; sink {0}, recent {7}, and the two
    // largest column sums among 1..7 are 2 and 3. Evicted: 1, 4, 5, 6 with best key
    // cosines 0.990 (to 2), 0.900 (to 3), 0 and 0: τ₀ = mean = 0.4725, so 1 and 4
    // merge and 5, 6 are dropped.
    let deg = |a: f32| [a.to_radians().cos(), a.to_radians().sin()];
    let c = (8.0f32.to_radians().cos()) as f64;
    let keys = [
        deg(180.0),
        deg(8.0),
        deg(0.0),
        deg(90.0),
        deg(115.84),
        deg(270.0),
        deg(270.0),
        deg(45.0),
    ];
    let data = keyed_layer(&keys, vec![9.0, 1.0, 5.0, 4.0, 1.0, 1.0, 1.0, 1.0], 2);
    let p = PolicySpec::parse("d2o:n_sink=1").unwrap().build().unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 4)).unwrap();
    let cache = &caches[0];
    assert_eq!(
        cache.member_lists(),
        vec![vec![0], vec![1, 2], vec![3, 4], vec![7]]
    );
    // k2' = (e·k2 + e^u·k1) / (e + e^u), u = cos 8°
    let (e1, eu) = (1f64.exp(), c.exp());
    let want = (e1 * 1.0 + eu * c) / (e1 + eu);
    assert!(
        (cache.key(1)[0] as f64 - want).abs() < 1e-5,
        "{:?} vs {want}",
        cache.key(1)
    );
    // without the threshold every evicted token merges into its match
    let p = PolicySpec::parse("d2o:n_sink=1,threshold=none")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 4)).unwrap();
    assert_eq!(caches[0].members.iter().map(|m| m.len()).sum::<usize>(), 8);
}

#[test]
fn d2o_keeps_a_fixed_size_and_beta_one_merges_every_decode_eviction() {
    let data = random_layer(9, 4, 2, 8, 30, 40);
    // single layer: r = B/P = 0.4 -> N = 9, M = 3, S = 12
    for spec in ["d2o", "d2o:beta=1"] {
        let steps = run_steps(spec, &data, 12);
        for (i, caches) in steps.iter().enumerate() {
            for c in caches {
                assert_eq!(c.len(), 12, "{spec}: step {i}");
            }
        }
        if spec == "d2o:beta=1" {
            // with β = 1, τ equals the evicted token's own similarity: it always merges
            for g in 0..2 {
                let after_prefill: usize = steps[0][g].members.iter().map(|m| m.len()).sum();
                for (i, caches) in steps.iter().enumerate() {
                    assert_eq!(
                        caches[g].members.iter().map(|m| m.len()).sum::<usize>(),
                        after_prefill + i
                    );
                }
            }
        }
    }
}

/// Two layers whose keys and values point the same way (layer b = 2 × layer a)
/// merge losslessly up to f16 storage; the pair stores one direction and two
/// norms per position and half: (d·16 + 2·16) bits instead of 2·d·16.
#[test]
fn minicache_merges_parallel_layers_losslessly_and_charges_one_direction() {
    let a = random_layer(31, 4, 2, 8, 20, 24);
    let mut b = random_layer(31, 4, 2, 8, 20, 24);
    b.layer = 1;
    a.k.iter()
        .zip(b.k.iter_mut())
        .for_each(|(x, y)| *y = 2.0 * x);
    a.v.iter()
        .zip(b.v.iter_mut())
        .for_each(|(x, y)| *y = 2.0 * x);
    let (mut a, mut b) = (a, b);
    a.n_layers = 2;
    b.n_layers = 2;
    let p = PolicySpec::parse("minicache:start=0")
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(p.layer_groups(2, 10, 20), vec![vec![0, 1]]);
    let r = kvreplay_replay::engine::replay_group(&[a, b], p.as_ref(), 10).unwrap();
    for l in &r {
        for m in &l.metrics {
            assert!(m.rel_l2 < 2e-3, "{m:?}"); // f16 rounding of directions and norms
        }
    }
    // all 24 positions merged (identical directions: every dist is 0, nothing exceeds τ = 0)
    let per_head_bits = 24 * 2 * (8 * 16 + 2 * 16);
    assert_eq!((r[0].bytes + r[1].bytes) * 8, 2 * per_head_bits as u64);
    // Mean-KV stores one vector per position and half
    let p = PolicySpec::parse("minicache:start=0,merge=mean")
        .unwrap()
        .build()
        .unwrap();
    let (mut a2, mut b2) = (
        random_layer(31, 4, 2, 8, 20, 24),
        random_layer(32, 4, 2, 8, 20, 24),
    );
    (b2.layer, a2.n_layers, b2.n_layers) = (1, 2, 2);
    let r = kvreplay_replay::engine::replay_group(&[a2, b2], p.as_ref(), 10).unwrap();
    assert_eq!((r[0].bytes + r[1].bytes) * 8, 2 * 24 * 2 * 8 * 16);
}

fn with_rope(mut d: LayerData) -> LayerData {
    use kvreplay_kernels::cpu::{RopeParams, RopeStyle};
    d.rope = Some(RopeParams {
        theta: 10000.0,
        style: RopeStyle::Neox,
        rotated_dims: d.d,
        linear_factor: 1.0,
        llama3: None,
    });
    d
}

/// EMS: with N + T <= N_budget + 1 nothing is demoted before the last output,
/// so every decode output equals full attention up to the f32 rounding of the
/// RoPE⁻¹/RoPE round trip of raw-space keys (ems.md §2.5).
#[test]
fn ems_singletons_reproduce_full_attention() {
    let data = with_rope(random_layer(41, 4, 2, 8, 20, 26));
    for spec in [
        "ems",
        "ems:gqa_mode=per_kv_head",
        "ems:merge_space=post_rope",
    ] {
        let p = PolicySpec::parse(spec).unwrap().build().unwrap();
        let r = replay_layer(&data, p.as_ref(), 25).unwrap();
        for m in &r.metrics {
            assert!(m.rel_l2 < 1e-5, "{spec}: {m:?}");
        }
    }
}

/// Slots (engine entries) and stored entries (slots charged 2·d·16 bits) of one head.
fn ems_counts(c: &HeadCache, d: usize) -> (usize, usize) {
    (
        c.len(),
        c.bits
            .iter()
            .filter(|b| **b >= HeadCache::exact_bits(d))
            .count(),
    )
}

#[test]
fn ems_invariants_and_threshold_extremes() {
    let data = with_rope(random_layer(43, 4, 2, 8, 60, 72));
    let (b, l) = (16usize, 4usize);
    // γ = 2: N_tbm = 16, S_max = 32; N_imp = 12
    for spec in [
        "ems:window=4,gamma=2",
        "ems:window=4,gamma=2,tau=0",
        "ems:window=4,gamma=2,gqa_mode=per_kv_head",
    ] {
        let steps = run_steps(spec, &data, b);
        for (i, caches) in steps.iter().enumerate() {
            for c in caches {
                let (slots, entries) = ems_counts(c, 8);
                assert!(
                    entries <= b && slots <= 32,
                    "{spec} step {i}: {entries} entries, {slots} slots"
                );
            }
        }
    }
    // τ = 0 merges every to-be-merged token: 12 centres + 16 members + 4 window slots
    let steps = run_steps("ems:window=4,gamma=2,tau=0", &data, b);
    assert_eq!(ems_counts(&steps[0][0], 8), (12 + 16 + l, b));
    // τ ≥ 1 and γ = 1 are both pure eviction: identical caches at every step
    let x = run_steps("ems:window=4,gamma=2,tau=1", &data, b);
    let y = run_steps("ems:window=4,gamma=1", &data, b);
    for (i, (cx, cy)) in x.iter().zip(&y).enumerate() {
        for (a, c) in cx.iter().zip(cy) {
            assert_eq!(a.positions(), c.positions(), "step {i}");
            assert_eq!(a.keys, c.keys, "step {i}");
        }
    }
}

/// A to-be-merged token whose key and value are positive multiples of a centre's
/// merges into that centre for any τ < 1 (R = 1).
#[test]
fn ems_merges_a_scaled_copy_of_a_centre() {
    let mut data = with_rope(random_layer(47, 1, 1, 8, 40, 41));
    // post-RoPE similarity so that a scaled copy has cosine exactly 1 in key space
    let d = 8;
    let (src, dst) = (5usize, 6usize);
    for c in 0..d {
        data.k[dst * d + c] = 0.5 * data.k[src * d + c];
        data.v[dst * d + c] = 2.0 * data.v[src * d + c];
    }
    // Make 5 important (large score) and 6 unimportant but within the to-be-merged band.
    let p = 40;
    data.colsum = (0..p)
        .map(|i| {
            if i == src {
                10.0
            } else if i == dst {
                0.05
            } else {
                0.1 + (i as f32) * 0.001
            }
        })
        .collect();
    let pol = PolicySpec::parse(
        "ems:window=4,gamma=100,tau=0.99,merge_space=post_rope,kernel=1,score=global",
    )
    .unwrap()
    .build()
    .unwrap();
    let (caches, _) = pol.prefill(&PrefillCtx::new(&data, 8)).unwrap();
    let c = &caches[0];
    let pos = c.positions();
    assert!(pos.contains(&dst), "the copy kept a slot: {pos:?}");
    let (i5, i6) = (
        pos.iter().position(|&x| x == src).unwrap(),
        pos.iter().position(|&x| x == dst).unwrap(),
    );
    // same stored entry: identical value vectors
    assert_eq!(c.value(i5), c.value(i6));
    // the centre's value is the score-weighted mean of its members (score =
    // global: the column sums 10 and 0.05, up to a common factor):
    // v̂ = (10·v5 + 0.05·2·v5) / 10.05. Tolerance: weights in f64, value
    // stored as f32 (relative 1e-6).
    let (a, b) = (10f32 as f64, 0.05f32 as f64);
    for x in 0..d {
        let v5 = data.v[src * d + x] as f64;
        let want = (a * v5 + b * 2.0 * v5) / (a + b);
        let got = c.value(i5)[x] as f64;
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
            "channel {x}: {got} vs {want}"
        );
    }
}

/// EMS zero_class=literal_zero: to-be-merged tokens that merge nowhere keep a
/// slot with a zero key and value (they still take softmax mass) but store nothing.
#[test]
fn ems_literal_zero_class_keeps_zero_slots() {
    let data = with_rope(random_layer(43, 4, 2, 8, 60, 72));
    let steps = run_steps(
        "ems:window=4,gamma=2,tau=1,zero_class=literal_zero",
        &data,
        16,
    );
    let c = &steps[0][0];
    // 12 centres + 16 zero-class slots + 4 window slots; 16 stored entries
    assert_eq!(ems_counts(c, 8), (12 + 16 + 4, 16));
    let zero_slots = (0..c.len())
        .filter(|&e| c.key(e).iter().all(|x| *x == 0.0) && c.value(e).iter().all(|x| *x == 0.0))
        .count();
    assert_eq!(zero_slots, 16);
    for caches in &steps {
        for c in caches {
            let (slots, entries) = ems_counts(c, 8);
            assert!(slots <= 32 && entries <= 16);
        }
    }
    // with `free` the same configuration keeps only the 16 stored entries' slots
    let free = run_steps("ems:window=4,gamma=2,tau=1", &data, 16);
    assert_eq!(ems_counts(&free[0][0], 8), (16, 16));
}

/// D2O's official-code preset keeps one cache per query head and leaves the
/// protected layers (0, 1 and the last) uncompressed.
#[test]
fn d2o_code_preset() {
    let mut data = random_layer(9, 4, 2, 8, 30, 40);
    data.layer = 2;
    data.n_layers = 6;
    let p = PolicySpec::parse("d2o:preset=code")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 12)).unwrap();
    assert_eq!(caches.len(), 4, "one cache per query head");
    // the first compression waits for decode step 1 (d2o_code_preset_defers_the_first_compression)
    assert!(caches.iter().all(|c| c.len() == 30));
    data.layer = 5;
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 12)).unwrap();
    assert!(
        caches.iter().all(|c| c.len() == 30),
        "the last layer is protected"
    );
    let r = replay_layer(&data, p.as_ref(), 12).unwrap();
    assert!(
        r.metrics.iter().all(|m| m.rel_l2 == 0.0),
        "a protected layer replays exactly"
    );
}

#[test]
fn ahakv_per_query_head_keeps_one_cache_per_query_head() {
    let data = random_layer(51, 4, 2, 8, 40, 44);
    let steps = run_steps("ahakv:gqa_mode=per_query_head", &data, 12);
    for caches in &steps {
        assert_eq!(caches.len(), 4);
        assert!(caches.iter().all(|c| c.len() == 12));
    }
}

/// D2O match_on=split: the key half follows key similarity and the value half
/// value similarity, each to its own target; positions follow the key half.
#[test]
fn d2o_split_matching_merges_halves_separately() {
    let deg = |a: f32| [a.to_radians().cos(), a.to_radians().sin()];
    let keys = [
        deg(180.0),
        deg(8.0),
        deg(0.0),
        deg(90.0),
        deg(115.84),
        deg(270.0),
        deg(270.0),
        deg(45.0),
    ];
    let mut data = keyed_layer(&keys, vec![9.0, 1.0, 5.0, 4.0, 1.0, 1.0, 1.0, 1.0], 2);
    let vals: [[f32; 2]; 8] = [
        [1.0, 0.0],
        [-1.0, 0.0],
        [0.0, 1.0],
        [-1.0, 0.0],
        [-1.0, 0.0],
        [-1.0, 0.0],
        [-1.0, 0.0],
        [0.0, -1.0],
    ];
    for (i, v) in vals.iter().enumerate() {
        data.v[2 * i..2 * i + 2].copy_from_slice(v);
    }
    let p = PolicySpec::parse("d2o:n_sink=1,threshold=none,match_on=split")
        .unwrap()
        .build()
        .unwrap();
    let (caches, _) = p.prefill(&PrefillCtx::new(&data, 4)).unwrap();
    let c = &caches[0];
    // key half: 1 -> 2, 4 -> 3, 5 and 6 -> 0 (cosine 0 with both 0 and 2: the earliest wins)
    assert_eq!(
        c.member_lists(),
        vec![vec![0, 5, 6], vec![1, 2], vec![3, 4], vec![7]]
    );
    // value half: every evicted value is (-1, 0), closest to position 3's value
    assert_eq!(c.value(1), &[0.0, 1.0], "position 2's value is untouched");
    assert_eq!(c.value(3), &[0.0, -1.0]);
    assert_eq!(c.value(2), &[-1.0, 0.0], "a convex mix of equal vectors");
    assert_ne!(
        c.key(1),
        &[1.0, 0.0],
        "position 2's key absorbed position 1's"
    );
}

/// MiniCache-4bit: directions quantised (per-token groups of 32 channels, f16
/// scale and minimum), re-normalised; norms and retained tokens stay f16.
#[test]
fn minicache_4bit_directions_cost_their_quantised_bits() {
    let mut a = random_layer(31, 4, 2, 8, 20, 24);
    let mut b = random_layer(31, 4, 2, 8, 20, 24);
    (b.layer, a.n_layers, b.n_layers) = (1, 2, 2);
    a.k.iter()
        .zip(b.k.iter_mut())
        .for_each(|(x, y)| *y = 2.0 * x);
    a.v.iter()
        .zip(b.v.iter_mut())
        .for_each(|(x, y)| *y = 2.0 * x);
    let p = PolicySpec::parse("minicache:start=0,b_dir=4")
        .unwrap()
        .build()
        .unwrap();
    let r = kvreplay_replay::engine::replay_group(&[a, b], p.as_ref(), 10).unwrap();
    // per position and half: a 4-bit direction (8·4 + 2·16 bits) + two f16 norms
    let per_head_bits = 24 * 2 * (8 * 4 + 2 * 16 + 2 * 16);
    assert_eq!((r[0].bytes + r[1].bytes) * 8, 2 * per_head_bits as u64);
    for l in &r {
        for m in &l.metrics {
            assert!(
                m.rel_l2 < 0.2 && m.rel_l2 > 1e-4,
                "4-bit directions lose a little: {m:?}"
            );
        }
    }
}

/// D2O's code preset compresses at decode step 1: step 1 still attends over the
/// whole prompt, and from then on each cache holds the budget of P + 1 positions.
#[test]
fn d2o_code_preset_defers_the_first_compression() {
    let mut data = random_layer(9, 4, 2, 8, 30, 40);
    data.layer = 2;
    data.n_layers = 6;
    let steps = run_steps("d2o:preset=code", &data, 12);
    assert!(
        steps[0].iter().all(|c| c.len() == 30),
        "nothing compressed at prefill"
    );
    // r = 0.4, f = 0.5 over P + 1 = 31 positions: N = M = 6
    for (i, caches) in steps.iter().enumerate().skip(1) {
        assert!(caches.iter().all(|c| c.len() == 12), "step {i}");
    }
}

/// With the official code's one τ per layer, the evicted entry of every head
/// merges or is dropped together at each decode step.
#[test]
fn d2o_code_preset_shares_the_threshold_across_heads() {
    let mut data = random_layer(13, 4, 2, 8, 30, 40);
    data.layer = 2;
    data.n_layers = 6;
    let steps = run_steps("d2o:preset=code", &data, 12);
    let covered = |caches: &Vec<HeadCache>| -> Vec<usize> {
        caches
            .iter()
            .map(|c| c.members.iter().map(|m| m.len()).sum())
            .collect()
    };
    let mut decisions = 0;
    for i in 2..steps.len() {
        let (before, after) = (covered(&steps[i - 1]), covered(&steps[i]));
        // the step's token arrives (+1); a merged eviction keeps every position
        let merged: Vec<bool> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| b + 1 == *a)
            .collect();
        assert!(
            merged.iter().all(|&m| m == merged[0]),
            "step {i}: {merged:?}"
        );
        decisions += 1;
    }
    assert!(decisions > 5);
}

/// MiniCache with f32 norms (b_norm = 32) restores each vector's norm to f32
/// rounding, and charges 32 bits per norm.
#[test]
fn minicache_f32_norms_are_exact() {
    let a = random_layer(61, 4, 2, 8, 20, 24);
    let mut b = random_layer(62, 4, 2, 8, 20, 24);
    b.layer = 1;
    let (ka, kb) = (a.k.clone(), b.k.clone());
    let p = PolicySpec::parse("minicache:start=0,b_norm=32,gamma=0")
        .unwrap()
        .build()
        .unwrap();
    let ctxs = [PrefillCtx::new(&a, 10), PrefillCtx::new(&b, 10)];
    let (caches, _) = p.prefill_group(&ctxs).unwrap();
    let nrm = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>().sqrt();
    for (layer, orig) in [(0usize, &ka), (1, &kb)] {
        for e in 0..20 {
            let want = nrm(&orig[e * 8..(e + 1) * 8]);
            let got = nrm(caches[layer][0].key(e));
            assert!(
                (got - want).abs() <= 1e-5 * want.max(1.0),
                "layer {layer} position {e}: {got} vs {want}"
            );
        }
    }
}

/// The policies split into module directories keep their public paths
/// (analysis calls `kvmerger::sets_of_run`).
#[test]
fn split_policies_keep_their_public_paths() {
    use kvreplay_replay::policies::{d2o, ems, kvmerger, minicache};
    let r = d2o::layer_ratio(0.25, 4, 100, 1000);
    assert_eq!(
        d2o::layer_counts(0.25, 4, 100, 1000, 0.75),
        d2o::counts(r, 1000, 0.75)
    );
    let key = |_: usize| vec![1.0f32, 0.0];
    assert_eq!(
        kvmerger::sets_of_run(&[0, 1, 2], &key, 0.75, false),
        vec![vec![0, 1, 2]]
    );
    let m: minicache::Merged = minicache::merge_token(&[1.0, 0.0], &[2.0, 0.0], 0.5);
    assert_eq!(m.dist, Some(0.0));
    let names = [
        ems::INFO.name,
        d2o::INFO.name,
        kvmerger::INFO.name,
        minicache::INFO.name,
    ];
    assert_eq!(names, ["ems", "d2o", "kvmerger", "minicache"]);
    let _types: Option<(d2o::D2o, ems::Ems, kvmerger::KvMerger, minicache::MiniCache)> = None;
}

#[test]
fn observed_attention_divides_column_sums_by_the_causal_count() {
    // Two query heads share one KV head, P = 4. Column sums:
    //   head 0 [2.0, 1.5, 0.3, 0.2], head 1 [2.0, 0.5, 0.9, 0.6]
    //   group mean [2.0, 1.0, 0.6, 0.4] (H2O's score: keeps 0 and 1 at B = 2)
    // Queries that saw position i: 4, 3, 2, 1, so the scores are
    //   [0.5, 0.333, 0.3, 0.4]: B = 2 keeps {0, 3}, B = 3 keeps {0, 1, 3}.
    let mut data = simple_layer(&[vec![0.0; 5]], 2, 4, 0, 1);
    data.colsum = [[2.0, 1.5, 0.3, 0.2], [2.0, 0.5, 0.9, 0.6]].concat();
    assert_eq!(kept("observed_attention", &data, 2), vec![vec![0, 3]]);
    assert_eq!(kept("observed_attention", &data, 3), vec![vec![0, 1, 3]]);
    assert_eq!(kept("h2o:recent=0", &data, 2), vec![vec![0, 1]]);
}

#[test]
fn keydiff_keeps_the_keys_least_like_the_anchor_block_by_block() {
    // One-shot (preset=kvpress), P = 5, keys (1,0) (1,0) (1,0) (0,2) (-1,0):
    // unit keys sum to (2, 1), anchor (0.4, 0.2); cosines .894, .894, .894,
    // .447, -.894, scores the negatives: B = 2 keeps {3, 4}; B = 3 adds the
    // latest of the three equal (1,0) keys, 2.
    let d1 = keyed_layer(
        &[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 2.0], [-1.0, 0.0]],
        vec![0.0; 5],
        1,
    );
    assert_eq!(kept("keydiff:preset=kvpress", &d1, 2), vec![vec![3, 4]]);
    assert_eq!(kept("keydiff:preset=kvpress", &d1, 3), vec![vec![2, 3, 4]]);
    // Block-wise, B = 2, block = 2, P = 6, keys
    //   0 (1,0)  1 (0,1)  2 (1,0)  3 (1,0)  4 (0,1)  5 (0,1)
    // start {0, 1}; + {2, 3}: anchor (3,1)/4, cos .949 for (1,0) keys, .316
    //   for (0,1): keep 1 and, of the equal 0, 2, 3, the latest: {1, 3}.
    // + {4, 5}: set {1, 3, 4, 5}, anchor (1,3)/4: now 3 is the odd one
    //   (cos .316), then the latest of 1, 4, 5: {3, 5}.
    // One-shot on the same keys: anchor (.5, .5), every cosine equal: {4, 5}.
    let keys = [
        [1.0, 0.0],
        [0.0, 1.0],
        [1.0, 0.0],
        [1.0, 0.0],
        [0.0, 1.0],
        [0.0, 1.0],
    ];
    let d2 = keyed_layer(&keys, vec![0.0; 6], 1);
    assert_eq!(kept("keydiff:block=2", &d2, 2), vec![vec![3, 5]]);
    assert_eq!(kept("keydiff:preset=kvpress", &d2, 2), vec![vec![4, 5]]);
    // one block covering the rest of the prompt is the one-shot rule on it
    assert_eq!(
        kept("keydiff:block=4", &d2, 2),
        kept("keydiff:preset=kvpress", &d2, 2)
    );
}

#[test]
fn lagkv_ranks_each_partition_against_the_next() {
    // n_sink = 1, lag = 2, P = 6: partitions {1, 2} and {3, 4}, tail {5}.
    // Only {1, 2} is scored (reference {3, 4}); 0, 3, 4, 5 score 1.
    // Keys k3 = (0,0), k4 = (1,1) span [0, 1] on both channels, so
    //   k1 = (0, 1) keeps std (N − 1) .707, k2 = (.5, .5) std 0:
    //   softmax (.670, .330).
    // Values v3 = (0,0), v4 = (1,1); v1 = (.5, .5) std 0, v2 = (.2, .8) std .424:
    //   softmax (.396, .604).
    // Mean (.533, .467): position 1 ranks above 2 (ranks 1/2 and 0).
    let keys = [
        [9.0, 9.0],
        [0.0, 1.0],
        [0.5, 0.5],
        [0.0, 0.0],
        [1.0, 1.0],
        [3.0, 3.0],
    ];
    let mut data = keyed_layer(&keys, vec![0.0; 6], 1);
    for (i, v) in [[0.5f32, 0.5], [0.2, 0.8], [0.0, 0.0], [1.0, 1.0]]
        .iter()
        .enumerate()
    {
        data.v[2 * (i + 1)..2 * (i + 2)].copy_from_slice(v);
    }
    assert_eq!(
        kept("lagkv:n_sink=1,lag=2", &data, 5),
        vec![vec![0, 1, 3, 4, 5]]
    );
    assert_eq!(
        kept("lagkv:n_sink=1,lag=2,cross_scoring=true", &data, 5),
        vec![vec![0, 1, 3, 4, 5]]
    );
    // B = 4: the sink and the positions scoring 1; B = 3: the sink first
    // (kvpress ties it with them: our choice), then the latest
    assert_eq!(
        kept("lagkv:n_sink=1,lag=2", &data, 4),
        vec![vec![0, 3, 4, 5]]
    );
    assert_eq!(kept("lagkv:n_sink=1,lag=2", &data, 3), vec![vec![0, 4, 5]]);
    // with k1 = (.5, .5) too the keys tie (.5, .5) and the values decide:
    // mean (.448, .552), so position 2 is kept instead
    data.k[2..4].copy_from_slice(&[0.5, 0.5]);
    assert_eq!(
        kept("lagkv:n_sink=1,lag=2", &data, 5),
        vec![vec![0, 2, 3, 4, 5]]
    );
    // P < n_sink + 2·lag (lag = 4): sinks, then the most recent
    assert_eq!(kept("lagkv:n_sink=1,lag=4", &data, 3), vec![vec![0, 4, 5]]);
}

#[test]
fn a2sf_forgets_old_attention_geometrically() {
    // Every query has logits s = [0, 0, 0, 2, 0] over the keys it sees (P = 5):
    //   row 0 [1]; row 1 [.5 .5]; row 2 [.333 ×3];
    //   row 3 [.0963 ×3, .7112]; row 4 [.0878 ×3, .6488, .0878].
    // H2O (α = 1): column sums 2.017, 1.017, .517, 1.360, .088 → B = 1 keeps 0.
    // α = .5, row j weighted .5^(4 − j):
    //   s0 = .0625 + .125·.5 + .25·.333 + .5·.0963 + .0878 = .344
    //   s3 = .5·.7112 + .6488 = 1.004 (s1 = .282, s2 = .219, s4 = .088)
    //   → B = 1 keeps 3, B = 2 keeps {0, 3}.
    let data = simple_layer(&[vec![0.0, 0.0, 0.0, 2.0, 0.0, 0.0]], 1, 5, 0, 1);
    assert_eq!(kept("h2o:recent=0", &data, 1), vec![vec![0]]);
    assert_eq!(kept("a2sf:alpha=0.5,recent=0", &data, 1), vec![vec![3]]);
    assert_eq!(kept("a2sf:alpha=0.5,recent=0", &data, 2), vec![vec![0, 3]]);

    // Decode. Logits [0, −5, −5, 0, 0], P = 4, B = 3, recent = 1, α = .5:
    //   rows: [1]; [.9933 .0067]; [.9867 .0067 .0067]; [.4967 .0034 .0034 .4967]
    //   s = (1.363, .0084, .0067, .4967): keep 3 and the top 2 of {0, 1, 2} = {0, 1, 3}.
    // Step 4 sees {0, 1, 3, 4} with attention (.3326, .0022, .3326, .3326):
    //   s ← .5·s + a = (1.014, .0064, .581, .333); outside the recent 1 the
    //   lowest is position 1: {0, 3, 4}.
    let data = simple_layer(&[vec![0.0, -5.0, -5.0, 0.0, 0.0]], 1, 4, 0, 1);
    let steps = run_steps("a2sf:alpha=0.5,recent=1", &data, 3);
    assert_eq!(steps[0][0].positions(), vec![0, 1, 3]);
    assert_eq!(steps[1][0].positions(), vec![0, 3, 4]);

    // α = 1 is H2O, at prefill and through decode (GQA group mean included)
    let data = random_layer(7, 4, 2, 8, 24, 32);
    for b in [4, 9, 16] {
        let a = run_steps("a2sf:alpha=1", &data, b);
        let h = run_steps("h2o", &data, b);
        for (x, y) in a.iter().zip(&h) {
            let px: Vec<_> = x.iter().map(|c| c.positions()).collect();
            let py: Vec<_> = y.iter().map(|c| c.positions()).collect();
            assert_eq!(px, py, "B = {b}");
        }
    }
}

#[test]
fn cur_scores_windowed_key_and_value_leverage() {
    // P = 6, keys (1,0) (1,0) (2,0) (1,0) (1,0) (3,0), values (i, 1), n_sink = 1.
    // ‖k‖² = 1 1 4 1 1 9, ‖v‖² = 1 2 5 10 17 26.
    // window = 2: per pair of positions each divided by the pair's sum
    //   keys .5 .5 | .8 .2 | .1 .9    values .333 .667 | .333 .667 | .395 .605
    //   product (sink), .333, .267, .133, .040, .544
    //   → B = 3 keeps {0, 1, 5}, B = 4 adds 2.
    // window = none: the raw products (sink), 2, 20, 10, 17, 234
    //   → B = 3 keeps {0, 2, 5}, B = 4 adds 4.
    let keys = [
        [1.0, 0.0],
        [1.0, 0.0],
        [2.0, 0.0],
        [1.0, 0.0],
        [1.0, 0.0],
        [3.0, 0.0],
    ];
    let data = keyed_layer(&keys, vec![0.0; 6], 1);
    assert_eq!(kept("cur:n_sink=1,window=2", &data, 3), vec![vec![0, 1, 5]]);
    assert_eq!(
        kept("cur:n_sink=1,window=2", &data, 4),
        vec![vec![0, 1, 2, 5]]
    );
    assert_eq!(
        kept("cur:n_sink=1,window=none", &data, 3),
        vec![vec![0, 2, 5]]
    );
    assert_eq!(
        kept("cur:n_sink=1,window=none", &data, 4),
        vec![vec![0, 2, 4, 5]]
    );
    // keys alone, window = 2: (sink), .5, .8, .2, .1, .9 → {0, 2, 5}
    assert_eq!(
        kept("cur:n_sink=1,window=2,leverage=key", &data, 3),
        vec![vec![0, 2, 5]]
    );
    // the default window (16) covers the prompt: the raw order; 4 sinks at B = 4
    assert_eq!(kept("cur", &data, 5), vec![vec![0, 1, 2, 3, 5]]);
}

#[test]
fn leverage_keeps_the_outlying_keys() {
    // Keys (d = 2, no RoPE), every one shifted by (50, 50), which the centring removes:
    //   (30, 0) (−10, 0) (−10, 0) (−10, 0) (0, 10) (0, −10)
    // Centred Gram matrix diag(1200, 200). An invertible sketch leaves the
    // leverage (hat-matrix diagonal) unchanged up to λ = 0.01 against entries
    // of order 10³: h = 900/1200, 100/1200 (×3), 100/200, 100/200
    //   = .75, .083, .083, .083, .5, .5 → B = 1 keeps {0}, B = 3 keeps {0, 4, 5}.
    let keys = [
        [30.0, 0.0],
        [-10.0, 0.0],
        [-10.0, 0.0],
        [-10.0, 0.0],
        [0.0, 10.0],
        [0.0, -10.0],
    ]
    .map(|[a, b]| [a + 50.0, b + 50.0]);
    let data = keyed_layer(&keys, vec![0.0; 6], 1);
    for spec in ["leverage:sketch=2", "leverage", "leverage:seed=7"] {
        assert_eq!(kept(spec, &data, 1), vec![vec![0]], "{spec}");
        assert_eq!(kept(spec, &data, 3), vec![vec![0, 4, 5]], "{spec}");
    }
    // (without the centring the hat diagonal would be .84, .23 ×3, .30, .19,
    // and B = 3 would keep {0, 3, 4})
}

/// `preset=kvpress` is kvpress 0.5.x's SnapKVPress: w = 64, k = 5, avg
/// pooling (zero padding counted), each query head pooled before the group
/// mean; given parameters still win over the preset's.
#[test]
fn snapkv_kvpress_preset_pools_with_avg_5_and_each_head_before_the_mean() {
    assert_eq!(
        PolicySpec::parse("snapkv:preset=kvpress")
            .unwrap()
            .canonical(),
        "snapkv:group_mean=after_pool,k=5,pool=avg,preset=kvpress,w=64"
    );
    assert_eq!(
        PolicySpec::parse("snapkv:preset=kvpress,w=4")
            .unwrap()
            .canonical(),
        "snapkv:group_mean=after_pool,k=5,pool=avg,preset=kvpress,w=4"
    );
    // P = 12, w = 4: candidates 0..8 with logits [0, 3, 0, 0, 0, 1.5, 1.5, 0],
    // so the window votes are c·e^s = c·[1, 20.09, 1, 1, 1, 4.48, 4.48, 1].
    // Default (k = 7, max): 0..=4 all pool to 20.09, the tie keeps the later
    // ones: {3, 4}. kvpress (k = 5, avg over 5 with zero padding): 0: 22.09/5 =
    // 4.42, 1: 23.09/5 = 4.62, 2: 24.09/5 = 4.82, 3: 27.57/5 = 5.51, 4: 11.96/5,
    // 5: 11.96/5, 6: 10.96/5, 7: 9.96/5 -> {3, 2}.
    let mut s = vec![0.0f32; 13];
    s[1] = 3.0;
    s[5] = 1.5;
    s[6] = 1.5;
    let data = simple_layer(&[s], 1, 12, 0, 1);
    assert_eq!(kept("snapkv:w=4", &data, 6), vec![vec![3, 4, 8, 9, 10, 11]]);
    assert_eq!(
        kept("snapkv:preset=kvpress,w=4", &data, 6),
        vec![vec![2, 3, 8, 9, 10, 11]]
    );
    // The group mean before or after pooling differs under max pooling.
    // One KV head, keys k_i = (a_i, b_i) with a = [0, 3, 0, 0, 0, 0] and
    // b = [0, 0, 0, 4, 0, 0]; query head 0 reads a (query (1, 0)), head 1
    // reads b (query (0, 1)). P = 6, w = 2 (rows 4, 5), candidates 0..4.
    // Head 0 votes c0·[1, e³, 1, 1] with c0 = 1/(e³+4) + 1/(e³+5) = 0.0814:
    // [0.081, 1.635, 0.081, 0.081]; head 1 votes c1·[1, 1, 1, e⁴] with
    // c1 = 1/(e⁴+4) + 1/(e⁴+5) = 0.0338: [0.034, 0.034, 0.034, 1.848].
    // before_pool: mean [0.058, 0.834, 0.058, 0.965], max-pool 3 ->
    // [0.834, 0.834, 0.965, 0.965], the tie keeps 3.
    // after_pool: head 0 pooled [1.635, 1.635, 1.635, 0.081], head 1 pooled
    // [0.034, 0.034, 1.848, 1.848], mean [0.834, 0.834, 1.741, 0.965] -> 2.
    let a = [0.0f32, 3.0, 0.0, 0.0, 0.0, 0.0];
    let b = [0.0f32, 0.0, 0.0, 4.0, 0.0, 0.0];
    let k = vec![(0..6).map(|i| vec![a[i], b[i]]).collect::<Vec<_>>()];
    let v = vec![(0..6).map(|i| vec![i as f32, 1.0]).collect::<Vec<_>>()];
    let q = vec![vec![vec![1.0, 0.0]; 6], vec![vec![0.0, 1.0]; 6]];
    let data = explicit_layer(&q, &k, &v, 6, 1.0);
    assert_eq!(kept("snapkv:w=2,k=3", &data, 3), vec![vec![3, 4, 5]]);
    assert_eq!(
        kept("snapkv:w=2,k=3,group_mean=after_pool", &data, 3),
        vec![vec![2, 4, 5]]
    );
}

/// `preset=kvpress` is kvpress 0.5.x's TOVAPress: the last prompt position is
/// always kept, and the cache is compressed at prefill only.
#[test]
fn tova_kvpress_preset_keeps_the_last_prompt_position_at_prefill_only() {
    // The last prompt row (j = 4) has logits [0, 3, 2, 1, -5] over keys 0..=4.
    // Default, B = 2: the top two, {1, 2}, so position 4 (its own weight e⁻⁵/Z)
    // is evicted. kvpress: 4 kept, plus the top one of 0..4: {1, 4}.
    let data = simple_layer(&[vec![0.0, 3.0, 2.0, 1.0, -5.0, 0.0, 0.0]], 1, 5, 0, 1);
    assert_eq!(kept("tova", &data, 2), vec![vec![1, 2]]);
    assert_eq!(kept("tova:preset=kvpress", &data, 2), vec![vec![1, 4]]);
    assert_eq!(
        PolicySpec::parse("tova:preset=kvpress")
            .unwrap()
            .canonical(),
        "tova:decode_evict=false,keep_last=true,per_kv_head=false,preset=kvpress"
    );
    // decode entries are appended (B = 2 held by the default)
    let steps = run_steps("tova:preset=kvpress", &data, 2);
    assert_eq!(steps[2][0].positions(), vec![1, 4, 5, 6]);
    let steps = run_steps("tova", &data, 2);
    assert_eq!(steps[2][0].len(), 2);
}

/// `preset=kvpress` is kvpress 0.5.x's KnormPress: every layer compressed.
#[test]
fn knorm_kvpress_preset_compresses_every_layer() {
    // key i = (s_i, 0): norms 0.5, 3, 1, 0.2, 2 in layer 0, which the default
    // skips; kvpress keeps the two smallest, {0, 3}.
    let data0 = simple_layer(&[vec![0.5, -3.0, 1.0, 0.2, 2.0, 0.0]], 1, 5, 0, 4);
    assert_eq!(kept("knorm", &data0, 2), vec![vec![0, 1, 2, 3, 4]]);
    assert_eq!(kept("knorm:preset=kvpress", &data0, 2), vec![vec![0, 3]]);
}

/// `preset=kvpress` is kvpress 0.5.x's StreamingLLMPress: the same 4 sinks and
/// recent window at prefill, no eviction during decode.
#[test]
fn streaming_llm_kvpress_preset_compresses_at_prefill_only() {
    // P = 10, B = 6: sinks 0..4 and the 2 most recent.
    let data = simple_layer(&[vec![0.0; 12]], 1, 10, 0, 1);
    assert_eq!(
        kept("streaming_llm:preset=kvpress", &data, 6),
        vec![vec![0, 1, 2, 3, 8, 9]]
    );
    let steps = run_steps("streaming_llm:preset=kvpress", &data, 6);
    assert_eq!(steps[2][0].positions(), vec![0, 1, 2, 3, 8, 9, 10, 11]);
    let steps = run_steps("streaming_llm", &data, 6);
    assert_eq!(steps[2][0].positions(), vec![0, 1, 2, 3, 10, 11]);
}

/// `preset=kvpress` is kvpress 0.5.x's ObservedAttentionPress (its closest to
/// H2O): each prompt column sum divided by the number of prompt queries that
/// see the key, no recent window, prefill only.
#[test]
fn h2o_kvpress_preset_divides_column_sums_by_the_queries_that_see_them() {
    // P = 4, logits [0, 0, 0, 2]: rows 0..=2 are uniform, row 3 gives
    // e²/(3 + e²) = 0.711 to position 3 and 0.096 to each other one.
    // Column sums: 1 + 1/2 + 1/3 + 0.096 = 1.930, 1/2 + 1/3 + 0.096 = 0.930,
    // 1/3 + 0.096 = 0.430, 0.711. Raw (recent = 0), B = 2: {0, 1}.
    // Divided by 4, 3, 2, 1: 0.483, 0.310, 0.215, 0.711 -> {0, 3}.
    let data = simple_layer(&[vec![0.0, 0.0, 0.0, 2.0, 0.0]], 1, 4, 0, 1);
    assert_eq!(
        kept("h2o:recent=0,decode_evict=false", &data, 2),
        vec![vec![0, 1]]
    );
    assert_eq!(kept("h2o:preset=kvpress", &data, 2), vec![vec![0, 3]]);
    assert_eq!(
        PolicySpec::parse("h2o:preset=kvpress").unwrap().canonical(),
        "h2o:decode_evict=false,mean=true,preset=kvpress,recent=0"
    );
    // the division is a prefill score: refused with decode-time eviction
    assert!(PolicySpec::parse("h2o:mean=true").unwrap().build().is_err());
}

/// Equal memory: at `--budget B`, every registered policy under its defaults
/// (a wrapper composed onto `snapkv`, since alone it wraps the uncompressed
/// cache), and every form with one cache per query head, holds at most the
/// bytes of B f16 entries per KV head and layer, plus the decode entries
/// appended to each cache (`Memory::Budget`), or plus the metadata it
/// documents (`Memory::Metadata`), or it says why its memory is not set by B
/// (`Memory::Beyond`). Shape: G = 3 query heads per KV head, so a
/// per-query-head cache given B entries would hold 3x the bound; d = 64 as
/// in the real models (EMS's per-slot metadata is relative to d).
#[test]
fn every_policy_holds_at_most_b_f16_entries_per_kv_head_or_says_why() {
    use kvreplay_replay::policies::{Build, Memory};
    let tmp = tempfile::tempdir().unwrap();
    let (nl, nh, nkv, d, p, t) = (6, 6, 2, 64, 96, 104);
    let layers: Vec<LayerData> = (0..nl)
        .map(|l| {
            let mut x = random_layer(40 + l as u64, nh, nkv, d, p, t);
            (x.layer, x.n_layers) = (l, nl);
            x
        })
        .collect();
    let trace = kvreplay_traces::Trace::open(common::write_trace(tmp.path(), &layers)).unwrap();
    let entry_bytes = HeadCache::exact_bits(d) / 8;
    // the largest share of the bound over B: Budget 0, Metadata its share
    let check = |spec: &str, memory: Memory| -> f64 {
        let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
        let mut worst = 0f64;
        for b in [12, 24, 48, 90] {
            let r = kvreplay_replay::replay(
                &trace,
                policy.as_ref(),
                kvreplay_replay::Budget::Entries(b),
            )
            .unwrap_or_else(|e| panic!("{spec} at B = {b}: {e}"));
            // decode entries are appended to every cache: G copies per KV
            // head where each query head has its own cache
            let per_query = r
                .layers
                .iter()
                .any(|l| l.retained.iter().any(|x| x.head >= nkv));
            let appended = (t - p) * if per_query { nh / nkv } else { 1 };
            let bound = (nl * nkv * (b + appended)) as u64 * entry_bytes;
            let over = r.bytes() as f64 / bound as f64 - 1.0;
            worst = worst.max(over);
            let allowed = match memory {
                Memory::Budget => 0.0,
                Memory::Metadata { share, .. } => share,
                Memory::Beyond(_) => f64::INFINITY,
            };
            assert!(
                over <= allowed,
                "{spec} at B = {b}: {} bytes, {:.2}% over {bound} (B f16 entries per KV head and layer, + decode); allowed {:.2}%",
                r.bytes(),
                100.0 * over,
                100.0 * allowed
            );
        }
        worst
    };
    let mut beyond = Vec::new();
    for info in REGISTRY.iter() {
        let spec = match info.build {
            Build::Wrapper(_) => format!("snapkv+{}", info.name),
            _ => info.name.to_string(),
        };
        let worst = check(&spec, info.caps.memory);
        match info.caps.memory {
            Memory::Beyond(why) => {
                assert!(why.len() > 20, "{}: say why", info.name);
                beyond.push(info.name);
            }
            Memory::Metadata { share, .. } => assert!(share < 0.1, "{}: {worst}", info.name),
            Memory::Budget => {}
        }
    }
    // one cache per query head: ⌊B/G⌋ each by default
    for spec in [
        "ahakv:gqa_mode=per_query_head",
        "ahakv:gqa_mode=per_query_head,decode_evict=false",
        "lazyeviction:per_query_head=true",
        "triforce:per_query_head=true",
        "adakv:scorer=ahakv,gqa_mode=per_query_head",
        "cam:scorer=ahakv,gqa_mode=per_query_head",
        "chunk:scorer=ahakv,gqa_mode=per_query_head",
        "snapkv+think+quant",
    ] {
        check(spec, Memory::Budget);
    }
    check(
        "ems:gqa_mode=per_kv_head",
        kvreplay_replay::policies::ems::INFO.caps.memory,
    );
    // the old meaning, kept as a parameter: B per query-head cache, G× the memory
    let over = check(
        "ahakv:gqa_mode=per_query_head,budget_per=query_head",
        Memory::Beyond("G×"),
    );
    assert!(over > 1.0, "{over}");
    assert_eq!(
        beyond,
        [
            "full",
            "pyramidkv",
            "knorm",
            "minicache",
            "mikv",
            "mustafar",
            "zipcache",
            "gear",
            "kvquant",
            "retrieval_head",
            "razor",
            "simlayerkv"
        ],
        "which policies' memory is not set by the budget is deliberate"
    );
}
