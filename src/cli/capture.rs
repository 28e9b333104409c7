//! `kvreplay capture`: its arguments, one trace from a prompt or task, or a
//! built-in suite of traces.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

use kvreplay_capture::{capture, CaptureOptions, Model, Phase, Progress};
use kvreplay_traces::{Dtype, Span, Trace};

use super::common::{open_device, resolve_model, Work};

#[derive(Args)]
pub(super) struct CaptureArgs {
    /// GGUF model file or HF checkpoint directory (config.json, *.safetensors, tokenizer.json) [default: $KVREPLAY_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
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
    #[arg(long, default_value_t = kvreplay_capture::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Named prompt token span NAME:START:END (end exclusive), recorded in the manifest. Repeatable.
    #[arg(long = "span", value_parser = parse_span)]
    spans: Vec<Span>,
    /// What to store: `full` (q, k, v, o at every position) or `lean` (k and v
    /// everywhere; q and o only for the last --keep-queries prompt positions
    /// and the decode steps: about 4x smaller; policies that read earlier
    /// prompt queries refuse a lean trace and say so).
    #[arg(long, value_enum, default_value = "full")]
    keep: Keep,
    /// With --keep lean: the last N prompt positions whose q and o are kept
    /// (128 covers every built-in policy's default observation window).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    keep_queries: u64,
    /// Overwrite an existing trace at --out.
    #[arg(long)]
    force: bool,
    #[arg(long, help = super::common::CAPTURE_DEVICE_HELP, default_value = "auto")]
    device: kvreplay_kernels::DeviceRequest,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Keep {
    Full,
    Lean,
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

impl CaptureArgs {
    /// The settings one capture and every trace of a suite take from the flags.
    fn apply(&self, opts: &mut CaptureOptions) {
        opts.n_decode = self.decode;
        opts.dtype = self.dtype;
        opts.prefill_chunk = self.prefill_chunk;
        opts.force = self.force;
        opts.keep_queries = self.keep_queries();
    }

    fn keep_queries(&self) -> Option<usize> {
        (self.keep == Keep::Lean).then_some(self.keep_queries as usize)
    }
}

pub(super) fn cmd_capture(a: CaptureArgs) -> Result<()> {
    let model_path = resolve_model(a.model.clone())?;
    if let Some(suite) = &a.suite {
        return capture_suite(&a, suite, &model_path);
    }
    let (prompt, source) = match (a.prompt.clone(), a.prompt_file.clone()) {
        (Some(p), _) => (p, "text".to_string()),
        (None, None) if a.task.is_some() => (String::new(), String::new()),
        (None, Some(f)) => {
            let text = kvreplay_capture::read_text_file(&f, "prompt file")?;
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
    model
        .llama
        .set_backend(open_device(a.device, Work::Capture)?);
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
    opts.attn_probs = a.attn_probs;
    a.apply(&mut opts);
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

fn capture_suite(a: &CaptureArgs, suite: &str, model_path: &Path) -> Result<()> {
    if suite != "default" {
        bail!("unknown suite `{suite}` (known: default)");
    }
    let mut model = Model::load(model_path)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let items = kvreplay_capture::tasks::default_suite();
    // Opened even when every trace exists: a finished trace is kept only if
    // it came from the device this run would use.
    model
        .llama
        .set_backend(open_device(a.device, Work::Capture)?);
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let bar = ProgressBar::new(items.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} traces ({elapsed}, eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    // Instruction-tuned models get the suite's prompts as one user turn of
    // their chat template; a base model (no template) gets the plain text.
    let chat = model.tokenizer.has_chat_template();
    if !chat {
        eprintln!(
            "{}: no chat template (a base model): the suite's prompts are captured as plain text",
            model_path.display()
        );
    }
    let mut made = 0;
    for (name, task) in &items {
        let out = a.out.join(name);
        bar.set_message(name.clone());
        let (ids, spans, source) = kvreplay_capture::tasks::prepare(task, &model, chat)?;
        // a finished trace of this very request is kept (rerunning resumes
        // the suite); one made otherwise is refused; --force recaptures
        if out.join("manifest.json").exists() && !a.force {
            let t = Trace::open(&out).with_context(|| {
                format!(
                    "resuming suite `{suite}`: {} is damaged; pass --force to recapture it",
                    out.display()
                )
            })?;
            let differs = kvreplay_capture::resume::differences(
                &t.manifest,
                &kvreplay_capture::resume::Request {
                    model: &model.source,
                    prompt_ids: &ids,
                    spans: &spans,
                    n_decode: a.decode,
                    dtype: a.dtype,
                    device: model.llama.backend.device().name(),
                    keep_queries: a.keep_queries(),
                },
            );
            if !differs.is_empty() {
                bail!(
                    "resuming suite `{suite}`: {} was captured with {}; pass --force to recapture the suite, or use another --out",
                    out.display(),
                    differs.join(", ")
                );
            }
            bar.inc(1);
            continue;
        }
        let mut opts = CaptureOptions::new(source.clone(), &out);
        opts.prompt_ids = Some(ids);
        opts.spans = spans;
        opts.prompt_source = source;
        opts.chat = chat;
        a.apply(&mut opts);
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
