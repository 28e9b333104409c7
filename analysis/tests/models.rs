//! `compare --models`: two models' sweeps ranked side by side, and the
//! memory share beyond sliding windows that rankings use on models such as
//! Gemma 3.

mod common;
use common::{synthetic_manifest, write_trace};
use kvreplay_analysis::models::compare_models;
use kvreplay_analysis::sweep::{compressible_share, run, Plan};
use kvreplay_traces::LayerAttention;
use std::path::{Path, PathBuf};

/// A synthetic trace whose manifest names `model`.
fn trace_of(dir: &Path, name: &str, seed: u64, model: &str) -> PathBuf {
    let t = write_trace(dir, name, seed, 40, 46);
    let path = t.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["model"]["name"] = serde_json::Value::String(model.into());
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    t
}

const POLICIES: [&str; 5] = ["h2o", "snapkv:w=4", "streaming_llm", "tova", "random"];

fn sweep(dir: &Path, out: &str, traces: &[PathBuf]) -> PathBuf {
    let policies: Vec<String> = POLICIES.iter().map(|s| s.to_string()).collect();
    let plan = Plan::new(traces, &policies, &[2, 4, 8, 16, 64]).unwrap();
    let out = dir.join(out);
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    out
}

/// The same data under two model names: each policy has the same error and
/// rank on both, so the rankings agree exactly (Spearman 1 over all five).
#[test]
fn identical_sweeps_of_two_models_agree_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (da, db) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let a = sweep(
        tmp.path(),
        "sweep-a",
        &[
            trace_of(&da, "x.kvtrace", 1, "Alpha"),
            trace_of(&da, "y.kvtrace", 2, "Alpha"),
        ],
    );
    let b = sweep(
        tmp.path(),
        "sweep-b",
        &[
            trace_of(&db, "x.kvtrace", 1, "Beta"),
            trace_of(&db, "y.kvtrace", 2, "Beta"),
        ],
    );
    let c = compare_models(&[a.clone(), b.clone()], &[0.2]).unwrap();
    assert_eq!(
        c.models
            .iter()
            .map(|m| m.model.as_str())
            .collect::<Vec<_>>(),
        ["Alpha", "Beta"]
    );
    assert_eq!(c.policies.len(), POLICIES.len());
    assert_eq!(c.agreement.len(), 1);
    let g = &c.agreement[0];
    assert_eq!(g.policies, POLICIES.len(), "{:?}", c.to_text());
    assert!((g.rho.unwrap() - 1.0).abs() < 1e-12, "{g:?}");
    let text = c.to_text();
    assert!(
        text.contains("Alpha vs Beta at 20%: Spearman 1.000 over 5 policies"),
        "{text}"
    );
    assert!(c.to_html().contains("<th>Beta</th>"));
    // a sweep over two models' traces is refused, naming both
    let mixed = sweep(
        tmp.path(),
        "sweep-mixed",
        &[da.join("x.kvtrace"), db.join("y.kvtrace")],
    );
    let e = compare_models(&[a, mixed], &[]).unwrap_err().to_string();
    assert!(e.contains("two models (Alpha") && e.contains("Beta"), "{e}");
    let e = compare_models(&[b], &[]).unwrap_err().to_string();
    assert!(e.contains("at least two"), "{e}");
}

/// Three layers, T = 100: windows of 16 and 200 hold 16 and 100 entries, the
/// full layer 100, so the windows hold 116 / 216 of the cache. A point at
/// memory share m then uses (m - 116/216) / (100/216) of the rest.
#[test]
fn window_share_and_the_compressible_share_by_hand() {
    let mut m = synthetic_manifest((3, 2, 1, 4), 90, 100, 0.5, vec![]);
    assert_eq!(m.window_share(), 0.0);
    assert_eq!(
        compressible_share(0.37, 0.0),
        0.37,
        "unchanged without windows"
    );
    m.model.layers = [Some(16), Some(200), None]
        .into_iter()
        .map(|window| LayerAttention {
            window,
            rope_theta: 10000.0,
        })
        .collect();
    let w = m.window_share();
    assert!((w - 116.0 / 216.0).abs() < 1e-15, "{w}");
    // the windows plus half of the full layer's 100 entries
    let half = (116.0 + 50.0) / 216.0;
    assert!((compressible_share(half, w) - 0.5).abs() < 1e-12);
    assert!((compressible_share(1.0, w) - 1.0).abs() < 1e-12);
}
