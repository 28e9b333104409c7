//! `kvreplay`'s command line: the clap `Cli` and `Cmd` definitions and the
//! dispatch. Each subcommand's arguments and run function live in the file of
//! the same name (`merge`, one library call, runs here in the dispatch; the
//! benchmarks run in `crate::bench`); helpers several of them share are in
//! `common`.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

mod bench;
mod capture;
mod claims;
pub(crate) mod common;
mod compare;
mod inspect;
mod policies;
mod replay;
mod sensitivity;
mod slurm;
mod sweep;
mod validate;
mod verify;

use bench::BenchCmd;
use capture::{cmd_capture, CaptureArgs};
use claims::cmd_claims;
use common::resolve_model;
use compare::{cmd_compare, CompareArgs};
use inspect::{cmd_inspect, InspectArgs};
use policies::cmd_policies;
use replay::{cmd_replay, ReplayArgs};
use sensitivity::{cmd_sensitivity, SensitivityArgs};
use sweep::{cmd_sweep, SweepArgs};
use validate::{cmd_validate, ValidateArgs};
use verify::cmd_verify;

#[derive(Parser)]
#[command(
    name = "kvreplay",
    version,
    about = "Record an LLM's attention inputs once; replay KV-cache compression policies on them in seconds."
)]
struct Cli {
    /// Worker threads (default: all cores; at most 256, or the CPU count where larger). Results do not depend on it.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a model (GGUF file or HF checkpoint) once on a prompt and write a trace (q/k/v/o per layer and head).
    Capture(CaptureArgs),
    /// Print a trace's manifest, its size by tensor, what it can replay and
    /// per-layer norms; or, with --estimate, the size of traces of a model.
    Inspect(InspectArgs),
    /// Check a trace's sizes and checksums and recompute `o` from q/k/v at sample positions.
    Verify {
        trace: PathBuf,
        /// Positions recomputed per layer.
        #[arg(long, default_value_t = 8)]
        positions: usize,
    },
    /// List every compression policy with its parameters, defaults and source paper.
    Policies,
    /// Apply a compression policy to a trace and measure output error, retention and memory.
    Replay(ReplayArgs),
    /// Replay every (trace, policy, budget) point into results.csv and summary.csv (resumable, shardable).
    Sweep(SweepArgs),
    /// Join the folders of a sharded sweep into what one unsharded run writes.
    Merge {
        /// Shard output folders.
        #[arg(required = true)]
        shards: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Write a Slurm job array for a sweep file and the merge job that runs once every shard succeeded.
    Slurm(slurm::SlurmArgs),
    /// Measure the seed papers' trace-checkable claims on a trace, next to what each paper states.
    Claims {
        #[arg(long)]
        trace: PathBuf,
        /// Also write the claims as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Compare method A with method B of a sweep at matched memory: paired per-trace differences and a bootstrap CI.
    Compare(CompareArgs),
    /// Closed loop: rerun the model with each policy inside the forward pass and check how well replay predicts it.
    Validate(ValidateArgs),
    /// Measure how much each layer's attention error moves the model's output (a closed loop) and store it with the trace, so sweeps predict the end-to-end KL.
    Sensitivity(SensitivityArgs),
    /// Benchmarks on the real model (see BENCHMARKS.md).
    #[command(subcommand)]
    Bench(BenchCmd),
}

/// Most worker threads `--threads` gets: 256, or the CPUs available where
/// there are more. Results do not depend on the count, and a pool of 100,000
/// threads took minutes to start.
fn max_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .max(256)
}

/// An error and its causes on one line, as `{:#}` prints them, without a
/// cause whose text the line already ends with (a library error such as
/// "compute: {0}" prints its cause itself and also returns it as its source).
pub fn error_text(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if !line.is_empty() && line.ends_with(&t) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&t);
    }
    line
}

pub fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(asked) = cli.threads {
        if asked == 0 {
            bail!("--threads must be at least 1");
        }
        let cap = max_threads();
        let n = asked.min(cap);
        if n < asked {
            eprintln!(
                "warning: --threads {asked} is more than kvreplay can use; using {cap} (the larger of 256 and the CPUs available)"
            );
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting up the thread pool")?;
    }
    match cli.cmd {
        Cmd::Capture(a) => cmd_capture(a),
        Cmd::Inspect(a) => cmd_inspect(a),
        Cmd::Verify { trace, positions } => cmd_verify(&trace, positions),
        Cmd::Policies => cmd_policies(),
        Cmd::Claims { trace, json } => cmd_claims(&trace, json.as_deref()),
        Cmd::Sweep(a) => cmd_sweep(a),
        Cmd::Compare(a) => cmd_compare(a),
        Cmd::Validate(a) => cmd_validate(a),
        Cmd::Sensitivity(a) => cmd_sensitivity(a),
        Cmd::Merge { shards, out } => {
            let r = kvreplay_analysis::sweep::merge(&shards, &out)
                .with_context(|| format!("merging into {}", out.display()))?;
            if r.complete {
                // what one run writes: the CSVs and the report with its plots
                let plan = kvreplay_analysis::sweep::read_plan(&out)?;
                kvreplay_analysis::report::write(&out, &plan).context("writing the report")?;
            }
            println!(
                "merged {} shard folders into {}{}",
                shards.len(),
                out.display(),
                if r.complete {
                    ""
                } else {
                    " (some points are still missing)"
                }
            );
            if !r.complete {
                bail!("{}", slurm::missing_message(&r, &out));
            }
            Ok(())
        }
        Cmd::Slurm(a) => slurm::cmd_slurm(a),
        Cmd::Bench(BenchCmd::Replay {
            trace,
            model,
            reps,
            python,
            no_rerun,
            no_numpy,
            policies,
        }) => crate::bench::bench_replay(&crate::bench::ReplayBench {
            trace,
            model,
            reps: reps.max(1),
            python: if no_numpy {
                None
            } else {
                python.or_else(|| {
                    let p = PathBuf::from(".venv-ref/bin/python");
                    p.exists().then_some(p)
                })
            },
            no_rerun,
            policies,
        }),
        Cmd::Bench(BenchCmd::Scaling {
            model,
            dir,
            lengths,
            policy,
            budget,
            reps,
        }) => crate::bench::bench_scaling(&crate::bench::ScalingBench {
            model,
            dir,
            lengths,
            policy,
            budget,
            reps: reps.max(1),
        }),
        Cmd::Replay(a) => cmd_replay(a),
        Cmd::Bench(BenchCmd::Capture {
            model,
            prompt_tokens,
            decode,
            reps,
            dtype,
            device,
            prefill_chunk,
        }) => crate::bench::bench_capture(&crate::bench::CaptureBench {
            model: resolve_model(model)?,
            prompt_tokens,
            decode,
            reps: reps.max(1),
            dtype,
            device,
            prefill_chunk,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::error_text;
    use anyhow::Context;

    /// A kernel error, and a library error that prints it and returns it
    /// as its source (thiserror's `#[error("compute: {0}")] X(#[from] ..)`).
    #[derive(Debug)]
    struct Inner;
    #[derive(Debug)]
    struct Outer(Inner);
    impl std::fmt::Display for Inner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("positions 0..9 do not fit")
        }
    }
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "compute: {}", self.0)
        }
    }
    impl std::error::Error for Inner {}
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn error_text_prints_each_cause_once() {
        let e = Err::<(), _>(Outer(Inner))
            .context("capturing into t.kvtrace")
            .unwrap_err();
        assert_eq!(format!("{e:#}").matches("do not fit").count(), 2);
        assert_eq!(
            error_text(&e),
            "capturing into t.kvtrace: compute: positions 0..9 do not fit"
        );
        // causes that add something are all kept
        let e = Err::<(), _>(Inner).context("a").context("b").unwrap_err();
        assert_eq!(error_text(&e), "b: a: positions 0..9 do not fit");
    }
}
