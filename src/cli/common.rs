//! Helpers shared by several commands (and by `crate::bench`): the model
//! path, the compute backend, and the expansion of trace-folder arguments.
//! A leaf module: it imports nothing else from this crate.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

/// Where `scripts/fetch-model.sh` caches the default model.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model of a trace (validate, bench): --model, else $KVREPLAY_MODEL,
/// else the file the trace records it was captured from when `models/`
/// holds it (e.g. the Gemma 3 GGUF), else the cached default.
pub fn resolve_trace_model(arg: Option<PathBuf>, trace: &std::path::Path) -> Result<PathBuf> {
    if arg.is_none() && std::env::var_os("KVREPLAY_MODEL").is_none() {
        if let Ok(m) = kvreplay_traces::Manifest::read(trace) {
            let cached = PathBuf::from("models").join(&m.model.source.file_name);
            if cached.is_file() && m.model.source.file_name.ends_with(".gguf") {
                return Ok(cached);
            }
        }
    }
    resolve_model(arg)
}

/// The model path (a GGUF file or an HF checkpoint directory): --model,
/// else $KVREPLAY_MODEL, else the cached default.
pub fn resolve_model(arg: Option<PathBuf>) -> Result<PathBuf> {
    let path = arg
        .or_else(|| std::env::var_os("KVREPLAY_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
    if !path.exists() {
        bail!(
            "model {} not found; pass --model FILE.gguf or --model DIR (an HF checkpoint directory with config.json, *.safetensors and tokenizer.json), or run scripts/fetch-model.sh to fetch the default model",
            path.display()
        );
    }
    Ok(path)
}

/// What a backend is opened for: `--device auto` decides per kind of work,
/// by what was measured on a GPU (BENCHMARKS.md, GPU; docs/gpu/).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Capture (and validate): `auto` uses CUDA when a usable GPU is present.
    /// On an H100 the CUDA capture matched the CPU's (q/k/v/o within 3e-5
    /// relative L2, the same greedy tokens) and ran 4.9x (prefill) and 4.1x
    /// (decode) faster than the 16-core CPU beside it.
    Capture,
    /// Replay and sweeps: `auto` uses the CPU. On the same machine replaying
    /// on CUDA took 25x longer than on the CPU (each step copies a small
    /// problem to the device and back); `--device cuda` still runs it.
    Replay,
}

/// Whether `--device auto` uses CUDA (when a usable GPU is present) for this
/// work; flipping one of these is the whole change (the help follows).
pub const fn auto_picks_cuda(w: Work) -> bool {
    match w {
        Work::Capture => true,
        Work::Replay => false,
    }
}

/// The `--device` help of `capture` (and `bench capture`).
pub const CAPTURE_DEVICE_HELP: &str = if auto_picks_cuda(Work::Capture) {
    "Where to compute: cpu, cuda or auto (CUDA when a usable GPU is present, else the CPU; the trace records which)"
} else {
    "Where to compute: cpu, cuda or auto (auto uses the CPU; CUDA is opt-in with --device cuda)"
};

/// The `--device` help of `replay` and `sweep`.
pub const REPLAY_DEVICE_HELP: &str = if auto_picks_cuda(Work::Replay) {
    "Where to compute: cpu, cuda or auto (CUDA when a usable GPU is present, else the CPU)"
} else {
    "Where to compute: cpu, cuda or auto (auto uses the CPU: replay on CUDA measured slower, see BENCHMARKS.md)"
};

/// Open the backend `--device` asks for; say why when `auto` uses the CPU,
/// and name the GPU when one is used.
pub fn open_device(
    req: kvreplay_kernels::DeviceRequest,
    work: Work,
) -> Result<kvreplay_kernels::Backend> {
    use kvreplay_kernels::DeviceRequest;
    let req = match req {
        DeviceRequest::Auto if !auto_picks_cuda(work) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "--device auto: replaying on the CPU (replay on CUDA measured slower; --device cuda to use it anyway)"
                )
            });
            DeviceRequest::Cpu
        }
        r => r,
    };
    let o = kvreplay_kernels::Backend::open(req).context("--device cuda")?;
    if let Some(note) = &o.note {
        eprintln!("{note}");
    }
    if o.backend.device() != kvreplay_kernels::Device::Cpu {
        eprintln!("device: {}", o.backend.describe());
    }
    Ok(o.backend)
}

/// Expand sweep trace arguments: a trace folder, or a folder of trace folders.
pub fn expand_traces(args: &[PathBuf]) -> Result<Vec<PathBuf>> {
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

/// `--max-memory`: a size (512M, 2G) or `auto`.
pub fn parse_memory(s: &str) -> Result<Option<u64>, String> {
    kvreplay_replay::memory::parse_size(s)
}

/// The peak resident memory of this run, on stderr (where the OS reports it).
pub fn report_peak_memory() {
    if let Some(b) = kvreplay_replay::memory::peak_rss() {
        eprintln!(
            "peak memory (RSS): {:.1} MiB",
            b as f64 / (1u64 << 20) as f64
        );
    }
}
