//! `kvreplay validate`: its arguments and the closed-loop check of replay
//! against the model rerun with each policy.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

use kvreplay_capture::Model;

use super::common::{expand_traces, resolve_trace_model};

#[derive(Args)]
pub(super) struct ValidateArgs {
    /// GGUF model file or HF checkpoint directory the traces were captured with [default: $KVREPLAY_MODEL, else the GGUF file the first trace names when models/ holds it, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Traces: trace folders, or folders whose sub-folders are traces (the first half selects the best predictor, the rest are held out).
    #[arg(long, num_args = 1.., required_unless_present = "rescore")]
    trace: Vec<PathBuf>,
    /// Policy specs (repeatable).
    #[arg(long = "policy", num_args = 1.., required_unless_present = "rescore")]
    policies: Vec<String>,
    /// Budgets, comma-separated (entries per KV head and layer).
    #[arg(long, value_delimiter = ',', required_unless_present = "rescore")]
    budget: Vec<usize>,
    /// Output folder: validation.csv, summary.json, scatter.svg, report.md.
    #[arg(long)]
    out: PathBuf,
    /// Rewrite the summary and report from the folder's validation.csv (no model run).
    #[arg(long)]
    rescore: bool,
    /// Write the factors fitted on the selection traces (overall and per
    /// policy family) into every --trace's sensitivity.json, so sweeps write
    /// the calibrated predicted_kl.
    #[arg(long)]
    calibrate: bool,
}

pub(super) fn cmd_validate(a: ValidateArgs) -> Result<()> {
    if a.rescore {
        let csv = a.out.join("validation.csv");
        let rows = kvreplay_validate::report::read_rows(&csv)?;
        let command = std::fs::read_to_string(a.out.join("report.md"))
            .ok()
            .and_then(|md| md.lines().nth(2).map(|l| l.trim_matches('`').to_string()))
            .unwrap_or_else(|| "kvreplay validate".into());
        let s = kvreplay_validate::report::write(&a.out, &rows, &command)
            .with_context(|| format!("writing {}", a.out.display()))?;
        calibrate(&a, &s)?;
        return print_summary(&s, &a.out);
    }
    let specs = a
        .policies
        .iter()
        .map(|p| kvreplay_replay::PolicySpec::parse(p).map_err(anyhow::Error::from))
        .collect::<Result<Vec<_>>>()?;
    for s in &specs {
        s.build()?;
    }
    if a.budget.is_empty() || a.budget.contains(&0) {
        bail!("--budget needs at least one budget, each at least 1");
    }
    let traces = expand_traces(&a.trace)?;
    let model_path = resolve_trace_model(a.model.clone(), &traces[0])?;
    let model = Model::load(&model_path)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} points ({elapsed}, eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let per_trace = specs.len() * a.budget.len();
    bar.set_length((per_trace * traces.len()) as u64);
    let mut rows = Vec::new();
    for (ti, t) in traces.iter().enumerate() {
        let r = kvreplay_validate::validate_trace(
            &model,
            t,
            &specs,
            &a.budget,
            &mut |done, _, label| {
                bar.set_position((ti * per_trace + done) as u64);
                bar.set_message(label.to_string());
            },
        )
        .with_context(|| format!("validating on {}", t.display()))?;
        rows.extend(r);
        // keep what is done if a later trace fails or the run is interrupted
        kvreplay_validate::report::write(&a.out, &rows, &validate_command(&a))
            .with_context(|| format!("writing {}", a.out.display()))?;
    }
    bar.finish_and_clear();
    let s = kvreplay_validate::report::write(&a.out, &rows, &validate_command(&a))
        .with_context(|| format!("writing {}", a.out.display()))?;
    calibrate(&a, &s)?;
    print_summary(&s, &a.out)
}

/// With --calibrate: the fitted factors into each trace's profile.
fn calibrate(a: &ValidateArgs, s: &kvreplay_validate::report::Summary) -> Result<()> {
    if !a.calibrate {
        return Ok(());
    }
    if a.trace.is_empty() {
        bail!("--calibrate needs the traces whose profiles get the factors (--trace)");
    }
    for t in expand_traces(&a.trace)? {
        let Some(mut p) = kvreplay_traces::Sensitivity::read(&t)? else {
            bail!("{}: no sensitivity.json to calibrate; run `kvreplay sensitivity` or `kvreplay validate` on it first", t.display());
        };
        p.scale = s.overall_scale;
        p.family_scale = s.family_scale.clone();
        p.write(&t)?;
    }
    println!(
        "calibrated the profiles: overall factor {:.3}, per family {}",
        s.overall_scale,
        s.family_scale
            .iter()
            .map(|(f, x)| format!("{f} {x:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

fn print_summary(s: &kvreplay_validate::report::Summary, out: &std::path::Path) -> Result<()> {
    println!(
        "{} points on {} traces; Spearman with end-to-end KL:",
        s.points,
        s.traces.len()
    );
    for c in s.correlations.iter().chain(&s.calibrated) {
        match c.held_out {
            Some(h) => println!(
                "  {:<45} all {:>6.3}   held-out {:>6.3}",
                c.predictor, c.all, h
            ),
            None => println!("  {:<45} all {:>6.3}", c.predictor, c.all),
        }
    }
    println!(
        "best predictor: {}; {} points where replay misleads",
        s.best,
        s.disagreements.len()
    );
    println!(
        "cost per point: closed loop {:.2} s, replay {:.2} s; wrote {}/{{validation.csv, summary.json, scatter.svg, report.md}}",
        s.closed_loop_seconds_per_point,
        s.replay_seconds_per_point,
        out.display()
    );
    Ok(())
}

fn validate_command(a: &ValidateArgs) -> String {
    let paths = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        "kvreplay validate --trace {} --policy {} --budget {} --out {}",
        paths(&a.trace),
        a.policies.join(" "),
        a.budget
            .iter()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(","),
        a.out.display()
    )
}
