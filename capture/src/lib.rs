//! Capture: run a llama-family model once and write a kvreplay trace.
//!
//! `Model::load` reads a GGUF file (metadata, tokenizer, dequantised f32
//! weights) or an HF transformers checkpoint directory (see [`hf`]); `capture` tokenizes a prompt, prefills in chunks, decodes
//! greedily, and streams every layer's post-RoPE q/k/v and per-head attention
//! output into a trace (see the `kvreplay-traces` crate). Compute goes
//! through the `kvreplay-kernels` crate.

mod capture;
mod error;
mod files;
pub mod gguf;
pub mod hf;
pub mod llama;
pub mod resume;
pub mod tasks;
#[doc(hidden)]
pub mod testing;
pub mod tokenizer;

pub use capture::{
    capture, CaptureOptions, CaptureSummary, Phase, Progress, DEFAULT_PREFILL_CHUNK,
    MAX_ATTN_PROBS_LEN,
};
pub use error::CaptureError;
pub use files::read_text_file;

use std::path::Path;

/// A loaded model: weights, tokenizer and where it came from.
pub struct Model {
    pub llama: llama::Llama,
    pub tokenizer: tokenizer::Tokenizer,
    pub architecture: String,
    pub name: Option<String>,
    pub source: kvreplay_traces::SourceFile,
}

impl Model {
    /// Load a GGUF file, or an HF checkpoint when `path` is a directory.
    pub fn load(path: &Path) -> Result<Model, CaptureError> {
        if hf::is_checkpoint_dir(path) {
            return Model::load_hf(path);
        }
        let g = gguf::GgufFile::open(path)?;
        let llama = llama::Llama::from_gguf(&g)?;
        let tokenizer = tokenizer::Tokenizer::from_gguf(&g)?;
        if tokenizer.vocab_size() != llama.cfg.vocab_size {
            return Err(CaptureError::Metadata {
                path: path.into(),
                key: "tokenizer.ggml.tokens".into(),
                problem: format!(
                    "{} tokens long, but the model's vocabulary is {}",
                    tokenizer.vocab_size(),
                    llama.cfg.vocab_size
                ),
            });
        }
        let sha256 = {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            h.update(g.bytes());
            h.finalize().iter().map(|b| format!("{b:02x}")).collect()
        };
        Ok(Model {
            architecture: g.get_str("general.architecture")?.to_string(),
            name: g
                .get("general.name")
                .and_then(|v| v.as_str())
                .map(String::from),
            source: kvreplay_traces::SourceFile {
                file_name: path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                sha256,
                size: g.bytes().len() as u64,
            },
            llama,
            tokenizer,
        })
    }

    /// Load an HF transformers checkpoint directory (see [`hf`]).
    pub fn load_hf(dir: &Path) -> Result<Model, CaptureError> {
        let (model_type, cfg, tied, biases) = hf::read_config(dir)?;
        let tokenizer = tokenizer::Tokenizer::from_hf(dir)?;
        if tokenizer.vocab_size() > cfg.vocab_size {
            return Err(CaptureError::Config {
                path: dir.join("config.json"),
                field: "vocab_size".into(),
                problem: format!(
                    "{}, but tokenizer.json holds {} tokens",
                    cfg.vocab_size,
                    tokenizer.vocab_size()
                ),
            });
        }
        let llama = hf::load_llama(dir, cfg, tied, biases)?;
        let (sha256, size) = hf::fingerprint(dir)?;
        Ok(Model {
            architecture: model_type,
            name: hf::model_name(dir),
            source: kvreplay_traces::SourceFile {
                file_name: dir
                    .canonicalize()
                    .ok()
                    .as_deref()
                    .unwrap_or(dir)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                sha256,
                size,
            },
            llama,
            tokenizer,
        })
    }
}
