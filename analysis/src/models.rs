//! Several models' sweeps side by side (`kvreplay compare --models`): each
//! policy's mean error at matched memory on each model and its rank there
//! ([`crate::rank`], the ranking each sweep's report opens with), and how
//! well two models agree on the order of the policies: Spearman's rank
//! correlation over the policies both rank at a share. This is the question
//! a method comparison on one model leaves open: does its ranking carry over
//! to another architecture?

use std::path::{Path, PathBuf};

use crate::compare::percent;
use crate::rank::{rank, Ranking, SHARES};
use crate::sweep::{load_points, read_plan, SweepError};

/// One model's sweep, ranked.
#[derive(Clone, Debug)]
pub struct ModelSweep {
    /// The model as the traces record it: its file or checkpoint folder name
    /// (`SmolLM2-135M-Instruct.Q4_1`), else the name it gives itself.
    pub model: String,
    pub sweep: PathBuf,
    pub ranking: Ranking,
}

/// Agreement of two models' rankings at one memory share.
#[derive(Clone, Debug, PartialEq)]
pub struct Agreement {
    pub a: usize,
    pub b: usize,
    pub share: f64,
    /// Spearman's rho over the `policies` policies ranked on both (`None`
    /// with fewer than three).
    pub rho: Option<f64>,
    pub policies: usize,
}

/// Every policy of any sweep (first-seen order) on every model.
#[derive(Clone, Debug)]
pub struct ModelComparison {
    pub shares: Vec<f64>,
    pub models: Vec<ModelSweep>,
    /// Policy labels, in the order of the first model's ranking, then any
    /// policy only a later model has.
    pub policies: Vec<String>,
    pub agreement: Vec<Agreement>,
}

/// Rank each sweep folder at `shares` and compare the rankings. Every trace
/// of one sweep must come from one model (the name its manifest records).
pub fn compare_models(sweeps: &[PathBuf], shares: &[f64]) -> Result<ModelComparison, SweepError> {
    if sweeps.len() < 2 {
        return Err(SweepError::Plan(
            "--models needs at least two sweep folders (one per model)".into(),
        ));
    }
    let shares = if shares.is_empty() {
        SHARES.to_vec()
    } else {
        shares.to_vec()
    };
    let mut models = Vec::new();
    for dir in sweeps {
        let plan = read_plan(dir)?;
        let points = load_points(dir, &plan)?;
        let model = sweep_model(dir, &plan.traces)?;
        models.push(ModelSweep {
            model,
            sweep: dir.clone(),
            ranking: rank(&plan, &points, &shares),
        });
    }
    let mut policies: Vec<String> = Vec::new();
    for m in &models {
        for r in &m.ranking.rows {
            if !policies.contains(&r.label) {
                policies.push(r.label.clone());
            }
        }
    }
    let mut agreement = Vec::new();
    for a in 0..models.len() {
        for b in a + 1..models.len() {
            for (k, &share) in shares.iter().enumerate() {
                let (mut x, mut y) = (Vec::new(), Vec::new());
                for p in &policies {
                    if let (Some(ea), Some(eb)) = (
                        mean_at(&models[a].ranking, p, k),
                        mean_at(&models[b].ranking, p, k),
                    ) {
                        x.push(ea);
                        y.push(eb);
                    }
                }
                agreement.push(Agreement {
                    a,
                    b,
                    share,
                    rho: (x.len() >= 3).then(|| crate::stats::spearman(&x, &y)),
                    policies: x.len(),
                });
            }
        }
    }
    Ok(ModelComparison {
        shares,
        models,
        policies,
        agreement,
    })
}

/// The model every trace of a sweep was captured from.
fn sweep_model(dir: &Path, traces: &[PathBuf]) -> Result<String, SweepError> {
    let mut name: Option<(String, &PathBuf)> = None;
    for t in traces {
        let m = kvreplay_traces::Manifest::read(t).map_err(|e| {
            SweepError::Plan(format!(
                "{}: reading the manifest of its trace {}: {e}",
                dir.display(),
                t.display()
            ))
        })?;
        // the model file's name (`gemma-3-270m-Q4_K_M`), which says the
        // quantisation too, else the name the model gives itself
        let f = &m.model.source.file_name;
        let this = match f.strip_suffix(".gguf").unwrap_or(f) {
            "" | "synthetic" => m.model.name.clone().unwrap_or_else(|| f.clone()),
            stem => stem.to_string(),
        };
        match &name {
            None => name = Some((this, t)),
            Some((n, first)) if *n != this => {
                return Err(SweepError::Plan(format!(
                    "{}: its traces come from two models ({n} in {}, {this} in {}); compare --models takes one sweep per model",
                    dir.display(),
                    first.display(),
                    t.display()
                )))
            }
            Some(_) => {}
        }
    }
    name.map(|n| n.0)
        .ok_or_else(|| SweepError::Plan(format!("{}: the sweep has no traces", dir.display())))
}

/// A policy's mean error at share `k` of a ranking, if it reaches it.
fn mean_at(r: &Ranking, label: &str, k: usize) -> Option<f64> {
    r.rows.iter().find(|row| row.label == label)?.at[k].mean()
}

/// The rank (1 = lowest error) of a policy at share `k`.
fn rank_at(r: &Ranking, label: &str, k: usize) -> Option<usize> {
    let i = r.rows.iter().position(|row| row.label == label)?;
    r.ranks_at(k)[i]
}

impl ModelComparison {
    fn cell(&self, m: usize, p: &str, k: usize) -> String {
        match (
            mean_at(&self.models[m].ranking, p, k),
            rank_at(&self.models[m].ranking, p, k),
        ) {
            (Some(e), Some(r)) => format!("{e:.4} ({r})"),
            _ => "-".into(),
        }
    }

    fn agreement_line(&self, g: &Agreement) -> String {
        format!(
            "{} vs {} at {}: {}",
            self.models[g.a].model,
            self.models[g.b].model,
            percent(g.share),
            match g.rho {
                Some(r) => format!("Spearman {r:.3} over {} policies", g.policies),
                None => format!("{} policies ranked on both (too few)", g.policies),
            }
        )
    }

    /// Text: per share, one column per model (mean error, rank), then the
    /// agreement of each pair.
    pub fn to_text(&self) -> String {
        let w = self
            .policies
            .iter()
            .map(|p| p.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let mut s = String::new();
        for (k, &share) in self.shares.iter().enumerate() {
            s.push_str(&format!(
                "mean relative L2 error (rank) at {} of the full cache\n{:w$}",
                percent(share),
                "policy"
            ));
            for m in &self.models {
                s.push_str(&format!("  {:>26}", truncate(&m.model, 26)));
            }
            s.push('\n');
            for p in &self.policies {
                s.push_str(&format!("{p:w$}"));
                for m in 0..self.models.len() {
                    s.push_str(&format!("  {:>26}", self.cell(m, p, k)));
                }
                s.push('\n');
            }
            s.push('\n');
        }
        for g in &self.agreement {
            s.push_str(&self.agreement_line(g));
            s.push('\n');
        }
        s
    }

    /// A self-contained HTML page with the same tables.
    pub fn to_html(&self) -> String {
        let esc = |s: &str| {
            s.replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
        };
        let mut h = String::from("<!doctype html><html><head><meta charset=\"utf-8\"><title>kvreplay: models compared</title><style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222;line-height:1.4}table{border-collapse:collapse;font-size:13px;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.cap{font-size:14px;color:#444}</style></head><body><h1>Models compared</h1>");
        h.push_str("<p class=\"cap\">Each policy's mean relative L2 error of the attention output at matched memory (a share of the model's full f16 cache, interpolated per trace between measured budgets, as in each sweep's report), and in brackets its rank among the policies on that model. The agreement line is Spearman's rank correlation of the errors over the policies both models rank at that share: 1 means the models order the methods alike. Compare ranks across models rather than absolute errors: the error is a mean over every layer, and on a model with sliding-window layers (Gemma 3) those keep their window by default and add 0; there a share is of the cache beyond the windows.</p><ul>");
        for m in &self.models {
            h.push_str(&format!(
                "<li><b>{}</b>: <code>{}</code> ({} traces; its report: <code>{}</code>)</li>",
                esc(&m.model),
                esc(&m.sweep.display().to_string()),
                m.ranking.traces,
                esc(&m.sweep.join("report.html").display().to_string())
            ));
        }
        h.push_str("</ul>");
        for (k, &share) in self.shares.iter().enumerate() {
            h.push_str(&format!(
                "<h2>At {} of the full cache</h2><table><thead><tr><th>policy</th>",
                percent(share)
            ));
            for m in &self.models {
                h.push_str(&format!("<th>{}</th>", esc(&m.model)));
            }
            h.push_str("</tr></thead><tbody>");
            for p in &self.policies {
                h.push_str(&format!("<tr><td>{}</td>", esc(p)));
                for m in 0..self.models.len() {
                    h.push_str(&format!("<td>{}</td>", self.cell(m, p, k)));
                }
                h.push_str("</tr>");
            }
            h.push_str("</tbody></table>");
            for g in self.agreement.iter().filter(|g| g.share == share) {
                h.push_str(&format!("<p>{}</p>", esc(&self.agreement_line(g))));
            }
        }
        h.push_str("</body></html>\n");
        h
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).chain(['…']).collect()
    }
}
