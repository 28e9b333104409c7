//! validation.csv, the predictor table (all points and held-out traces), the
//! points where replay misleads, a scatter plot and report.md.

use std::path::Path;

use kvreplay_analysis::stats::{ranks, spearman};
use plotters::prelude::*;
use serde::Serialize;

use crate::{Row, ValidateError, PREDICTORS};

/// Spearman correlation of one predictor with the end-to-end KL.
#[derive(Clone, Debug, Serialize)]
pub struct Correlation {
    pub predictor: String,
    /// Over every point of every trace.
    pub all: f64,
    /// Over the points of the held-out traces (None with one trace).
    pub held_out: Option<f64>,
    /// Over the points of the traces the best predictor was chosen on.
    pub selection: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub points: usize,
    pub traces: Vec<String>,
    pub selection_traces: Vec<String>,
    pub held_out_traces: Vec<String>,
    pub correlations: Vec<Correlation>,
    /// The predictor with the highest correlation on the selection traces
    /// (on all points with one trace).
    pub best: String,
    /// Points ranked far apart by replay rel_l2 and by end-to-end KL.
    pub disagreements: Vec<String>,
    pub closed_loop_seconds_per_point: f64,
    pub replay_seconds_per_point: f64,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ValidateError + '_ {
    move |err| ValidateError::Io {
        path: path.display().to_string(),
        err,
    }
}

fn rho(rows: &[&Row], f: fn(&Row) -> f64) -> f64 {
    let x: Vec<f64> = rows.iter().map(|r| f(r)).collect();
    let y: Vec<f64> = rows.iter().map(|r| r.e2e_kl).collect();
    spearman(&x, &y)
}

/// The summary of `rows`: correlations on all points, the best predictor
/// chosen on the first half of the traces and scored on the rest, and the
/// points whose ranks by replay rel_l2 and by end-to-end KL differ by more
/// than a third of the points (within their trace).
pub fn summarise(rows: &[Row]) -> Summary {
    let mut traces: Vec<String> = rows.iter().map(|r| r.trace.clone()).collect();
    traces.dedup();
    let half = traces.len() / 2;
    let (sel, held): (Vec<String>, Vec<String>) = if traces.len() >= 2 {
        (traces[..half].to_vec(), traces[half..].to_vec())
    } else {
        (traces.clone(), Vec::new())
    };
    let all: Vec<&Row> = rows.iter().collect();
    let pick = |names: &[String]| -> Vec<&Row> {
        rows.iter().filter(|r| names.contains(&r.trace)).collect()
    };
    let (sel_rows, held_rows) = (pick(&sel), pick(&held));
    let correlations: Vec<Correlation> = PREDICTORS
        .iter()
        .map(|(name, f)| Correlation {
            predictor: name.to_string(),
            all: rho(&all, *f),
            held_out: (!held_rows.is_empty()).then(|| rho(&held_rows, *f)),
            selection: (!held_rows.is_empty()).then(|| rho(&sel_rows, *f)),
        })
        .collect();
    let score = |c: &Correlation| c.selection.unwrap_or(c.all);
    let best = correlations
        .iter()
        .filter(|c| score(c).is_finite())
        .max_by(|a, b| kvreplay_replay::select::cmp_f64(score(a), score(b)))
        .map(|c| c.predictor.clone())
        .unwrap_or_default();
    let mut disagreements = Vec::new();
    for t in &traces {
        let tr: Vec<&Row> = rows.iter().filter(|r| &r.trace == t).collect();
        let rx = ranks(&tr.iter().map(|r| r.replay_rel_l2).collect::<Vec<_>>());
        let ry = ranks(&tr.iter().map(|r| r.e2e_kl).collect::<Vec<_>>());
        let n = tr.len() as f64;
        for (i, r) in tr.iter().enumerate() {
            let d = rx[i] - ry[i];
            if d.abs() > n / 3.0 {
                disagreements.push(format!(
                    "{} {} B={}: replay rel_l2 rank {:.0} of {n}, end-to-end KL rank {:.0} ({})",
                    r.trace,
                    r.policy,
                    r.budget,
                    rx[i],
                    ry[i],
                    if d > 0.0 {
                        "replay looks worse than it is"
                    } else {
                        "replay looks better than it is"
                    }
                ));
            }
        }
    }
    let n = rows.len().max(1) as f64;
    Summary {
        points: rows.len(),
        traces,
        selection_traces: if held.is_empty() { Vec::new() } else { sel },
        held_out_traces: held,
        correlations,
        best,
        disagreements,
        closed_loop_seconds_per_point: rows.iter().map(|r| r.closed_loop_seconds).sum::<f64>() / n,
        replay_seconds_per_point: rows.iter().map(|r| r.replay_seconds).sum::<f64>() / n,
    }
}

/// Write validation.csv, summary.json, scatter.svg and report.md into `out`.
pub fn write(out: &Path, rows: &[Row], command: &str) -> Result<Summary, ValidateError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let csv_path = out.join("validation.csv");
    let mut w = csv::Writer::from_path(&csv_path).map_err(|e| ValidateError::Input {
        path: csv_path.display().to_string(),
        msg: e.to_string(),
    })?;
    for r in rows {
        w.serialize(r).map_err(|e| ValidateError::Input {
            path: csv_path.display().to_string(),
            msg: e.to_string(),
        })?;
    }
    w.flush().map_err(io(&csv_path))?;
    let s = summarise(rows);
    let js = out.join("summary.json");
    std::fs::write(
        &js,
        serde_json::to_string_pretty(&s).expect("serialises") + "\n",
    )
    .map_err(io(&js))?;
    scatter(&out.join("scatter.svg"), rows).map_err(|e| ValidateError::Input {
        path: out.join("scatter.svg").display().to_string(),
        msg: e.to_string(),
    })?;
    let mut md = String::new();
    md += "# Closed-loop validation\n\n";
    md += &format!("`{command}`\n\n");
    md += &format!(
        "{} points over {} trace(s). Cost per point: closed loop (teacher-forced + free-running decode) {:.2} s, replay {:.2} s.\n\n",
        s.points,
        s.traces.len(),
        s.closed_loop_seconds_per_point,
        s.replay_seconds_per_point
    );
    md += "Spearman rank correlation of each replay statistic with the end-to-end KL(full || compressed) of the next-token distribution";
    if s.held_out_traces.is_empty() {
        md += " (one trace: no held-out split):\n\n| predictor | all points |\n|---|---|\n";
        for c in &s.correlations {
            md += &format!("| {} | {:.3} |\n", c.predictor, c.all);
        }
    } else {
        md += &format!(
            ". The best predictor is chosen on {} and scored on the held-out {}:\n\n| predictor | all points | selection traces | held-out traces |\n|---|---|---|---|\n",
            s.selection_traces.join(", "),
            s.held_out_traces.join(", ")
        );
        for c in &s.correlations {
            md += &format!(
                "| {} | {:.3} | {:.3} | {:.3} |\n",
                c.predictor,
                c.all,
                c.selection.unwrap_or(f64::NAN),
                c.held_out.unwrap_or(f64::NAN)
            );
        }
    }
    md += &format!(
        "\nBest predictor (chosen on the selection traces): **{}**.\n\n",
        s.best
    );
    md += "Points where replay misleads (ranked more than a third of the points apart by replay rel_l2 and by end-to-end KL, within their trace):\n\n";
    if s.disagreements.is_empty() {
        md += "- none\n";
    }
    for d in &s.disagreements {
        md += &format!("- {d}\n");
    }
    md += "\n![replay error against end-to-end KL](scatter.svg)\n";
    let rp = out.join("report.md");
    std::fs::write(&rp, md).map_err(io(&rp))?;
    Ok(s)
}

fn scatter(path: &Path, rows: &[Row]) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let floor = 1e-6f64;
    let pts: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.replay_rel_l2, r.e2e_kl.max(floor).log10()))
        .collect();
    let xmax = pts.iter().map(|p| p.0).fold(0f64, f64::max).max(1e-3) * 1.05;
    let (ymin, ymax) = pts
        .iter()
        .fold((0f64, -6f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let mut chart = ChartBuilder::on(&root)
        .caption("Replay error against end-to-end KL", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax, (ymin - 0.2)..(ymax + 0.2))?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("replay: mean relative L2 error of attention outputs")
        .y_desc("log10 end-to-end KL (teacher-forced)")
        .draw()?;
    let mut policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    policies.sort();
    policies.dedup();
    for (i, p) in policies.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        let mine: Vec<(f64, f64)> = rows
            .iter()
            .zip(&pts)
            .filter(|(r, _)| r.policy == *p)
            .map(|(_, q)| *q)
            .collect();
        chart
            .draw_series(mine.iter().map(|q| Circle::new(*q, 4, c.filled())))?
            .label(*p)
            .legend(move |(x, y)| Circle::new((x + 8, y), 4, c.filled()));
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
