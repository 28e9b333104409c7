//! `kvreplay policies` and `kvreplay replay` argument errors (no model needed).

mod common;

use common::{kvreplay, text};

#[test]
fn policies_lists_every_registered_policy_with_its_paper_and_parameters() {
    let o = kvreplay(&["policies"]);
    let s = text(&o);
    assert!(o.status.success());
    for info in kvreplay_replay::REGISTRY {
        assert!(
            s.contains(&format!("\n{}", info.name)) || s.starts_with(info.name),
            "{} missing",
            info.name
        );
        assert!(s.contains(info.paper), "{}: paper missing", info.name);
        for p in info.params {
            assert!(
                s.contains(p.help),
                "{}: parameter {} missing",
                info.name,
                p.name
            );
        }
    }
}

#[test]
fn replay_argument_errors_are_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o_s = out.to_str().unwrap();
    let t = tmp.path().to_str().unwrap();
    let cases: [(&[&str], &str); 7] = [
        (
            &["--policy", "snap", "--budget", "4"],
            "unknown policy `snap`",
        ),
        (
            &["--policy", "snapkv:window=3", "--budget", "4"],
            "unknown parameter `window` (valid: w, k, pool, group_mean, preset)",
        ),
        (
            &["--policy", "snapkv:w=x", "--budget", "4"],
            "expected a non-negative integer",
        ),
        (&["--policy", "h2o", "--budget", "-3"], "-3 keeps no entry"),
        (&["--policy", "h2o", "--budget", "0"], "0 keeps no entry"),
        (&["--policy", "h2o", "--ratio", "2"], "must lie in (0, 1]"),
        (
            &["--policy", "h2o", "--budget", "4"],
            "not a trace directory (no manifest.json)",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["replay", "--trace", t, "--out", o_s];
        args.extend_from_slice(extra);
        let o = kvreplay(&args);
        assert!(
            !o.status.success() && text(&o).contains(want),
            "{extra:?}: {}",
            text(&o)
        );
        assert!(!out.exists(), "{extra:?} wrote output");
    }
}

#[test]
fn bad_sweeps_fail_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o_s = out.to_str().unwrap();
    let file = tmp.path().join("sweep.toml");
    std::fs::write(
        &file,
        "traces = [\"x\"]\npolices = [\"h2o\"]\nbudgets = [4]\n",
    )
    .unwrap();
    let o = kvreplay(&["sweep", "--file", file.to_str().unwrap(), "--out", o_s]);
    assert!(
        !o.status.success() && text(&o).contains("sweep.toml") && text(&o).contains("polices"),
        "{}",
        text(&o)
    );
    let o = kvreplay(&[
        "sweep",
        "--traces",
        tmp.path().to_str().unwrap(),
        "--policy",
        "h2o",
        "--budget",
        "4",
        "--out",
        o_s,
    ]);
    assert!(
        !o.status.success() && text(&o).contains("neither a trace nor a folder of traces"),
        "{}",
        text(&o)
    );
    assert!(!out.exists(), "nothing written");
}
