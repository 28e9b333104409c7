//! Helpers shared by the binary's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const ROOT: &str = env!("CARGO_MANIFEST_DIR");

pub fn require(what: &str, path: PathBuf, how: &str) -> Option<PathBuf> {
    if path.exists() {
        return Some(path);
    }
    let msg = format!("{what} not found at {}; {how}", path.display());
    if std::env::var_os("KVREPLAY_REQUIRE_MODEL").is_some() {
        panic!("{msg}");
    }
    eprintln!("NOT RUN: {msg}");
    None
}

pub fn model() -> Option<PathBuf> {
    let p = std::env::var_os("KVREPLAY_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    require(
        "the SmolLM2 model",
        p,
        "run scripts/fetch-model.sh (or scripts/test.sh)",
    )
}

/// Gemma 3 270M (GGUF Q4_K_M), fetched by `scripts/fetch-model.sh gemma3`;
/// `KVREPLAY_GEMMA3_MODEL` names another path.
pub fn gemma3_model() -> Option<PathBuf> {
    let p = std::env::var_os("KVREPLAY_GEMMA3_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join("models/gemma-3-270m-Q4_K_M.gguf"));
    require(
        "the Gemma 3 model",
        p,
        "run scripts/fetch-model.sh gemma3 (or scripts/test.sh)",
    )
}

pub fn python() -> Option<PathBuf> {
    let p = std::env::var_os("KVREPLAY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join(".venv-ref/bin/python"));
    require(
        "the reference Python environment",
        p,
        "run scripts/setup-reference.sh (or scripts/test.sh)",
    )
}

/// A command running the reference Python `python` with its BLAS on one
/// thread. cargo runs a binary's tests two at a time, and two NumPy
/// processes whose OpenBLAS threads spin against each other on this 2-core
/// machine took 5x longer: 47 s against 9.4 s for the same two reference
/// runs (tests/replay_real.rs's NumPy comparisons).
pub fn python_cmd(python: &Path) -> Command {
    let mut c = Command::new(python);
    for var in ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"] {
        c.env(var, "1");
    }
    c
}

pub fn kvreplay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvreplay"))
        .args(args)
        .output()
        .expect("kvreplay runs")
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Bytes of the files directly in `dir` (a trace's layer files and manifest).
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}
