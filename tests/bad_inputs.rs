//! Regressions from trying kvreplay as a new user and as a hostile input
//! would (issue 13), at the command line, on the small committed trace.

mod common;

use common::{kvreplay, text, ROOT};
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    Path::new(ROOT).join("replay/tests/golden/tiny.kvtrace")
}

/// A copy of the tiny trace under `dir` (tests damage their own copy).
fn tiny_copy(dir: &Path) -> PathBuf {
    let to = dir.join("tiny.kvtrace");
    std::fs::create_dir(&to).unwrap();
    for e in std::fs::read_dir(tiny()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

#[test]
fn replay_refuses_an_existing_out_without_force_and_replaces_it_with_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    let (t, o) = (tiny(), out.to_str().unwrap().to_string());
    let args = |b: &'static str| {
        vec![
            "replay".to_string(),
            "--trace".into(),
            t.to_str().unwrap().into(),
            "--policy".into(),
            "h2o".into(),
            "--budget".into(),
            b.into(),
            "--out".into(),
            o.clone(),
        ]
    };
    let run = |a: Vec<String>| kvreplay(&a.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(run(args("4")).status.success());
    let before = std::fs::read(out.join("summary.json")).unwrap();
    let x = run(args("8"));
    assert!(!x.status.success(), "{}", text(&x));
    assert!(
        text(&x).contains("already exists; pass --force"),
        "{}",
        text(&x)
    );
    assert_eq!(std::fs::read(out.join("summary.json")).unwrap(), before);
    let mut forced = args("8");
    forced.push("--force".into());
    let x = run(forced);
    assert!(x.status.success(), "{}", text(&x));
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["budget"], 8);
    assert_eq!(s["trace"]["verified"], true);
}

#[test]
fn replay_refuses_a_damaged_trace_unless_told_not_to_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tiny_copy(tmp.path());
    let f = t.join("layer-002.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 7] ^= 0x02;
    std::fs::write(&f, b).unwrap();
    let out = tmp.path().join("r");
    let base = [
        "replay",
        "--trace",
        t.to_str().unwrap(),
        "--policy",
        "snapkv",
        "--budget",
        "4",
        "--out",
        out.to_str().unwrap(),
    ];
    let x = kvreplay(&base);
    assert!(!x.status.success());
    assert!(
        text(&x).contains("layer-002.safetensors") && text(&x).contains("sha256"),
        "{}",
        text(&x)
    );
    assert!(!out.exists());
    let mut v = base.to_vec();
    v.push("--no-verify");
    let x = kvreplay(&v);
    assert!(x.status.success(), "{}", text(&x));
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["trace"]["verified"], false, "recorded in the output");
}

#[test]
fn merge_writes_the_report_a_single_run_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tiny();
    let sweep = |out: &Path, shard: Option<&str>| {
        let mut a = vec![
            "sweep",
            "--traces",
            t.to_str().unwrap(),
            "--policy",
            "h2o",
            "streaming_llm",
            "--budget",
            "4,8",
            "--out",
            out.to_str().unwrap(),
        ];
        if let Some(s) = shard {
            a.extend(["--shard", s]);
        }
        let x = kvreplay(&a);
        assert!(x.status.success(), "{}", text(&x));
    };
    let one = tmp.path().join("one");
    sweep(&one, None);
    let (s0, s1) = (tmp.path().join("s0"), tmp.path().join("s1"));
    sweep(&s0, Some("0/2"));
    sweep(&s1, Some("1/2"));
    let merged = tmp.path().join("merged");
    let x = kvreplay(&[
        "merge",
        s0.to_str().unwrap(),
        s1.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(x.status.success(), "{}", text(&x));
    for f in [
        "results.csv",
        "summary.csv",
        "report.html",
        "error_vs_budget.svg",
        "layer_error_heatmap.svg",
    ] {
        assert_eq!(
            std::fs::read(one.join(f)).unwrap(),
            std::fs::read(merged.join(f)).unwrap_or_default(),
            "{f}"
        );
    }
}
