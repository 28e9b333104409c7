//! The replay engine through real trace files: determinism, outputs, errors.

mod common;

use common::{random_layer, write_trace};
use kvreplay_replay::{replay, Budget, PolicySpec, ReplayError};
use kvreplay_traces::Trace;

fn layers(n: usize, p: usize, t: usize) -> Vec<kvreplay_replay::policy::LayerData> {
    (0..n)
        .map(|l| {
            let mut d = random_layer(100 + l as u64, 4, 2, 8, p, t);
            d.layer = l;
            d.n_layers = n;
            d
        })
        .collect()
}

#[test]
fn replay_is_bit_identical_for_any_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = Trace::open(write_trace(tmp.path(), &layers(4, 30, 36))).unwrap();
    for spec in [
        "h2o",
        "snapkv:w=8+quant:bits=2,group=4,residual=4",
        "cam:m=4",
        "adakv:w=4",
    ] {
        let p = PolicySpec::parse(spec).unwrap().build().unwrap();
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let r = pool
                .install(|| replay(&trace, p.as_ref(), Budget::Entries(10)))
                .unwrap();
            format!("{:?}", r.layers)
        };
        let one = run(1);
        assert_eq!(one, run(2), "{spec}");
        assert_eq!(one, run(3), "{spec}");
    }
}

#[test]
fn outputs_hold_one_row_per_head_and_per_retained_position() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = Trace::open(write_trace(tmp.path(), &layers(2, 20, 24))).unwrap();
    let spec = PolicySpec::parse("streaming_llm:n_sink=2").unwrap();
    let r = replay(&trace, spec.build().unwrap().as_ref(), Budget::Ratio(0.5)).unwrap();
    assert_eq!(r.budget, 10);
    let s = kvreplay_replay::output::summary(
        &trace,
        &spec,
        Budget::Ratio(0.5),
        &r,
        &kvreplay_kernels::Backend::Cpu,
    );
    let out = tmp.path().join("out");
    kvreplay_replay::output::write(&out, &s, &r, false).unwrap();
    let metrics = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    let lines: Vec<&str> = metrics.lines().collect();
    assert_eq!(
        lines[0],
        "policy,budget,layer,head,rel_l2,cosine,attn_mass,kl,bytes"
    );
    assert_eq!(lines.len(), 1 + 2 * 4, "one row per layer and query head");
    assert!(lines[1].starts_with("streaming_llm,10,0,0,"));
    // After 4 decode steps holding B = 10: sinks {0, 1} and the last 8 positions 16..24,
    // of which 16..20 are prompt positions: 6 retained prompt positions per KV head.
    let retention = std::fs::read_to_string(out.join("retention.csv")).unwrap();
    assert_eq!(retention.lines().count(), 1 + 2 * 2 * 6);
    assert!(retention.contains("\n0,1,17,3\n"), "{retention}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        summary["policy_spec"],
        "streaming_llm:decode_evict=true,n_sink=2,preset=paper"
    );
    assert_eq!(
        summary["trace"]["files_sha256"].as_array().unwrap().len(),
        2
    );
    assert!(!out.join(".metrics.csv.tmp").exists());
    assert_eq!(summary["trace"]["verified"], true);
    assert_eq!(summary["trace"]["content_id"], trace.content_id());
    // where it was computed: results on CPU and CUDA are close, not identical
    assert_eq!(summary["device"], "cpu");
    assert_eq!(summary["device_detail"], "cpu");
}

#[test]
fn bad_budgets_and_traces_are_explained() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_trace(tmp.path(), &layers(1, 20, 24));
    let trace = Trace::open(&dir).unwrap();
    let p = PolicySpec::parse("h2o").unwrap().build().unwrap();
    let e = replay(&trace, p.as_ref(), Budget::Entries(0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 1"), "{e}");
    let e = replay(&trace, p.as_ref(), Budget::Ratio(1.5))
        .unwrap_err()
        .to_string();
    assert!(e.contains("(0, 1]"), "{e}");
    let e = replay(&trace, p.as_ref(), Budget::Ratio(0.01))
        .unwrap_err()
        .to_string();
    assert!(e.contains("keeps no entry"), "{e}");
    // the budget as the user wrote it, not the enum's debug form
    assert!(e.contains("--ratio 0.01 of a 20-token prompt"), "{e}");
    assert!(!e.contains("Ratio("), "{e}");
    // A trace without decode tokens has nothing to replay.
    let t2 = tmp.path().join("nodecode");
    std::fs::create_dir(&t2).unwrap();
    let no_decode = write_trace(&t2, &layers(1, 20, 20));
    let e = replay(
        &Trace::open(no_decode).unwrap(),
        p.as_ref(),
        Budget::Entries(5),
    )
    .unwrap_err();
    assert!(
        matches!(e, ReplayError::TraceLacks { .. }) && e.to_string().contains("--decode"),
        "{e}"
    );
}

/// Results reused across budgets (window votes, masks, the full-cache
/// reference, EMS's rows and rankings) give exactly what computing them
/// afresh gives, whether each policy has its own replay of the trace or
/// all share one (so a memo key that left out a parameter would show).
#[test]
fn reused_budget_independent_results_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = Trace::open(write_trace(tmp.path(), &layers(2, 30, 36))).unwrap();
    let shared = kvreplay_replay::TraceReplay::new(&trace, &Default::default()).unwrap();
    for (spec, own) in [
        "snapkv:w=4",
        "scissorhands:w_h=8",
        "tova",
        "full",
        "adakv:w=4",
        "ems",
        "ems:merge_space=post_rope,sim_pos=true",
        "ems:gqa_mode=per_kv_head,similarity=key,kernel=3",
        "ems:sim_pos=true,score=global",
    ]
    .into_iter()
    .flat_map(|s| [(s, true), (s, false)])
    {
        let p = PolicySpec::parse(spec).unwrap().build().unwrap();
        // one TraceReplay: the second budget and the repeat reuse the memo
        let mine;
        let tr = match own {
            true => {
                mine = kvreplay_replay::TraceReplay::new(&trace, &Default::default()).unwrap();
                &mine
            }
            false => &shared,
        };
        for b in [6, 10] {
            let cached = tr.replay(p.as_ref(), Budget::Entries(b)).unwrap();
            let again = tr.replay(p.as_ref(), Budget::Entries(b)).unwrap();
            assert!(
                !tr.layer(0).memo.as_ref().unwrap().is_empty(),
                "{spec}: nothing kept"
            );
            for l in 0..2 {
                let d = kvreplay_replay::engine::load_layer(&trace, l);
                // entries per cache (⌊B/G⌋ for per-query-head caches)
                let cb = kvreplay_replay::policy::cache_budget(p.as_ref(), b, d.group());
                let fresh = kvreplay_replay::replay_layer(&d, p.as_ref(), cb).unwrap();
                assert_eq!(
                    format!("{:?}", cached.layers[l]),
                    format!("{fresh:?}"),
                    "{spec} B={b} layer {l}"
                );
                assert_eq!(
                    format!("{:?}", again.layers[l]),
                    format!("{fresh:?}"),
                    "{spec} B={b} layer {l}"
                );
            }
        }
    }
}

#[test]
fn replay_output_is_replaced_only_with_force_and_only_when_whole() {
    use kvreplay_replay::output::{partial_of, write};
    let tmp = tempfile::tempdir().unwrap();
    let trace = Trace::open(write_trace(tmp.path(), &layers(1, 20, 24))).unwrap();
    let spec = PolicySpec::parse("h2o").unwrap();
    let run = |b| {
        let r = replay(&trace, spec.build().unwrap().as_ref(), Budget::Entries(b)).unwrap();
        let s = kvreplay_replay::output::summary(
            &trace,
            &spec,
            Budget::Entries(b),
            &r,
            &kvreplay_kernels::Backend::Cpu,
        );
        (s, r)
    };
    let out = tmp.path().join("out");
    let (s8, r8) = run(8);
    write(&out, &s8, &r8, false).unwrap();
    let read = |f: &str| std::fs::read(out.join(f)).unwrap();
    let before = (read("metrics.csv"), read("summary.json"));
    // an existing output is refused without force
    let (s4, r4) = run(4);
    let e = write(&out, &s4, &r4, false).unwrap_err().to_string();
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
    // a write that fails (here: OUT.partial cannot be made) leaves the old output whole
    std::fs::write(partial_of(&out), b"in the way").unwrap();
    assert!(write(&out, &s4, &r4, true).is_err());
    assert_eq!((read("metrics.csv"), read("summary.json")), before);
    // with force and a clear path, the new output replaces the old one as a whole
    std::fs::remove_file(partial_of(&out)).unwrap();
    write(&out, &s4, &r4, true).unwrap();
    assert_ne!(read("metrics.csv"), before.0);
    let summary: serde_json::Value = serde_json::from_slice(&read("summary.json")).unwrap();
    assert_eq!(summary["budget"], 4);
    assert!(!partial_of(&out).exists());
    let names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!names.iter().any(|n| n.contains("replaced")), "{names:?}");
}

/// Every policy that says its caches do not depend on the budget
/// (`Policy::budget_independent`) gives the same result at every budget, so
/// a sweep may replay it once per trace (`TraceReplay::replay_spec`); and
/// what replay_spec reports equals a fresh replay at each budget.
#[test]
fn budget_independent_policies_give_the_same_result_at_every_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = Trace::open(write_trace(tmp.path(), &layers(2, 30, 36))).unwrap();
    let mut seen = Vec::new();
    for info in kvreplay_replay::REGISTRY.iter() {
        for spec in [
            info.name.to_string(),
            format!("full+{}", info.name),
            format!("snapkv:w=4+{}", info.name),
        ] {
            let Ok(s) = PolicySpec::parse(&spec) else {
                continue;
            };
            let Ok(p) = s.build() else { continue };
            if !p.budget_independent() {
                continue;
            }
            seen.push(spec.clone());
            let tr = kvreplay_replay::TraceReplay::new(&trace, &Default::default()).unwrap();
            let at = |b| replay(&trace, p.as_ref(), Budget::Entries(b)).unwrap();
            let base = format!("{:?}", at(4).layers);
            for b in [9, 30] {
                assert_eq!(
                    format!("{:?}", at(b).layers),
                    base,
                    "{spec}: budget {b} changed the result"
                );
                let r = tr
                    .replay_spec(&spec, p.as_ref(), Budget::Entries(b))
                    .unwrap();
                assert_eq!(
                    (r.budget, format!("{:?}", r.layers)),
                    (b, base.clone()),
                    "{spec} via replay_spec"
                );
            }
        }
    }
    // the uncompressed cache, the quantised one, and the fixed-precision stores
    for want in ["full", "quant", "full+quant", "gear", "mustafar", "kvquant"] {
        assert!(
            seen.contains(&want.to_string()),
            "{want} should be budget-independent: {seen:?}"
        );
    }
    assert!(!seen.iter().any(|s| s.starts_with("snapkv")), "{seen:?}");
}

/// Every policy that sorts budgets into classes (`Policy::budget_class`:
/// MiniCache's first merged layer) gives the same result at every budget of
/// a class, and what `TraceReplay::replay_spec` reports at each budget, the
/// class replayed once, equals a fresh replay at that budget.
#[test]
fn budgets_of_one_class_give_the_same_result() {
    let tmp = tempfile::tempdir().unwrap();
    // 4 layers, a 30-token prompt: MiniCache starts merging at ⌊4·B/30⌋
    let trace = Trace::open(write_trace(tmp.path(), &layers(4, 30, 36))).unwrap();
    let (n_layers, prompt) = (4, 30);
    let mut seen = Vec::new();
    for info in kvreplay_replay::REGISTRY.iter() {
        let Ok(p) = PolicySpec::parse(info.name).and_then(|s| s.build()) else {
            continue;
        };
        let budgets = [2usize, 4, 7, 8, 14, 15, 22, 23, 29, 30, 40];
        let classes: Vec<Option<usize>> = budgets
            .iter()
            .map(|&b| p.budget_class(n_layers, b, prompt))
            .collect();
        if classes.iter().all(Option::is_none) {
            continue;
        }
        seen.push(info.name);
        let tr = kvreplay_replay::TraceReplay::new(&trace, &Default::default()).unwrap();
        let mut firsts: Vec<(usize, String)> = Vec::new();
        for (&b, class) in budgets.iter().zip(&classes) {
            let class = class.expect("a policy with classes gives every budget one");
            let fresh = replay(&trace, p.as_ref(), Budget::Entries(b)).unwrap();
            let fresh = format!("{:?}", fresh.layers);
            match firsts.iter().find(|(c, _)| *c == class) {
                Some((_, first)) => {
                    assert_eq!(&fresh, first, "{}: budget {b} (class {class})", info.name)
                }
                None => firsts.push((class, fresh.clone())),
            }
            let r = tr
                .replay_spec(info.name, p.as_ref(), Budget::Entries(b))
                .unwrap();
            assert_eq!(
                (r.budget, format!("{:?}", r.layers)),
                (b, fresh),
                "{} via replay_spec at {b}",
                info.name
            );
        }
        // the classes here are real: several budgets share one, and there
        // is more than one
        assert!(
            firsts.len() > 1 && firsts.len() < budgets.len(),
            "{}: {classes:?}",
            info.name
        );
    }
    assert_eq!(seen, ["minicache"]);
}

/// Every policy whose groups' replays read no budget
/// (`Policy::group_budget_free`: MiniCache's pairs) gives a group the same
/// results at every budget whose grouping holds it, and what
/// `TraceReplay::replay_spec` reports at each budget, groups replayed once
/// and taken where they recur, equals a fresh replay at that budget.
#[test]
fn groups_that_read_no_budget_give_the_same_result_at_every_budget() {
    let tmp = tempfile::tempdir().unwrap();
    // 6 layers, a 30-token prompt: MiniCache pairs layers from ⌊6·B/30⌋ on,
    // so pair (3, 4) recurs at B = 5 (from layer 1) and B = 15 (from 3)
    let trace = Trace::open(write_trace(tmp.path(), &layers(6, 30, 36))).unwrap();
    let (n_layers, prompt) = (6, 30);
    let mut seen = Vec::new();
    for spec in kvreplay_replay::REGISTRY
        .iter()
        .flat_map(|i| [i.name.to_string(), format!("{}:start=0.5", i.name)])
    {
        let Ok(p) = PolicySpec::parse(&spec).and_then(|s| s.build()) else {
            continue;
        };
        if !p.group_budget_free() {
            continue;
        }
        seen.push(spec.clone());
        let tr = kvreplay_replay::TraceReplay::new(&trace, &Default::default()).unwrap();
        // each group's results, by its layers, from the first budget that made it
        let mut firsts: Vec<(Vec<usize>, usize, String)> = Vec::new();
        let mut recurred = 0;
        for b in [2usize, 5, 7, 15, 16, 25, 40] {
            let fresh = replay(&trace, p.as_ref(), Budget::Entries(b)).unwrap();
            for g in p.layer_groups(n_layers, b, prompt) {
                let r = format!(
                    "{:?}",
                    g.iter().map(|&l| &fresh.layers[l]).collect::<Vec<_>>()
                );
                match firsts.iter().find(|(f, _, _)| *f == g) {
                    Some((_, b0, first)) => {
                        assert_eq!(&r, first, "{spec}: group {g:?} at {b} against {b0}");
                        recurred += (g.len() > 1) as usize;
                    }
                    None => firsts.push((g, b, r)),
                }
            }
            let kept = tr
                .replay_spec(&spec, p.as_ref(), Budget::Entries(b))
                .unwrap();
            assert_eq!(
                (kept.budget, format!("{:?}", kept.layers)),
                (b, format!("{:?}", fresh.layers)),
                "{spec} via replay_spec at {b}"
            );
        }
        // a group of several layers recurs across budgets with other groupings
        if !spec.contains("start=") {
            assert!(recurred > 0, "{spec}: no pair recurred: {firsts:?}");
        }
    }
    assert_eq!(seen, ["minicache", "minicache:start=0.5"]);
}
