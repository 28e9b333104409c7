//! Plots (SVG, and PNG where `rsvg-convert` is installed), `summary.tex` and
//! a self-contained HTML report of a finished sweep: the ranking at matched
//! memory first, a paired comparison with its interval, the plots, the
//! summary table (sortable, each column explained), provenance last.

use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

use kvreplay_traces::Manifest;

use crate::compare::{
    compare_points, label, percent, resolve_method, short, Comparison, Curve, Options,
};
use crate::figure::{linear_ticks, log_ticks, Axis, Figure, Panel, PlotResult, Series, MAX_SERIES};
use crate::rank::{self, curves, mean_curve, At, Ranking, X};
use crate::sweep::{
    load_results, trace_name, Plan, PointResult, SummaryRow, SweepError, RETENTION_BINS,
};

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

/// A figure's series for one policy over a set of traces: the mean curve
/// (on the traces' common range) with its 95% t-band, marks at the measured
/// x of a single trace, or at the figure's ticks (and the range's ends) for
/// several.
fn series_over(label: String, cs: &[&Curve], ticks: &[f64]) -> Option<Series> {
    let Some(mc) = mean_curve(cs) else {
        // no x common to every trace (a policy whose memory does not follow
        // the budget, e.g. quantisation): the mean (x, y) per budget, marked *
        let mut budgets: Vec<usize> = cs[0].points.iter().map(|p| p.2).collect();
        budgets.retain(|b| cs.iter().all(|c| c.points.iter().any(|p| p.2 == *b)));
        let line: Vec<(f64, f64)> = budgets
            .iter()
            .map(|b| {
                let v: Vec<(f64, f64)> = cs
                    .iter()
                    .filter_map(|c| c.points.iter().find(|p| p.2 == *b).map(|p| (p.0, p.1)))
                    .collect();
                let (xs, ys): (Vec<f64>, Vec<f64>) = v.into_iter().unzip();
                (crate::stats::mean(&xs), crate::stats::mean(&ys))
            })
            .collect();
        if line.is_empty() {
            return None;
        }
        return Some(Series {
            label: format!("{label} *"),
            marks: line.clone(),
            line,
            band: Vec::new(),
        });
    };
    let line: Vec<(f64, f64)> = mc.iter().map(|p| (p.0, p.1)).collect();
    let band = if cs.len() > 1 {
        mc.iter()
            .filter_map(|p| p.2.map(|c| (p.0, c[0], c[1])))
            .collect()
    } else {
        Vec::new()
    };
    let at = |x: f64| -> Option<f64> {
        let v: Vec<f64> = cs
            .iter()
            .map(|c| c.at(x).map(|a| a.0))
            .collect::<Option<_>>()?;
        Some(crate::stats::mean(&v))
    };
    let marks: Vec<(f64, f64)> = if cs.len() == 1 {
        line.clone()
    } else {
        let (lo, hi) = (line[0].0, line[line.len() - 1].0);
        let mut xs: Vec<f64> = ticks
            .iter()
            .copied()
            .filter(|&t| t > lo && t < hi)
            .chain([lo, hi])
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs.into_iter().filter_map(|x| Some((x, at(x)?))).collect()
    };
    Some(Series {
        label,
        line,
        band,
        marks,
    })
}

/// What a figure plots, per policy and trace.
struct Metric {
    x: X,
    y: fn(&SummaryRow) -> Option<f64>,
    /// y on a log axis when the values span more than a decade.
    log_y_ok: bool,
    /// A fixed y range (shares), else from the data.
    y_range: Option<(f64, f64)>,
}

/// Panels: one per family (the reference `snapkv` first in each, when the
/// sweep has it), families of more than MAX_SERIES - 2 others split;
/// `full` is the dashed line at 100% memory where x is memory.
fn family_panels(plan: &Plan) -> Vec<(String, Vec<String>)> {
    let reference = resolve_method(plan, "snapkv").ok();
    let mut fams: Vec<(String, Vec<String>)> = Vec::new();
    for p in &plan.policies {
        if Some(p) == reference.as_ref() || short(p) == "full" {
            continue;
        }
        let f = rank::family(p);
        match fams.iter_mut().find(|x| x.0 == f) {
            Some(x) => x.1.push(p.clone()),
            None => fams.push((f, vec![p.clone()])),
        }
    }
    if fams.is_empty() {
        if let Some(r) = &reference {
            fams.push((rank::family(r), Vec::new()));
        }
    }
    let per = MAX_SERIES - 2; // the reference and the full-cache line
    let mut out = Vec::new();
    for (f, members) in fams {
        let parts = members.len().div_ceil(per).max(1);
        for (k, chunk) in members
            .chunks(per.max(1))
            .chain(members.is_empty().then_some(&[][..]))
            .enumerate()
        {
            let title = if parts > 1 {
                format!("{f} ({}/{parts})", k + 1)
            } else {
                f.clone()
            };
            let mut specs: Vec<String> = reference.iter().cloned().collect();
            specs.extend(chunk.iter().cloned());
            out.push((title, specs));
        }
    }
    out
}

/// A figure of `metric` with one panel per (title, specs, traces); `window`:
/// each trace's share held by sliding windows ([`Ranking::window`]).
#[allow(clippy::too_many_arguments)]
fn figure(
    plan: &Plan,
    points: &[PointResult],
    window: &[f64],
    file: &str,
    title: &str,
    caption: String,
    y_desc: &str,
    metric: &Metric,
    panels: &[(String, Vec<String>, Vec<usize>)],
) -> Figure {
    let x_ticks_for = |lo: f64, hi: f64| -> Vec<f64> {
        match metric.x {
            X::Budget => plan.budgets.iter().map(|&b| b as f64).collect(),
            X::Memory => {
                let mut v: Vec<f64> = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
                    .into_iter()
                    .chain(rank::SHARES)
                    .filter(|&t| t >= lo * (1.0 - 1e-9) && t <= hi * (1.0 + 1e-9))
                    .collect();
                v.sort_by(f64::total_cmp);
                v.dedup();
                v
            }
        }
    };
    // first pass: the series, with the ticks of the widest x range
    let window_of = |trace: &str| {
        plan.traces
            .iter()
            .position(|t| trace_name(t) == trace)
            .map_or(0.0, |i| window[i])
    };
    let all_x: Vec<f64> = points
        .iter()
        .map(|p| match metric.x {
            X::Memory => crate::sweep::compressible_share(
                p.summary.memory_ratio,
                window_of(&p.summary.trace),
            ),
            X::Budget => p.summary.budget as f64,
        })
        .filter(|x| *x > 0.0)
        .collect();
    let xlo = all_x.iter().copied().fold(f64::MAX, f64::min);
    let xhi = all_x.iter().copied().fold(0f64, f64::max).max(1.0);
    let xlo = if xlo.is_finite() && xlo < xhi {
        xlo
    } else {
        xhi / 10.0
    };
    let ticks = x_ticks_for(xlo, xhi);
    let mut out_panels = Vec::new();
    for (ptitle, specs, traces) in panels {
        let mut series = Vec::new();
        for spec in specs {
            let cs = curves(plan, points, spec, metric.x, window, &|s| (metric.y)(s));
            let cs: Vec<&Curve> = traces
                .iter()
                .filter_map(|&i| cs.get(i).and_then(|c| c.1.as_ref()))
                .collect();
            if cs.len() < traces.len() {
                continue; // a trace without finished points of this policy
            }
            if let Some(s) = series_over(label(plan, spec), &cs, &ticks) {
                series.push(s);
            }
        }
        let vline = (metric.x == X::Memory && plan.policies.iter().any(|p| short(p) == "full"))
            .then(|| (1.0, "full cache (100%)".to_string()));
        out_panels.push(Panel {
            title: ptitle.clone(),
            series,
            vline,
        });
    }
    // y: log when positive values span more than a decade
    let ys: Vec<f64> = out_panels
        .iter()
        .flat_map(|p| p.series.iter())
        .flat_map(|s| {
            s.line
                .iter()
                .map(|p| p.1)
                .chain(s.band.iter().flat_map(|b| [b.1, b.2]))
        })
        .filter(|y| y.is_finite())
        .collect();
    // the lower end from the lines only (a band reaching towards 0 would
    // squash them on a log axis)
    let pos: Vec<f64> = out_panels
        .iter()
        .flat_map(|p| p.series.iter())
        .flat_map(|s| s.line.iter().map(|p| p.1))
        .filter(|&y| y > 0.0 && y.is_finite())
        .collect();
    let (pmin, ymax) = (
        pos.iter().copied().fold(f64::MAX, f64::min),
        ys.iter().copied().fold(0f64, f64::max).max(1e-6),
    );
    let (y_log, y_range) = match metric.y_range {
        Some(r) => (false, r),
        None if metric.log_y_ok && !pos.is_empty() && ymax / pmin > 10.0 => {
            // the 1-2-5 values just outside the lines
            let lhi = pos.iter().copied().fold(0f64, f64::max);
            let steps = |e: i32| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e));
            let e0 = pmin.log10().floor() as i32;
            let lo = steps(e0)
                .into_iter()
                .rev()
                .find(|&v| v <= pmin * (1.0 + 1e-9))
                .unwrap_or(10f64.powi(e0));
            let e1 = lhi.log10().floor() as i32;
            let hi = steps(e1)
                .into_iter()
                .chain([10f64.powi(e1 + 1)])
                .find(|&v| v >= lhi * (1.0 - 1e-9))
                .unwrap_or(10f64.powi(e1 + 1));
            // at most three decades: what lies below sits on the lower edge
            (true, (lo.max(hi / 1000.0), hi))
        }
        None => (false, (0.0, ymax * 1.05)),
    };
    let y_ticks = if y_log {
        log_ticks(y_range.0, y_range.1)
    } else {
        linear_ticks(y_range.0, y_range.1)
    };
    // x: what the panels draw (and the full-cache line), a little wider
    let xs: Vec<f64> = out_panels
        .iter()
        .flat_map(|p| {
            p.series
                .iter()
                .flat_map(|s| s.line.iter().map(|q| q.0))
                .chain(p.vline.as_ref().map(|v| v.0))
        })
        .filter(|x| *x > 0.0 && x.is_finite())
        .collect();
    let (dlo, dhi) = if xs.is_empty() {
        (xlo, xhi)
    } else {
        (
            xs.iter().copied().fold(f64::MAX, f64::min),
            xs.iter().copied().fold(0f64, f64::max),
        )
    };
    let x_range = (dlo / 1.2, dhi * 1.2);
    let ticks: Vec<f64> = ticks
        .into_iter()
        .filter(|&t| t >= x_range.0 && t <= x_range.1)
        .collect();
    let mut caption = caption;
    if y_log {
        caption += " Error on a log axis; errors below its lower end (0 included) sit on it.";
    }
    Figure {
        file: file.into(),
        title: title.into(),
        caption,
        x: Axis {
            desc: match metric.x {
                X::Memory if window.iter().any(|w| *w > 0.0) => {
                    "memory, share of the f16 cache beyond the sliding windows (log)".into()
                }
                X::Memory => "memory, share of the full f16 cache (log)".into(),
                X::Budget => "budget, entries per KV head and layer (log)".into(),
            },
            log: true,
            range: x_range,
            ticks,
            percent: metric.x == X::Memory,
        },
        y: Axis {
            desc: y_desc.into(),
            log: y_log,
            range: y_range,
            ticks: y_ticks,
            percent: false,
        },
        panels: out_panels,
    }
}

/// The report's line figures, in the report's order (the ranking decides
/// which policies the per-trace panels show).
pub fn figures(plan: &Plan, points: &[PointResult], ranking: &Ranking) -> Vec<Figure> {
    let all: Vec<usize> = (0..plan.traces.len()).collect();
    let fam: Vec<(String, Vec<String>, Vec<usize>)> = family_panels(plan)
        .into_iter()
        .map(|(t, s)| (t, s, all.clone()))
        .collect();
    let n = plan.traces.len();
    let band = if n > 1 {
        format!(
            " Lines: mean over the {n} traces where all of them are measured; shaded: 95% \
             t-interval of that mean over traces (Student's t, {} degrees of freedom)",
            n - 1
        )
    } else {
        " Lines: the one trace's measured points".to_string()
    };
    let err = Metric {
        x: X::Memory,
        y: |s| Some(s.rel_l2_mean),
        log_y_ok: true,
        y_range: None,
    };
    let mut figs = vec![figure(
        plan,
        points,
        &ranking.window,
        "error_vs_memory.svg",
        "Error against memory, by method family",
        format!(
            "Each panel: one family of methods with <code>snapkv</code> as the fixed \
             reference; the dashed line is the full cache. Each trace's error is interpolated \
             linearly in memory between its measured budgets (no extrapolation), as in the \
             ranking.{band}. Markers at the memory shares labelled on the axis and at the ends \
             of the common range. *: no memory share is measured on every trace (its memory \
             does not follow the budget): the mean memory and error per budget instead."
        ),
        "relative L2 error of attention output",
        &err,
        &fam,
    )];
    let groups = rank::trace_groups(plan);
    if groups.len() > 1 {
        // the policies ranked best at the primary share, and the reference
        let reference = resolve_method(plan, "snapkv").ok();
        let mut specs: Vec<String> = reference.iter().cloned().collect();
        for r in &ranking.rows {
            if specs.len() >= MAX_SERIES - 1 {
                break;
            }
            if !specs.contains(&r.spec) && short(&r.spec) != "full" {
                specs.push(r.spec.clone());
            }
        }
        let panels: Vec<(String, Vec<String>, Vec<usize>)> = groups
            .into_iter()
            .map(|(t, ix)| (t, specs.clone(), ix))
            .collect();
        figs.push(figure(
            plan,
            points,
            &ranking.window,
            "error_vs_memory_by_trace.svg",
            "Error against memory, per task and prompt length",
            format!(
                "The {} policies ranked best at {} of the full cache, with <code>snapkv</code>, \
                 on each task and prompt length, over each trace's whole measured range \
                 (markers: measured budgets).",
                specs.len() - usize::from(reference.is_some()),
                percent(rank::PRIMARY)
            ),
            "relative L2 error of attention output",
            &err,
            &panels,
        ));
    }
    figs.push(figure(
        plan,
        points,
        &ranking.window,
        "error_vs_budget.svg",
        "Error against budget, by method family",
        format!(
            "The same errors against the budget a policy is given. Policies do not use equal \
             memory at equal budget (merging and per-query-head caches use more, quantised \
             ones less), so compare methods at equal memory, above.{band}; markers at the \
             swept budgets."
        ),
        "relative L2 error of attention output",
        &Metric {
            x: X::Budget,
            ..err
        },
        &fam,
    ));
    if points.iter().any(|p| p.summary.needle_retention.is_some()) {
        figs.push(figure(
            plan,
            points,
            &ranking.window,
            "needle_retention.svg",
            "Needle retention against memory, by method family",
            format!(
                "Share of the needle span's prompt positions still represented at the end, \
                 over layers and cache heads, interpolated in memory like the error.{band}."
            ),
            "needle retention",
            &Metric {
                x: X::Memory,
                y: |s| s.needle_retention,
                log_y_ok: false,
                y_range: Some((0.0, 1.05)),
            },
            &fam,
        ));
    }
    figs
}

/// Where each policy keeps its tokens, by family, at the middle budget.
fn retention_figure(a: &Agg, plan: &Plan) -> Figure {
    let b = a.mid_budget();
    let panels = family_panels(plan)
        .into_iter()
        .map(|(title, specs)| {
            let series = specs
                .iter()
                .filter_map(|spec| {
                    let i = a.policies.iter().position(|p| p == spec)?;
                    let cell = a.cells.get(&(i, b))?;
                    let mut line = Vec::new();
                    let mut band = Vec::new();
                    for k in 0..RETENTION_BINS {
                        let v: Vec<f64> = cell.iter().map(|p| p.retention[k]).collect();
                        let x = (k as f64 + 0.5) / RETENTION_BINS as f64;
                        line.push((x, crate::stats::mean(&v)));
                        if let Some(c) = crate::stats::t_interval95(&v) {
                            band.push((x, c[0], c[1]));
                        }
                    }
                    Some(Series {
                        label: a.label(i),
                        marks: line.clone(),
                        line,
                        band,
                    })
                })
                .collect();
            Panel {
                title,
                series,
                vline: None,
            }
        })
        .collect();
    Figure {
        file: "retention_by_position.svg".into(),
        title: format!("Where each policy keeps its tokens (budget {b})"),
        caption: format!(
            "Share of the prompt positions of each tenth of the prompt still represented at the \
             end, over layers and cache heads, at budget {b}; mean over traces, shaded: 95% \
             t-interval over traces."
        ),
        x: Axis {
            desc: "relative position in the prompt".into(),
            log: false,
            range: (0.0, 1.0),
            ticks: vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
            percent: false,
        },
        y: Axis {
            desc: "share retained".into(),
            log: false,
            range: (0.0, 1.05),
            ticks: vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
            percent: false,
        },
        panels,
    }
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

/// The summary table's cells for policy `i` at budget `b`: the means over
/// traces of rel_l2_mean, rel_l2_p95, cosine, attention mass, entry-KL,
/// memory ratio and needle retention (`missing` where there is none).
fn summary_cells(a: &Agg, i: usize, b: usize, missing: &str) -> [String; 7] {
    let f = |g: &dyn Fn(&PointResult) -> Option<f64>| {
        a.stat(i, b, g)
            .map(|x| format!("{:.4}", x.1))
            .unwrap_or_else(|| missing.into())
    };
    [
        f(&|p| Some(p.summary.rel_l2_mean)),
        f(&|p| Some(p.summary.rel_l2_p95)),
        f(&|p| Some(p.summary.cosine_mean)),
        f(&|p| Some(p.summary.attn_mass_mean)),
        f(&|p| Some(p.summary.kl_mean)),
        f(&|p| Some(p.summary.memory_ratio)),
        f(&|p| p.summary.needle_retention),
    ]
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

/// What each summary column means (the table's header titles and the glossary).
const GLOSSARY: [(&str, &str); 9] = [
    ("policy", "The compression policy (full spec under Provenance)."),
    ("budget", "Entries per KV head and layer the policy is given. Not memory: merging, per-query-head and quantised caches use more or less at the same budget."),
    ("rel_l2", "Relative L2 error of the per-head attention output, ‖o′ − o‖ / ‖o‖ against the full cache, averaged over layers, heads and decode steps, then over traces. Lower is better."),
    ("rel_l2 p95", "95th percentile over (layer, head) of the step-averaged relative L2 error."),
    ("cosine", "Cosine similarity between the compressed and full attention outputs (1 is identical)."),
    ("attn_mass", "Full-cache attention probability on the prompt positions the compressed cache still represents (1 for full)."),
    ("entry-KL", "KL(full ‖ compressed) over the cache's entries: the full attention summed over each entry's member positions and renormalised over what the cache represents, against the compressed attention over the entries. It measures how merging, bias and quantisation distort the distribution among represented positions, not a model-level KL over tokens; 0 by construction for pure eviction (the probability eviction loses is attn_mass's business). CSV column kl_mean."),
    ("memory", "Bytes of the compressed cache at the end of the run as a share of the full f16 cache (can exceed 1)."),
    ("needle", "Share of the needle span's prompt positions still represented at the end, over layers and cache heads (tasks with a needle only)."),
];

const SORT_JS: &str = "document.querySelectorAll('table.sortable th').forEach(function(th,i){th.style.cursor='pointer';th.addEventListener('click',function(){var t=th.closest('table'),b=t.tBodies[0],r=Array.prototype.slice.call(b.rows),d=th.dataset.dir=th.dataset.dir==='asc'?'desc':'asc';var v=function(x){var s=x.cells[i].textContent,n=parseFloat(s);return isNaN(n)?s:n};r.sort(function(a,c){var p=v(a),q=v(c),o=(typeof p==='number'&&typeof q==='number')?p-q:(typeof p==='number'?-1:(typeof q==='number'?1:String(p).localeCompare(String(q))));return d==='asc'?o:-o});r.forEach(function(x){b.appendChild(x)})})});";

/// The sortable table of a ranking: policy, family, `short` at each share.
fn ranking_table(ranking: &Ranking, metric: &str, short: &str) -> String {
    let mut html =
        String::from("<table class=\"sortable\"><thead><tr><th>policy</th><th>family</th>");
    for &m in &ranking.shares {
        html.push_str(&format!(
            "<th title=\"{metric} at {0} of the full cache\">{short} at {0}</th>",
            percent(m)
        ));
    }
    html.push_str("</tr></thead><tbody>");
    let ranks: Vec<Vec<Option<usize>>> = (0..ranking.shares.len())
        .map(|k| ranking.ranks_at(k))
        .collect();
    for (i, r) in ranking.rows.iter().enumerate() {
        html.push_str(&format!(
            "<tr><td>{}</td><td>{}</td>",
            esc(&r.label),
            esc(&r.family)
        ));
        for (k, x) in r.at.iter().enumerate() {
            html.push_str(&at_cell(x, ranks[k][i]));
        }
        html.push_str("</tr>");
    }
    html.push_str("</tbody></table>");
    html
}

fn at_cell(a: &At, rank: Option<usize>) -> String {
    match a {
        At::Value { mean, ci, .. } => {
            let ci = ci.map_or(String::new(), |c| format!(" [{:.4}, {:.4}]", c[0], c[1]));
            format!(
                "<td>{mean:.4}<small>{ci}</small>{}</td>",
                rank.map_or(String::new(), |r| format!(" <small>#{r}</small>"))
            )
        }
        At::NotReached(why) => format!("<td class=\"nr\" title=\"{}\">not reached</td>", esc(why)),
    }
}

fn tex(s: &str) -> String {
    s.replace('\\', "\\textbackslash{}")
        .replace('_', "\\_")
        .replace('&', "\\&")
        .replace('%', "\\%")
        .replace('#', "\\#")
}

/// `summary.tex`: the matched-memory ranking and the summary, booktabs tables.
fn latex(a: &Agg, r: &Ranking) -> String {
    let mut s = String::from(
        "% kvreplay sweep: tables for \\usepackage{booktabs}\n\
         % Mean relative L2 error at matched memory (interpolated per trace), 95% bootstrap CI over traces.\n\
         \\begin{tabular}{l",
    );
    s += &"r".repeat(r.shares.len());
    s += "}\n\\toprule\npolicy";
    for &m in &r.shares {
        s += &format!(" & {}", tex(&format!("at {}", percent(m))));
    }
    s += " \\\\\n\\midrule\n";
    for row in &r.rows {
        s += &tex(&row.label);
        for x in &row.at {
            s += &match x {
                At::Value {
                    mean, ci: Some(c), ..
                } => {
                    format!(" & {mean:.4} [{:.4}, {:.4}]", c[0], c[1])
                }
                At::Value { mean, ci: None, .. } => format!(" & {mean:.4}"),
                At::NotReached(_) => " & --".into(),
            };
        }
        s += " \\\\\n";
    }
    s += "\\bottomrule\n\\end{tabular}\n\n% Summary: mean over traces per policy and budget (entry-KL: KL over cache entries, 0 for pure eviction).\n\\begin{tabular}{lrrrrrrrr}\n\\toprule\npolicy & budget & rel.\\ L2 & rel.\\ L2 p95 & cosine & attn.\\ mass & entry-KL & memory & needle \\\\\n\\midrule\n";
    for i in 0..a.policies.len() {
        for &b in &a.budgets {
            if !a.cells.contains_key(&(i, b)) {
                continue;
            }
            s += &format!(
                "{} & {b} & {} \\\\\n",
                tex(&a.label(i)),
                summary_cells(a, i, b, "--").join(" & ")
            );
        }
    }
    s += "\\bottomrule\n\\end{tabular}\n";
    s
}

/// Write the plots, `summary.tex` and `report.html` into the sweep folder `out`.
pub fn write(out: &Path, plan: &Plan) -> Result<(), SweepError> {
    let command = command(plan);
    let (points, failed) = load_results(out, plan)?;
    if points.is_empty() {
        return Err(SweepError::Plan(format!(
            "{}: no finished points to report",
            out.display()
        )));
    }
    let unverified = points.iter().filter(|p| p.unverified).count();
    let ranking = rank::rank(plan, &points, &rank::SHARES);
    // by the predicted end-to-end KL, where every trace has a sensitivity profile
    let by_kl = points
        .iter()
        .all(|p| p.summary.predicted_kl.is_some())
        .then(|| rank::rank_by(plan, &points, &rank::SHARES, &|s| s.predicted_kl));
    let figs = figures(plan, &points, &ranking);
    let comparison = paired(plan, &points, &ranking);
    let a = Agg::new(plan, points);
    let retention = retention_figure(&a, plan);
    fn plot_err(name: &str) -> impl Fn(Box<dyn std::error::Error>) -> SweepError + '_ {
        move |e| SweepError::Plan(format!("plotting {name}: {e}"))
    }
    // each plot is drawn under a temporary name and renamed when whole
    let plot = |name: &str, f: &dyn Fn(&Path) -> PlotResult| {
        let tmp = out.join(format!(".{name}.{}.tmp", std::process::id()));
        if let Err(e) = f(&tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(plot_err(name)(e));
        }
        std::fs::rename(&tmp, out.join(name)).map_err(|err| SweepError::Io {
            path: out.join(name),
            err,
        })
    };
    let mut plots: Vec<(String, String, String)> = Vec::new();
    for f in figs.iter().chain([&retention]) {
        plot(&f.file, &|p| crate::figure::draw(f, p))?;
        plots.push((f.file.clone(), f.title.clone(), f.caption.clone()));
    }
    plot("layer_error_heatmap.svg", &|p| layer_heatmap(&a, p))?;
    plots.push((
        "layer_error_heatmap.svg".into(),
        "Error per layer".into(),
        format!(
            "Mean relative L2 error per layer and policy at budget {}, over traces and heads.",
            a.mid_budget()
        ),
    ));
    crate::sweep::write_atomic(&out.join("summary.tex"), latex(&a, &ranking).as_bytes())?;

    let mut html = String::from("<!doctype html><html><head><meta charset=\"utf-8\"><title>kvreplay sweep report</title><style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222;line-height:1.4}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}td.nr{color:#888}small{color:#555}code{font-size:12px}svg{max-width:100%;height:auto}.cap{font-size:14px;color:#444}dt{font-weight:bold}</style></head><body>");
    html.push_str(&format!(
        "<h1>kvreplay sweep</h1><p>{} traces × {} policies × {} budgets, computed on {}. \
         Error is the relative L2 error of the per-head attention output against the full \
         cache, averaged over layers, heads and decode steps. Policies do not use equal memory \
         at equal budget, so they are ranked and compared at equal <em>memory</em> (bytes of \
         the compressed cache as a share of the full f16 cache).</p>",
        plan.traces.len(),
        a.policies.len(),
        a.budgets.len(),
        esc(&plan.device)
    ));
    // 1. the ranking at matched memory
    html.push_str(&format!(
        "<h2 id=\"ranking\">Ranking at matched memory</h2><p class=\"cap\">On each trace, each \
         policy's error is interpolated linearly in memory share between the two measured \
         budgets that bracket the share (no extrapolation: a policy whose measured range misses \
         the share on some trace is shown as <em>not reached</em>, hover for where). Cells: \
         mean over {} traces, <small>[95% percentile bootstrap interval over traces, {} \
         resamples, seed {}]</small> and rank at that share. Ordered by the error at {}. With \
         few traces the bootstrap interval is narrower than it should be: read it as a \
         description of these traces.</p>",
        ranking.traces,
        rank::RESAMPLES,
        rank::SEED,
        percent(ranking.shares[ranking.primary])
    ));
    if ranking.windows() {
        html.push_str(
            "<p class=\"cap\">Some traces come from a model with sliding-window layers \
             (Gemma 3): their windows (min(T, W) entries per layer) stay as they are by default, \
             so a share here is of the rest of the cache: 10% means the windows plus 10% of \
             the full-attention layers' cache (the x axis of the memory plots likewise). The \
             error is still the mean over every layer, sliding ones included.</p>",
        );
    }
    html.push_str(&ranking_table(&ranking, "mean relative L2 error", "error"));
    if let Some(by_kl) = &by_kl {
        html.push_str(
            "<h2 id=\"predicted\">Ranking by predicted end-to-end KL</h2><p class=\"cap\">The same \
             matched-memory ranking by <code>predicted_kl</code>: each layer's mean squared \
             relative output error weighted by the trace's depth-sensitivity profile (how much \
             an error on that layer moves the model's next-token distribution, measured with \
             the model by <code>kvreplay sensitivity</code>). How well it predicts the model: \
             README, \"Does replay predict the model?\".</p>",
        );
        html.push_str(&ranking_table(
            by_kl,
            "predicted end-to-end KL",
            "predicted KL",
        ));
    }
    // 2. the paired comparison
    html.push_str("<h2 id=\"paired\">Paired comparison</h2>");
    match &comparison {
        Ok(c) => {
            for l in &c.levels {
                html.push_str(&format!(
                    "<p><b>{}</b></p><p class=\"cap\">Per trace, A = {} and B = {}, each \
                     interpolated at {} of the full cache; difference A − B (negative: A \
                     lower); interval: 95% percentile bootstrap of the mean difference over \
                     traces ({} resamples, seed {}); p: paired sign-flip permutation test. \
                     Other pairs: <code>kvreplay compare SWEEP --a X --b Y --memory 0.2</code>.</p>\
                     <table><thead><tr><th>trace</th><th>A error</th><th>B error</th><th>A − B</th></tr></thead><tbody>",
                    esc(&l.statement),
                    esc(&c.a_label),
                    esc(&c.b_label),
                    percent(l.memory),
                    c.resamples,
                    c.seed
                ));
                for t in &l.traces {
                    html.push_str(&format!(
                        "<tr><td>{}</td><td>{:.4}</td><td>{:.4}</td><td>{:+.4}</td></tr>",
                        esc(&t.trace),
                        t.a_error,
                        t.b_error,
                        t.diff
                    ));
                }
                html.push_str("</tbody></table>");
            }
        }
        Err(why) => html.push_str(&format!("<p>No paired comparison: {}.</p>", esc(why))),
    }
    // 3. the plots
    for (file, title, caption) in &plots {
        let svg = std::fs::read_to_string(out.join(file)).map_err(|e| SweepError::Io {
            path: out.join(file),
            err: e,
        })?;
        let svg = svg
            .find("<svg")
            .map(|i| &svg[i..])
            .unwrap_or(&svg)
            .to_string();
        html.push_str(&format!(
            "<h2>{}</h2><p class=\"cap\">{} (<code>{}</code>)</p>{}",
            esc(title),
            caption,
            esc(file),
            svg
        ));
    }
    // 4. the summary table, sortable, each column explained
    html.push_str("<h2 id=\"summary\">Summary (mean over traces)</h2><p class=\"cap\">Click a column header to sort; hover it for its meaning. The same numbers per trace: <code>summary.csv</code> (entry-KL is its <code>kl_mean</code>); as LaTeX: <code>summary.tex</code>.</p><details><summary>What each column means</summary><dl>");
    for (k, v) in GLOSSARY {
        html.push_str(&format!("<dt>{}</dt><dd>{}</dd>", esc(k), esc(v)));
    }
    html.push_str("</dl></details><table class=\"sortable\"><thead><tr>");
    for (k, v) in GLOSSARY {
        html.push_str(&format!("<th title=\"{}\">{}</th>", esc(v), esc(k)));
    }
    html.push_str("</tr></thead><tbody>");
    for i in 0..a.policies.len() {
        for &b in &a.budgets {
            html.push_str(&format!(
                "<tr><td>{}</td><td>{b}</td><td>{}</td></tr>",
                esc(&a.label(i)),
                summary_cells(&a, i, b, "-").join("</td><td>")
            ));
        }
    }
    html.push_str("</tbody></table>");
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
        "</ul><p>kvreplay {}; command: <code>{}</code>. CSVs: <code>results.csv</code> (one row per point, layer and head), <code>summary.csv</code> (one row per point).</p><script>{SORT_JS}</script></body></html>\n",
        env!("CARGO_PKG_VERSION"),
        esc(&command)
    ));
    crate::sweep::write_atomic(&out.join("report.html"), html.as_bytes())?;
    // PNGs last: the report does not need them
    for (file, _, _) in &plots {
        crate::figure::png(&out.join(file));
    }
    Ok(())
}

/// The paired comparison the report makes: the policy ranked best at the
/// primary share against `snapkv` there (against the second best when
/// `snapkv` is the best or not in the sweep).
fn paired(plan: &Plan, points: &[PointResult], r: &Ranking) -> Result<Comparison, String> {
    let best = r
        .best()
        .ok_or_else(|| {
            format!(
                "no policy reaches {} of the full cache on every trace",
                percent(r.shares[r.primary])
            )
        })?
        .spec
        .clone();
    let reaches = |spec: &str| {
        r.rows
            .iter()
            .any(|x| x.spec == spec && x.at[r.primary].mean().is_some())
    };
    let other = match resolve_method(plan, "snapkv") {
        Ok(s) if s != best && reaches(&s) => s,
        _ => r
            .rows
            .iter()
            .skip(1)
            .find(|x| x.at[r.primary].mean().is_some())
            .map(|x| x.spec.clone())
            .ok_or("only one policy reaches that share on every trace")?,
    };
    compare_points(
        plan,
        points,
        &Options {
            a: best,
            b: other,
            memory: Some(vec![r.shares[r.primary]]),
            confidence: rank::CONFIDENCE,
            resamples: rank::RESAMPLES,
            seed: rank::SEED,
        },
    )
    .map_err(|e| e.to_string())
}
