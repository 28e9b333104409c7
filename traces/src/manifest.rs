//! `manifest.json`: everything about a trace except the tensors themselves.

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::TraceError;

/// Value of the manifest's `format` field.
pub const FORMAT_NAME: &str = "kvreplay-trace";
/// The newest format version this build reads. Version 2 added lean traces
/// (`capture.keep_queries`) and `model.layers` (per-layer attention window
/// and RoPE base); version-1 manifests read with neither (full traces, every
/// layer full attention with `model.rope`). A trace is written with the
/// lowest version that describes it (see [`Manifest::needed_version`]), so a
/// full trace of a llama-style model stays readable by releases that know
/// only version 1.
pub const FORMAT_VERSION: u32 = 2;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub model: ModelInfo,
    pub tokens: Tokens,
    pub generation: Generation,
    /// Named token ranges of the prompt (e.g. a needle or a question), `[start, end)`.
    #[serde(default)]
    pub spans: Vec<Span>,
    pub capture: CaptureInfo,
    /// One entry per layer, in layer order.
    pub files: Vec<FileEntry>,
}

/// The model the trace was captured from, with every parameter needed to
/// undo or redo its rotary embedding exactly.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ModelInfo {
    pub architecture: String,
    pub name: Option<String>,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_model: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub norm_eps: f64,
    /// Softmax scale applied to q·k (1/sqrt(head_dim) for llama).
    pub attn_scale: f64,
    pub rope: Rope,
    pub source: SourceFile,
    /// Per layer, when the layers differ (Gemma 3: sliding-window layers
    /// with their own RoPE base); empty means every layer is full attention
    /// with `rope` (llama, and every version-1 trace).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<LayerAttention>,
}

/// One layer's attention: its key window and RoPE base.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LayerAttention {
    /// `Some(W)`: sliding window; the query at position t attends to keys
    /// `max(0, t - W + 1) ..= t` (W keys counting itself). `None`: full
    /// causal attention.
    pub window: Option<usize>,
    /// This layer's RoPE base (the other RoPE parameters are `model.rope`'s;
    /// a layer with a base other than `rope.theta` is unscaled).
    pub rope_theta: f64,
}

impl ModelInfo {
    /// The sliding window of `layer` (None: full attention).
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.layers.get(layer).and_then(|l| l.window)
    }

    /// Whether any layer attends through a sliding window.
    pub fn has_sliding_layers(&self) -> bool {
        self.layers.iter().any(|l| l.window.is_some())
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Rope {
    /// Base of the inverse frequencies: inv_freq[i] = theta^(-2i / rotated_dims).
    pub theta: f64,
    /// How dimensions are paired in the stored q and k.
    pub style: RopeStyle,
    /// Leading dimensions of each head that are rotated (the rest pass through).
    pub rotated_dims: usize,
    pub scaling: RopeScaling,
}

/// Pairing of rotated dimensions.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Dimension i pairs with i + rotated_dims/2 ("rotate_half", HF transformers layout).
    Neox,
    /// Dimension 2i pairs with 2i + 1 (GPT-J / llama.cpp "normal" layout).
    Interleaved,
}

/// Position scaling applied before the rotation: angle = (pos / factor) * inv_freq.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    /// Llama 3.x frequency scaling (HF `rope_type: llama3`): inv_freq is
    /// divided by `factor` for wavelengths above `original_max_position_embeddings
    /// / low_freq_factor`, kept below `/ high_freq_factor`, interpolated between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SourceFile {
    pub file_name: String,
    pub sha256: String,
    pub size: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Tokens {
    /// All T token ids: the prompt, then the generated continuation.
    pub ids: Vec<u32>,
    pub prompt_len: usize,
    /// The decoded text of each token (same length as `ids`).
    pub text: Vec<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Generation {
    /// Always "greedy" in format version 1.
    pub method: String,
    /// Number of generated tokens in the trace (T - prompt_len); every one
    /// of them was fed back through the model, so its q/k/v/o exist.
    pub n_decode: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Span {
    pub name: String,
    pub start: usize,
    pub end: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct CaptureInfo {
    pub device: String,
    /// Storage dtype of q, k, v and o.
    pub dtype: Dtype,
    /// Dtype the model was computed in.
    pub compute_dtype: String,
    pub prefill_chunk: usize,
    pub threads: usize,
    /// Whether `attn_probs` (n_heads, T, T) is stored.
    pub attn_probs: bool,
    /// A lean trace (`capture --keep lean`, format version 2): `q` and `o`
    /// are stored only for the last `keep_queries` prompt positions and every
    /// decode step; absent in a full trace (every position stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_queries: Option<usize>,
    pub chat_template: bool,
    /// Where the prompt came from (`text`, `file:NAME`, a task name, ...).
    pub prompt_source: String,
    pub kvreplay_version: String,
    /// RFC 3339, UTC.
    pub created: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct FileEntry {
    pub layer: usize,
    pub file: String,
    pub size: u64,
    pub sha256: String,
}

/// Storage dtype of the q/k/v/o tensors.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F16,
    Bf16,
    F32,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
        }
    }
    pub(crate) fn safetensors(self) -> safetensors::Dtype {
        match self {
            Dtype::F16 => safetensors::Dtype::F16,
            Dtype::Bf16 => safetensors::Dtype::BF16,
            Dtype::F32 => safetensors::Dtype::F32,
        }
    }
    pub(crate) fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::F16 => Some(Dtype::F16),
            safetensors::Dtype::BF16 => Some(Dtype::Bf16),
            safetensors::Dtype::F32 => Some(Dtype::F32),
            _ => None,
        }
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(Dtype::F16),
            "bf16" => Ok(Dtype::Bf16),
            "f32" => Ok(Dtype::F32),
            _ => Err(format!("unknown dtype `{s}` (expected f16, bf16 or f32)")),
        }
    }
}

impl Manifest {
    /// Total positions T.
    pub fn total_len(&self) -> usize {
        self.tokens.ids.len()
    }
    pub fn prompt_len(&self) -> usize {
        self.tokens.prompt_len
    }

    /// Share of the full cache at the last position that the sliding-window
    /// layers' windows hold, min(T, W) entries each against T for a full
    /// layer (every layer's entries are the same size): 0 without sliding
    /// layers. By default a policy leaves that part as it is.
    pub fn window_share(&self) -> f64 {
        let t = self.total_len();
        let n = self.model.n_layers;
        let window: usize = (0..n)
            .filter_map(|l| self.model.window(l))
            .map(|w| w.min(t))
            .sum();
        if window == 0 {
            return 0.0;
        }
        let all: usize = (0..n)
            .map(|l| self.model.window(l).map_or(t, |w| w.min(t)))
            .sum();
        window as f64 / all as f64
    }

    /// First position whose `q` and `o` are stored (0 in a full trace).
    pub fn query_start(&self) -> usize {
        match self.capture.keep_queries {
            Some(n) => self.prompt_len() - n.min(self.prompt_len()),
            None => 0,
        }
    }

    /// Whether q and o are missing for some prompt positions.
    pub fn is_lean(&self) -> bool {
        self.query_start() > 0
    }

    /// The lowest format version that describes this trace: 2 for a lean
    /// trace, one whose layers differ (`model.layers`) or one with Llama 3
    /// RoPE scaling, else 1.
    pub fn needed_version(&self) -> u32 {
        let v2 = !self.model.layers.is_empty()
            || matches!(self.model.rope.scaling, RopeScaling::Llama3 { .. });
        if v2 {
            2
        } else {
            self.layout().format_version()
        }
    }

    /// Read and check `dir/manifest.json`: format name and version first (so
    /// a newer trace gets the "upgrade" message, not a parse error), then the
    /// full structure and its internal consistency.
    pub fn read(dir: &Path) -> Result<Manifest, TraceError> {
        Manifest::read_with_id(dir).map(|(m, _)| m)
    }

    /// [`Manifest::read`], plus the sha256 of the manifest's bytes.
    pub fn read_with_id(dir: &Path) -> Result<(Manifest, String), TraceError> {
        let path = dir.join("manifest.json");
        match std::fs::metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TraceError::Io {
                    path: dir.to_path_buf(),
                    err: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "trace directory not found",
                    ),
                })
            }
            Err(e) => return Err(TraceError::io(dir, e)),
            Ok(m) if !m.is_dir() => return Err(TraceError::Io {
                path: dir.to_path_buf(),
                err: std::io::Error::other(
                    "is a file, not a trace: a trace is the directory `kvreplay capture` writes",
                ),
            }),
            Ok(_) => {}
        }
        if !path.exists() {
            return Err(TraceError::NotATrace {
                path: dir.to_path_buf(),
            });
        }
        if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            return Err(TraceError::NotAFile { path });
        }
        let bytes = std::fs::read(&path).map_err(|e| TraceError::io(&path, e))?;
        let id = {
            use sha2::{Digest, Sha256};
            crate::hex(&Sha256::digest(&bytes))
        };
        let text = String::from_utf8(bytes).map_err(|_| TraceError::Manifest {
            path: path.clone(),
            msg: "not UTF-8 text".into(),
        })?;
        Ok((Manifest::parse(&path, &text)?, id))
    }

    /// Parse and check the text of a manifest; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Manifest, TraceError> {
        let path = path.to_path_buf();
        let bad = |msg: String| TraceError::Manifest {
            path: path.clone(),
            msg,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT_NAME) => {}
            other => {
                return Err(bad(format!(
                    "field `format` is {other:?}, expected \"{FORMAT_NAME}\""
                )))
            }
        }
        let version = value
            .get("format_version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad("field `format_version` is missing or not an integer".into()))?;
        if version > FORMAT_VERSION as u64 {
            return Err(TraceError::NewerVersion {
                path,
                found: version as u32,
                supported: FORMAT_VERSION,
            });
        }
        if version == 0 {
            return Err(bad(
                "field `format_version` is 0; versions start at 1: this is not a manifest kvreplay wrote"
                    .into(),
            ));
        }
        let m: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        m.check().map_err(bad)?;
        Ok(m)
    }

    /// Internal consistency of the fields.
    pub fn check(&self) -> Result<(), String> {
        let m = &self.model;
        if m.n_layers == 0 || m.n_heads == 0 || m.n_kv_heads == 0 || m.head_dim == 0 {
            return Err(
                "model: n_layers, n_heads, n_kv_heads and head_dim must be positive".into(),
            );
        }
        if !m.n_heads.is_multiple_of(m.n_kv_heads) {
            return Err(format!(
                "model: n_heads ({}) is not a multiple of n_kv_heads ({})",
                m.n_heads, m.n_kv_heads
            ));
        }
        let positive = |name: &str, v: f64, max: f64| {
            if v.is_finite() && v > 0.0 && v <= max {
                Ok(())
            } else {
                Err(format!(
                    "model: {name} is {v}, expected a finite value in (0, {max:e}]"
                ))
            }
        };
        // 1/sqrt(head_dim) in every supported model; a few use 1; 10 is absurd
        positive("attn_scale", m.attn_scale, 10.0)?;
        positive("norm_eps", m.norm_eps, 1.0)?;
        positive("rope.theta", m.rope.theta, 1e12)?;
        if let RopeScaling::Linear { factor } = m.rope.scaling {
            positive("rope.scaling.factor", factor, 1e6)?;
        }
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = m.rope.scaling
        {
            positive("rope.scaling.factor", factor, 1e6)?;
            positive("rope.scaling.low_freq_factor", low_freq_factor, 1e6)?;
            positive("rope.scaling.high_freq_factor", high_freq_factor, 1e6)?;
            positive(
                "rope.scaling.original_max_position_embeddings",
                original_max_position_embeddings,
                1e9,
            )?;
            if high_freq_factor <= low_freq_factor {
                return Err("rope.scaling: high_freq_factor must exceed low_freq_factor".into());
            }
        }
        if m.rope.rotated_dims > m.head_dim || !m.rope.rotated_dims.is_multiple_of(2) {
            return Err(format!(
                "model: rope.rotated_dims {} must be even and at most head_dim {}",
                m.rope.rotated_dims, m.head_dim
            ));
        }
        if !m.layers.is_empty() && m.layers.len() != m.n_layers {
            return Err(format!(
                "model.layers: {} entries for {} layers",
                m.layers.len(),
                m.n_layers
            ));
        }
        for (l, la) in m.layers.iter().enumerate() {
            if la.window == Some(0) {
                return Err(format!(
                    "model.layers[{l}]: window 0 (a window holds at least one key)"
                ));
            }
            positive(&format!("layers[{l}].rope_theta"), la.rope_theta, 1e12)?;
        }
        let t = &self.tokens;
        if t.text.len() != t.ids.len() {
            return Err(format!(
                "tokens: {} ids but {} decoded texts",
                t.ids.len(),
                t.text.len()
            ));
        }
        if t.prompt_len == 0 || t.prompt_len > t.ids.len() {
            return Err(format!(
                "tokens: prompt_len {} is outside 1..={}",
                t.prompt_len,
                t.ids.len()
            ));
        }
        if t.prompt_len.checked_add(self.generation.n_decode) != Some(t.ids.len()) {
            return Err(format!(
                "tokens: prompt_len {} + generation.n_decode {} != {} ids",
                t.prompt_len,
                self.generation.n_decode,
                t.ids.len()
            ));
        }
        for s in &self.spans {
            if s.start > s.end || s.end > t.ids.len() {
                return Err(format!(
                    "spans: `{}` [{}, {}) is outside the {} tokens",
                    s.name,
                    s.start,
                    s.end,
                    t.ids.len()
                ));
            }
        }
        if self.files.len() != m.n_layers {
            return Err(format!(
                "files: {} entries for {} layers",
                self.files.len(),
                m.n_layers
            ));
        }
        if (self.format_version as u64) < self.needed_version() as u64 {
            return Err(format!(
                "format_version {} cannot describe this trace: a lean trace (capture.keep_queries {:?}) or per-layer attention (model.layers) needs version {}",
                self.format_version,
                self.capture.keep_queries,
                self.needed_version()
            ));
        }
        for (l, f) in self.files.iter().enumerate() {
            if f.layer != l || f.file != crate::layer_file_name(l) {
                return Err(format!(
                    "files[{l}]: expected layer {l} in `{}`, found layer {} in `{}`",
                    crate::layer_file_name(l),
                    f.layer,
                    f.file
                ));
            }
        }
        Ok(())
    }

    /// Position of the query heads' shared key/value head.
    pub fn kv_head_of(&self, head: usize) -> usize {
        head / (self.model.n_heads / self.model.n_kv_heads)
    }
}
