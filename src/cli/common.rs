//! Helpers shared by several commands (and by `crate::bench`): the model
//! path, the compute backend, and the expansion of trace-folder arguments.
//! A leaf module: it imports nothing else from this crate.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

/// Where `scripts/fetch-model.sh` caches the default model.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

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

/// Whether `--device auto` uses CUDA when a usable GPU is present. Off until
/// the CUDA path's parity with the CPU and its speed are recorded in
/// BENCHMARKS.md (`scripts/gpu-check.sh` measures both on a GPU machine);
/// turning it on is this one line (the `--device` help follows it).
pub const AUTO_PICKS_CUDA: bool = false;

/// What `auto` does instead, printed once per run when it is asked for.
const AUTO_CPU_NOTE: &str = "--device auto: using the CPU; the CUDA path is opt-in \
     (--device cuda) until its parity and speed are recorded in BENCHMARKS.md";

/// The `--device` help of every command that takes it.
pub const DEVICE_HELP: &str = if AUTO_PICKS_CUDA {
    "Where to compute: cpu, cuda or auto (CUDA when a usable GPU is present, else the CPU)"
} else {
    "Where to compute: cpu, cuda or auto (auto uses the CPU: the CUDA path is opt-in, \
     --device cuda, until its parity and speed are recorded in BENCHMARKS.md)"
};

/// Open the backend `--device` asks for; say why when `auto` uses the CPU,
/// and name the GPU when one is used.
pub fn open_device(req: kvreplay_kernels::DeviceRequest) -> Result<kvreplay_kernels::Backend> {
    use kvreplay_kernels::DeviceRequest;
    let req = match req {
        DeviceRequest::Auto if !AUTO_PICKS_CUDA => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("{AUTO_CPU_NOTE}"));
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
