//! `compare` on hand-built sweep folders (plan.json and point files written
//! directly), whose answers are known.

use std::path::{Path, PathBuf};

use kvreplay_analysis::compare::{
    bootstrap_mean_ci, compare, CompareError, Comparison, Curve, Options,
};
use kvreplay_analysis::sweep::{Plan, Point, PointResult, ResultRow, SummaryRow};
use kvreplay_replay::PolicySpec;

fn spec(s: &str) -> String {
    PolicySpec::parse(s).unwrap().canonical()
}

/// One finished point: (trace index, policy index, budget, memory share, error).
type Pt = (usize, usize, usize, f64, f64);

/// A sweep folder in `dir` with `traces` named t0, t1, ..., the `policies`
/// (short names) and the given finished points.
fn sweep(dir: &Path, n_traces: usize, policies: &[&str], pts: &[Pt]) -> PathBuf {
    let pts: Vec<(Pt, Vec<f64>)> = pts.iter().map(|p| (*p, vec![])).collect();
    sweep_rows(dir, n_traces, policies, &pts)
}

/// [`sweep`] with each point's per-head errors (layer 0, heads 0, 1, ...).
fn sweep_rows(dir: &Path, n_traces: usize, policies: &[&str], pts: &[(Pt, Vec<f64>)]) -> PathBuf {
    let out = dir.join("sweep");
    std::fs::create_dir_all(out.join("points")).unwrap();
    let mut budgets: Vec<usize> = pts.iter().map(|p| p.0 .2).collect();
    budgets.sort_unstable();
    budgets.dedup();
    let plan = Plan {
        traces: (0..n_traces)
            .map(|i| PathBuf::from(format!("/nowhere/t{i}")))
            .collect(),
        policies: policies.iter().map(|p| spec(p)).collect(),
        budgets,
        trace_ids: vec![],
        shapes: vec![],
        device: "cpu".into(),
    };
    std::fs::write(
        out.join("plan.json"),
        serde_json::to_string_pretty(&plan).unwrap(),
    )
    .unwrap();
    for ((trace, policy, budget, memory, err), heads) in pts {
        let (trace, policy, budget) = (*trace, *policy, *budget);
        let (memory, err) = (*memory, *err);
        let r = PointResult {
            rows: heads
                .iter()
                .enumerate()
                .map(|(head, &rel_l2)| ResultRow {
                    trace: format!("t{trace}"),
                    policy: policies[policy].to_string(),
                    budget,
                    layer: 0,
                    head,
                    rel_l2,
                    cosine: 1.0,
                    attn_mass: 1.0,
                    kl: 0.0,
                    bytes: 500,
                })
                .collect(),
            summary: SummaryRow {
                trace: format!("t{trace}"),
                policy: policies[policy].to_string(),
                budget,
                rel_l2_mean: err,
                rel_l2_p95: err,
                cosine_mean: 1.0,
                attn_mass_mean: 1.0,
                kl_mean: 0.0,
                bytes: 1000,
                memory_ratio: memory,
                needle_retention: None,
                predicted_kl: None,
                policy_spec: plan.policies[policy].clone(),
            },
            retention: vec![],
            unverified: false,
            device: "cpu".into(),
        };
        let id = plan.point_id(&Point {
            trace,
            policy,
            budget,
        });
        std::fs::write(
            out.join("points").join(format!("{id}.json")),
            serde_json::to_string(&r).unwrap(),
        )
        .unwrap();
    }
    out
}

/// Points of A (policy 0) and B (policy 1) on each trace at budgets 32 and
/// 64, memory 0.1 and 0.3 for both, errors `a[t]`, `b[t]` at 0.1 and half
/// of them at 0.3.
fn two_methods(a: &[f64], b: &[f64]) -> Vec<Pt> {
    let mut v = Vec::new();
    for t in 0..a.len() {
        for (p, e) in [(0, a[t]), (1, b[t])] {
            v.push((t, p, 32, 0.1, e));
            v.push((t, p, 64, 0.3, e / 2.0));
        }
    }
    v
}

fn opts(memory: &[f64]) -> Options {
    Options {
        a: "snapkv".into(),
        b: "h2o".into(),
        memory: (!memory.is_empty()).then(|| memory.to_vec()),
        ..Options::default()
    }
}

fn run(a: &[f64], b: &[f64], memory: &[f64]) -> Comparison {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sweep(tmp.path(), a.len(), &["snapkv", "h2o"], &two_methods(a, b));
    compare(&dir, &opts(memory)).unwrap()
}

#[test]
fn a_better_on_every_trace_interval_below_zero() {
    let b = [0.5, 0.4, 0.6, 0.3, 0.45];
    let d = [0.01, 0.02, 0.03, 0.04, 0.05];
    let a: Vec<f64> = b.iter().zip(d).map(|(b, d)| b - d).collect();
    let c = run(&a, &b, &[0.1]);
    assert_eq!(c.levels.len(), 1);
    let l = &c.levels[0];
    assert_eq!((l.a_lower, l.a_higher, l.ties), (5, 0, 0));
    assert!((l.mean_diff + 0.03).abs() < 1e-12, "{}", l.mean_diff);
    let [lo, hi] = l.ci.unwrap();
    assert!(
        hi < 0.0 && lo < l.mean_diff && l.mean_diff < hi,
        "{lo} {hi}"
    );
    // a bootstrap mean lies between the smallest and the largest difference
    assert!(lo >= -0.05 - 1e-12 && hi <= -0.01 + 1e-12, "{lo} {hi}");
    assert!(
        l.statement.starts_with(
            "snapkv's error is lower than h2o's at 10% of the full cache on 5 of 5 traces; \
             mean difference -0.0300 ["
        ),
        "{}",
        l.statement
    );
    // every difference negative: only the all-same-sign patterns are as extreme
    assert_eq!(l.p_value, Some(2.0 / 32.0));
    assert!(
        l.statement.ends_with(
            "], 95% bootstrap CI over traces; paired sign-flip test p = 0.062 \
             (the smallest 5 traces can give)."
        ),
        "{}",
        l.statement
    );
}

#[test]
fn a_not_better_interval_straddles_zero() {
    let b = [0.5, 0.4, 0.6, 0.3, 0.45];
    let d = [-0.02, 0.03, 0.01, -0.01, 0.02];
    let a: Vec<f64> = b.iter().zip(d).map(|(b, d)| b - d).collect();
    let c = run(&a, &b, &[0.1]);
    let l = &c.levels[0];
    assert_eq!((l.a_lower, l.a_higher, l.ties), (3, 2, 0));
    assert!((l.mean_diff + 0.006).abs() < 1e-12);
    let [lo, hi] = l.ci.unwrap();
    assert!(lo < 0.0 && hi > 0.0, "{lo} {hi}");
    assert!(l.statement.contains("on 3 of 5 traces"), "{}", l.statement);

    // B against A: worse on every trace, the interval above 0
    let c = run(&b, &[0.4, 0.3, 0.5, 0.2, 0.35], &[0.1]);
    let l = &c.levels[0];
    assert_eq!((l.a_lower, l.a_higher), (0, 5));
    assert!(l.ci.unwrap()[0] > 0.0);
    assert!(l
        .statement
        .contains("on 0 of 5 traces; mean difference 0.100 [0.100, 0.100]"));
}

#[test]
fn exact_tie_gives_zero_and_interval_zero() {
    let e = [0.5, 0.4, 0.6, 0.3];
    let c = run(&e, &e, &[0.1, 0.2]);
    for l in &c.levels {
        assert_eq!(l.mean_diff, 0.0);
        assert_eq!(l.ci, Some([0.0, 0.0]));
        assert_eq!((l.a_lower, l.a_higher, l.ties), (0, 0, 4));
        assert!(
            l.statement.contains(
                "on 0 of 4 traces (4 tied); mean difference 0.000 [0.000, 0.000], 95% bootstrap"
            ),
            "{}",
            l.statement
        );
    }
}

#[test]
fn interpolation_by_hand() {
    // A: (10%, 0.4) at B=32, (30%, 0.2) at B=64; B: (20%, 0.5) at 32, (40%, 0.1) at 64
    let pts = [
        (0, 0, 32, 0.1, 0.4),
        (0, 0, 64, 0.3, 0.2),
        (0, 1, 32, 0.2, 0.5),
        (0, 1, 64, 0.4, 0.1),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let dir = sweep(tmp.path(), 1, &["snapkv", "h2o"], &pts);
    let c = compare(&dir, &opts(&[0.25])).unwrap();
    let t = &c.levels[0].traces[0];
    // 0.4 + (0.25 - 0.1) / (0.3 - 0.1) * (0.2 - 0.4) = 0.25
    assert!((t.a_error - 0.25).abs() < 1e-12, "{}", t.a_error);
    // 0.5 + (0.25 - 0.2) / (0.4 - 0.2) * (0.1 - 0.5) = 0.4
    assert!((t.b_error - 0.4).abs() < 1e-12, "{}", t.b_error);
    assert!((t.diff + 0.15).abs() < 1e-12);
    assert_eq!((t.a_budgets, t.b_budgets), ([32, 64], [32, 64]));
    // at a measured share: that point's error and budget
    let c = compare(&dir, &opts(&[0.3])).unwrap();
    let t = &c.levels[0].traces[0];
    assert_eq!((t.a_error, t.a_budgets), (0.2, [64, 64]));
    assert!((t.b_error - 0.3).abs() < 1e-12);
    // default levels: the round shares within [20%, 30%]
    let c = compare(&dir, &opts(&[])).unwrap();
    let m: Vec<f64> = c.levels.iter().map(|l| l.memory).collect();
    assert_eq!(m, vec![0.2, 0.3]);

    // points at one memory share (a saturated cache) are averaged
    let cu = Curve::new(&[(1.0, 0.0, 512), (0.5, 0.2, 256), (1.0, 0.1, 1024)]).unwrap();
    assert_eq!(
        cu.points,
        vec![(0.5, 0.2, 256, 256), (1.0, 0.05, 512, 1024)]
    );
    let (e, b) = cu.at(0.75).unwrap();
    assert!((e - 0.125).abs() < 1e-12);
    assert_eq!(b, [256, 512]);
    assert_eq!(cu.at(0.49), None);
}

#[test]
fn memory_outside_a_range_is_refused_naming_trace_and_range() {
    let mut pts = two_methods(&[0.4, 0.3], &[0.5, 0.4]);
    // B on t1 only reaches 25% (budget 64 uses 25%, not 30%)
    for p in pts.iter_mut() {
        if p.0 == 1 && p.1 == 1 && p.2 == 64 {
            p.3 = 0.25;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = sweep(tmp.path(), 2, &["snapkv", "h2o"], &pts);
    let e = compare(&dir, &opts(&[0.1, 0.28])).unwrap_err();
    assert!(matches!(e, CompareError::OutOfRange(_)));
    assert_eq!(
        e.to_string(),
        format!(
            "28% of the full cache is outside what {} was measured at on t1 (10% to 25%); \
             choose --memory within every trace's range, or sweep more budgets",
            spec("h2o")
        )
    );
    // below every range
    let e = compare(&dir, &opts(&[0.05])).unwrap_err();
    assert!(
        e.to_string().contains("5% of the full cache is outside"),
        "{e}"
    );
    // the default levels stay inside: 10% and 20%
    let c = compare(&dir, &opts(&[])).unwrap();
    let m: Vec<f64> = c.levels.iter().map(|l| l.memory).collect();
    assert_eq!(m, vec![0.1, 0.2]);
}

#[test]
fn one_trace_has_no_interval() {
    let c = run(&[0.3], &[0.5], &[0.1]);
    let l = &c.levels[0];
    assert_eq!(l.ci, None);
    assert!((l.mean_diff + 0.2).abs() < 1e-12);
    assert_eq!(
        l.statement,
        "snapkv's error is lower than h2o's at 10% of the full cache on 1 of 1 trace; \
         difference -0.200; with one trace no interval can be computed."
    );
}

#[test]
fn sign_flip_p_values_by_hand() {
    use kvreplay_analysis::compare::sign_flip_p;
    // |sum| of ±1 ±1 ±1 ±1 reaches 4 only with all signs equal: 2 of 16
    assert_eq!(sign_flip_p(&[-1.0; 4], 1000, 0), Some(0.125));
    // ±2 ±1 ±3: |sum| >= 6 for the 2 same-sign patterns only: 2 of 8
    assert_eq!(sign_flip_p(&[-2.0, -1.0, -3.0], 1000, 0), Some(0.25));
    // 3 -1 -1 sums to 1; every pattern of ±3 ±1 ±1 has |sum| >= 1: all 8
    assert_eq!(sign_flip_p(&[3.0, -1.0, -1.0], 1000, 0), Some(1.0));
    // ±3 ±1 ±1 with observed 5: |sum| >= 5 for (3,1,1) and its negation: 2 of 8
    assert_eq!(sign_flip_p(&[3.0, 1.0, 1.0], 1000, 0), Some(0.25));
    // a tie: every pattern is as extreme as 0
    assert_eq!(sign_flip_p(&[0.0; 3], 1000, 0), Some(1.0));
    assert_eq!(sign_flip_p(&[0.5], 1000, 0), None);
    // beyond 20 values: Monte Carlo, (hits + 1) / (resamples + 1); 24 equal
    // signs are as extreme only in 2 of 2^24 patterns, so almost never drawn
    let p = sign_flip_p(&[-1.0; 24], 999, 3).unwrap();
    assert_eq!(p, 1.0 / 1000.0);
}

#[test]
fn bootstrap_known_distribution() {
    // resamples of {-1, 1}: mean -1 (1/4), 0 (1/2), 1 (1/4): the 95% interval is [-1, 1]
    assert_eq!(
        bootstrap_mean_ci(&[-1.0, 1.0], 0.95, 10_000, 7),
        Some([-1.0, 1.0])
    );
    // the 40% interval (quantiles 0.3, 0.7) is [0, 0]
    assert_eq!(
        bootstrap_mean_ci(&[-1.0, 1.0], 0.4, 10_000, 7),
        Some([0.0, 0.0])
    );
    assert_eq!(bootstrap_mean_ci(&[1.0], 0.95, 100, 0), None);
}

#[test]
fn same_inputs_and_seed_same_bytes() {
    let b = [0.5, 0.4, 0.6, 0.3, 0.45, 0.2];
    let a = [0.45, 0.42, 0.5, 0.31, 0.4, 0.1];
    let tmp = tempfile::tempdir().unwrap();
    let dir = sweep(tmp.path(), 6, &["snapkv", "h2o"], &two_methods(&a, &b));
    let json = |seed| {
        let o = Options { seed, ..opts(&[]) };
        serde_json::to_string(&compare(&dir, &o).unwrap()).unwrap()
    };
    assert_eq!(json(0), json(0));
    assert_ne!(json(0), json(1), "the seed drives the bootstrap");
    let text = compare(&dir, &opts(&[])).unwrap().to_text();
    assert_eq!(text, compare(&dir, &opts(&[])).unwrap().to_text());
}

#[test]
fn methods_by_short_name_or_spec_and_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let mut pts = two_methods(&[0.3, 0.2], &[0.5, 0.4]);
    pts.extend([(0, 2, 32, 0.1, 0.9), (0, 2, 64, 0.3, 0.8)]);
    let dir = sweep(tmp.path(), 2, &["snapkv", "h2o", "snapkv:w=8"], &pts);
    let o = |a: &str, b: &str| Options {
        a: a.into(),
        b: b.into(),
        memory: Some(vec![0.1]),
        ..Options::default()
    };
    // `snapkv` is a spec too: the default one, though two snapkv policies are swept
    let c = compare(&dir, &o("snapkv", "h2o")).unwrap();
    assert_eq!(c.a, spec("snapkv"));
    // a spec, with defaults filled in, picks one
    let c = compare(&dir, &o("snapkv:w=32", "h2o:recent=half")).unwrap();
    assert_eq!(
        (c.a.as_str(), c.b.as_str()),
        (spec("snapkv").as_str(), spec("h2o").as_str())
    );
    assert_eq!(c.a_label, spec("snapkv"));
    assert_eq!(c.b_label, "h2o");
    let e = compare(&dir, &o("tova", "h2o")).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("`tova` is not a policy of this sweep; its policies: "));
    // snapkv:w=8 has points on t0 only (as in a merge with a shard missing): t1 is skipped
    let c = compare(&dir, &o("snapkv:w=8", "h2o")).unwrap();
    assert_eq!(c.levels[0].traces.len(), 1);
    assert_eq!(c.skipped.len(), 1);
    assert!(c.skipped[0].starts_with("t1: no finished point of snapkv"));
    let e = compare(
        &dir,
        &Options {
            confidence: 1.0,
            ..o("h2o", "snapkv:w=8")
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("--confidence 1"), "{e}");
}

#[test]
fn a_short_name_of_several_non_default_policies_is_ambiguous() {
    let tmp = tempfile::tempdir().unwrap();
    let mut pts = two_methods(&[0.3], &[0.5]);
    pts.extend([(0, 2, 32, 0.1, 0.9), (0, 2, 64, 0.3, 0.8)]);
    let dir = sweep(tmp.path(), 1, &["snapkv:w=8", "h2o", "snapkv:w=16"], &pts);
    let e = compare(&dir, &opts(&[0.1])).unwrap_err();
    assert!(matches!(e, CompareError::Method(_)));
    assert_eq!(
        e.to_string(),
        format!(
            "`snapkv` names 2 policies of this sweep ({}, {}); give the full spec",
            spec("snapkv:w=8"),
            spec("snapkv:w=16")
        )
    );
    // a short name that one policy has picks it
    let o = Options {
        a: "h2o".into(),
        b: "snapkv:w=16".into(),
        ..opts(&[0.1])
    };
    let c = compare(&dir, &o).unwrap();
    assert_eq!(c.b_label, spec("snapkv:w=16"));
    assert!((c.levels[0].mean_diff + 0.4).abs() < 1e-12);
}

#[test]
fn no_common_memory_names_the_methods_and_traces() {
    // A measured at 10%-30%, B (a full cache) at 100% only
    let pts = [
        (0, 0, 32, 0.1, 0.4),
        (0, 0, 64, 0.3, 0.2),
        (0, 1, 32, 1.0, 0.0),
        (0, 1, 64, 1.0, 0.0),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let dir = sweep(tmp.path(), 1, &["snapkv", "full"], &pts);
    let o = Options {
        b: "full".into(),
        ..opts(&[])
    };
    let e = compare(&dir, &o).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "no memory share is measured for both {s} and full on every trace: full starts at \
             100% on t0, {s} ends at 30% on t0; sweep budgets that overlap in memory, or \
             compare other methods",
            s = spec("snapkv")
        )
    );
}

#[test]
fn per_layer_head_differences_interpolated_like_the_mean() {
    // 3 traces; head 0 favours A, head 1 favours B; points at 10% and 30%
    // (errors halve), compared at 20%: each error times 3/4
    let mut pts = Vec::new();
    let a = [[0.2, 0.6], [0.3, 0.5], [0.1, 0.7]];
    let b = [[0.4, 0.4], [0.4, 0.3], [0.3, 0.6]];
    for t in 0..3 {
        for (p, h) in [(0, a[t]), (1, b[t])] {
            let mean = (h[0] + h[1]) / 2.0;
            pts.push(((t, p, 32, 0.1, mean), h.to_vec()));
            pts.push(((t, p, 64, 0.3, mean / 2.0), vec![h[0] / 2.0, h[1] / 2.0]));
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = sweep_rows(tmp.path(), 3, &["snapkv", "h2o"], &pts);
    let c = compare(&dir, &opts(&[0.2])).unwrap();
    let l = &c.levels[0];
    assert_eq!(l.heads.len(), 2);
    let (h0, h1) = (&l.heads[0], &l.heads[1]);
    assert_eq!((h0.layer, h0.head, h1.layer, h1.head), (0, 0, 0, 1));
    // head 0: 0.75 * mean(-0.2, -0.1, -0.2); head 1: 0.75 * mean(0.2, 0.2, 0.1)
    assert!((h0.mean_diff + 0.125).abs() < 1e-12, "{}", h0.mean_diff);
    assert!((h1.mean_diff - 0.125).abs() < 1e-12, "{}", h1.mean_diff);
    assert_eq!((h0.a_lower, h1.a_lower), (3, 0));
    assert!(h0.ci.unwrap()[1] < 0.0 && h1.ci.unwrap()[0] > 0.0);
    // the heads' mean is the traces' mean difference (0 here)
    assert!(
        l.mean_diff.abs() < 1e-12
            && ((h0.mean_diff + h1.mean_diff) / 2.0 - l.mean_diff).abs() < 1e-12
    );
    assert!(c.to_text().contains(
        "per (layer, head): A's mean error is lower on 1 of 2 heads; the interval lies below 0 \
         on 1 and above 0 on 1 (each 95%, not adjusted for 2 comparisons)"
    ));
}
