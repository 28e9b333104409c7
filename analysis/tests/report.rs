//! The report a paper can use: on a small sweep of synthetic traces (two
//! prompt lengths, two traces each), the report opens with the ranking at
//! matched memory and a paired comparison with its interval; every plot is
//! 1,000 px wide, has at most 8 series per panel in colours of the
//! colour-blind-safe palette, markers, and tick labels at the swept budgets
//! and the ranked memory shares; the CSVs are not touched.

mod common;
use common::write_trace;
use kvreplay_analysis::figure::{GRID, MAX_SERIES, PALETTE, WIDTH};
use kvreplay_analysis::report;
use kvreplay_analysis::sweep::{load_points, run, Plan};
use std::path::{Path, PathBuf};

/// A random 2-layer trace (4 query heads, 2 KV heads, d = 8) with a needle span.
fn sweep(dir: &Path) -> (Plan, PathBuf) {
    let traces = vec![
        write_trace(dir, "passkey-0040-a.kvtrace", 1, 40, 46),
        write_trace(dir, "passkey-0040-b.kvtrace", 2, 40, 46),
        write_trace(dir, "passkey-0064-a.kvtrace", 3, 64, 70),
        write_trace(dir, "passkey-0064-b.kvtrace", 4, 64, 70),
    ];
    let policies: Vec<String> = [
        "full",
        "snapkv:w=4",
        "h2o",
        "tova",
        "streaming_llm",
        "scissorhands",
        "random",
        "knorm",
        "pyramidkv",
        "kvmerger",
        "quant",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let plan = Plan::new(&traces, &policies, &[4, 8, 16, 32, 64]).unwrap();
    let out = dir.join("sweep");
    run(&plan, &out, None, &mut |_, _, _| {}).unwrap();
    (plan, out)
}

/// The `#RRGGBB` colours an SVG strokes and fills with.
fn colours(svg: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for key in ["stroke=\"#", "fill=\"#"] {
        for (i, _) in svg.match_indices(key) {
            out.insert(svg[i + key.len()..i + key.len() + 6].to_string());
        }
    }
    out
}

fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let t = &t[t.find('>')? + 1..];
            Some(t[..t.find("</text>")?].trim().to_string())
        })
        .collect()
}

#[test]
fn the_report_ranks_at_matched_memory_and_its_plots_are_readable() {
    let tmp = tempfile::tempdir().unwrap();
    let (plan, out) = sweep(tmp.path());
    let csvs = |d: &Path| {
        (
            std::fs::read(d.join("results.csv")).unwrap(),
            std::fs::read(d.join("summary.csv")).unwrap(),
        )
    };
    let before = csvs(&out);
    report::write(&out, &plan).unwrap();
    assert_eq!(csvs(&out), before, "the report leaves the CSVs alone");

    // the page: ranking, paired comparison, plots, summary, provenance, in that order
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    let at = |s: &str| html.find(s).unwrap_or_else(|| panic!("report lacks {s}"));
    let order = [
        "Ranking at matched memory",
        "Paired comparison",
        "<svg",
        "Summary (mean over traces)",
        "Provenance",
    ];
    for w in order.windows(2) {
        assert!(at(w[0]) < at(w[1]), "{} before {}", w[0], w[1]);
    }
    assert!(html.contains("error at 20%") && html.contains("error at 10%"));
    // one policy does not reach 10% on the 40-token traces (full: 100% only)
    assert!(html.contains("not reached"));
    assert!(
        html.contains("of the full cache on ") && html.contains("95% bootstrap CI over traces"),
        "a paired comparison with its interval"
    );
    assert!(html.contains("entry-KL") && html.contains("0 by construction for pure eviction"));
    assert!(html.contains("class=\"sortable\"") && html.contains("<script>"));
    assert!(html.contains("<details>"));
    assert!(
        !html.contains("src=\"http") && !html.contains("href=\"http"),
        "self-contained"
    );
    let tex = std::fs::read_to_string(out.join("summary.tex")).unwrap();
    for k in [
        "\\toprule",
        "\\midrule",
        "\\bottomrule",
        "snapkv",
        "entry-KL",
    ] {
        assert!(tex.contains(k), "summary.tex lacks {k}");
    }

    // the figures: at most 8 series per panel, panels per task and length
    let points = load_points(&out, &plan).unwrap();
    let ranking = kvreplay_analysis::rank::rank(&plan, &points, &kvreplay_analysis::rank::SHARES);
    let figs = report::figures(&plan, &points, &ranking);
    let names: Vec<&str> = figs.iter().map(|f| f.file.as_str()).collect();
    assert!(names.contains(&"error_vs_memory_by_trace.svg"), "{names:?}");
    for f in &figs {
        for p in &f.panels {
            let n = p.series.len() + usize::from(p.vline.is_some());
            assert!(n <= MAX_SERIES, "{}: {}: {n} series", f.file, p.title);
            assert!(!p.series.is_empty(), "{}: {}: empty", f.file, p.title);
        }
    }
    let by_trace = figs
        .iter()
        .find(|f| f.file == "error_vs_memory_by_trace.svg")
        .unwrap();
    assert_eq!(by_trace.panels.len(), 2, "one panel per prompt length");
    assert!(by_trace.panels[0].title.contains("40-token"));

    // the SVGs: width, palette, markers, tick labels
    let mut allowed: Vec<String> = PALETTE
        .iter()
        .chain([&GRID, &(0xFF, 0xFF, 0xFF)])
        .map(|c| format!("{:02X}{:02X}{:02X}", c.0, c.1, c.2))
        .collect();
    allowed.sort();
    for f in &figs {
        let svg = std::fs::read_to_string(out.join(&f.file)).unwrap();
        assert!(svg.contains(&format!("width=\"{WIDTH}\"")), "{}", f.file);
        for c in colours(&svg) {
            assert!(
                allowed.contains(&c),
                "{}: colour #{c} is not in the palette",
                f.file
            );
        }
        assert!(
            svg.contains("<polygon") && svg.contains("<circle") && svg.contains("<rect"),
            "{}: markers",
            f.file
        );
        let t = texts(&svg);
        let want: Vec<String> = if f.file == "error_vs_budget.svg" {
            plan.budgets.iter().map(|b| b.to_string()).collect()
        } else {
            vec!["10%".into(), "20%".into(), "50%".into()]
        };
        for w in want {
            assert!(t.contains(&w), "{}: no tick label {w}", f.file);
        }
        assert!(!svg.contains("font-family=\"Arial"), "generic font only");
    }
    // the memory plot keeps its legend: every policy but full named
    let mem = texts(&std::fs::read_to_string(out.join("error_vs_memory.svg")).unwrap());
    for p in ["snapkv", "h2o", "kvmerger", "quant", "pyramidkv"] {
        assert!(
            mem.iter().any(|t| t == p || *t == format!("{p} *")),
            "legend lacks {p}"
        );
    }
    // the same folder gives the same bytes
    let html1 = std::fs::read(out.join("report.html")).unwrap();
    report::write(&out, &plan).unwrap();
    assert_eq!(std::fs::read(out.join("report.html")).unwrap(), html1);
}
