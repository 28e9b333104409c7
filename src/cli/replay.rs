//! `kvreplay replay`: its arguments and one (policy, budget) replay of a trace.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

use kvreplay_traces::{Reads, Trace};

use super::common::{open_device, Work};

#[derive(Args)]
pub(super) struct ReplayArgs {
    /// Trace directory written by `kvreplay capture`.
    #[arg(long)]
    trace: PathBuf,
    /// Policy spec: NAME, NAME:key=value,..., or a composition like snapkv+quant:bits=4.
    #[arg(long)]
    policy: String,
    /// Prompt entries kept per KV head per layer.
    #[arg(long, group = "budget_arg", required = true, allow_negative_numbers = true, value_parser = parse_budget)]
    budget: Option<usize>,
    /// Fraction of the prompt kept per KV head per layer, in (0, 1].
    #[arg(long, group = "budget_arg", allow_negative_numbers = true)]
    ratio: Option<f64>,
    /// Output directory for metrics.csv, retention.csv and summary.json.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, help = super::common::REPLAY_DEVICE_HELP, default_value = "cpu")]
    device: kvreplay_kernels::DeviceRequest,
    /// Replace an existing --out.
    #[arg(long)]
    force: bool,
    /// Skip checking the layer files' sha256 and finiteness (recorded in summary.json).
    #[arg(long)]
    no_verify: bool,
}

fn parse_budget(s: &str) -> Result<usize, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n as usize),
        Ok(n) => Err(format!("{n} keeps no entry; the budget is the number of prompt entries kept per KV head and layer, at least 1")),
        Err(_) => Err(format!("`{s}` is not a whole number of entries (use --ratio for a fraction of the prompt)")),
    }
}

pub(super) fn cmd_replay(a: ReplayArgs) -> Result<()> {
    use kvreplay_replay::{Budget, PolicySpec};
    let spec = PolicySpec::parse(&a.policy)?;
    let policy = spec.build()?;
    let budget = match (a.budget, a.ratio) {
        (Some(n), _) => Budget::Entries(n),
        (None, Some(r)) => Budget::Ratio(r),
        (None, None) => unreachable!("clap requires one budget"),
    };
    budget.validate()?;
    kvreplay_replay::output::check_out(&a.out, a.force)?;
    let reads = if a.no_verify {
        Reads::Unverified
    } else {
        Reads::Verified
    };
    let trace = Trace::open_with(&a.trace, reads)
        .with_context(|| format!("opening trace {}", a.trace.display()))?;
    budget.resolve(trace.manifest.prompt_len())?;
    let start = std::time::Instant::now();
    let backend = open_device(a.device, Work::Replay)?;
    let r = kvreplay_replay::replay_on(&trace, policy.as_ref(), budget, &backend)
        .with_context(|| format!("replaying {} on {}", spec.canonical(), a.trace.display()))?;
    let secs = start.elapsed().as_secs_f64();
    let s = kvreplay_replay::output::summary(&trace, &spec, budget, &r, &backend);
    kvreplay_replay::output::write(&a.out, &s, &r, a.force)
        .with_context(|| format!("writing results to {}", a.out.display()))?;
    println!(
        "{} at budget {} on {} ({} prompt + {} decode tokens), {:.2} s",
        s.policy_spec,
        s.budget,
        a.trace.display(),
        s.trace.prompt_len,
        s.trace.n_decode,
        secs
    );
    println!(
        "{:>6} {:>10} {:>9} {:>10} {:>10} {:>12}",
        "layer", "rel_l2", "cosine", "attn_mass", "kl", "bytes"
    );
    for l in &r.layers {
        let n = l.metrics.len() as f64;
        let mean = |f: &dyn Fn(&kvreplay_replay::HeadMetrics) -> f64| {
            l.metrics.iter().map(f).sum::<f64>() / n
        };
        println!(
            "{:>6} {:>10.4} {:>9.4} {:>10.4} {:>10.4} {:>12}",
            l.metrics[0].layer,
            mean(&|m| m.rel_l2),
            mean(&|m| m.cosine),
            mean(&|m| m.attn_mass),
            mean(&|m| m.kl),
            l.bytes
        );
    }
    println!(
        "{:>6} {:>10.4} {:>9.4} {:>10.4} {:>10.4} {:>12}  ({:.1}% of the full f16 cache)",
        "all",
        s.rel_l2_mean,
        s.cosine_mean,
        s.attn_mass_mean,
        s.kl_mean,
        s.bytes,
        100.0 * s.memory_ratio
    );
    println!(
        "wrote {}/{{metrics.csv, retention.csv, summary.json}}",
        a.out.display()
    );
    super::common::report_peak_memory();
    Ok(())
}
