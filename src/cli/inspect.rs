//! `kvreplay inspect`: a trace's manifest, its size by tensor, which policies
//! it can replay, and per-layer shapes and norms; `--estimate`: the size of
//! full and lean traces of a model at given lengths, computed from the same
//! layout code the writer uses.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};

use kvreplay_replay::{PolicySpec, REGISTRY};
use kvreplay_traces::{Dtype, Manifest, Trace, TraceLayout};

#[derive(Args)]
pub(super) struct InspectArgs {
    /// The trace to describe.
    #[arg(required_unless_present = "estimate", conflicts_with = "estimate")]
    trace: Option<PathBuf>,
    /// Instead: estimate trace sizes for a model, given by a HF `config.json`
    /// (or a folder holding one), a GGUF file, or a trace (its model).
    #[arg(long, value_name = "MODEL_CONFIG")]
    estimate: Option<PathBuf>,
    /// With --estimate: prompt lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768,131072")]
    tokens: Vec<usize>,
    /// With --estimate: generated tokens per trace.
    #[arg(long, default_value_t = 16)]
    decode: usize,
    /// With --estimate: prompt queries a lean trace keeps (capture --keep-queries).
    #[arg(long, default_value_t = 128)]
    keep_queries: usize,
    /// With --estimate: storage dtype.
    #[arg(long, default_value = "f16")]
    dtype: Dtype,
}

pub(super) fn cmd_inspect(a: InspectArgs) -> Result<()> {
    if let Some(config) = &a.estimate {
        return estimate(&a, config);
    }
    let dir = a
        .trace
        .as_deref()
        .expect("clap requires a trace without --estimate");
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
    if !md.layers.is_empty() {
        let kinds: Vec<String> = md
            .layers
            .iter()
            .map(|la| match la.window {
                Some(w) => format!("sliding {w} (theta {})", la.rope_theta),
                None => format!("full (theta {})", la.rope_theta),
            })
            .collect();
        println!("layers     {}", kinds.join(", "));
    }
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
    if let Some(n) = c.keep_queries {
        println!(
            "keep       lean: q and o of the last {} prompt positions (from {}) and the decode steps",
            n.min(m.prompt_len()),
            m.query_start()
        );
    } else {
        println!("keep       full: q, k, v and o of every position");
    }
    println!();
    print_sizes(&m.layout());
    println!();
    print_replayable(m);
    println!();
    let tq = m.total_len() - m.query_start();
    println!(
        "layer  q {:?}  k/v {:?}  o {:?}  attn_colsum [{}, {}]",
        [md.n_heads, tq, md.head_dim],
        [md.n_kv_heads, m.total_len(), md.head_dim],
        [md.n_heads, tq, md.head_dim],
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

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Bytes of each tensor over every layer, with its share of the layer files.
fn print_sizes(layout: &TraceLayout) {
    let total = layout.trace_bytes();
    println!(
        "size       {} in {} layer files",
        mib(total),
        layout.n_layers
    );
    for (name, per_layer) in layout.tensor_bytes() {
        let b = per_layer * layout.n_layers as u64;
        println!(
            "  {:<12} {:>12} {:>5.1}%",
            name,
            mib(b),
            100.0 * b as f64 / total as f64
        );
    }
}

/// Budgets at which what a policy reads is checked.
const CHECK_BUDGETS: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];

/// Which registered policies (under their defaults) this trace can replay.
fn print_replayable(m: &Manifest) {
    if !m.is_lean() {
        println!(
            "replays    every policy ({} registered): every prompt query is stored",
            REGISTRY.len()
        );
        return;
    }
    let (mut ok, mut not) = (Vec::new(), Vec::new());
    for info in REGISTRY {
        let Ok(policy) = PolicySpec::parse(info.name).and_then(|s| s.build()) else {
            continue;
        };
        let need = CHECK_BUDGETS
            .iter()
            .map(|&b| policy.prompt_queries(m.prompt_len(), b))
            .max()
            .unwrap_or(0)
            .min(m.prompt_len());
        // what `check_reads` compares
        if need <= m.prompt_len() - m.query_start() {
            ok.push(info.name.to_string());
        } else {
            not.push(format!("{} (reads {need})", info.name));
        }
    }
    println!(
        "replays    {} of {} registered policies under their defaults: {}",
        ok.len(),
        REGISTRY.len(),
        ok.join(", ")
    );
    if !not.is_empty() {
        println!(
            "refuses    {} (prompt queries read; this trace keeps {})",
            not.join(", "),
            m.prompt_len() - m.query_start()
        );
    }
    println!("           (parameters that widen a window, e.g. snapkv:w=256, can need more)");
}

/// A model's attention shape for the estimate.
struct Shape {
    name: String,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

fn read_shape(path: &Path) -> Result<Shape> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if path.join("manifest.json").is_file() {
        let m = Manifest::read(path)?;
        return Ok(Shape {
            name: m.model.name.clone().unwrap_or(name),
            n_layers: m.model.n_layers,
            n_heads: m.model.n_heads,
            n_kv_heads: m.model.n_kv_heads,
            head_dim: m.model.head_dim,
        });
    }
    let config = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if config.extension().is_some_and(|e| e == "gguf") {
        let g = kvreplay_capture::gguf::GgufFile::open(&config)?;
        let c = kvreplay_capture::llama::LlamaConfig::from_gguf(&g)?;
        return Ok(Shape {
            name,
            n_layers: c.n_layers,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        });
    }
    let text = std::fs::read_to_string(&config)
        .with_context(|| format!("reading {}", config.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", config.display()))?;
    // multimodal configs (Gemma 3) nest the language model's
    let v = v.get("text_config").unwrap_or(&v);
    let field = |k: &str| -> Result<usize> {
        match v.get(k) {
            Some(x) => x.as_u64().map(|x| x as usize).with_context(|| {
                format!("{}: field `{k}` is not a whole number", config.display())
            }),
            None => bail!(
                "{}: field `{k}` is missing (a HF config.json has it)",
                config.display()
            ),
        }
    };
    let n_heads = field("num_attention_heads")?;
    let head_dim = match v.get("head_dim") {
        Some(_) => field("head_dim")?,
        None => field("hidden_size")? / n_heads.max(1),
    };
    let n_kv_heads = match v.get("num_key_value_heads") {
        Some(_) => field("num_key_value_heads")?,
        None => n_heads,
    };
    let name = v
        .get("_name_or_path")
        .and_then(|x| x.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| {
            let stem = config.file_stem().map(|s| s.to_string_lossy().into_owned());
            match stem.as_deref() {
                Some("config") | None => name.clone(),
                Some(s) => s.to_string(),
            }
        });
    Ok(Shape {
        name,
        n_layers: field("num_hidden_layers")?,
        n_heads,
        n_kv_heads,
        head_dim,
    })
}

/// Sizes of full and lean traces of a model: one markdown row per length.
fn estimate(a: &InspectArgs, config: &Path) -> Result<()> {
    let s = read_shape(config)?;
    if s.n_layers == 0 || s.n_heads == 0 || s.n_kv_heads == 0 || s.head_dim == 0 {
        bail!("{}: the model has an empty dimension", config.display());
    }
    println!(
        "| model | layers x heads/KV x dim | prompt tokens | full trace | lean trace (last {} queries) | lean / full |",
        a.keep_queries
    );
    println!("|---|---|---:|---:|---:|---:|");
    for &p in &a.tokens {
        if p == 0 {
            bail!("--tokens: a prompt has at least one token");
        }
        let full = TraceLayout {
            n_layers: s.n_layers,
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            head_dim: s.head_dim,
            total_len: p + a.decode,
            prompt_len: p,
            dtype: a.dtype,
            attn_probs: false,
            query_start: 0,
        };
        let lean = TraceLayout {
            query_start: p - a.keep_queries.min(p),
            ..full
        };
        let (f, l) = (full.trace_bytes(), lean.trace_bytes());
        println!(
            "| {} | {} x {}/{} x {} | {} | {} | {} | {:.2} |",
            s.name,
            s.n_layers,
            s.n_heads,
            s.n_kv_heads,
            s.head_dim,
            p,
            human(f),
            human(l),
            l as f64 / f as f64
        );
    }
    Ok(())
}

/// Bytes in KB/MB/GB (powers of 1000, as disks are sold).
fn human(b: u64) -> String {
    let x = b as f64;
    if x >= 1e9 {
        format!("{:.1} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} MB", x / 1e6)
    } else {
        format!("{:.1} KB", x / 1e3)
    }
}
