//! `kvreplay compare`: two methods of a sweep at matched memory, paired over
//! traces, with a bootstrap interval ([`kvreplay_analysis::compare`]).

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub(super) struct CompareArgs {
    /// A sweep folder (also a merged one): its plan.json and finished points.
    sweep: PathBuf,
    /// Method A: a policy spec of the sweep or its short name (snapkv).
    #[arg(long)]
    a: String,
    /// Method B, compared with A (differences are A - B).
    #[arg(long)]
    b: String,
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
    let opts = kvreplay_analysis::compare::Options {
        a: a.a,
        b: a.b,
        memory: (!a.memory.is_empty()).then_some(a.memory),
        confidence: a.confidence,
        resamples: a.resamples,
        seed: a.seed,
    };
    let c = kvreplay_analysis::compare::compare(&a.sweep, &opts)
        .with_context(|| format!("comparing in {}", a.sweep.display()))?;
    print!("{}", c.to_text());
    if let Some(path) = a.json {
        let text = serde_json::to_string_pretty(&c).expect("comparison serialises");
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
