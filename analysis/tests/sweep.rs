//! Sweeps on small synthetic traces: resumption and sharding reproduce the
//! uninterrupted run byte for byte; bad plans fail before any work.

mod common;
use common::{write_trace, write_trace_scaled};
use kvreplay_analysis::cost::TraceShape;
use kvreplay_analysis::sweep::{merge, run, Plan, Shard};
use kvreplay_traces::*;
use std::path::{Path, PathBuf};

/// A random 2-layer trace (4 query heads, 2 KV heads, d = 8) with a needle span.
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
    assert!(summary.starts_with("trace,policy,budget,rel_l2_mean,rel_l2_p95,cosine_mean,attn_mass_mean,kl_mean,bytes,memory_ratio,needle_retention,predicted_kl,policy_spec\n"));
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
    let mut sizes = Vec::new();
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
            assert!(!r.complete);
            sizes.push(r.points);
            d
        })
        .collect();
    assert_eq!(sizes.iter().sum::<usize>(), 18, "{sizes:?}");
    assert!(sizes.iter().all(|&n| n > 0), "{sizes:?}");
    let merged = tmp.path().join("merged");
    let r = merge(&shards, &merged).unwrap();
    assert!(r.complete && r.missing == 0 && r.points == 18);
    assert_eq!(r.shards.len(), 3);
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
    let e = Plan::new(std::slice::from_ref(&a), &["h2o:window=3".into()], &[4]).unwrap_err();
    // the message once, as the error and its causes print it together
    // (regression: the CLI printed "...`window` (valid: ...): policy `h2o`: unknown ...")
    let chain: Vec<String> =
        std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
            .map(|e| e.to_string())
            .collect();
    let e = chain.join(": ");
    assert_eq!(e.matches("unknown parameter `window`").count(), 1, "{e}");
    let e = Plan::new(std::slice::from_ref(&a), &["h2o".into()], &[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 1"), "{e}");
    let e = Plan::new(&[tmp.path().join("nope")], &["h2o".into()], &[4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope"), "{e}");
    // A folder holding a sweep of other traces is not silently mixed with this one.
    let out = tmp.path().join("out");
    run(
        &Plan::new(std::slice::from_ref(&a), &["h2o".into()], &[4]).unwrap(),
        &out,
        None,
        &mut |_, _, _| {},
    )
    .unwrap();
    let b = write_trace(tmp.path(), "b.kvtrace", 2, 30, 34);
    let e = run(
        &Plan::new(&[a, b], &["h2o".into()], &[4]).unwrap(),
        &out,
        None,
        &mut |_, _, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("holds a sweep of other traces"), "{e}");
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
    assert_eq!(claims.len(), 40, "{} claims", claims.len());
    // a NaN only where too few layers leave nothing to compare (2 layers here)
    let nan: Vec<_> = claims
        .iter()
        .filter(|c| {
            c.measured.contains("NaN")
                && c.verdict != kvreplay_analysis::claims::Verdict::NotCheckable
        })
        .map(|c| format!("{}: {}", c.id, c.measured))
        .collect();
    assert!(nan.is_empty(), "{nan:#?}");
}

#[test]
fn a_recaptured_trace_invalidates_its_points_and_only_those() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 40, 46);
    let b = write_trace(tmp.path(), "b.kvtrace", 2, 30, 34);
    let specs = ["h2o".to_string(), "snapkv:w=4".to_string()];
    let out = tmp.path().join("out");
    let plan = Plan::new(&[a.clone(), b.clone()], &specs, &[4, 8]).unwrap();
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    let old = files(&out);
    // `capture --force` into the same path: other content, same folder name
    std::fs::remove_dir_all(&a).unwrap();
    write_trace(tmp.path(), "a.kvtrace", 7, 40, 46);
    let plan = Plan::new(&[a.clone(), b.clone()], &specs, &[4, 8]).unwrap();
    let r = run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.ran, r.reused), (4, 4), "a's 4 points redone, b's kept");
    assert_eq!(r.notices.len(), 1, "{:?}", r.notices);
    assert!(
        r.notices[0].contains("a.kvtrace")
            && r.notices[0].contains("4 of its finished points invalidated"),
        "{}",
        r.notices[0]
    );
    assert_ne!(files(&out), old, "the stale numbers are gone");
    // the same as a sweep that never saw the old capture
    let fresh = tmp.path().join("fresh");
    run(&plan, &fresh, None, &mut |_, _, _| {}).unwrap();
    assert_eq!(files(&out), files(&fresh));
    assert_eq!(
        std::fs::read_dir(out.join("points")).unwrap().count(),
        8,
        "no stale point file is left behind"
    );
}

#[test]
fn more_policies_or_budgets_on_the_same_traces_reuse_the_finished_points() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 40, 46);
    let b = write_trace(tmp.path(), "b.kvtrace", 2, 30, 34);
    let traces = [a, b];
    let out = tmp.path().join("out");
    let small = Plan::new(&traces, &["h2o".into()], &[4, 8]).unwrap();
    run(&small, &out, None, &mut |_, _, _| {}).unwrap();
    // two more policies and one more budget: only the new points run
    let specs = [
        "snapkv:w=4".to_string(),
        "h2o".to_string(),
        "tova".to_string(),
    ];
    let grown = Plan::new(&traces, &specs, &[4, 8, 16]).unwrap();
    let r = run(&grown, &out, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.points, r.ran, r.reused), (18, 14, 4));
    assert_eq!(r.notices.len(), 1, "{:?}", r.notices);
    assert!(
        r.notices[0].contains("4 points before, 18 now, 4 in both"),
        "{}",
        r.notices[0]
    );
    // the CSVs are those of the grown plan run in one go
    let fresh = tmp.path().join("fresh");
    run(&grown, &fresh, None, &mut |_, _, _| {}).unwrap();
    assert_eq!(files(&out), files(&fresh));
    // and back to the small plan: nothing to run, its CSVs again
    let r = run(&small, &out, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.ran, r.reused), (0, 4));
    let only = tmp.path().join("only");
    run(&small, &only, None, &mut |_, _, _| {}).unwrap();
    assert_eq!(files(&out), files(&only));
}

#[test]
fn a_trace_named_by_another_path_resumes_the_same_sweep() {
    // `--traces ./x` once, `--traces /abs/x` next: the same trace
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 20, 24);
    let out = tmp.path().join("out");
    let plan = Plan::new(std::slice::from_ref(&a), &["h2o".into()], &[4]).unwrap();
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    std::fs::create_dir(tmp.path().join("sub")).unwrap();
    let other = tmp.path().join("sub").join("..").join("a.kvtrace");
    let plan = Plan::new(&[other], &["h2o".into()], &[4]).unwrap();
    let r = run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.ran, r.reused), (0, 1));
}

#[test]
fn a_non_finite_point_is_recorded_as_failed_and_the_sweep_completes() {
    // once: its result was saved with `null`, assembly refused it, and the
    // rerun wrote the same file, so no CSV was ever written
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 40, 46);
    let bad = "kvmerger:sigma=fixed,sigma0=1e-300".to_string();
    let plan = Plan::new(&[a], &["h2o".into(), bad], &[4, 8]).unwrap();
    let out = tmp.path().join("out");
    let r = run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    assert!(r.complete);
    assert_eq!(r.failed.len(), 2);
    assert!(r.failed[0].reason.contains("NaN"), "{}", r.failed[0].reason);
    let summary = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    assert_eq!(summary.lines().count(), 1 + 2, "the h2o points");
    let failed = std::fs::read_to_string(out.join("failed.csv")).unwrap();
    assert!(failed.starts_with("trace,policy,budget,policy_spec,reason\n"));
    assert_eq!(failed.lines().count(), 1 + 2);
    assert!(failed.contains("a.kvtrace,kvmerger,4,"), "{failed}");
    // a rerun keeps the failure (a result like any other) and redoes nothing
    let r = run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.ran, r.reused, r.failed.len()), (0, 4, 2));
    kvreplay_analysis::report::write(&out, &plan).unwrap();
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("Failed points (2"), "report lists them");
}

#[test]
fn a_second_writer_is_refused_while_a_sweep_holds_the_folder() {
    // two sweeps into one --out once died with "points/ID.json: No such file"
    // or computed points twice
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 20, 24);
    let plan = Plan::new(&[a], &["h2o".into()], &[4, 8]).unwrap();
    let out = tmp.path().join("out");
    let held = kvreplay_analysis::sweep::lock(&out, None).unwrap();
    let e = run(&plan, &out, None, &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("another kvreplay (pid {})", std::process::id())),
        "{e}"
    );
    assert!(!out.join("points").exists(), "nothing was written");
    // shards hold their own locks: shard 1 may run while shard 0 is held
    let s0 = kvreplay_analysis::sweep::lock(&out, Some(Shard { index: 0, count: 2 })).unwrap();
    drop(held);
    let r = run(
        &plan,
        &out,
        Some(Shard { index: 1, count: 2 }),
        &mut |_, _, _| {},
    )
    .unwrap();
    assert_eq!(r.ran, 1);
    let e = run(
        &plan,
        &out,
        Some(Shard { index: 0, count: 2 }),
        &mut |_, _, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("shard 0/2"), "{e}");
    drop(s0);
    assert!(run(&plan, &out, None, &mut |_, _, _| {}).unwrap().complete);
}

#[test]
fn an_unverified_sweep_says_so_and_a_verified_one_refuses_a_damaged_trace() {
    use kvreplay_kernels::Backend;
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 20, 24);
    let f = a.join("layer-001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x01;
    std::fs::write(&f, bytes).unwrap();
    let plan = Plan::new(std::slice::from_ref(&a), &["h2o".into()], &[4]).unwrap();
    let e = run(&plan, &tmp.path().join("v"), None, &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer-001.safetensors") && e.contains("sha256"),
        "{e}"
    );
    let out = tmp.path().join("u");
    let opts = kvreplay_analysis::sweep::RunOptions {
        reads: Reads::Unverified,
        ..kvreplay_analysis::sweep::RunOptions::new(&Backend::Cpu)
    };
    kvreplay_analysis::sweep::run_opts(&plan, &out, &opts, &mut |_, _, _| {}).unwrap();
    let points = kvreplay_analysis::sweep::load_points(&out, &plan).unwrap();
    assert!(points[0].unverified);
    kvreplay_analysis::report::write(&out, &plan).unwrap();
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(
        html.contains("without checking its files"),
        "report says so"
    );
}

/// A small tmpfs mounted for one test (root only), unmounted when dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            println!("not run: cannot mount a tmpfs here (needs root) to fill a disk");
            return None;
        }
        Some(SmallDisk { dir })
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
    /// Take every free byte.
    fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.path().join("filler")).unwrap();
        let block = vec![7u8; 4096];
        while f.write_all(&block).is_ok() {}
        let _ = f.flush();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

#[test]
fn a_full_disk_fails_a_sweep_clearly_and_keeps_the_previous_results() {
    let Some(disk) = SmallDisk::mount("2m") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 40, 46);
    let plan = Plan::new(
        std::slice::from_ref(&a),
        &["h2o".into(), "tova".into()],
        &[4, 8],
    )
    .unwrap();
    let out = disk.path().join("out");
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    kvreplay_analysis::report::write(&out, &plan).unwrap();
    let before = files(&out);
    let report = std::fs::read(out.join("report.html")).unwrap();
    disk.fill();
    // rewriting the CSVs and the report on a full disk: a clear error, the
    // previous files whole, no temporary file left
    let e = run(&plan, &out, None, &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("No space left on device") && e.contains("out/"),
        "{e}"
    );
    assert_eq!(files(&out), before);
    let e = kvreplay_analysis::report::write(&out, &plan)
        .unwrap_err()
        .to_string();
    assert!(e.contains("No space left on device"), "{e}");
    assert_eq!(std::fs::read(out.join("report.html")).unwrap(), report);
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    // a new sweep on the full disk: an error, and no CSV that looks complete
    let out2 = disk.path().join("out2");
    assert!(run(&plan, &out2, None, &mut |_, _, _| {}).is_err());
    assert!(!out2.join("results.csv").exists() && !out2.join("summary.csv").exists());
}

/// A plan over SmolLM2-shaped traces of the default suite's lengths and every
/// registered policy (no trace files: the assignment needs only shapes).
fn synthetic_plan(lengths: &[usize]) -> Plan {
    let policies: Vec<String> = kvreplay_replay::REGISTRY
        .iter()
        .filter(|p| !p.is_wrapper())
        .map(|p| p.name.to_string())
        .chain(["snapkv+quant".to_string(), "adakv:scorer=h2o".to_string()])
        .collect();
    Plan {
        traces: lengths
            .iter()
            .map(|n| PathBuf::from(format!("passkey-{n}.kvtrace")))
            .collect(),
        policies,
        budgets: vec![32, 64, 128, 256, 512, 1024],
        trace_ids: lengths.iter().map(|n| format!("id{n}")).collect(),
        shapes: lengths
            .iter()
            .map(|&n| TraceShape {
                n_layers: 30,
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: 64,
                prompt_len: n,
                total_len: n + 16,
            })
            .collect(),
        device: "cpu".into(),
    }
}

#[test]
fn shards_cover_every_point_once_balanced_and_grouped_by_trace() {
    let plan = synthetic_plan(&[512, 1024, 2048, 4096]);
    let all = plan.points();
    assert_eq!(all.len(), 4 * plan.policies.len() * 6);
    let costs = plan.point_costs();
    let setups = plan.setup_costs();
    for count in 1..=8 {
        let mut seen = vec![0; all.len()];
        let mut touched = 0;
        let a = plan.assignment(count);
        for index in 0..count {
            let mine = plan.shard_points(Shard { index, count });
            assert!(!mine.is_empty(), "shard {index}/{count} is empty");
            let mut traces: Vec<usize> = mine.iter().map(|p| p.trace).collect();
            traces.dedup();
            touched += traces.len();
            let mut load: u64 = traces.iter().map(|&t| setups[t]).sum();
            for p in &mine {
                let k = all.iter().position(|q| q == p).unwrap();
                seen[k] += 1;
                load += costs[k];
            }
            assert_eq!(load, a.loads[index], "shard {index}/{count}'s load");
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "{count} shards: every point exactly once"
        );
        let total: u64 = a.loads.iter().sum();
        let max = *a.loads.iter().max().unwrap();
        // within 10% of the mean (the split's target)
        assert!(
            max as f64 <= 1.1 * total as f64 / count as f64,
            "{count} shards: loads {:?}",
            a.loads
        );
        // a trace's points stay together where that balances: at most two
        // extra (shard, trace) pairs per shard beyond one per trace
        assert!(
            touched <= 4 + 2 * count,
            "{count} shards touch {touched} (shard, trace) pairs"
        );
        // deterministic: the same plan, read back from JSON, splits the same way
        let back: Plan = serde_json::from_str(&serde_json::to_string(&plan).unwrap()).unwrap();
        assert_eq!(back.assignment(count), a);
    }
    // one shard: each trace once, in plan order
    assert!(plan.assignment(1).shard_of.iter().all(|&s| s == 0));
    // the whole plan's cost is the one shard's load
    assert_eq!(plan.estimated_cost(), plan.assignment(1).loads[0]);
    // four traces on four shards would leave the 512-token shard idle: the
    // 4,096-token trace is split and the small ones share a shard
    let a = plan.assignment(4);
    assert!(a.imbalance() <= 1.1, "{:?}", a.loads);
    let per_trace = |t: usize| -> Vec<usize> {
        let mut v: Vec<usize> = (0..all.len())
            .filter(|&k| all[k].trace == t)
            .map(|k| a.shard_of[k])
            .collect();
        v.dedup();
        v
    };
    assert!(per_trace(3).len() >= 2, "the longest trace is split");
    assert_eq!(per_trace(0).len(), 1, "the shortest trace stays whole");
}

#[test]
fn merge_names_missing_and_unfinished_shards_and_a_rerun_of_only_those_completes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path());
    let one = tmp.path().join("one");
    run(&plan, &one, None, &mut |_, _, _| {}).unwrap();
    let shard = |i: usize| Shard { index: i, count: 3 };
    let dir = |i: usize| tmp.path().join(format!("s{i}"));
    // shard 1 never ran; shard 0 was stopped after some of its points
    for i in [0, 2] {
        run(&plan, &dir(i), Some(shard(i)), &mut |_, _, _| {}).unwrap();
    }
    let rec = kvreplay_analysis::sweep::read_shard_records(&dir(0)).unwrap();
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].shard, shard(0));
    assert_eq!(rec[0].points, plan.shard_points(shard(0)).len());
    let gone = plan.shard_points(shard(0))[0].clone();
    std::fs::remove_file(
        dir(0)
            .join("points")
            .join(format!("{}.json", plan.point_id(&gone))),
    )
    .unwrap();
    let merged = tmp.path().join("merged");
    let r = merge(&[dir(0), dir(2)], &merged).unwrap();
    let n1 = plan.shard_points(shard(1)).len();
    assert!(!r.complete);
    assert_eq!((r.points, r.missing), (18, n1 + 1));
    let bad: Vec<_> = r.incomplete().collect();
    assert_eq!(bad.len(), 2);
    assert_eq!((bad[0].shard, bad[0].missing), (shard(0), 1));
    assert_eq!(bad[0].folders, vec![dir(0)]);
    assert_eq!(
        (bad[1].shard, bad[1].missing, bad[1].points),
        (shard(1), n1, n1)
    );
    assert!(bad[1].folders.is_empty());
    // rerun only those two; a second copy of shard 0 (a requeued task) is harmless
    for i in [0, 1, 0] {
        run(&plan, &dir(i), Some(shard(i)), &mut |_, _, _| {}).unwrap();
    }
    let r = merge(&[dir(0), dir(1), dir(2)], &merged).unwrap();
    assert!(r.complete && r.missing == 0, "{r:?}");
    assert_eq!(files(&merged), files(&one));
    // folders of two different splits are refused
    let other = tmp.path().join("other");
    run(
        &plan,
        &other,
        Some(Shard { index: 0, count: 2 }),
        &mut |_, _, _| {},
    )
    .unwrap();
    let e = merge(&[dir(0), other.clone()], &tmp.path().join("m2"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("shard 0/2") && e.contains("one split"), "{e}");
}

#[test]
fn a_waiting_writer_takes_the_lock_when_the_holder_lets_go() {
    use kvreplay_analysis::sweep::{lock, lock_with};
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let s = Some(Shard { index: 1, count: 4 });
    let held = lock(&out, s).unwrap();
    let (told_tx, told_rx) = std::sync::mpsc::channel::<String>();
    let (got_tx, got_rx) = std::sync::mpsc::channel::<()>();
    let o = out.clone();
    let waiter = std::thread::spawn(move || {
        let tell = move |m: &str| told_tx.send(m.to_string()).unwrap();
        let l = lock_with(&o, s, Some(&tell)).unwrap();
        got_tx.send(()).unwrap();
        drop(l);
    });
    // it says whom it waits for before it waits
    let told = told_rx.recv().unwrap();
    assert!(
        told.contains(&format!("pid {}", std::process::id()))
            && told.contains("shard 1/4")
            && told.contains("waiting"),
        "{told}"
    );
    assert!(got_rx.try_recv().is_err(), "not while the lock is held");
    drop(held);
    got_rx.recv().unwrap();
    waiter.join().unwrap();
}

/// Rewrite the JSON file `path` with `edit` (not for floats: a round trip
/// through serde_json::Value may move one by an ulp).
fn edit_json(path: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap() + "\n").unwrap();
}

/// Every point file of a sweep folder.
fn point_files(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out.join("points"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

#[test]
fn a_sweep_records_its_device_and_refuses_another() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path());
    assert_eq!(plan.device, "cpu", "a new plan is for the CPU");
    let out = tmp.path().join("out");
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).unwrap()).unwrap();
    assert_eq!(on_disk["device"], "cpu");
    for f in point_files(&out) {
        let p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        assert_eq!(p["device"], "cpu", "{}", f.display());
    }
    let full = files(&out);

    // The folder as a `--device cuda` run would have left it (there is no GPU
    // here: its plan says cuda). Resuming it on the CPU is refused, named.
    edit_json(&out.join("plan.json"), |v| v["device"] = "cuda".into());
    let e = run(&plan, &out, None, &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    for part in [
        "holds a sweep run on cuda",
        "asks for --device cpu",
        "use --device cuda",
        "new --out",
    ] {
        assert!(e.contains(part), "{part:?} missing from: {e}");
    }
    assert_eq!(files(&out), full, "nothing was rewritten");

    // A plan for another device than the backend's is a caller's mistake.
    let fresh = tmp.path().join("fresh");
    let e = run(
        &plan.clone().on_device(kvreplay_kernels::Device::Cuda),
        &fresh,
        None,
        &mut |_, _, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("backend runs on cpu"), "{e}");
    assert!(!fresh.join("plan.json").exists());

    // A point file of another device in a CPU folder is refused, not mixed in.
    edit_json(&out.join("plan.json"), |v| v["device"] = "cpu".into());
    let stray = &point_files(&out)[0];
    edit_json(stray, |v| v["device"] = "cuda".into());
    let e = kvreplay_analysis::sweep::load_points(&out, &plan)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("computed on cuda, but this sweep runs on cpu"),
        "{e}"
    );
}

#[test]
fn cpu_point_ids_are_unchanged_and_other_devices_have_their_own() {
    use sha2::{Digest, Sha256};
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path());
    let cuda = plan.clone().on_device(kvreplay_kernels::Device::Cuda);
    for p in plan.points() {
        // the id every sweep before devices were recorded gave this point
        let key = format!(
            "{}|{}|{}|{}",
            kvreplay_analysis::sweep::trace_name(&plan.traces[p.trace]),
            plan.trace_ids[p.trace],
            plan.policies[p.policy],
            p.budget
        );
        let old: String = Sha256::digest(key.as_bytes())
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(plan.point_id(&p), old);
        assert_ne!(cuda.point_id(&p), old);
    }
}

#[test]
fn a_sweep_made_before_devices_were_recorded_resumes_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path());
    let one = tmp.path().join("one");
    run(&plan, &one, None, &mut |_, _, _| {}).unwrap();
    let full = files(&one);

    // An old folder: no device in its plan or point files, some points missing.
    let old = tmp.path().join("old");
    run(&plan, &old, None, &mut |_, _, _| {}).unwrap();
    edit_json(&old.join("plan.json"), |v| {
        v.as_object_mut().unwrap().remove("device");
    });
    let mut gone = 0;
    for (i, f) in point_files(&old).iter().enumerate() {
        if i % 4 == 0 {
            std::fs::remove_file(f).unwrap();
            gone += 1;
        } else {
            // as text: a round trip through serde_json::Value may move a float by an ulp
            let text = std::fs::read_to_string(f).unwrap();
            let old_text = text.replace(r#","device":"cpu""#, "");
            assert_ne!(old_text, text);
            std::fs::write(f, old_text).unwrap();
        }
    }
    std::fs::remove_file(old.join("results.csv")).unwrap();
    let r = run(&plan, &old, None, &mut |_, _, _| {}).unwrap();
    assert_eq!((r.ran, r.reused, r.complete), (gone, 18 - gone, true));
    assert_eq!(files(&old), full, "byte-identical to one run");
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(old.join("plan.json")).unwrap()).unwrap();
    assert_eq!(on_disk["device"], "cpu", "the plan now says so");
}

#[test]
fn shards_of_different_devices_are_not_merged() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path());
    let shards: Vec<PathBuf> = (0..2)
        .map(|i| {
            let d = tmp.path().join(format!("shard{i}"));
            run(
                &plan,
                &d,
                Some(Shard { index: i, count: 2 }),
                &mut |_, _, _| {},
            )
            .unwrap();
            d
        })
        .collect();
    // shard 1 as a `--device cuda` run would have left it
    edit_json(&shards[1].join("plan.json"), |v| {
        v["device"] = "cuda".into()
    });
    let merged = tmp.path().join("merged");
    let e = merge(&shards, &merged).unwrap_err().to_string();
    for part in ["ran on cpu", "ran on cuda", "one device", "--device cpu"] {
        assert!(e.contains(part), "{part:?} missing from: {e}");
    }
    assert!(!merged.join("results.csv").exists());
    // the CPU shard alone merges
    let r = merge(&shards[..1], &merged).unwrap();
    assert!(!r.complete);
}

/// With a depth-sensitivity profile beside a trace's manifest, the summary's
/// `predicted_kl` is Σ_l s_l · (mean over the layer's query heads of
/// rel_l2²), recomputed here from results.csv's per-head rows (exact
/// decimals: the CSV round trip is lossless; 1e-12 relative covers the
/// summation order). A profile of another model is ignored (empty column).
#[test]
fn a_sensitivity_profile_gives_predicted_kl() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "a.kvtrace", 1, 40, 46);
    let b = write_trace(tmp.path(), "b.kvtrace", 2, 30, 34);
    let sha = Manifest::read(&a).unwrap().model.source.sha256;
    let profile = |sha: &str| Sensitivity {
        format: SENSITIVITY_FORMAT.into(),
        model_sha256: sha.into(),
        eps: 0.2,
        draws: 1,
        decode_steps: 6,
        per_layer: vec![0.25, 3.0],
        per_head: None,
        scale: 2.0,
        family_scale: Default::default(),
        kvreplay_version: "test".into(),
    };
    profile(&sha).write(&a).unwrap();
    profile("another model").write(&b).unwrap();
    let plan = Plan::new(&[a, b], &["h2o".into(), "snapkv:w=4".into()], &[4, 8]).unwrap();
    let out = tmp.path().join("out");
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    let mut rows = csv::Reader::from_path(out.join("results.csv")).unwrap();
    let hdr = rows.headers().unwrap().clone();
    let col = |n: &str| hdr.iter().position(|h| h == n).unwrap();
    let (ct, cp, cb, cl, ce) = (
        col("trace"),
        col("policy"),
        col("budget"),
        col("layer"),
        col("rel_l2"),
    );
    // (trace, policy, budget) -> per layer (Σ rel_l2², heads)
    let mut sq: std::collections::BTreeMap<(String, String, String), [(f64, f64); 2]> =
        Default::default();
    for r in rows.records() {
        let r = r.unwrap();
        let e: f64 = r[ce].parse().unwrap();
        let l: usize = r[cl].parse().unwrap();
        let acc = &mut sq
            .entry((r[ct].into(), r[cp].into(), r[cb].into()))
            .or_default()[l];
        acc.0 += e * e;
        acc.1 += 1.0;
    }
    let mut sum = csv::Reader::from_path(out.join("summary.csv")).unwrap();
    let hdr = sum.headers().unwrap().clone();
    let col = |n: &str| hdr.iter().position(|h| h == n).unwrap();
    let (ct, cp, cb, ck) = (
        col("trace"),
        col("policy"),
        col("budget"),
        col("predicted_kl"),
    );
    let mut checked = 0;
    for r in sum.records() {
        let r = r.unwrap();
        if &r[ct] == "b.kvtrace" {
            assert_eq!(&r[ck], "", "a profile of another model is ignored");
            continue;
        }
        let l = sq[&(r[ct].to_string(), r[cp].to_string(), r[cb].to_string())];
        let want = 2.0 * (0.25 * l[0].0 / l[0].1 + 3.0 * l[1].0 / l[1].1);
        let got: f64 = r[ck].parse().unwrap();
        assert!(
            want > 0.0 && ((got - want) / want).abs() < 1e-12,
            "{got} vs {want}"
        );
        checked += 1;
    }
    assert_eq!(checked, 4);
    // the report ranks by it only where every trace has a profile (b's is of another model)
    kvreplay_analysis::report::write(&out, &plan).unwrap();
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(!html.contains("Ranking by predicted end-to-end KL"));
    let only_a = Plan::new(
        &plan.traces[..1],
        &["h2o".into(), "snapkv:w=4".into()],
        &[4, 8],
    )
    .unwrap();
    let out_a = tmp.path().join("out-a");
    run(&only_a, &out_a, None, &mut |_, _, _| {}).unwrap();
    kvreplay_analysis::report::write(&out_a, &only_a).unwrap();
    let html = std::fs::read_to_string(out_a.join("report.html")).unwrap();
    assert!(html.contains("Ranking by predicted end-to-end KL"));
}
