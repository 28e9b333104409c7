//! Sweeps on small synthetic traces: resumption and sharding reproduce the
//! uninterrupted run byte for byte; bad plans fail before any work.

use kvreplay_analysis::sweep::{merge, run, Plan, Shard};
use kvreplay_traces::*;
use std::path::{Path, PathBuf};

/// A random 2-layer trace (4 query heads, 2 KV heads, d = 8) with a needle span.
fn write_trace(dir: &Path, name: &str, seed: u64, p: usize, t: usize) -> PathBuf {
    write_trace_scaled(dir, name, seed, p, t, 1.0)
}

fn write_trace_scaled(
    dir: &Path,
    name: &str,
    seed: u64,
    p: usize,
    t: usize,
    key_scale: f32,
) -> PathBuf {
    let layout = TraceLayout {
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        total_len: t,
        prompt_len: p,
        dtype: Dtype::F32,
        attn_probs: false,
    };
    let out = dir.join(name);
    let mut w = TraceWriter::create(&out, layout, false).unwrap();
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
    };
    for l in 0..2 {
        let lw = w.layer(l);
        for h in 0..4 {
            let q: Vec<f32> = (0..t * 8).map(|_| rnd()).collect();
            lw.write_rows(TensorKind::Q, h, 0, &q);
            lw.write_rows(TensorKind::O, h, 0, &q);
            lw.write_colsum(
                h,
                &(0..p)
                    .map(|i| 1.0 / (i + 1) as f32 + rnd().abs())
                    .collect::<Vec<_>>(),
            );
        }
        for g in 0..2 {
            let k: Vec<f32> = (0..t * 8).map(|_| key_scale * rnd()).collect();
            let v: Vec<f32> = (0..t * 8).map(|_| rnd()).collect();
            lw.write_rows(TensorKind::K, g, 0, &k);
            lw.write_rows(TensorKind::V, g, 0, &v);
        }
    }
    let m = Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        model: ModelInfo {
            architecture: "llama".into(),
            name: None,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            d_model: 32,
            ffn_dim: 0,
            vocab_size: 0,
            context_length: t,
            norm_eps: 1e-5,
            attn_scale: 1.0 / 8f64.sqrt(),
            rope: Rope {
                theta: 10000.0,
                style: RopeStyle::Neox,
                rotated_dims: 8,
                scaling: RopeScaling::None,
            },
            source: SourceFile {
                file_name: "synthetic".into(),
                sha256: String::new(),
                size: 0,
            },
        },
        tokens: Tokens {
            ids: vec![0; t],
            prompt_len: p,
            text: vec![String::new(); t],
        },
        generation: Generation {
            method: "greedy".into(),
            n_decode: t - p,
        },
        spans: vec![Span {
            name: "needle".into(),
            start: p / 2,
            end: p / 2 + 4,
        }],
        capture: CaptureInfo {
            device: "cpu".into(),
            dtype: Dtype::F32,
            compute_dtype: "f32".into(),
            prefill_chunk: 1,
            threads: 1,
            attn_probs: false,
            chat_template: false,
            prompt_source: "test".into(),
            kvreplay_version: "test".into(),
            created: "2026-01-01T00:00:00Z".into(),
        },
        files: vec![],
    };
    w.finish(m).unwrap()
}

fn plan(dir: &Path) -> Plan {
    let traces = vec![
        write_trace(dir, "a.kvtrace", 1, 40, 46),
        write_trace(dir, "b.kvtrace", 2, 30, 34),
    ];
    Plan::new(
        &traces,
        &["h2o".into(), "snapkv:w=4".into(), "full".into()],
        &[8, 4, 64],
    )
    .unwrap()
}

fn files(out: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        std::fs::read(out.join("results.csv")).unwrap(),
        std::fs::read(out.join("summary.csv")).unwrap(),
    )
}

#[test]
fn resumed_and_sharded_sweeps_equal_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path());
    assert_eq!(plan.budgets, vec![4, 8, 64], "budgets are sorted");
    let one = tmp.path().join("one");
    let r = run(&plan, &one, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.points, r.ran, r.reused, r.complete), (18, 18, 0, true));
    let full = files(&one);
    let summary = String::from_utf8(full.1.clone()).unwrap();
    assert!(summary.starts_with("trace,policy,budget,rel_l2_mean,rel_l2_p95,cosine_mean,attn_mass_mean,kl_mean,bytes,memory_ratio,needle_retention,policy_spec\n"));
    assert_eq!(summary.lines().count(), 1 + 18);
    // full keeps every needle position; h2o at B = 4 cannot keep all 4 plus its window
    assert!(summary.contains("a.kvtrace,full,4,0.0,0.0,"));
    let results = String::from_utf8(full.0.clone()).unwrap();
    assert_eq!(
        results.lines().count(),
        1 + 18 * 2 * 4,
        "one row per point, layer and query head"
    );

    // An interrupted run: some point files never written. Rerunning finishes them.
    let resumed = tmp.path().join("resumed");
    run(&plan, &resumed, None, &mut |_, _, _| {}).unwrap();
    let mut gone = 0;
    for (i, e) in std::fs::read_dir(resumed.join("points"))
        .unwrap()
        .enumerate()
    {
        if i % 3 == 0 {
            std::fs::remove_file(e.unwrap().path()).unwrap();
            gone += 1;
        }
    }
    std::fs::remove_file(resumed.join("results.csv")).unwrap();
    let r = run(&plan, &resumed, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.ran, r.reused), (gone, 18 - gone));
    assert_eq!(files(&resumed), full);

    // Three shards, merged.
    let shards: Vec<PathBuf> = (0..3)
        .map(|i| {
            let d = tmp.path().join(format!("shard{i}"));
            let r = run(
                &plan,
                &d,
                Some(Shard { index: i, count: 3 }),
                &mut |_, _, _| {},
            )
            .unwrap();
            assert_eq!((r.points, r.complete), (6, false));
            d
        })
        .collect();
    let merged = tmp.path().join("merged");
    assert!(merge(&shards, &merged).unwrap());
    assert_eq!(files(&merged), full);

    // The plots and the report are the same however the sweep was split.
    kvreplay_analysis::report::write(&one, &plan).unwrap();
    kvreplay_analysis::report::write(&merged, &plan).unwrap();
    for f in [
        "error_vs_budget.svg",
        "error_vs_memory.svg",
        "retention_by_position.svg",
        "layer_error_heatmap.svg",
        "needle_retention.svg",
        "report.html",
    ] {
        let (x, y) = (
            std::fs::read(one.join(f)).unwrap(),
            std::fs::read(merged.join(f)).unwrap(),
        );
        assert_eq!(x, y, "{f}");
        assert!(!x.is_empty());
    }
    let html = std::fs::read_to_string(one.join("report.html")).unwrap();
    assert!(
        html.contains("<svg")
            && html.contains("Provenance")
            && html.contains("<td>snapkv</td><td>8</td>"),
        "report content"
    );
    assert!(
        std::fs::read_to_string(one.join("error_vs_budget.svg"))
            .unwrap()
            .contains("h2o"),
        "legend names the policies"
    );
}

#[test]
fn bad_plans_fail_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 40, 46);
    let e = Plan::new(std::slice::from_ref(&a), &["snap".into()], &[4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown policy `snap`"), "{e}");
    let e = Plan::new(std::slice::from_ref(&a), &["h2o:window=3".into()], &[4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown parameter `window`"), "{e}");
    let e = Plan::new(std::slice::from_ref(&a), &["h2o".into()], &[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 1"), "{e}");
    let e = Plan::new(&[tmp.path().join("nope")], &["h2o".into()], &[4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope"), "{e}");
    // A folder holding another sweep is not silently mixed with this one.
    let out = tmp.path().join("out");
    run(
        &Plan::new(std::slice::from_ref(&a), &["h2o".into()], &[4]).unwrap(),
        &out,
        None,
        &mut |_, _, _| {},
    )
    .unwrap();
    let e = run(
        &Plan::new(&[a], &["h2o".into()], &[8]).unwrap(),
        &out,
        None,
        &mut |_, _, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("holds a different sweep"), "{e}");
    let e = "3/3".parse::<Shard>().unwrap_err();
    assert!(e.contains("i/n"), "{e}");
}

/// Regression: merged keys can put an entry's logit hundreds below the
/// maximum; its weight must not underflow to a zero probability (an infinite
/// KL, written as null, made the sweep's point file unreadable).
#[test]
fn extreme_logits_keep_every_metric_finite() {
    let tmp = tempfile::tempdir().unwrap();
    let t = write_trace_scaled(tmp.path(), "big.kvtrace", 3, 40, 46, 60.0);
    let plan = Plan::new(
        &[t],
        &[
            "minicache:start=0".into(),
            "kvmerger".into(),
            "d2o".into(),
            "ems:merge_space=post_rope".into(),
        ],
        &[8, 16],
    )
    .unwrap();
    let out = tmp.path().join("out");
    assert!(run(&plan, &out, None, &mut |_, _, _| {}).unwrap().complete);
    let results = std::fs::read_to_string(out.join("results.csv")).unwrap();
    for line in results.lines().skip(1) {
        for field in line.split(',').skip(5) {
            let x: f64 = field
                .parse()
                .unwrap_or_else(|_| panic!("not a number in {line}"));
            assert!(x.is_finite(), "{line}");
        }
    }
}

#[test]
fn equivalent_specs_are_planned_once() {
    // `h2o` and `h2o:recent=half` are the same policy; they once gave
    // duplicate rows in results.csv and summary.csv
    let tmp = tempfile::tempdir().unwrap();
    let t = write_trace(tmp.path(), "a.kvtrace", 1, 12, 14);
    let specs: Vec<String> = ["h2o", "h2o:recent=half", "snapkv", "h2o:decode_evict=true"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let plan = Plan::new(&[t], &specs, &[4]).unwrap();
    assert_eq!(plan.policies.len(), 2, "{:?}", plan.policies);
    assert!(plan.policies[0].starts_with("h2o:") && plan.policies[1].starts_with("snapkv:"));
}

#[test]
fn claims_on_a_too_short_prompt_say_so() {
    // a one-token prompt once panicked inside the MiniCache claims
    let tmp = tempfile::tempdir().unwrap();
    let t = Trace::open(write_trace(tmp.path(), "one.kvtrace", 3, 1, 4)).unwrap();
    let e = kvreplay_analysis::claims::measure(&t)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("1-token prompt") && e.contains("at least 64"),
        "{e}"
    );
    // at the minimum every claim is measured without a panic
    let t = Trace::open(write_trace(tmp.path(), "min.kvtrace", 3, 64, 70)).unwrap();
    let claims = kvreplay_analysis::claims::measure(&t).unwrap();
    assert!(claims.len() > 40, "{} claims", claims.len());
}
