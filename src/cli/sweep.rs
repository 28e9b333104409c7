//! `kvreplay sweep`: its arguments, the sweep file, and the resumable,
//! shardable sweep.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvreplay_analysis::sweep::Shard;
use std::path::PathBuf;

use super::common::{expand_traces, open_device, Work};

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
    /// Run only shard i of n (0-based; shards of about equal estimated cost).
    /// `auto` takes i and n from a Slurm job array (SLURM_ARRAY_TASK_ID,
    /// SLURM_ARRAY_TASK_COUNT); `auto/N` takes i from it and n = N (for a
    /// resubmission of some shards, whose array is not 0..N-1).
    #[arg(long)]
    shard: Option<ShardArg>,
    /// If another kvreplay is writing this folder (shard), wait for it to
    /// finish instead of refusing (a duplicated or requeued task then finds
    /// its points done).
    #[arg(long)]
    wait: bool,
    #[arg(long, help = super::common::REPLAY_DEVICE_HELP, default_value = "cpu")]
    device: kvreplay_kernels::DeviceRequest,
    /// Skip checking the traces' files (sha256, finite values); recorded in the points.
    #[arg(long)]
    no_verify: bool,
    /// Memory for the f32 layer copies kept between points of a trace (e.g.
    /// 2G, 512M); layers beyond it are read from the trace when a point needs
    /// them, so a trace larger than memory still sweeps. Results do not
    /// depend on it. [default: auto = half the memory available]
    #[arg(long, value_parser = super::common::parse_memory, default_value = "auto")]
    max_memory: MaxMemory,
}

type MaxMemory = Option<u64>;

/// `--shard`: `i/n`, `auto` or `auto/N`.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum ShardArg {
    Fixed(Shard),
    Auto(Option<usize>),
}

impl std::str::FromStr for ShardArg {
    type Err = String;
    fn from_str(s: &str) -> Result<ShardArg, String> {
        if s == "auto" {
            return Ok(ShardArg::Auto(None));
        }
        if let Some(n) = s.strip_prefix("auto/") {
            return match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(ShardArg::Auto(Some(n))),
                _ => Err(format!(
                    "`{s}`: expected auto/N with N the number of shards (e.g. auto/4)"
                )),
            };
        }
        s.parse().map(ShardArg::Fixed).map_err(|e| {
            format!("{e}, or auto (from SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT)")
        })
    }
}

/// The shard `--shard auto[/N]` means in this environment, and how it was found.
pub(super) fn resolve_shard(
    arg: &ShardArg,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Shard, String)> {
    let var = |name: &str| -> Result<Option<usize>> {
        match env(name) {
            None => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|_| {
                anyhow::anyhow!("--shard auto: {name}={v:?} is not a non-negative integer")
            }),
        }
    };
    let n = match arg {
        ShardArg::Fixed(s) => return Ok((*s, format!("shard {}/{}", s.index, s.count))),
        ShardArg::Auto(n) => *n,
    };
    let Some(index) = var("SLURM_ARRAY_TASK_ID")? else {
        bail!(
            "--shard auto: SLURM_ARRAY_TASK_ID is not set, so this is not a Slurm array task; \
             submit it with `sbatch --array=0-N` (see `kvreplay slurm`) or give the shard as i/n"
        );
    };
    let count = match n {
        Some(n) => n,
        None => {
            let Some(count) = var("SLURM_ARRAY_TASK_COUNT")? else {
                bail!(
                    "--shard auto: SLURM_ARRAY_TASK_COUNT is not set (Slurm before 17.11?); \
                     give the number of shards: --shard auto/N"
                );
            };
            // an array that is not 0..count-1 (a resubmission of some shards)
            // does not give the number of shards
            let (min, max) = (var("SLURM_ARRAY_TASK_MIN")?, var("SLURM_ARRAY_TASK_MAX")?);
            if min.is_some_and(|m| m != 0) || max.is_some_and(|m| m + 1 != count) {
                bail!(
                    "--shard auto: this array runs tasks {}-{} ({count} of them), not 0-{}, so its \
                     size is not the number of shards (a resubmission of some shards?); give it: \
                     --shard auto/N",
                    min.unwrap_or(0),
                    max.unwrap_or(0),
                    count.saturating_sub(1)
                );
            }
            count
        }
    };
    if count == 0 || index >= count {
        bail!(
            "--shard auto: SLURM_ARRAY_TASK_ID={index} is not a shard of {count} (0-{}); \
             submit the array as --array=0-{}",
            count.saturating_sub(1),
            count.saturating_sub(1)
        );
    }
    let how = match n {
        Some(_) => format!("SLURM_ARRAY_TASK_ID={index}, {count} shards given"),
        None => format!("SLURM_ARRAY_TASK_ID={index}, SLURM_ARRAY_TASK_COUNT={count}"),
    };
    Ok((
        Shard { index, count },
        format!("shard {index}/{count} (from {how})"),
    ))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepFile {
    traces: Vec<PathBuf>,
    policies: Vec<String>,
    budgets: Vec<usize>,
}

/// The plan of a sweep file (`traces`, `policies`, `budgets`).
pub(super) fn plan_of_file(f: &std::path::Path) -> Result<kvreplay_analysis::sweep::Plan> {
    let text = std::fs::read_to_string(f)
        .with_context(|| format!("reading sweep file {}", f.display()))?;
    let sf: SweepFile =
        toml::from_str(&text).with_context(|| format!("sweep file {}", f.display()))?;
    kvreplay_analysis::sweep::Plan::new(&expand_traces(&sf.traces)?, &sf.policies, &sf.budgets)
        .context("checking the sweep before any work")
}

pub(super) fn cmd_sweep(a: SweepArgs) -> Result<()> {
    let shard = match &a.shard {
        None => None,
        Some(arg) => {
            let (s, how) = resolve_shard(arg, &|k| std::env::var(k).ok())?;
            if matches!(arg, ShardArg::Auto(_)) {
                eprintln!("kvreplay sweep: running {how}");
            }
            Some(s)
        }
    };
    let plan = match &a.file {
        Some(f) => plan_of_file(f)?,
        None => {
            kvreplay_analysis::sweep::Plan::new(&expand_traces(&a.traces)?, &a.policies, &a.budget)
                .context("checking the sweep before any work")?
        }
    };
    if let Some(s) = shard {
        let asg = plan.assignment(s.count);
        let total: u64 = asg.loads.iter().sum();
        eprintln!(
            "kvreplay sweep: shard {}/{}: {} of {} points, {:.1}% of the estimated cost",
            s.index,
            s.count,
            asg.shard_of.iter().filter(|&&x| x == s.index).count(),
            asg.shard_of.len(),
            100.0 * asg.loads[s.index] as f64 / total.max(1) as f64
        );
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} points ({elapsed}, eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let backend = open_device(a.device, Work::Replay)?;
    // the plan records the device: a folder holds one device's results
    let plan = plan.on_device(backend.device());
    let reads = if a.no_verify {
        kvreplay_traces::Reads::Unverified
    } else {
        kvreplay_traces::Reads::Verified
    };
    let tell = |msg: &str| eprintln!("kvreplay sweep: {msg}");
    let opts = kvreplay_analysis::sweep::RunOptions {
        shard,
        backend: &backend,
        reads,
        wait: a.wait.then_some(&tell as &dyn Fn(&str)),
        command: std::env::args().collect(),
        resubmit: std::env::var("KVREPLAY_RESUBMIT").ok(),
        max_memory: a.max_memory,
    };
    let r = kvreplay_analysis::sweep::run_opts(&plan, &a.out, &opts, &mut |done, total, label| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(label.to_string());
    })
    .with_context(|| format!("sweeping into {}", a.out.display()))?;
    bar.finish_and_clear();
    for n in &r.notices {
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
    super::common::report_peak_memory();
    Ok(())
}
