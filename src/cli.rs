use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

use kvreplay_capture::{capture, CaptureOptions, Model, Phase, Progress};
use kvreplay_traces::{Dtype, Span, Trace, VerifyOptions};

/// Where `scripts/fetch-model.sh` caches the default model.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(
    name = "kvreplay",
    version,
    about = "Record an LLM's attention inputs once; replay KV-cache compression policies on them in seconds."
)]
struct Cli {
    /// Worker threads (default: all cores). Results do not depend on it.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a GGUF model once on a prompt and write a trace (q/k/v/o per layer and head).
    Capture(CaptureArgs),
    /// Print a trace's manifest and per-layer shapes and norms.
    Inspect { trace: PathBuf },
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
    /// Measure the seed papers' trace-checkable claims on a trace, next to what each paper states.
    Claims {
        #[arg(long)]
        trace: PathBuf,
        /// Also write the claims as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Closed loop: rerun the model with each policy inside the forward pass and check how well replay predicts it.
    Validate(ValidateArgs),
    /// Benchmarks on the real model (see BENCHMARKS.md).
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Args)]
struct ValidateArgs {
    /// GGUF model the traces were captured with [default: $KVREPLAY_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Traces: trace folders, or folders whose sub-folders are traces (the first half selects the best predictor, the rest are held out).
    #[arg(long, num_args = 1.., required = true)]
    trace: Vec<PathBuf>,
    /// Policy specs (repeatable).
    #[arg(long = "policy", num_args = 1.., required = true)]
    policies: Vec<String>,
    /// Budgets, comma-separated (entries per KV head and layer).
    #[arg(long, value_delimiter = ',', required = true)]
    budget: Vec<usize>,
    /// Output folder: validation.csv, summary.json, scatter.svg, report.md.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Capture throughput: prefill and decode tokens per second, trace writes included.
    Capture {
        /// GGUF model file [default: $KVREPLAY_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
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
    },
    /// Replay speed: one (policy, budget) point and a sweep of every policy over 6 budgets.
    Replay {
        /// Trace to replay; captured first (2048 + 64 filler tokens) if it does not exist [default: a temporary one]
        #[arg(long)]
        trace: Option<PathBuf>,
        /// GGUF model used when no --trace is given.
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Python (with numpy, safetensors) to run scripts/reference_replay.py [default: .venv-ref/bin/python if present]
        #[arg(long)]
        python: Option<PathBuf>,
        /// Do not time a model rerun.
        #[arg(long)]
        no_rerun: bool,
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

#[derive(Args)]
struct SweepArgs {
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
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepFile {
    traces: Vec<PathBuf>,
    policies: Vec<String>,
    budgets: Vec<usize>,
}

#[derive(Args)]
struct ReplayArgs {
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
    /// Where to compute: cpu, cuda or auto (CUDA when a usable GPU is present).
    #[arg(long, default_value = "cpu")]
    device: kvreplay_kernels::DeviceRequest,
}

#[derive(Args)]
struct CaptureArgs {
    /// GGUF model file [default: $KVREPLAY_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text (tokenized as is: no special tokens are added).
    #[arg(long, group = "prompt_src", required = true)]
    prompt: Option<String>,
    /// A built-in task: passkey:length=N,depth=D | multifact:length=N,facts=K | file:PATH (spans recorded).
    #[arg(long, group = "prompt_src")]
    task: Option<String>,
    /// Capture a built-in suite of traces into the --out folder (`default`: pass key at 512, 1024, 2048 and 4096 tokens, needle depths 0.1-0.9).
    #[arg(long, group = "prompt_src")]
    suite: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long, group = "prompt_src")]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt in the model's chat template (one user message, then the assistant turn).
    #[arg(long)]
    chat: bool,
    /// Greedy tokens to generate after the prompt.
    #[arg(long, default_value_t = 16)]
    decode: usize,
    /// Output trace directory (conventionally NAME.kvtrace).
    #[arg(long)]
    out: PathBuf,
    /// Storage dtype of q/k/v/o: f16, bf16 or f32.
    #[arg(long, default_value = "f16")]
    dtype: Dtype,
    /// Also store full attention probabilities (n_heads, T, T) per layer; T <= 1024.
    #[arg(long)]
    attn_probs: bool,
    /// Prompt positions per prefill step (bounds memory on long prompts).
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Named prompt token span NAME:START:END (end exclusive), recorded in the manifest. Repeatable.
    #[arg(long = "span", value_parser = parse_span)]
    spans: Vec<Span>,
    /// Overwrite an existing trace at --out.
    #[arg(long)]
    force: bool,
    /// Where to compute: cpu, cuda or auto (CUDA when a usable GPU is present).
    #[arg(long, default_value = "auto")]
    device: kvreplay_kernels::DeviceRequest,
}

fn parse_budget(s: &str) -> Result<usize, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n as usize),
        Ok(n) => Err(format!("{n} keeps no entry; the budget is the number of prompt entries kept per KV head and layer, at least 1")),
        Err(_) => Err(format!("`{s}` is not a whole number of entries (use --ratio for a fraction of the prompt)")),
    }
}

fn parse_span(s: &str) -> Result<Span, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("`{s}` is not NAME:START:END (e.g. needle:120:140)");
    if parts.len() != 3 || parts[0].is_empty() {
        return Err(bad());
    }
    let start = parts[1].parse().map_err(|_| bad())?;
    let end = parts[2].parse().map_err(|_| bad())?;
    Ok(Span {
        name: parts[0].into(),
        start,
        end,
    })
}

pub fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(n) = cli.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting up the thread pool")?;
    }
    match cli.cmd {
        Cmd::Capture(a) => cmd_capture(a),
        Cmd::Inspect { trace } => cmd_inspect(&trace),
        Cmd::Verify { trace, positions } => cmd_verify(&trace, positions),
        Cmd::Policies => cmd_policies(),
        Cmd::Claims { trace, json } => cmd_claims(&trace, json.as_deref()),
        Cmd::Sweep(a) => cmd_sweep(a),
        Cmd::Validate(a) => cmd_validate(a),
        Cmd::Merge { shards, out } => {
            let complete = kvreplay_analysis::sweep::merge(&shards, &out)
                .with_context(|| format!("merging into {}", out.display()))?;
            println!(
                "merged {} shard folders into {}{}",
                shards.len(),
                out.display(),
                if complete {
                    ""
                } else {
                    " (some points are still missing)"
                }
            );
            Ok(())
        }
        Cmd::Bench(BenchCmd::Replay {
            trace,
            model,
            reps,
            python,
            no_rerun,
        }) => crate::bench::bench_replay(&crate::bench::ReplayBench {
            trace,
            model,
            reps: reps.max(1),
            python: python.or_else(|| {
                let p = PathBuf::from(".venv-ref/bin/python");
                p.exists().then_some(p)
            }),
            no_rerun,
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
        }) => crate::bench::bench_capture(&crate::bench::CaptureBench {
            model: resolve_model(model)?,
            prompt_tokens,
            decode,
            reps: reps.max(1),
            dtype,
        }),
    }
}

/// The model path: --model, else $KVREPLAY_MODEL, else the cached default.
pub fn resolve_model(arg: Option<PathBuf>) -> Result<PathBuf> {
    let path = arg
        .or_else(|| std::env::var_os("KVREPLAY_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
    if !path.exists() {
        bail!(
            "model file {} not found; pass --model FILE.gguf, or run scripts/fetch-model.sh to fetch the default model",
            path.display()
        );
    }
    Ok(path)
}

fn cmd_capture(a: CaptureArgs) -> Result<()> {
    let model_path = resolve_model(a.model.clone())?;
    if let Some(suite) = &a.suite {
        return capture_suite(&a, suite, &model_path);
    }
    let (prompt, source) = match (a.prompt.clone(), a.prompt_file.clone()) {
        (Some(p), _) => (p, "text".to_string()),
        (None, None) if a.task.is_some() => (String::new(), String::new()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(&f)
                .with_context(|| format!("reading prompt file {}", f.display()))?;
            let name = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (text, format!("file:{name}"))
        }
        (None, None) => unreachable!("clap requires one prompt source"),
    };
    if a.out.exists() && !a.force {
        bail!(
            "{}: already exists; pass --force to overwrite it or choose another --out",
            a.out.display()
        );
    }
    let spinner =
        ProgressBar::new_spinner().with_message(format!("loading {}", model_path.display()));
    let mut model = Model::load(&model_path)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    spinner.finish_and_clear();
    model.llama.set_backend(open_device(a.device)?);
    let mut opts = CaptureOptions::new(prompt, &a.out);
    opts.prompt_source = source;
    if let Some(task) = &a.task {
        let (ids, spans, source) = kvreplay_capture::tasks::prepare(task, &model, a.chat)?;
        opts.prompt = source.clone();
        opts.prompt_ids = Some(ids);
        opts.spans = spans;
        opts.prompt_source = source;
    }
    opts.chat = a.chat;
    opts.n_decode = a.decode;
    opts.dtype = a.dtype;
    opts.prefill_chunk = a.prefill_chunk;
    opts.attn_probs = a.attn_probs;
    opts.force = a.force;
    opts.spans.extend(a.spans.iter().cloned());
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>8} [{bar:40}] {pos}/{len} tokens ({per_sec}, eta {eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut on_progress = |p: Progress| {
        let msg = match p.phase {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Finish => "writing",
        };
        if bar.message() != msg {
            bar.reset();
            bar.set_message(msg);
            bar.set_length(p.total as u64);
        }
        bar.set_position(p.done as u64);
    };
    let s = capture(&model, &opts, &mut on_progress)
        .with_context(|| format!("capturing into {}", a.out.display()))?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {} prompt + {} generated tokens, {} layers",
        s.out.display(),
        s.prompt_len,
        s.n_decode,
        model.llama.cfg.n_layers
    );
    println!(
        "prefill {:.1} tok/s ({:.2} s), decode {:.1} tok/s ({:.2} s)",
        s.prompt_len as f64 / s.prefill_secs,
        s.prefill_secs,
        s.n_decode as f64 / s.decode_secs.max(1e-9),
        s.decode_secs
    );
    println!("continuation: {:?}", s.continuation);
    Ok(())
}

fn cmd_inspect(dir: &Path) -> Result<()> {
    let trace = Trace::open(dir).with_context(|| format!("opening trace {}", dir.display()))?;
    let m = &trace.manifest;
    let md = &m.model;
    println!("trace      {}", dir.display());
    println!("format     {} v{}", m.format, m.format_version);
    println!(
        "model      {} ({}), {} layers, {} heads / {} KV heads, head_dim {}",
        md.name.as_deref().unwrap_or("?"),
        md.architecture,
        md.n_layers,
        md.n_heads,
        md.n_kv_heads,
        md.head_dim
    );
    println!(
        "source     {} ({} bytes, sha256 {})",
        md.source.file_name, md.source.size, md.source.sha256
    );
    println!(
        "rope       theta {}, {:?}, {} rotated dims, scaling {:?}",
        md.rope.theta, md.rope.style, md.rope.rotated_dims, md.rope.scaling
    );
    println!(
        "tokens     {} prompt + {} generated ({}) = T {}",
        m.prompt_len(),
        m.generation.n_decode,
        m.generation.method,
        m.total_len()
    );
    let prompt: String = m.tokens.text[..m.prompt_len()].concat();
    let cont: String = m.tokens.text[m.prompt_len()..].concat();
    println!("prompt     {:?}", preview(&prompt, 160));
    println!("generated  {:?}", preview(&cont, 160));
    for s in &m.spans {
        println!("span       {} [{}, {})", s.name, s.start, s.end);
    }
    let c = &m.capture;
    println!(
        "capture    device {}, dtype {} (compute {}), chunk {}, threads {}, attn_probs {}, chat {}, source {}",
        c.device, c.dtype.name(), c.compute_dtype, c.prefill_chunk, c.threads, c.attn_probs, c.chat_template, c.prompt_source
    );
    println!(
        "created    {} by kvreplay {}",
        c.created, c.kvreplay_version
    );
    println!();
    println!(
        "layer  q {:?}  k/v {:?}  o {:?}  attn_colsum [{}, {}]",
        [md.n_heads, m.total_len(), md.head_dim],
        [md.n_kv_heads, m.total_len(), md.head_dim],
        [md.n_heads, m.total_len(), md.head_dim],
        md.n_heads,
        m.prompt_len()
    );
    println!(
        "{:>5} {:>9} {:>9} {:>9} {:>9}   (mean L2 norm of a row)",
        "layer", "|q|", "|k|", "|v|", "|o|"
    );
    for l in 0..trace.n_layers() {
        let layer = trace.layer(l);
        let norm = |views: Vec<kvreplay_traces::HeadView>| -> f64 {
            let (mut s, mut n) = (0f64, 0usize);
            for v in views {
                for row in v.to_f32().chunks_exact(v.cols) {
                    s += row.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
                    n += 1;
                }
            }
            s / n as f64
        };
        println!(
            "{:>5} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
            l,
            norm((0..md.n_heads).map(|h| layer.q(h)).collect()),
            norm((0..md.n_kv_heads).map(|h| layer.k(h)).collect()),
            norm((0..md.n_kv_heads).map(|h| layer.v(h)).collect()),
            norm((0..md.n_heads).map(|h| layer.o(h)).collect()),
        );
    }
    Ok(())
}

fn preview(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n).collect::<String>() + "..."
    }
}

fn cmd_verify(dir: &Path, positions: usize) -> Result<()> {
    let opts = VerifyOptions {
        positions_per_layer: positions,
        tolerance: None,
    };
    let r = kvreplay_traces::verify(dir, &opts)
        .with_context(|| format!("verifying trace {}", dir.display()))?;
    println!(
        "ok: {} layer files ({:.1} MB) match their sizes and sha256; o recomputed from q/k/v at {} (layer, head, position) points, max relative L2 error {:.2e} (tolerance {:.0e})",
        r.files_checked,
        r.bytes_checked as f64 / 1e6,
        r.positions_checked,
        r.max_rel_err,
        r.tolerance
    );
    Ok(())
}

fn cmd_policies() -> Result<()> {
    print!("{}", kvreplay_replay::policies::listing());
    Ok(())
}

/// Open the backend `--device` asks for; say so when `auto` falls back to the
/// CPU, and name the GPU when one is used.
fn open_device(req: kvreplay_kernels::DeviceRequest) -> Result<kvreplay_kernels::Backend> {
    let o = kvreplay_kernels::Backend::open(req).context("--device cuda")?;
    if let Some(note) = &o.note {
        eprintln!("{note}");
    }
    if o.backend.device() != kvreplay_kernels::Device::Cpu {
        eprintln!("device: {}", o.backend.describe());
    }
    Ok(o.backend)
}

fn cmd_replay(a: ReplayArgs) -> Result<()> {
    use kvreplay_replay::{Budget, PolicySpec};
    let spec = PolicySpec::parse(&a.policy)?;
    let policy = spec.build()?;
    let budget = match (a.budget, a.ratio) {
        (Some(n), _) => Budget::Entries(n),
        (None, Some(r)) => Budget::Ratio(r),
        (None, None) => unreachable!("clap requires one budget"),
    };
    budget.validate()?;
    let trace =
        Trace::open(&a.trace).with_context(|| format!("opening trace {}", a.trace.display()))?;
    budget.resolve(trace.manifest.prompt_len())?;
    let start = std::time::Instant::now();
    let backend = open_device(a.device)?;
    let r = kvreplay_replay::replay_on(&trace, policy.as_ref(), budget, &backend)
        .with_context(|| format!("replaying {} on {}", spec.canonical(), a.trace.display()))?;
    let secs = start.elapsed().as_secs_f64();
    let s = kvreplay_replay::output::summary(&trace, &spec, budget, &r);
    kvreplay_replay::output::write(&a.out, &s, &r)
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
    Ok(())
}

fn cmd_claims(dir: &Path, json: Option<&Path>) -> Result<()> {
    let trace = Trace::open(dir).with_context(|| format!("opening trace {}", dir.display()))?;
    let m = &trace.manifest;
    eprintln!("measuring claims on {} ({} prompt + {} decode tokens); replays run at B = P/4 unless stated", dir.display(), m.prompt_len(), m.generation.n_decode);
    let claims = kvreplay_analysis::claims::measure(&trace)
        .with_context(|| format!("measuring claims on {}", dir.display()))?;
    for c in &claims {
        println!("[{}] {} {}: {}", c.verdict.label(), c.method, c.id, c.claim);
        println!("      paper:    {}", c.paper);
        println!("      measured: {}", c.measured);
    }
    let count = |v| claims.iter().filter(|c| c.verdict == v).count();
    use kvreplay_analysis::claims::Verdict;
    println!(
        "{} claims: {} agree, {} partly, {} disagree, {} not checkable on this trace",
        claims.len(),
        count(Verdict::Agrees),
        count(Verdict::Partly),
        count(Verdict::Disagrees),
        count(Verdict::NotCheckable)
    );
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&claims).expect("claims serialise");
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Expand sweep trace arguments: a trace folder, or a folder of trace folders.
fn expand_traces(args: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for a in args {
        if a.join("manifest.json").exists() {
            out.push(a.clone());
            continue;
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(a)
            .with_context(|| format!("reading {}", a.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("manifest.json").exists())
            .collect();
        if found.is_empty() {
            bail!(
                "{}: neither a trace nor a folder of traces (no manifest.json found)",
                a.display()
            );
        }
        found.sort();
        out.extend(found);
    }
    Ok(out)
}

fn cmd_sweep(a: SweepArgs) -> Result<()> {
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
    let r = kvreplay_analysis::sweep::run_on(
        &plan,
        &a.out,
        a.shard,
        &backend,
        &mut |done, total, label| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(label.to_string());
        },
    )
    .with_context(|| format!("sweeping into {}", a.out.display()))?;
    bar.finish_and_clear();
    if r.complete {
        kvreplay_analysis::report::write(&a.out, &plan).context("writing the report")?;
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

fn cmd_validate(a: ValidateArgs) -> Result<()> {
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
    let model_path = resolve_model(a.model.clone())?;
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
    println!(
        "{} points on {} traces; Spearman with end-to-end KL:",
        s.points,
        s.traces.len()
    );
    for c in &s.correlations {
        match c.held_out {
            Some(h) => println!(
                "  {:<24} all {:>6.3}   held-out {:>6.3}",
                c.predictor, c.all, h
            ),
            None => println!("  {:<24} all {:>6.3}", c.predictor, c.all),
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
        a.out.display()
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

fn capture_suite(a: &CaptureArgs, suite: &str, model_path: &Path) -> Result<()> {
    if suite != "default" {
        bail!("unknown suite `{suite}` (known: default)");
    }
    let mut model = Model::load(model_path)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let items = kvreplay_capture::tasks::default_suite();
    if a.force
        || items
            .iter()
            .any(|(name, _)| !a.out.join(name).join("manifest.json").exists())
    {
        model.llama.set_backend(open_device(a.device)?);
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let bar = ProgressBar::new(items.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} traces ({elapsed}, eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut made = 0;
    for (name, task) in &items {
        let out = a.out.join(name);
        bar.set_message(name.clone());
        // a finished trace is kept (rerunning resumes the suite); --force recaptures
        if out.join("manifest.json").exists() && !a.force {
            bar.inc(1);
            continue;
        }
        let (ids, spans, source) = kvreplay_capture::tasks::prepare(task, &model, true)?;
        let mut opts = CaptureOptions::new(source.clone(), &out);
        opts.prompt_ids = Some(ids);
        opts.spans = spans;
        opts.prompt_source = source;
        opts.chat = true;
        opts.n_decode = a.decode;
        opts.dtype = a.dtype;
        opts.prefill_chunk = a.prefill_chunk;
        opts.force = a.force;
        capture(&model, &opts, &mut |_| {})
            .with_context(|| format!("capturing {}", out.display()))?;
        made += 1;
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "suite `{suite}`: {} traces in {} ({made} captured now)",
        items.len(),
        a.out.display()
    );
    Ok(())
}
