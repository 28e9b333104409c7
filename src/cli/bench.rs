//! `kvreplay bench`: the clap subcommands and their arguments; the
//! benchmarks themselves are in `crate::bench`.

use clap::Subcommand;
use std::path::PathBuf;

use kvreplay_traces::Dtype;

#[derive(Subcommand)]
pub(super) enum BenchCmd {
    /// Capture throughput: prefill and decode tokens per second, trace writes included.
    Capture {
        /// GGUF model file or HF checkpoint directory (config.json, *.safetensors, tokenizer.json) [default: $KVREPLAY_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 2048)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 64)]
        decode: usize,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        #[arg(long, default_value = "f16")]
        dtype: Dtype,
        /// Where to compute: cpu, cuda or auto
        #[arg(long, default_value = "cpu")]
        device: kvreplay_kernels::DeviceRequest,
        /// Prompt positions per prefill step (as `capture --prefill-chunk`).
        #[arg(long, default_value_t = kvreplay_capture::DEFAULT_PREFILL_CHUNK)]
        prefill_chunk: usize,
    },
    /// Replay speed: one (policy, budget) point and a sweep of every policy over 6 budgets.
    Replay {
        /// Trace to replay; captured first (2048 + 64 filler tokens) if it does not exist [default: a temporary one]
        #[arg(long)]
        trace: Option<PathBuf>,
        /// GGUF model used when no --trace is given.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Repetitions of the one-point timing, the sweep and the model
        /// rerun; their medians are reported (this machine's run-to-run
        /// spread is ±10%, BENCHMARKS.md)
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Python (with numpy, safetensors) to run scripts/reference_replay.py [default: .venv-ref/bin/python if present]
        #[arg(long)]
        python: Option<PathBuf>,
        /// Do not time a model rerun.
        #[arg(long)]
        no_rerun: bool,
        /// Do not run the NumPy reference comparison.
        #[arg(long)]
        no_numpy: bool,
        /// Policies to sweep: `all` (the performance issue's 17, then every
        /// other registered method), `core` (the 17 alone) or a comma-separated list.
        #[arg(long, default_value = "all")]
        policies: String,
    },
    /// Replay time against prompt length (captures filler traces of each length first).
    Scaling {
        /// GGUF model used to capture missing traces.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Where the traces are kept between runs.
        #[arg(long, default_value = "results/bench-scaling")]
        dir: PathBuf,
        /// Prompt lengths (beyond the model's context, RoPE extrapolates: fine for timing).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "512,1024,2048,4096,8192,16384"
        )]
        lengths: Vec<usize>,
        #[arg(long, default_value = "snapkv")]
        policy: String,
        #[arg(long, default_value_t = 256)]
        budget: usize,
        #[arg(long, default_value_t = 3)]
        reps: usize,
    },
}
