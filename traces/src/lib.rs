//! The kvreplay trace format (versions 1 and 2: lean traces store q and o for the last prompt positions only).
//!
//! A trace is a directory `NAME.kvtrace/` holding `manifest.json` and one
//! safetensors file per layer (`layer-000.safetensors`, ...). Each layer file
//! holds the post-RoPE `q` (n_heads, T, head_dim), `k` and `v`
//! (n_kv_heads, T, head_dim), the per-head attention output `o`
//! (n_heads, T, head_dim), and `attn_colsum` (n_heads, prompt_len, f32).
//! See `traces/FORMAT.md` for the full specification.
//!
//! Invariant: this crate depends on nothing else in the workspace. It knows
//! the format, not the models that write it nor the policies that read it.

mod error;
mod manifest;
mod reader;
mod sensitivity;
mod verify;
mod writer;

pub use error::TraceError;
pub use manifest::{
    CaptureInfo, Dtype, FileEntry, Generation, LayerAttention, Manifest, ModelInfo, Rope,
    RopeScaling, RopeStyle, SourceFile, Span, Tokens, FORMAT_NAME, FORMAT_VERSION,
};
pub use reader::{parse_layer_header, HeadView, LayerView, Reads, TensorIndex, Trace};
pub use sensitivity::{Sensitivity, SENSITIVITY_FILE, SENSITIVITY_FORMAT};
pub use verify::{verify, VerifyOptions, VerifyReport};
pub use writer::{LayerWriter, TensorKind, TraceLayout, TraceWriter};

/// Name of the layer file for layer `l`.
pub fn layer_file_name(l: usize) -> String {
    format!("layer-{l:03}.safetensors")
}

/// Hex sha256 of a file, streamed.
pub fn sha256_file(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
