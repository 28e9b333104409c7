//! `kvreplay sweep`: its arguments, the sweep file, and the resumable,
//! shardable sweep.

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

use super::common::{expand_traces, open_device};

#[derive(Args)]
pub(super) struct SweepArgs {
    /// Traces: trace folders, or folders whose sub-folders are traces.
    #[arg(long, num_args = 1.., required_unless_present = "file")]
    traces: Vec<PathBuf>,
    /// Policy specs (repeatable).
    #[arg(long = "policy", num_args = 1..)]
    policies: Vec<String>,
    /// Budgets, comma-separated (entries per KV head and layer).
    #[arg(long, value_delimiter = ',')]
    budget: Vec<usize>,
    /// A sweep file (TOML: traces = [...], policies = [...], budgets = [...]) instead of the flags.
    #[arg(long, conflicts_with_all = ["traces", "policies", "budget"])]
    file: Option<PathBuf>,
    /// Output folder (rerunning the same command resumes it).
    #[arg(long)]
    out: PathBuf,
    /// Run only shard i of n (0-based): point k belongs to shard k mod n.
    #[arg(long)]
    shard: Option<kvreplay_analysis::sweep::Shard>,
    /// Where to compute: cpu, cuda or auto (CUDA when a usable GPU is present).
    #[arg(long, default_value = "cpu")]
    device: kvreplay_kernels::DeviceRequest,
    /// Skip checking the traces' files (sha256, finite values); recorded in the points.
    #[arg(long)]
    no_verify: bool,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepFile {
    traces: Vec<PathBuf>,
    policies: Vec<String>,
    budgets: Vec<usize>,
}

pub(super) fn cmd_sweep(a: SweepArgs) -> Result<()> {
    let (traces, policies, budgets) = match &a.file {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading sweep file {}", f.display()))?;
            let sf: SweepFile =
                toml::from_str(&text).with_context(|| format!("sweep file {}", f.display()))?;
            (sf.traces, sf.policies, sf.budgets)
        }
        None => (a.traces.clone(), a.policies.clone(), a.budget.clone()),
    };
    let plan = kvreplay_analysis::sweep::Plan::new(&expand_traces(&traces)?, &policies, &budgets)
        .context("checking the sweep before any work")?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} points ({elapsed}, eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let backend = open_device(a.device)?;
    let reads = if a.no_verify {
        kvreplay_traces::Reads::Unverified
    } else {
        kvreplay_traces::Reads::Verified
    };
    let r = kvreplay_analysis::sweep::run_with(
        &plan,
        &a.out,
        a.shard,
        &backend,
        reads,
        &mut |done, total, label| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(label.to_string());
        },
    )
    .with_context(|| format!("sweeping into {}", a.out.display()))?;
    bar.finish_and_clear();
    for n in &r.invalidated {
        eprintln!("note: {n}");
    }
    if r.complete && r.failed.len() < plan.points().len() {
        kvreplay_analysis::report::write(&a.out, &plan).context("writing the report")?;
    }
    if let Some(f) = r.failed.first() {
        eprintln!(
            "warning: {} point(s) failed and are listed in {}/failed.csv; the first: {} {} B={}: {}",
            r.failed.len(),
            a.out.display(),
            f.trace,
            f.policy_spec,
            f.budget,
            f.reason
        );
    }
    println!(
        "{} points ({} run now, {} already done){}; wrote {}/results.csv and summary.csv",
        r.points,
        r.ran,
        r.reused,
        if r.complete {
            ""
        } else {
            ", other shards still missing"
        },
        a.out.display()
    );
    Ok(())
}
