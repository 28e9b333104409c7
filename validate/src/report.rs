//! validation.csv, the predictor table (all points and held-out traces), the
//! points where replay misleads, a scatter plot and report.md.

use std::collections::BTreeMap;
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
    /// Over the points of the policies outside the held-out families.
    pub family_selection: Option<f64>,
    /// Over the points of the held-out families (merging methods).
    pub family_held_out: Option<f64>,
    /// Area under the ROC curve of the predictor (lower = kept) for whether
    /// free-running generation still contains the needle (None without
    /// needle tasks or where every point agrees).
    pub needle_auc: Option<f64>,
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
    /// The predictor with the highest correlation on the policies outside
    /// the held-out families.
    pub best_by_family: String,
    pub held_out_families: Vec<String>,
    /// The predicted KL calibrated on the selection traces: per policy
    /// family, and per policy (each falling back to the coarser factor,
    /// then to the overall one, where the selection traces have no point).
    pub calibrated: Vec<Correlation>,
    /// The factors fitted on the selection traces (all points with one
    /// trace): median of end-to-end KL / predicted KL per family and overall.
    pub family_scale: BTreeMap<String, f64>,
    pub overall_scale: f64,
    /// Points ranked far apart by replay rel_l2 and by end-to-end KL.
    pub disagreements: Vec<String>,
    /// The closed loop's in-loop statistics ([`crate::IN_LOOP`]): Spearman
    /// with the end-to-end KL on all points and the held-out traces.
    pub in_loop: Vec<Correlation>,
    /// Per policy family: (family, points, mean query drift, mean
    /// end-to-end KL).
    pub drift_by_family: Vec<(String, usize, f64, f64)>,
    pub closed_loop_seconds_per_point: f64,
    pub replay_seconds_per_point: f64,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ValidateError + '_ {
    move |err| ValidateError::Io {
        path: path.display().to_string(),
        err,
    }
}

/// AUC of `score` (lower predicts a positive) for the labels: the share of
/// (positive, negative) pairs the score orders right, ties counting half.
pub fn auc(score: &[f64], positive: &[bool]) -> Option<f64> {
    let r = ranks(&score.iter().map(|x| -x).collect::<Vec<_>>());
    let np = positive.iter().filter(|p| **p).count() as f64;
    let nn = positive.len() as f64 - np;
    if np == 0.0 || nn == 0.0 {
        return None;
    }
    // Mann-Whitney U from the positives' rank sum (ranks are 1-based, ties averaged)
    let sum: f64 = r
        .iter()
        .zip(positive)
        .filter(|(_, p)| **p)
        .map(|(x, _)| x)
        .sum();
    Some((sum - np * (np + 1.0) / 2.0) / (np * nn))
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
    let (fam_held, fam_sel): (Vec<&Row>, Vec<&Row>) = rows
        .iter()
        .partition(|r| crate::HELD_OUT_FAMILIES.contains(&r.family.as_str()));
    let by_family = !fam_held.is_empty() && !fam_sel.is_empty();
    let needle: Vec<&Row> = rows.iter().filter(|r| r.needle_kept.is_some()).collect();
    let kept: Vec<bool> = needle.iter().map(|r| r.needle_kept == Some(true)).collect();
    // each statistic of `list` against the end-to-end KL on every split
    let correlate = |list: &[(&str, crate::Predictor)]| -> Vec<Correlation> {
        list.iter()
            .map(|(name, f)| Correlation {
                predictor: name.to_string(),
                all: rho(&all, *f),
                held_out: (!held_rows.is_empty()).then(|| rho(&held_rows, *f)),
                selection: (!held_rows.is_empty()).then(|| rho(&sel_rows, *f)),
                family_selection: by_family.then(|| rho(&fam_sel, *f)),
                family_held_out: by_family.then(|| rho(&fam_held, *f)),
                needle_auc: auc(&needle.iter().map(|r| f(r)).collect::<Vec<_>>(), &kept),
            })
            .collect()
    };
    let correlations = correlate(PREDICTORS);
    let best_of = |score: &dyn Fn(&Correlation) -> f64| {
        correlations
            .iter()
            .filter(|c| score(c).is_finite())
            .max_by(|a, b| kvreplay_replay::select::cmp_f64(score(a), score(b)))
            .map(|c| c.predictor.clone())
            .unwrap_or_default()
    };
    let best = best_of(&|c: &Correlation| c.selection.unwrap_or(c.all));
    let best_by_family = best_of(&|c: &Correlation| c.family_selection.unwrap_or(c.all));
    let best_fn = PREDICTORS
        .iter()
        .find(|(n, _)| *n == best)
        .map_or(PREDICTORS[0].1, |(_, f)| *f);
    let mut disagreements = Vec::new();
    for t in &traces {
        let tr: Vec<&Row> = rows.iter().filter(|r| &r.trace == t).collect();
        let rx = ranks(&tr.iter().map(|r| best_fn(r)).collect::<Vec<_>>());
        let ry = ranks(&tr.iter().map(|r| r.e2e_kl).collect::<Vec<_>>());
        let n = tr.len() as f64;
        for (i, r) in tr.iter().enumerate() {
            let d = rx[i] - ry[i];
            if d.abs() > n / 3.0 {
                disagreements.push(format!(
                    "{} {} B={}: replay rank {:.0} of {n}, end-to-end KL rank {:.0} ({})",
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
    let in_loop = correlate(crate::IN_LOOP);
    // calibration of the predicted KL: factors fitted on the selection
    // traces (the other families for the by-family split), applied to all
    let fit = |fit_rows: &[&Row]| {
        // both floored: an exact point (KL 0, predicted 0) counts as 1
        let ratio = |r: &&Row| (r.e2e_kl.max(1e-9) / r.replay_predicted_kl.max(1e-9)).ln();
        let median = |mut v: Vec<f64>| -> Option<f64> {
            v.sort_by(f64::total_cmp);
            (!v.is_empty()).then(|| {
                let n = v.len();
                if n % 2 == 1 {
                    v[n / 2]
                } else {
                    (v[n / 2 - 1] + v[n / 2]) / 2.0
                }
            })
        };
        let overall = median(fit_rows.iter().map(ratio).collect()).unwrap_or(0.0);
        let by = |key: &dyn Fn(&Row) -> &str| -> BTreeMap<String, f64> {
            let mut keys: Vec<&str> = fit_rows.iter().map(|r| key(r)).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .filter_map(|k| {
                    let m = median(fit_rows.iter().filter(|r| key(r) == k).map(ratio).collect())?;
                    Some((k.to_string(), m))
                })
                .collect()
        };
        (
            overall,
            by(&|r| r.family.as_str()),
            by(&|r| r.policy.as_str()),
        )
    };
    type Fit = (f64, BTreeMap<String, f64>, BTreeMap<String, f64>);
    let calibrate = |(overall, fam, pol): &Fit, per_policy: bool| -> Vec<f64> {
        let overall = *overall;
        rows.iter()
            .map(|r| {
                let f = fam.get(&r.family).copied().unwrap_or(overall);
                let ln = if per_policy {
                    pol.get(&r.policy).copied().unwrap_or(f)
                } else {
                    f
                };
                r.replay_predicted_kl * ln.exp()
            })
            .collect()
    };
    // fitted once per split: on the selection traces, and on the other families
    let trace_fit = fit(if held_rows.is_empty() {
        &all
    } else {
        &sel_rows
    });
    let family_fit = fit(&fam_sel);
    let calibrated: Vec<Correlation> = [
        ("predicted KL calibrated per family", false),
        ("predicted KL calibrated per policy", true),
    ]
    .iter()
    .map(|&(name, per_policy)| {
        let by_trace = calibrate(&trace_fit, per_policy);
        let fam_cal = calibrate(&family_fit, per_policy);
        let rho_of = |v: &[f64], keep: &dyn Fn(&Row) -> bool| {
            let (x, y): (Vec<f64>, Vec<f64>) = rows
                .iter()
                .zip(v)
                .filter(|(r, _)| keep(r))
                .map(|(r, x)| (*x, r.e2e_kl))
                .unzip();
            spearman(&x, &y)
        };
        let in_held = |r: &Row| held.contains(&r.trace);
        let in_held_family = |r: &Row| crate::HELD_OUT_FAMILIES.contains(&r.family.as_str());
        Correlation {
            predictor: name.to_string(),
            all: rho_of(&by_trace, &|_| true),
            held_out: (!held_rows.is_empty()).then(|| rho_of(&by_trace, &in_held)),
            selection: (!held_rows.is_empty()).then(|| rho_of(&by_trace, &|r| !in_held(r))),
            family_selection: by_family.then(|| rho_of(&fam_cal, &|r| !in_held_family(r))),
            // the held-out families fall back to the overall factor: one
            // constant, so their own ranking is the uncalibrated one
            family_held_out: by_family.then(|| rho_of(&fam_cal, &in_held_family)),
            needle_auc: None,
        }
    })
    .collect();
    let (overall_ln, fam_ln, _) = trace_fit;
    let mut families: Vec<String> = rows.iter().map(|r| r.family.clone()).collect();
    families.sort();
    families.dedup();
    let drift_by_family = families
        .into_iter()
        .map(|f| {
            let mine: Vec<&Row> = rows.iter().filter(|r| r.family == f).collect();
            let k = mine.len().max(1) as f64;
            let drift = mine.iter().map(|r| r.query_drift).sum::<f64>() / k;
            let kl = mine.iter().map(|r| r.e2e_kl).sum::<f64>() / k;
            (f, mine.len(), drift, kl)
        })
        .collect();
    let n = rows.len().max(1) as f64;
    Summary {
        calibrated,
        family_scale: fam_ln.into_iter().map(|(k, v)| (k, v.exp())).collect(),
        overall_scale: overall_ln.exp(),
        in_loop,
        drift_by_family,
        points: rows.len(),
        traces,
        selection_traces: if held.is_empty() { Vec::new() } else { sel },
        held_out_traces: held,
        correlations,
        best,
        best_by_family,
        held_out_families: if by_family {
            crate::HELD_OUT_FAMILIES
                .iter()
                .map(|s| s.to_string())
                .collect()
        } else {
            Vec::new()
        },
        disagreements,
        closed_loop_seconds_per_point: rows.iter().map(|r| r.closed_loop_seconds).sum::<f64>() / n,
        replay_seconds_per_point: rows.iter().map(|r| r.replay_seconds).sum::<f64>() / n,
    }
}

/// The rows of a `validation.csv` written by [`write`] (to rescore them
/// without rerunning the closed loop).
pub fn read_rows(csv_path: &Path) -> Result<Vec<Row>, ValidateError> {
    let bad = |e: csv::Error| ValidateError::Input {
        path: csv_path.display().to_string(),
        msg: format!(
            "{e}; it must be the validation.csv a `kvreplay validate` of this version wrote"
        ),
    };
    let mut r = csv::Reader::from_path(csv_path).map_err(bad)?;
    r.deserialize()
        .collect::<Result<Vec<Row>, _>>()
        .map_err(bad)
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
    if !s.held_out_families.is_empty() {
        md += &format!(
            "\nHeld out by policy family: the predictor is chosen on the policies outside the {} families and scored on theirs. AUC: how well the predictor (lower = kept) separates the free-running points that still recover the pass key from those that do not.\n\n| predictor | other families | held-out families | needle AUC |\n|---|---|---|---|\n",
            s.held_out_families.join(" and ")
        );
        for c in &s.correlations {
            md += &format!(
                "| {} | {:.3} | {:.3} | {} |\n",
                c.predictor,
                c.family_selection.unwrap_or(f64::NAN),
                c.family_held_out.unwrap_or(f64::NAN),
                cell(c.needle_auc)
            );
        }
        md += &format!(
            "\nBest predictor chosen without the held-out families: **{}**.\n",
            s.best_by_family
        );
    }
    md += &format!(
        "\nBest predictor (chosen on the selection traces): **{}**.\n\n",
        s.best
    );
    md += &format!(
        "Calibrated: the predicted KL times a factor per policy family (or per policy) fitted on the selection traces as the median of end-to-end KL / predicted KL (overall factor {:.2}; per family: {}); a policy or family the selection traces lack gets the next coarser factor:\n\n| calibrated predictor | all points | held-out traces | other families | held-out families |\n|---|---|---|---|---|\n",
        s.overall_scale,
        s.family_scale.iter().map(|(f, x)| format!("{f} {x:.2}")).collect::<Vec<_>>().join(", ")
    );
    for c in &s.calibrated {
        md += &format!(
            "| {} | {:.3} | {} | {} | {} |\n",
            c.predictor,
            c.all,
            cell(c.held_out),
            cell(c.family_selection),
            cell(c.family_held_out)
        );
    }
    md += "\n";
    md += "What teacher forcing costs: the same statistics measured inside the compressed run, with the queries the compressed model really computed (replay cannot see them; they bound what replay statistics of this form can reach):\n\n| in-loop statistic | all points | held-out traces | held-out families |\n|---|---|---|---|\n";
    for c in &s.in_loop {
        md += &format!(
            "| {} | {:.3} | {} | {} |\n",
            c.predictor,
            c.all,
            cell(c.held_out),
            cell(c.family_held_out)
        );
    }
    md += "\nQuery drift (mean relative L2 distance of the compressed run's queries from the uncompressed run's, over layers, heads and decode steps) by policy family:\n\n| family | points | query drift | mean end-to-end KL |\n|---|---|---|---|\n";
    for (f, k, drift, kl) in &s.drift_by_family {
        md += &format!("| {f} | {k} | {drift:.4} | {kl:.4} |\n");
    }
    md += "\n";
    md += "Points where replay misleads (ranked more than a third of the points apart by the best predictor and by end-to-end KL, within their trace):\n\n";
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

/// A table cell: the figure to 3 decimals, or "-" where there is none.
fn cell(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{x:.3}"))
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

#[cfg(test)]
mod tests {
    use super::auc;

    #[test]
    fn auc_by_hand() {
        // lower score predicts a positive
        let s = [0.1, 0.2, 0.3, 0.4];
        assert_eq!(auc(&s, &[true, true, false, false]), Some(1.0));
        assert_eq!(auc(&s, &[false, false, true, true]), Some(0.0));
        // pairs (0.1+, 0.2-) right, (0.3+, 0.2-) wrong, (0.1+, 0.4-) and (0.3+, 0.4-) right: 3/4
        assert_eq!(auc(&s, &[true, false, true, false]), Some(0.75));
        // a tie between a positive and a negative counts half
        assert_eq!(auc(&[0.5, 0.5], &[true, false]), Some(0.5));
        assert_eq!(auc(&s, &[true; 4]), None);
    }
}

#[cfg(test)]
mod calibration_tests {
    use super::summarise;
    use crate::Row;

    fn row(trace: &str, policy: &str, family: &str, pred: f64, kl: f64) -> Row {
        Row {
            trace: trace.into(),
            policy: policy.into(),
            family: family.into(),
            budget: 64,
            e2e_kl: kl,
            e2e_top1: 1.0,
            e2e_ppl: 1.0,
            full_ppl: 1.0,
            needle_kept: None,
            text: String::new(),
            replay_rel_l2: pred,
            replay_attn_loss: 0.0,
            replay_kl: 0.0,
            replay_worst_layer_rel_l2: 0.0,
            replay_p95_rel_l2: 0.0,
            replay_depth_weighted_rel_l2: 0.0,
            replay_predicted_kl: pred,
            loop_rel_l2: 0.0,
            loop_predicted_kl: 0.0,
            query_drift: 0.0,
            closed_loop_seconds: 0.0,
            replay_seconds: 0.0,
        }
    }

    /// Two families whose errors move the model 1x and 10x their prediction:
    /// uncalibrated, the predicted KL ranks them wrongly across families; a
    /// factor per family fitted on the selection trace (median KL/predicted:
    /// 1 and 10 exactly) ranks the held-out trace perfectly.
    #[test]
    fn per_family_factors_fitted_on_the_selection_traces_fix_the_cross_family_order() {
        let mut rows = Vec::new();
        for t in ["a", "b"] {
            for (i, pred) in [0.1, 0.2, 0.3, 0.4].into_iter().enumerate() {
                rows.push(row(t, &format!("n{i}"), "quantisation", pred, pred));
                rows.push(row(
                    t,
                    &format!("e{i}"),
                    "eviction",
                    pred / 4.0,
                    10.0 * pred / 4.0,
                ));
            }
        }
        let s = summarise(&rows);
        assert_eq!(s.held_out_traces, ["b"]);
        let raw = s
            .correlations
            .iter()
            .find(|c| c.predictor.contains("predicted KL"))
            .unwrap();
        assert!(raw.held_out.unwrap() < 0.9, "{raw:?}");
        let fam = &s.calibrated[0];
        assert_eq!(fam.held_out, Some(1.0), "{fam:?}");
        assert!(
            (s.family_scale["eviction"] - 10.0).abs() < 1e-12
                && (s.family_scale["quantisation"] - 1.0).abs() < 1e-12
        );
    }
}
