//! Lean traces on the real model: a 4,096-token SmolLM2 prompt captured with
//! `--keep full` and with `--keep lean` (q and o for the last 128 prompt
//! positions and the decode steps). The lean trace is at least 3x smaller;
//! every registered policy whose declared reads it holds gives byte-identical
//! metrics and retention; every other one is refused before any work with an
//! error naming the policy and the capture flag that helps.

use kvreplay_replay::{check_reads, Budget, PolicySpec, TraceReplay, REGISTRY};
use kvreplay_traces::Trace;

mod common;
use common::{kvreplay, text};

#[test]
fn lean_trace_is_3x_smaller_and_replays_every_policy_it_can_identically() {
    let Some(model) = common::model() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (full, lean) = (
        tmp.path().join("full.kvtrace"),
        tmp.path().join("lean.kvtrace"),
    );
    for (out, keep) in [(&full, "full"), (&lean, "lean")] {
        let o = kvreplay(&[
            "capture",
            "--model",
            model.to_str().unwrap(),
            "--task",
            "passkey:length=4096,depth=0.5",
            "--chat",
            "--decode",
            "4",
            "--keep",
            keep,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            o.status.success(),
            "capture --keep {keep} failed:\n{}",
            text(&o)
        );
    }
    let (fb, lb) = (common::dir_bytes(&full), common::dir_bytes(&lean));
    println!(
        "4,096-token trace: full {fb} B, lean {lb} B ({:.2}x smaller)",
        fb as f64 / lb as f64
    );
    assert!(
        fb >= 3 * lb,
        "lean {lb} B is not 3x smaller than full {fb} B"
    );

    let (tf, tl) = (Trace::open(&full).unwrap(), Trace::open(&lean).unwrap());
    assert_eq!(
        tf.manifest.tokens, tl.manifest.tokens,
        "same prompt and continuation"
    );
    let (rf, rl) = (
        TraceReplay::new(&tf, &Default::default()).unwrap(),
        TraceReplay::new(&tl, &Default::default()).unwrap(),
    );
    let budget = Budget::Entries(256);
    let (mut same, mut refused) = (Vec::new(), Vec::new());
    // every registered policy under its defaults, and ones that read every row
    let specs: Vec<String> = REGISTRY
        .iter()
        .map(|p| p.name.to_string())
        .chain([
            "ahakv:use_ra=false".into(),
            "kvmerger:pivot=within_set".into(),
        ])
        .collect();
    for spec in &specs {
        let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
        let a = rf.replay(policy.as_ref(), budget).unwrap();
        match check_reads(&tl, policy.as_ref(), budget) {
            Ok(()) => {
                let b = rl.replay(policy.as_ref(), budget).unwrap();
                for (la, lb) in a.layers.iter().zip(&b.layers) {
                    assert_eq!(la.metrics, lb.metrics, "{spec}: metrics differ");
                    assert_eq!(la.retained, lb.retained, "{spec}: retention differs");
                    assert_eq!(la.bytes, lb.bytes, "{spec}: bytes differ");
                }
                same.push(spec.clone());
            }
            Err(e) => {
                let e = e.to_string();
                let name = spec.split(':').next().unwrap();
                assert!(
                    e.contains(&format!("policy `{name}`")) && e.contains("--keep-queries"),
                    "{spec}: {e}"
                );
                // refused by the replay itself too, not only by the check
                let r = rl
                    .replay(policy.as_ref(), budget)
                    .err()
                    .unwrap()
                    .to_string();
                assert_eq!(r, e);
                refused.push(spec.clone());
            }
        }
    }
    println!("identical on the lean trace: {same:?}");
    println!("refused on the lean trace: {refused:?}");
    // the policies that read every prompt query, and only they, are refused
    // (`mikv`: its key-channel balancer takes max |q| over every prompt query;
    // `chunk`: its scorer reads the last rows of every prompt chunk;
    // expected_attention's query statistics and compactor's non-causal
    // attention use every prompt query, as kvpress's presses do)
    assert_eq!(
        refused,
        [
            "mikv",
            "chunk",
            "expected_attention",
            "compactor",
            "ahakv:use_ra=false",
            "kvmerger:pivot=within_set"
        ]
    );
    assert_eq!(same.len(), REGISTRY.len() - 4);

    // the CLI says so before any work
    let o = kvreplay(&[
        "replay",
        "--trace",
        lean.to_str().unwrap(),
        "--policy",
        "snapkv:w=200",
        "--budget",
        "256",
        "--out",
        tmp.path().join("r").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("holding the queries of the last 128 prompt positions"),
        "{t}"
    );
    assert!(t.contains("--keep-queries 200"), "{t}");
    assert!(
        !tmp.path().join("r").exists(),
        "nothing written for a refused replay"
    );
    // and a sweep refuses when it is planned, before any point runs
    let sw = tmp.path().join("sw");
    let o = kvreplay(&[
        "sweep",
        "--traces",
        lean.to_str().unwrap(),
        "--policy",
        "h2o",
        "--policy",
        "ahakv:use_ra=false",
        "--budget",
        "64,256",
        "--out",
        sw.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("policy ahakv") && t.contains("--keep-queries"),
        "{t}"
    );
    assert!(!sw.join("points").exists(), "no point computed: {t}");
}
