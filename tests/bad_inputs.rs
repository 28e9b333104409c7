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

/// The tiny trace swept (h2o, streaming_llm; budgets 4, 8) in one run into
/// `DIR/one` and as two shards merged into `DIR/merged`.
fn one_run_and_merged_shards(dir: &Path) -> (PathBuf, PathBuf) {
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
    let one = dir.join("one");
    sweep(&one, None);
    let (s0, s1) = (dir.join("s0"), dir.join("s1"));
    sweep(&s0, Some("0/2"));
    sweep(&s1, Some("1/2"));
    let merged = dir.join("merged");
    let x = kvreplay(&[
        "merge",
        s0.to_str().unwrap(),
        s1.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(x.status.success(), "{}", text(&x));
    (one, merged)
}

#[test]
fn merge_writes_the_report_a_single_run_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, merged) = one_run_and_merged_shards(tmp.path());
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

#[test]
fn compare_reads_a_sweep_and_its_merged_shards_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, merged) = one_run_and_merged_shards(tmp.path());
    let compare = |dir: &Path, threads: &str, json: &Path| {
        let x = kvreplay(&[
            "--threads",
            threads,
            "compare",
            dir.to_str().unwrap(),
            "--a",
            "h2o",
            "--b",
            "streaming_llm",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(x.status.success(), "{}", text(&x));
        (
            String::from_utf8(x.stdout).unwrap(),
            std::fs::read(json).unwrap(),
        )
    };
    let (j1, j2) = (tmp.path().join("1.json"), tmp.path().join("2.json"));
    let (out, json) = compare(&one, "1", &j1);
    assert_eq!((out.clone(), json), compare(&merged, "2", &j2));
    assert!(
        out.contains("h2o's error is lower than streaming_llm's at ")
            && out.contains("with one trace no interval can be computed."),
        "{out}"
    );
    // a memory share outside the measured range is refused, naming the trace
    let x = kvreplay(&[
        "compare",
        one.to_str().unwrap(),
        "--a",
        "h2o",
        "--b",
        "streaming_llm",
        "--memory",
        "0.0001",
    ]);
    assert!(!x.status.success());
    assert!(
        text(&x).contains("0.01% of the full cache is outside what h2o")
            && text(&x).contains("on tiny.kvtrace ("),
        "{}",
        text(&x)
    );
}

/// `kvreplay sweep --shard auto` in a given Slurm environment (none of the
/// caller's SLURM_* variables leak in).
fn sweep_auto(out: &Path, shard: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_kvreplay"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SLURM_") {
            c.env_remove(k);
        }
    }
    c.args([
        "sweep",
        "--traces",
        tiny().to_str().unwrap(),
        "--policy",
        "h2o",
        "streaming_llm",
        "--budget",
        "4,8",
        "--shard",
        shard,
        "--out",
        out.to_str().unwrap(),
    ])
    .envs(env.iter().copied())
    .output()
    .expect("kvreplay runs")
}

#[test]
fn shard_auto_reads_the_slurm_array_and_says_which_shard_it_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("s");
    let x = sweep_auto(&out, "auto", &[]);
    assert!(!x.status.success());
    assert!(
        text(&x).contains("SLURM_ARRAY_TASK_ID is not set"),
        "{}",
        text(&x)
    );
    let array = [
        ("SLURM_ARRAY_TASK_ID", "1"),
        ("SLURM_ARRAY_TASK_COUNT", "2"),
        ("SLURM_ARRAY_TASK_MIN", "0"),
        ("SLURM_ARRAY_TASK_MAX", "1"),
    ];
    let x = sweep_auto(&out, "auto", &array);
    assert!(x.status.success(), "{}", text(&x));
    assert!(
        text(&x)
            .contains("running shard 1/2 (from SLURM_ARRAY_TASK_ID=1, SLURM_ARRAY_TASK_COUNT=2)"),
        "{}",
        text(&x)
    );
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("shard-1-of-2.json")).unwrap()).unwrap();
    assert_eq!(rec["shard"]["index"], 1);
    assert_eq!(rec["shard"]["count"], 2);
    // a resubmission of shard 1 alone is an array of one task: its size is not
    // the number of shards, so `auto` refuses and `auto/N` runs
    let rerun = [
        ("SLURM_ARRAY_TASK_ID", "1"),
        ("SLURM_ARRAY_TASK_COUNT", "1"),
        ("SLURM_ARRAY_TASK_MIN", "1"),
        ("SLURM_ARRAY_TASK_MAX", "1"),
    ];
    let x = sweep_auto(&out, "auto", &rerun);
    assert!(!x.status.success());
    assert!(text(&x).contains("--shard auto/N"), "{}", text(&x));
    let x = sweep_auto(&out, "auto/2", &rerun);
    assert!(x.status.success(), "{}", text(&x));
    assert!(text(&x).contains("running shard 1/2"), "{}", text(&x));
    let x = sweep_auto(&out, "auto/1", &rerun);
    assert!(!x.status.success());
    assert!(
        text(&x).contains("SLURM_ARRAY_TASK_ID=1 is not a shard of 1"),
        "{}",
        text(&x)
    );
}

#[test]
fn merge_names_the_missing_shard_and_how_to_rerun_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |i: usize| tmp.path().join("shards").join(i.to_string());
    let env = |i: &'static str| {
        [
            ("SLURM_ARRAY_TASK_ID", i),
            ("SLURM_ARRAY_TASK_COUNT", "2"),
            ("KVREPLAY_RESUBMIT", "/jobs/submit.sh"),
        ]
    };
    let x = sweep_auto(&dir(0), "auto", &env("0"));
    assert!(x.status.success(), "{}", text(&x));
    let merged = tmp.path().join("merged");
    let merge = || {
        let mut a = vec!["merge".to_string()];
        for i in 0..2 {
            if dir(i).exists() {
                a.push(dir(i).to_string_lossy().into_owned());
            }
        }
        a.extend(["--out".into(), merged.to_string_lossy().into_owned()]);
        kvreplay(&a.iter().map(|s| s.as_str()).collect::<Vec<_>>())
    };
    let x = merge();
    assert!(!x.status.success(), "an incomplete merge fails");
    let t = text(&x);
    assert!(t.contains("shard 1/2: no folder of it was given"), "{t}");
    assert!(t.contains("/jobs/submit.sh 1"), "{t}");
    assert!(
        t.contains(&format!("--shard 1/2 --out {}", dir(1).display())),
        "{t}"
    );
    assert!(!merged.join("report.html").exists());
    let x = sweep_auto(&dir(1), "auto", &env("1"));
    assert!(x.status.success(), "{}", text(&x));
    let x = merge();
    assert!(x.status.success(), "{}", text(&x));
    assert!(merged.join("report.html").exists());
}
