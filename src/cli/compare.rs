//! `kvreplay compare`: two methods of a sweep at matched memory, paired over
//! traces, with a bootstrap interval ([`kvreplay_analysis::compare`]).

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub(super) struct CompareArgs {
    /// A sweep folder (also a merged one): its plan.json and finished points.
    #[arg(required_unless_present = "models")]
    sweep: Option<PathBuf>,
    /// Instead of one sweep: two or more sweep folders, one per model (the
    /// same policies and budgets on each model's traces), ranked side by side
    /// at matched memory with the Spearman agreement of their rankings.
    #[arg(long, num_args = 2.., conflicts_with_all = ["sweep", "a", "b", "rank", "json"])]
    models: Vec<PathBuf>,
    /// With --models: also write the comparison as a self-contained HTML page.
    #[arg(long, requires = "models")]
    html: Option<PathBuf>,
    /// Method A: a policy spec of the sweep or its short name (snapkv).
    #[arg(long, required_unless_present_any = ["rank", "models"])]
    a: Option<String>,
    /// Method B, compared with A (differences are A - B).
    #[arg(long, required_unless_present_any = ["rank", "models"])]
    b: Option<String>,
    /// Instead of A against B: every policy ranked by its mean error at 10%,
    /// 20% and 50% of the full cache (`--memory` for other shares), with 95%
    /// bootstrap intervals over traces: the ranking report.html opens with.
    #[arg(long, conflicts_with_all = ["a", "b", "json"])]
    rank: bool,
    /// Memory shares of the full cache, comma-separated (0.2 = 20%). Default:
    /// 5%, 10%, 20%, ..., 100% where both methods are measured on every trace.
    #[arg(long, value_delimiter = ',')]
    memory: Vec<f64>,
    /// Level of the bootstrap interval over traces.
    #[arg(long, default_value_t = 0.95)]
    confidence: f64,
    /// Bootstrap resamples.
    #[arg(long, default_value_t = 10_000)]
    resamples: usize,
    /// Seed of the bootstrap's generator (same seed, same output).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the comparison as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub(super) fn cmd_compare(a: CompareArgs) -> Result<()> {
    check_shares(&a.memory)?;
    if !a.models.is_empty() {
        let c = kvreplay_analysis::models::compare_models(&a.models, &a.memory)
            .context("comparing the models' sweeps")?;
        print!("{}", c.to_text());
        if let Some(path) = &a.html {
            std::fs::write(path, c.to_html())
                .with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
        return Ok(());
    }
    let sweep = a
        .sweep
        .clone()
        .expect("clap requires a sweep without --models");
    if a.rank {
        let ctx = || format!("ranking in {}", sweep.display());
        let plan = kvreplay_analysis::sweep::read_plan(&sweep).with_context(ctx)?;
        let points = kvreplay_analysis::sweep::load_points(&sweep, &plan).with_context(ctx)?;
        let shares = if a.memory.is_empty() {
            kvreplay_analysis::rank::SHARES.to_vec()
        } else {
            a.memory
        };
        print!(
            "{}",
            kvreplay_analysis::rank::rank(&plan, &points, &shares).to_text()
        );
        return Ok(());
    }
    let opts = kvreplay_analysis::compare::Options {
        a: a.a.unwrap_or_default(),
        b: a.b.unwrap_or_default(),
        memory: (!a.memory.is_empty()).then_some(a.memory),
        confidence: a.confidence,
        resamples: a.resamples,
        seed: a.seed,
    };
    let c = kvreplay_analysis::compare::compare(&sweep, &opts)
        .with_context(|| format!("comparing in {}", sweep.display()))?;
    print!("{}", c.to_text());
    if let Some(path) = a.json {
        let text = serde_json::to_string_pretty(&c).expect("comparison serialises");
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn check_shares(shares: &[f64]) -> Result<()> {
    if let Some(x) = shares.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        anyhow::bail!(
            "--memory {x}: a memory share must be positive (0.2 is 20% of the full cache)"
        );
    }
    Ok(())
}
