//! Plots (SVG) and a self-contained HTML report of a finished sweep.

use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

use kvreplay_traces::Manifest;

use crate::sweep::{load_results, trace_name, Plan, PointResult, SweepError, RETENTION_BINS};

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// Per (policy, budget): values over traces.
struct Agg {
    policies: Vec<String>,
    budgets: Vec<usize>,
    /// (policy, budget) -> per-trace summaries
    cells: BTreeMap<(usize, usize), Vec<PointResult>>,
}

impl Agg {
    fn new(plan: &Plan, points: Vec<PointResult>) -> Agg {
        let mut policies: Vec<String> = Vec::new();
        for p in &points {
            if !policies.contains(&p.summary.policy_spec) {
                policies.push(p.summary.policy_spec.clone());
            }
        }
        let mut cells: BTreeMap<(usize, usize), Vec<PointResult>> = BTreeMap::new();
        for p in points {
            let i = policies
                .iter()
                .position(|x| *x == p.summary.policy_spec)
                .unwrap();
            cells.entry((i, p.summary.budget)).or_default().push(p);
        }
        Agg {
            policies,
            budgets: plan.budgets.clone(),
            cells,
        }
    }
    fn label(&self, i: usize) -> String {
        // short name, plus parameters when two specs share a name
        let short = |s: &str| {
            s.split('+')
                .map(|p| p.split(':').next().unwrap_or(p))
                .collect::<Vec<_>>()
                .join("+")
        };
        let n = short(&self.policies[i]);
        if self.policies.iter().filter(|p| short(p) == n).count() > 1 {
            self.policies[i].clone()
        } else {
            n
        }
    }
    fn stat(
        &self,
        i: usize,
        b: usize,
        f: impl Fn(&PointResult) -> Option<f64>,
    ) -> Option<(f64, f64, f64)> {
        let v: Vec<f64> = self.cells.get(&(i, b))?.iter().filter_map(f).collect();
        if v.is_empty() {
            return None;
        }
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        Some((
            v.iter().cloned().fold(f64::MAX, f64::min),
            mean,
            v.iter().cloned().fold(f64::MIN, f64::max),
        ))
    }
    fn mid_budget(&self) -> usize {
        self.budgets[self.budgets.len() / 2]
    }
}

fn color(i: usize) -> RGBColor {
    let c = Palette99::pick(i).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

fn error_vs_budget(a: &Agg, path: &Path) -> PlotResult {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let ymax = a
        .cells
        .values()
        .flatten()
        .map(|p| p.summary.rel_l2_mean)
        .fold(0f64, f64::max)
        .max(1e-6)
        * 1.05;
    let (b0, b1) = (
        *a.budgets.first().unwrap() as f64,
        *a.budgets.last().unwrap() as f64,
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Output error vs budget (mean over traces; bars: min-max)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((b0 * 0.9..b1 * 1.1).log_scale(), 0f64..ymax)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("budget (entries per KV head and layer)")
        .y_desc("relative L2 error of attention output")
        .draw()?;
    for i in 0..a.policies.len() {
        let c = color(i);
        let pts: Vec<(f64, (f64, f64, f64))> = a
            .budgets
            .iter()
            .filter_map(|&b| {
                a.stat(i, b, |p| Some(p.summary.rel_l2_mean))
                    .map(|s| (b as f64, s))
            })
            .collect();
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|(x, s)| (*x, s.1)),
                c.stroke_width(2),
            ))?
            .label(a.label(i))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart.draw_series(
            pts.iter()
                .map(|(x, s)| ErrorBar::new_vertical(*x, s.0, s.1, s.2, c.stroke_width(1), 6)),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn error_vs_memory(a: &Agg, path: &Path) -> PlotResult {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut all: Vec<(f64, f64)> = Vec::new();
    for i in 0..a.policies.len() {
        for &b in &a.budgets {
            if let (Some(m), Some(e)) = (
                a.stat(i, b, |p| Some(p.summary.memory_ratio)),
                a.stat(i, b, |p| Some(p.summary.rel_l2_mean)),
            ) {
                all.push((m.1, e.1));
            }
        }
    }
    let xmax = all.iter().map(|x| x.0).fold(0f64, f64::max).max(1e-6) * 1.05;
    let ymax = all.iter().map(|x| x.1).fold(0f64, f64::max).max(1e-6) * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Output error vs memory (dashed: Pareto front)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("memory, share of the full f16 cache")
        .y_desc("relative L2 error")
        .draw()?;
    for i in 0..a.policies.len() {
        let c = color(i);
        let pts: Vec<(f64, f64)> = a
            .budgets
            .iter()
            .filter_map(|&b| {
                Some((
                    a.stat(i, b, |p| Some(p.summary.memory_ratio))?.1,
                    a.stat(i, b, |p| Some(p.summary.rel_l2_mean))?.1,
                ))
            })
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
            .label(a.label(i))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled())))?;
    }
    // Pareto front: the lowest error reachable at each memory or less.
    all.sort_by(|x, y| kvreplay_replay::select::cmp_f64(x.0, y.0));
    let mut front = Vec::new();
    let mut best = f64::MAX;
    for (m, e) in all {
        if e < best {
            best = e;
            front.push((m, e));
        }
    }
    chart.draw_series(DashedLineSeries::new(front, 6, 4, BLACK.stroke_width(1)))?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn retention_by_position(a: &Agg, path: &Path) -> PlotResult {
    let b = a.mid_budget();
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Prompt positions still represented, by relative position (budget {b})"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..1f64, 0f64..1.05f64)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("relative position in the prompt")
        .y_desc("share retained")
        .draw()?;
    for i in 0..a.policies.len() {
        let Some(cell) = a.cells.get(&(i, b)) else {
            continue;
        };
        let c = color(i);
        let pts: Vec<(f64, f64)> = (0..RETENTION_BINS)
            .map(|k| {
                (
                    (k as f64 + 0.5) / RETENTION_BINS as f64,
                    cell.iter().map(|p| p.retention[k]).sum::<f64>() / cell.len() as f64,
                )
            })
            .collect();
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(a.label(i))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn layer_heatmap(a: &Agg, path: &Path) -> PlotResult {
    let b = a.mid_budget();
    let n_layers = a
        .cells
        .values()
        .flatten()
        .flat_map(|p| p.rows.iter().map(|r| r.layer + 1))
        .max()
        .unwrap_or(1);
    let np = a.policies.len();
    // mean rel_l2 per (policy, layer) over traces and heads
    let mut grid = vec![vec![f64::NAN; n_layers]; np];
    for (i, row) in grid.iter_mut().enumerate() {
        if let Some(cell) = a.cells.get(&(i, b)) {
            for (l, v) in row.iter_mut().enumerate() {
                let xs: Vec<f64> = cell
                    .iter()
                    .flat_map(|p| p.rows.iter().filter(|r| r.layer == l).map(|r| r.rel_l2))
                    .collect();
                if !xs.is_empty() {
                    *v = xs.iter().sum::<f64>() / xs.len() as f64;
                }
            }
        }
    }
    let vmax = grid
        .iter()
        .flatten()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, v| m.max(*v))
        .max(1e-9);
    let root = SVGBackend::new(path, (960, 80 + 28 * np as u32 + 60)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Relative L2 error per layer (budget {b}; white 0, dark red {vmax:.3})"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(160)
        .build_cartesian_2d(0..n_layers, (0..np).into_segmented())?;
    let labels: Vec<String> = (0..np).map(|i| a.label(i)).collect();
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("layer")
        .y_labels(np)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(grid.iter().enumerate().flat_map(|(i, row)| {
        row.iter().enumerate().map(move |(l, v)| {
            let t = if v.is_finite() {
                (v / vmax).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let c = RGBColor(
                255 - (100.0 * t) as u8,
                (255.0 * (1.0 - t)) as u8,
                (255.0 * (1.0 - t)) as u8,
            );
            Rectangle::new(
                [
                    (l, SegmentValue::Exact(i)),
                    (l + 1, SegmentValue::Exact(i + 1)),
                ],
                c.filled(),
            )
        })
    }))?;
    root.present()?;
    Ok(())
}

fn needle_retention(a: &Agg, path: &Path) -> PlotResult {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (b0, b1) = (
        *a.budgets.first().unwrap() as f64,
        *a.budgets.last().unwrap() as f64,
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Needle retention vs budget (share of the needle span still represented)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((b0 * 0.9..b1 * 1.1).log_scale(), 0f64..1.05f64)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("budget")
        .y_desc("needle retention")
        .draw()?;
    for i in 0..a.policies.len() {
        let c = color(i);
        let pts: Vec<(f64, f64)> = a
            .budgets
            .iter()
            .filter_map(|&b| {
                a.stat(i, b, |p| p.summary.needle_retention)
                    .map(|s| (b as f64, s.1))
            })
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(a.label(i))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The command that reproduces a plan (the same however the sweep was split).
pub fn command(plan: &Plan) -> String {
    let q = |s: &str| {
        if s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-/:=,+".contains(c))
        {
            s.to_string()
        } else {
            format!("'{s}'")
        }
    };
    format!(
        "kvreplay sweep --traces {} --policy {} --budget {} --out DIR",
        plan.traces
            .iter()
            .map(|t| q(&t.display().to_string()))
            .collect::<Vec<_>>()
            .join(" "),
        plan.policies
            .iter()
            .map(|p| q(p))
            .collect::<Vec<_>>()
            .join(" "),
        plan.budgets
            .iter()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(",")
    )
}

/// Write the plots and `report.html` into the sweep folder `out`.
pub fn write(out: &Path, plan: &Plan) -> Result<(), SweepError> {
    let command = command(plan);
    let (points, failed) = load_results(out, plan)?;
    if points.is_empty() {
        return Err(SweepError::Plan(format!(
            "{}: no finished points to report",
            out.display()
        )));
    }
    let has_needle = points.iter().any(|p| p.summary.needle_retention.is_some());
    let unverified = points.iter().filter(|p| p.unverified).count();
    let a = Agg::new(plan, points);
    fn plot_err(name: &'static str) -> impl Fn(Box<dyn std::error::Error>) -> SweepError {
        move |e| SweepError::Plan(format!("plotting {name}: {e}"))
    }
    let mut plots: Vec<(&'static str, &str)> = vec![
        ("error_vs_budget.svg", "Error against budget"),
        ("error_vs_memory.svg", "Error against memory"),
        (
            "retention_by_position.svg",
            "Where each policy keeps its tokens",
        ),
        ("layer_error_heatmap.svg", "Error per layer"),
    ];
    // each plot is drawn under a temporary name and renamed when whole
    let plot = |name: &'static str, f: &dyn Fn(&Agg, &Path) -> PlotResult| {
        let tmp = out.join(format!(".{name}.{}.tmp", std::process::id()));
        if let Err(e) = f(&a, &tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(plot_err(name)(e));
        }
        std::fs::rename(&tmp, out.join(name)).map_err(|err| SweepError::Io {
            path: out.join(name),
            err,
        })
    };
    plot(plots[0].0, &error_vs_budget)?;
    plot(plots[1].0, &error_vs_memory)?;
    plot(plots[2].0, &retention_by_position)?;
    plot(plots[3].0, &layer_heatmap)?;
    if has_needle {
        plots.push(("needle_retention.svg", "Needle retention against budget"));
        plot("needle_retention.svg", &needle_retention)?;
    }
    // The report: plots inline, the summary table, provenance.
    let mut html = String::from("<!doctype html><html><head><meta charset=\"utf-8\"><title>kvreplay sweep report</title><style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}code{font-size:12px}</style></head><body>");
    html.push_str(&format!("<h1>kvreplay sweep</h1><p>{} traces × {} policies × {} budgets, computed on {}. Errors are relative L2 errors of the per-head attention output against the full cache, averaged over layers, heads and decode steps, then over traces.</p>", plan.traces.len(), a.policies.len(), a.budgets.len(), esc(&plan.device)));
    for (file, title) in &plots {
        let svg = std::fs::read_to_string(out.join(file)).map_err(|e| SweepError::Io {
            path: out.join(file),
            err: e,
        })?;
        let svg = svg
            .find("<svg")
            .map(|i| &svg[i..])
            .unwrap_or(&svg)
            .to_string();
        html.push_str(&format!("<h2>{}</h2>{}", esc(title), svg));
    }
    html.push_str("<h2>Summary (mean over traces)</h2><table><tr><th>policy</th><th>budget</th><th>rel_l2</th><th>rel_l2 p95</th><th>cosine</th><th>attn_mass</th><th>kl</th><th>memory</th><th>needle</th></tr>");
    for i in 0..a.policies.len() {
        for &b in &a.budgets {
            let f = |g: &dyn Fn(&PointResult) -> Option<f64>| {
                a.stat(i, b, g)
                    .map(|s| format!("{:.4}", s.1))
                    .unwrap_or_else(|| "-".into())
            };
            html.push_str(&format!(
                "<tr><td>{}</td><td>{b}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&a.label(i)),
                f(&|p| Some(p.summary.rel_l2_mean)),
                f(&|p| Some(p.summary.rel_l2_p95)),
                f(&|p| Some(p.summary.cosine_mean)),
                f(&|p| Some(p.summary.attn_mass_mean)),
                f(&|p| Some(p.summary.kl_mean)),
                f(&|p| Some(p.summary.memory_ratio)),
                f(&|p| p.summary.needle_retention),
            ));
        }
    }
    html.push_str("</table>");
    if !failed.is_empty() {
        html.push_str(&format!(
            "<h2>Failed points ({}, also in <code>failed.csv</code>)</h2><ul>",
            failed.len()
        ));
        for f in &failed {
            html.push_str(&format!(
                "<li><code>{}</code> <code>{}</code> B={}: {}</li>",
                esc(&f.trace),
                esc(&f.policy_spec),
                f.budget,
                esc(&f.reason)
            ));
        }
        html.push_str("</ul>");
    }
    html.push_str("<h2>Provenance</h2>");
    if unverified > 0 {
        html.push_str(&format!("<p><b>{unverified} points read their trace without checking its files (<code>--no-verify</code>).</b></p>"));
    }
    html.push_str("<ul>");
    for (i, t) in plan.traces.iter().enumerate() {
        let m = Manifest::read(t).map_err(|e| SweepError::Plan(e.to_string()))?;
        html.push_str(&format!(
            "<li><code>{}</code> (content {}): {} ({} sha256 {}), {} prompt + {} decode tokens, source <code>{}</code>, captured {} by kvreplay {}</li>",
            esc(&trace_name(t)),
            esc(plan.trace_ids.get(i).map_or("?", |s| &s[..s.len().min(16)])),
            esc(m.model.name.as_deref().unwrap_or("?")),
            esc(&m.model.source.file_name),
            esc(&m.model.source.sha256),
            m.prompt_len(),
            m.generation.n_decode,
            esc(&m.capture.prompt_source),
            esc(&m.capture.created),
            esc(&m.capture.kvreplay_version)
        ));
    }
    html.push_str("</ul><p>Policy specs (every default filled in):</p><ul>");
    for p in &plan.policies {
        html.push_str(&format!("<li><code>{}</code></li>", esc(p)));
    }
    html.push_str(&format!(
        "</ul><p>kvreplay {}; command: <code>{}</code>. CSVs: <code>results.csv</code> (one row per point, layer and head), <code>summary.csv</code> (one row per point).</p></body></html>\n",
        env!("CARGO_PKG_VERSION"),
        esc(&command)
    ));
    crate::sweep::write_atomic(&out.join("report.html"), html.as_bytes())
}
