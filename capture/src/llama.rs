//! The llama-family forward pass in f32 (RMSNorm, RoPE, grouped-query
//! attention, SwiGLU MLP, tied or untied output head), generalised by an
//! architecture description read from GGUF metadata ([`LlamaConfig`]) to
//! Gemma 3 (`gemma3`): q/k RMSNorm per head before RoPE, post-attention and
//! post-FFN norms, GELU-tanh gated FFN, embeddings scaled by sqrt(d_model),
//! and per layer a sliding window and RoPE base.
//!
//! Weights are held in the HF layout: llama GGUFs store the rows of Q and K
//! permuted so that llama.cpp's interleaved RoPE applies (see
//! `unpermute_rows`); we undo that at load time and apply NEOX ("rotate_half")
//! RoPE, so captured q and k come out exactly as HF transformers computes them.
//! Gemma 3 GGUFs are not permuted (llama.cpp runs gemma3 with NEOX RoPE), so
//! their rows load as stored.
//!
//! Qwen 2 (`qwen2`) and Qwen 3 (`qwen3`) GGUFs as llama.cpp writes them:
//! NEOX RoPE, so Q/K rows are stored in the HF order (llama.cpp's converter
//! permutes only for `llama`); qwen2 adds the biases `blk.N.attn_{q,k,v}.bias`
//! to q, k and v (no o bias); qwen3 applies the per-head RMSNorms
//! `blk.N.attn_{q,k}_norm.weight` (`x / rms(x) * w`, the file's epsilon) to
//! q and k before RoPE, with head_dim from `qwen3.attention.key_length`.
//! llama.cpp runs neither with a sliding window, so a
//! `{arch}.attention.sliding_window` key outside gemma3 is refused, and every
//! tensor of the file must be one the architecture uses (a bias on llama, a
//! q norm on qwen2, MoE experts, ...): anything else is refused by name.
//!
//! Gemma 3 facts this file relies on (checked against the GGUF of
//! gemma-3-270m and HF transformers' Gemma 3):
//! - RMSNorm is `x / rms(x) * (1 + w)` in HF; llama.cpp's converter adds the 1
//!   to every `*norm.weight` (`norm_shift`), so the GGUF norms are applied as
//!   `x / rms(x) * w` like llama's (the stored values hover nowhere near 0).
//! - layer l is full attention when `l % 6 == 5` (HF `sliding_window_pattern`
//!   6, llama.cpp `set_swa_pattern(6)`), otherwise sliding with
//!   `gemma3.attention.sliding_window` keys: the query at t sees keys
//!   `t - W + 1 ..= t` (HF mask `kv_idx > q_idx - W`).
//! - full layers use `gemma3.rope.freq_base` (1e6, with the file's linear
//!   scaling if any); sliding layers use [`GEMMA3_LOCAL_ROPE_BASE`], which
//!   GGUF does not store (HF `rope_local_base_freq`, llama.cpp
//!   `freq_base_swa`), unscaled.
//! - the attention scale is `query_pre_attn_scalar^-0.5`; GGUF does not store
//!   the scalar, and for every Gemma 3 but 27B it equals head_dim (256 here),
//!   which is what llama.cpp uses; `{arch}.attention.scale` wins when present.
//! - embeddings are multiplied by sqrt(d_model) in f32 (HF multiplies by
//!   `embed_scale.to(weight.dtype)`: in bf16 that is 25.25 for d_model 640,
//!   in f32 25.298222; llama.cpp and we use the f32 value).
//! - no final-logit or attention softcapping in Gemma 3 (files that carry
//!   `*.final_logit_softcapping` / `*.attn_logit_softcapping` are refused).

use kvreplay_kernels::cpu::{argmax, QuantMatrix, RopeParams, RopeStyle};
use kvreplay_kernels::{AttnShape, Backend, Buf, KernelError, Weight};

use crate::gguf::GgufFile;
use crate::CaptureError;

/// Architectures this build can run.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

/// RoPE base of Gemma 3's sliding-window layers (HF `rope_local_base_freq`,
/// llama.cpp's `freq_base_swa`); GGUF files do not store it.
pub const GEMMA3_LOCAL_ROPE_BASE: f64 = 10_000.0;

/// Every `GEMMA3_SWA_PATTERN`-th layer of Gemma 3 is full attention (layer l
/// with `l % 6 == 5`), the others sliding-window (HF
/// `sliding_window_pattern`, llama.cpp `set_swa_pattern(6)`).
pub const GEMMA3_SWA_PATTERN: usize = 6;

/// The gated FFN's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: silu(gate) · up (llama).
    Silu,
    /// GeGLU with tanh-approximated GELU (Gemma).
    GeluTanh,
}

/// What one layer's attention sees: its key window and its RoPE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// `Some(W)`: sliding window, the query at t attends to keys t-W+1..=t.
    pub window: Option<usize>,
    pub rope: RopeParams,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub norm_eps: f32,
    /// The file's RoPE (the full-attention layers').
    pub rope: RopeParams,
    pub attn_scale: f32,
    /// Per layer: window and RoPE (all `rope` and no window for llama).
    pub layer_attention: Vec<LayerAttention>,
    /// Per-head RMSNorm of q and k before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before the residual add
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    pub activation: Activation,
    /// Multiply the embeddings by this (sqrt(d_model) for Gemma).
    pub embed_scale: Option<f32>,
    /// Q and K rows are stored permuted for interleaved RoPE (llama GGUFs).
    pub permuted_qk: bool,
}

/// One transformer block. Shapes are (out_features, in_features), row-major.
pub struct LayerWeights {
    pub attn_norm: Weight,              // (d_model,)
    pub q_norm: Option<Weight>,         // (head_dim,), with `qk_norm`
    pub k_norm: Option<Weight>,         // (head_dim,), with `qk_norm`
    pub post_attn_norm: Option<Weight>, // (d_model,), with `post_norms`
    pub post_ffn_norm: Option<Weight>,  // (d_model,), with `post_norms`
    pub wq: Weight,                     // (n_heads * head_dim, d_model), HF row order
    pub wk: Weight,                     // (n_kv_heads * head_dim, d_model), HF row order
    pub wv: Weight,                     // (n_kv_heads * head_dim, d_model)
    pub wo: Weight,                     // (d_model, n_heads * head_dim)
    /// Projection biases (HF qwen2's q/k/v, llama's `attention_bias`).
    pub bq: Option<Weight>, // (n_heads * head_dim,)
    pub bk: Option<Weight>,             // (n_kv_heads * head_dim,)
    pub bv: Option<Weight>,             // (n_kv_heads * head_dim,)
    pub bo: Option<Weight>,             // (d_model,)
    pub ffn_norm: Weight,               // (d_model,)
    pub w_gate: Weight,                 // (ffn_dim, d_model)
    pub w_up: Weight,                   // (ffn_dim, d_model)
    pub w_down: Weight,                 // (d_model, ffn_dim)
}

pub struct Llama {
    pub cfg: LlamaConfig,
    pub embed: Weight, // (vocab, d_model)
    pub layers: Vec<LayerWeights>,
    pub out_norm: Weight,        // (d_model,)
    pub lm_head: Option<Weight>, // (vocab, d_model); None = tied to `embed`
    /// Where the forward pass runs (the CPU unless set with `set_backend`).
    pub backend: Backend,
}

/// GGUF rows of one Q/K head are ordered so that pairs (2i, 2i+1) rotate
/// together; HF pairs (i, i + d/2). GGUF row 2i + j holds HF row j*d/2 + i.
/// `cols` is the row length in elements of `w` (f32 values, or bytes of a
/// quantised row).
pub fn unpermute_rows<T: Copy + Default>(
    w: &[T],
    n_heads: usize,
    head_dim: usize,
    cols: usize,
) -> Vec<T> {
    let half = head_dim / 2;
    let mut out = vec![T::default(); w.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * head_dim + 2 * i + j) * cols;
                let dst = (h * head_dim + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

impl LlamaConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<LlamaConfig, CaptureError> {
        let arch = g.get_str("general.architecture")?.to_string();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(CaptureError::UnsupportedArchitecture {
                path: g.path.clone(),
                arch,
                supported: SUPPORTED_ARCHITECTURES.join(", "),
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        // Every value is checked where it is read: counts positive, floats
        // finite and positive, products that size tensors free of overflow.
        let count = |s: &str| g.count(&k(s));
        let n_layers = count("block_count")?;
        let d_model = count("embedding_length")?;
        let n_heads = count("attention.head_count")?;
        let n_kv_heads = match g.get(&k("attention.head_count_kv")) {
            Some(v) => v.as_u64().ok_or_else(|| CaptureError::Metadata {
                path: g.path.clone(),
                key: k("attention.head_count_kv"),
                problem: "not an unsigned integer (per-layer head counts are not supported)".into(),
            })? as usize,
            None => n_heads,
        };
        let ffn_dim = count("feed_forward_length")?;
        let context_length = count("context_length")?;
        let norm_eps = g.positive_f32(&k("attention.layer_norm_rms_epsilon"), None)?;
        if n_kv_heads == 0
            || !n_heads.is_multiple_of(n_kv_heads)
            || !d_model.is_multiple_of(n_heads)
        {
            return Err(CaptureError::Metadata {
                path: g.path.clone(),
                key: k("attention.head_count"),
                problem: format!(
                    "inconsistent: {n_heads} heads, {n_kv_heads} KV heads, embedding {d_model}"
                ),
            });
        }
        let head_dim = g.count_or(&k("attention.key_length"), d_model / n_heads)?;
        if let Some(value_dim) = g.opt_u64(&k("attention.value_length"))? {
            if value_dim != head_dim as u64 {
                return Err(CaptureError::Unsupported {
                    path: g.path.clone(),
                    msg: format!(
                        "{} is {value_dim} but {} is {head_dim}; only equal key and value head sizes are supported",
                        k("attention.value_length"),
                        k("attention.key_length")
                    ),
                });
            }
        }
        if n_heads.checked_mul(head_dim).is_none() {
            return Err(CaptureError::Metadata {
                path: g.path.clone(),
                key: k("attention.key_length"),
                problem: format!(
                    "{head_dim}, which times {n_heads} heads overflows; the file is corrupt"
                ),
            });
        }
        let rotated_dims = g.count_or(&k("rope.dimension_count"), head_dim)?;
        if rotated_dims > head_dim || rotated_dims % 2 != 0 {
            return Err(CaptureError::Metadata {
                path: g.path.clone(),
                key: k("rope.dimension_count"),
                problem: format!("{rotated_dims}, which does not fit head_dim {head_dim}"),
            });
        }
        let gemma3 = arch == "gemma3";
        let qwen3 = arch == "qwen3";
        // llama.cpp runs only gemma3 (of these) with a sliding window; a
        // window key on another architecture is not something we can mirror.
        if !gemma3 && g.get(&k("attention.sliding_window")).is_some() {
            return Err(CaptureError::Unsupported {
                path: g.path.clone(),
                msg: format!(
                    "sliding-window attention ({}) is only supported for gemma3 GGUFs",
                    k("attention.sliding_window")
                ),
            });
        }
        for cap in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if g.get(&k(cap)).is_some() {
                return Err(CaptureError::Unsupported {
                    path: g.path.clone(),
                    msg: format!("logit softcapping ({}) is not supported", k(cap)),
                });
            }
        }
        let theta = g.positive_f64(&k("rope.freq_base"), Some(10000.0))?;
        let scaling = g.opt_str(&k("rope.scaling.type"))?.unwrap_or("none");
        let linear_factor = match scaling {
            "none" => 1.0,
            "linear" => g.positive_f64(&k("rope.scaling.factor"), None)?,
            other => {
                return Err(CaptureError::Unsupported {
                    path: g.path.clone(),
                    msg: format!(
                        "RoPE scaling `{other}` ({}); only none and linear are supported",
                        k("rope.scaling.type")
                    ),
                })
            }
        };
        if g.tensor_info("rope_freqs.weight").is_some() {
            return Err(CaptureError::Unsupported {
                path: g.path.clone(),
                msg: "per-dimension RoPE frequency factors (rope_freqs.weight, Llama 3.1-style scaling) are not supported yet".into(),
            });
        }
        let vocab_size = match g.get(&k("vocab_size")) {
            Some(_) => count("vocab_size")?,
            None => g.get_strings("tokenizer.ggml.tokens")?.len(),
        };
        if vocab_size == 0 {
            return Err(CaptureError::Metadata {
                path: g.path.clone(),
                key: "tokenizer.ggml.tokens".into(),
                problem: "empty; a model needs a vocabulary".into(),
            });
        }
        let rope = RopeParams {
            theta,
            style: RopeStyle::Neox,
            rotated_dims,
            linear_factor,
            llama3: None,
        };
        let window = if gemma3 {
            Some(g.count(&k("attention.sliding_window"))?)
        } else {
            None
        };
        let layer_attention = (0..n_layers)
            .map(|l| match window {
                Some(w) if l % GEMMA3_SWA_PATTERN != GEMMA3_SWA_PATTERN - 1 => LayerAttention {
                    window: Some(w),
                    rope: RopeParams {
                        theta: GEMMA3_LOCAL_ROPE_BASE,
                        linear_factor: 1.0,
                        ..rope
                    },
                },
                _ => LayerAttention { window: None, rope },
            })
            .collect();
        let attn_scale = match g.get(&k("attention.scale")) {
            Some(_) => g.positive_f32(&k("attention.scale"), None)?,
            None => 1.0 / (head_dim as f32).sqrt(),
        };
        Ok(LlamaConfig {
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab_size,
            context_length,
            norm_eps,
            rope,
            attn_scale,
            layer_attention,
            qk_norm: gemma3 || qwen3,
            post_norms: gemma3,
            activation: if gemma3 {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: gemma3.then(|| (d_model as f32).sqrt()),
            // llama.cpp's converter permutes Q/K rows only for `llama`
            // (interleaved RoPE); qwen2, qwen3 and gemma3 run NEOX RoPE on
            // rows stored in the HF order.
            permuted_qk: arch == "llama",
        })
    }
}

impl Llama {
    /// Load every weight: matrices of the quantised block types stay as
    /// their blocks (the CPU multiplies by them directly; see
    /// `kvreplay_kernels::cpu::qlinear`), everything else is dequantised to
    /// f32. A tensor the architecture does not use (a bias on llama, MoE
    /// experts, ...) is refused by name rather than ignored.
    pub fn from_gguf(g: &GgufFile) -> Result<Llama, CaptureError> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let arch = g.get_str("general.architecture")?;
        // qwen2 always has q/k/v biases (llama.cpp's `bq`/`bk`/`bv`), no o bias.
        let qkv_bias = arch == "qwen2";
        let (d, hd, f, v) = (
            cfg.d_model as u64,
            cfg.head_dim as u64,
            cfg.ffn_dim as u64,
            cfg.vocab_size as u64,
        );
        let (h, kv) = (cfg.n_heads as u64, cfg.n_kv_heads as u64);
        let used = std::cell::RefCell::new(std::collections::HashSet::<String>::new());
        let get = |name: String, dims: &[u64]| {
            let w = g.tensor_f32(&name, dims);
            used.borrow_mut().insert(name);
            w
        };
        // A matrix (out, in): kept quantised when the CPU kernels multiply by
        // its block type directly (no f32 copy), else dequantised to f32;
        // `heads` un-permutes llama's Q/K rows (whole rows of blocks).
        let matrix = |name: String, dims: &[u64], heads: Option<usize>| {
            let (ty, data, _) = g.tensor_raw(&name, dims)?;
            let (rows, cols) = (dims[1] as usize, dims[0] as usize);
            let w = if QuantMatrix::supports(ty) {
                let rb = data.len() / rows.max(1);
                let bytes = match heads {
                    Some(h) => unpermute_rows(data, h, cfg.head_dim, rb),
                    None => data.to_vec(),
                };
                QuantMatrix::new(ty, rows, cols, bytes)
                    .map_err(|e| CaptureError::Tensor {
                        path: g.path.clone(),
                        tensor: name.clone(),
                        msg: e.to_string(),
                    })?
                    .into()
            } else {
                let w = g.tensor_f32(&name, dims)?;
                match heads {
                    Some(h) => unpermute_rows(&w, h, cfg.head_dim, cols),
                    None => w,
                }
                .into()
            };
            used.borrow_mut().insert(name);
            Ok::<Weight, CaptureError>(w)
        };
        let embed = matrix("token_embd.weight".into(), &[d, v], None)?;
        let out_norm = get("output_norm.weight".into(), &[d])?.into();
        let lm_head = match g.tensor_info("output.weight") {
            Some(_) => Some(matrix("output.weight".into(), &[d, v], None)?),
            None => None,
        };
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let t = |name: &str, dims: &[u64]| get(format!("blk.{l}.{name}.weight"), dims);
                let mat =
                    |name: &str, dims: &[u64]| matrix(format!("blk.{l}.{name}.weight"), dims, None);
                let qk = |name: &str, heads: usize| -> Result<Weight, CaptureError> {
                    matrix(
                        format!("blk.{l}.{name}.weight"),
                        &[d, heads as u64 * hd],
                        cfg.permuted_qk.then_some(heads),
                    )
                };
                let opt =
                    |on: bool, name: &str, dim: u64| -> Result<Option<Weight>, CaptureError> {
                        Ok(if on {
                            Some(t(name, &[dim])?.into())
                        } else {
                            None
                        })
                    };
                let bias =
                    |on: bool, name: &str, dim: u64| -> Result<Option<Weight>, CaptureError> {
                        Ok(if on {
                            Some(get(format!("blk.{l}.{name}.bias"), &[dim])?.into())
                        } else {
                            None
                        })
                    };
                Ok(LayerWeights {
                    attn_norm: t("attn_norm", &[d])?.into(),
                    q_norm: opt(cfg.qk_norm, "attn_q_norm", hd)?,
                    k_norm: opt(cfg.qk_norm, "attn_k_norm", hd)?,
                    post_attn_norm: opt(cfg.post_norms, "post_attention_norm", d)?,
                    post_ffn_norm: opt(cfg.post_norms, "post_ffw_norm", d)?,
                    wq: qk("attn_q", cfg.n_heads)?,
                    wk: qk("attn_k", cfg.n_kv_heads)?,
                    wv: mat("attn_v", &[d, kv * hd])?,
                    wo: mat("attn_output", &[h * hd, d])?,
                    bq: bias(qkv_bias, "attn_q", h * hd)?,
                    bk: bias(qkv_bias, "attn_k", kv * hd)?,
                    bv: bias(qkv_bias, "attn_v", kv * hd)?,
                    bo: None,
                    ffn_norm: t("ffn_norm", &[d])?.into(),
                    w_gate: mat("ffn_gate", &[d, f])?,
                    w_up: mat("ffn_up", &[d, f])?,
                    w_down: mat("ffn_down", &[f, d])?,
                })
            })
            .collect::<Result<_, CaptureError>>()?;
        let used = used.into_inner();
        if let Some(extra) = g.tensors.iter().find(|t| !used.contains(&t.name)) {
            return Err(CaptureError::Unsupported {
                path: g.path.clone(),
                msg: format!(
                    "tensor {} is not used by the {arch} architecture as supported here; refusing rather than ignoring it",
                    extra.name
                ),
            });
        }
        Ok(Llama {
            cfg,
            embed,
            layers,
            out_norm,
            lm_head,
            backend: Backend::Cpu,
        })
    }

    /// Run later forward passes on `backend`.
    pub fn set_backend(&mut self, backend: Backend) {
        self.backend = backend;
    }
}

/// Keys and values of every layer: per layer (n_kv_heads, capacity,
/// head_dim) in the backend's layout ([`Backend::kv_cache`]), on the device
/// of the first forward pass that uses it.
#[derive(Clone)]
pub struct KvCache {
    pub capacity: usize,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Per layer, the keys and values in the backend's layout
    /// ([`Backend::kv_cache`]).
    k: Vec<Buf>,
    v: Vec<Buf>,
}

impl KvCache {
    pub fn new(cfg: &LlamaConfig, capacity: usize) -> KvCache {
        KvCache {
            capacity,
            n_layers: cfg.n_layers,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    /// Allocate the buffers on `be` if this is the first use.
    fn ready(&mut self, be: &Backend) -> Result<(), KernelError> {
        if self.k.is_empty() {
            for _ in 0..self.n_layers {
                let (k, v) = be.kv_cache(self.n_kv_heads, self.capacity, self.head_dim)?;
                self.k.push(k);
                self.v.push(v);
            }
        }
        Ok(())
    }
}

/// What one layer computed for a block of positions `pos0 .. pos0 + c`.
pub struct LayerTaps<'a> {
    pub layer: usize,
    pub pos0: usize,
    pub q: &'a [f32], // (n_heads, c, head_dim), post-RoPE
    pub k: &'a [f32], // (n_kv_heads, c, head_dim), post-RoPE
    pub v: &'a [f32], // (n_kv_heads, c, head_dim)
    pub o: &'a [f32], // (n_heads, c, head_dim), attention output before W_o
    /// (n_heads, c, pos0 + c) attention probabilities, when requested.
    pub probs: Option<&'a [f32]>,
}

/// Per-call options of [`Llama::forward`].
pub struct ForwardOptions<'a> {
    /// Per layer (n_heads, n_tracked): accumulate each head's attention
    /// column sums, in buffers made by [`Llama::colsum_buffers`].
    pub colsum: Option<&'a mut [Buf]>,
    /// Produce attention probabilities in the taps.
    pub probs: bool,
    /// Replace attention over `cache` with this function (a compressed cache
    /// in closed-loop validation): called per layer with (layer, q (n_heads,
    /// c, d), k (n_kv_heads, c, d), v (n_kv_heads, c, d)) of the new
    /// positions, it writes o (n_heads, c, d). Column sums and probabilities
    /// are then not produced.
    pub attention: Option<&'a mut ExternalAttention<'a>>,
}

/// See [`ForwardOptions::attention`].
pub type ExternalAttention<'a> =
    dyn FnMut(usize, &[f32], &[f32], &[f32], &mut [f32]) -> Result<(), KernelError> + 'a;

impl Llama {
    /// Run `tokens` at positions `pos0 ..` through the model, appending their
    /// keys and values to `cache`, calling `taps` once per layer, and return
    /// the logits (vocab,) of the last position.
    pub fn forward(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        mut opts: ForwardOptions<'_>,
        taps: &mut dyn FnMut(LayerTaps<'_>),
    ) -> Result<Vec<f32>, KernelError> {
        let cfg = &self.cfg;
        let be = &self.backend;
        let (c, dm, hd) = (tokens.len(), cfg.d_model, cfg.head_dim);
        let (nh, nkv) = (cfg.n_heads, cfg.n_kv_heads);
        let n = match pos0.checked_add(c) {
            Some(n) if c > 0 && n <= cache.capacity => n,
            _ => {
                return Err(KernelError::Shape {
                    op: "forward",
                    msg: format!(
                        "positions {pos0}..{} do not fit the KV cache (capacity {} positions)",
                        pos0.saturating_add(c),
                        cache.capacity
                    ),
                })
            }
        };
        cache.ready(be)?;
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            c,
            pos0,
            cap: cache.capacity,
            head_dim: hd,
            scale: cfg.attn_scale,
        };
        // Host-device traffic per call: the token ids and the RoPE table go
        // up; every layer's q, k, v and o come down together after the last
        // layer, then the logits. Everything else stays where the backend
        // computes. With probabilities, (n_heads, c, n) per layer, each
        // layer's taps come down as soon as it is done (one copy of q/k/v/o,
        // one of the probabilities) rather than holding every layer's.
        // One table per distinct RoPE among the layers (one for llama; the
        // full and the sliding layers' for Gemma 3).
        let mut ropes: Vec<(RopeParams, Buf)> = Vec::new();
        for la in &cfg.layer_attention {
            if !ropes.iter().any(|(p, _)| *p == la.rope) {
                ropes.push((la.rope, be.rope_table(c, pos0, &la.rope, 1.0)?));
            }
        }
        // Taps gathered on the device: per layer q, k, v, o.
        let (q_len, kv_len) = (nh * c * hd, nkv * c * hd);
        let tap_len = 2 * (q_len + kv_len);
        let layers_held = match (&opts.attention, opts.probs) {
            (None, false) => cfg.n_layers,
            (None, true) => 1,
            (Some(_), _) => 0,
        };
        let tap_buf = be.zeros(layers_held * tap_len)?;
        // x: (c, d_model) residual stream
        let mut x = be.embed(&self.embed, dm, tokens)?;
        if let Some(s) = cfg.embed_scale {
            be.scale(&mut x, s)?;
        }
        // Biases (n,) repeated over the c rows, uploaded before the layers
        // (so every transfer of a call is made, and counted, on this thread).
        let rows = |b: &Option<Weight>| b.as_ref().map(|b| be.upload(&b.repeat(c))).transpose();
        let biases = self
            .layers
            .iter()
            .map(|w| Ok([rows(&w.bq)?, rows(&w.bk)?, rows(&w.bv)?, rows(&w.bo)?]))
            .collect::<Result<Vec<_>, KernelError>>()?;
        let mut pass = Pass {
            m: self,
            c,
            pos0,
            n,
            shape,
            ropes,
            biases,
            q_len,
            kv_len,
            probs: opts.probs,
            tap_buf,
            x,
        };
        if opts.attention.is_none() && !opts.probs {
            // Every layer's taps come after the last layer, so the layers
            // run on a rayon worker: each parallel product then starts from
            // a worker instead of handing off from this thread and waiting
            // (decode runs ~150 of them per token). Same results.
            let colsum = opts.colsum.take();
            let pass = &mut pass;
            let c: &mut KvCache = cache;
            rayon::scope(move |_| -> Result<(), KernelError> {
                let mut colsum = colsum;
                // Not called: taps are emitted after the layers.
                let mut none = |_: LayerTaps<'_>| {};
                for l in 0..pass.m.cfg.n_layers {
                    let cs = colsum.as_deref_mut().map(|cs| &mut cs[l]);
                    pass.layer(l, c, cs, None, &mut none)?;
                }
                Ok(())
            })?;
        } else {
            for l in 0..cfg.n_layers {
                let cs = opts.colsum.as_deref_mut().map(|cs| &mut cs[l]);
                pass.layer(l, cache, cs, opts.attention.as_deref_mut(), taps)?;
            }
        }
        be.stop_read_ahead();
        if layers_held == cfg.n_layers {
            let host = be.download(&pass.tap_buf)?;
            for (l, t) in host.chunks_exact(tap_len).enumerate() {
                pass.emit(taps, l, t, None);
            }
        }
        let x = &pass.x;
        let mut last = be.zeros(dm)?;
        be.copy_within(x, (c - 1) * dm, &mut last, 0, dm)?;
        let last = be.norm(&last, &self.out_norm, cfg.norm_eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = be.matmul(&last, head, 1, dm, cfg.vocab_size)?;
        Ok(be.download(&logits)?.into_owned())
    }

    /// Column-sum accumulators for [`ForwardOptions::colsum`]: per layer
    /// (n_heads, n_tracked) zeros on this model's backend.
    pub fn colsum_buffers(&self, n_tracked: usize) -> Result<Vec<Buf>, KernelError> {
        (0..self.cfg.n_layers)
            .map(|_| self.backend.zeros(self.cfg.n_heads * n_tracked))
            .collect()
    }

    /// Greedy next token from logits.
    pub fn greedy(logits: &[f32]) -> u32 {
        argmax(logits) as u32
    }
}

/// One forward call's state: the residual stream, the RoPE tables and the
/// gathered taps.
struct Pass<'a> {
    m: &'a Llama,
    c: usize,
    pos0: usize,
    /// Keys after this call (pos0 + c).
    n: usize,
    shape: AttnShape,
    /// One table per distinct RoPE among the layers.
    ropes: Vec<(RopeParams, Buf)>,
    /// Per layer the (c, n) q, k, v and o biases, where the model has them.
    biases: Vec<[Option<Buf>; 4]>,
    q_len: usize,
    kv_len: usize,
    probs: bool,
    tap_buf: Buf,
    /// (c, d_model)
    x: Buf,
}

impl Pass<'_> {
    /// One layer's taps from its packed q, k, v, o on the host.
    fn emit(
        &self,
        taps: &mut dyn FnMut(LayerTaps<'_>),
        layer: usize,
        t: &[f32],
        probs: Option<&[f32]>,
    ) {
        let (q, rest) = t.split_at(self.q_len);
        let (k, rest) = rest.split_at(self.kv_len);
        let (v, o) = rest.split_at(self.kv_len);
        taps(LayerTaps {
            layer,
            pos0: self.pos0,
            q,
            k,
            v,
            o,
            probs,
        });
    }

    /// Layer `l` on the residual stream: attention over `cache` (or through
    /// `external`), then the gated MLP.
    fn layer(
        &mut self,
        l: usize,
        cache: &mut KvCache,
        colsum: Option<&mut Buf>,
        external: Option<&mut ExternalAttention<'_>>,
        taps: &mut dyn FnMut(LayerTaps<'_>),
    ) -> Result<(), KernelError> {
        let (m, c, pos0, n) = (self.m, self.c, self.pos0, self.n);
        let (cfg, be) = (&m.cfg, &m.backend);
        let (dm, hd, nh, nkv) = (cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let (q_len, kv_len) = (self.q_len, self.kv_len);
        let tap_len = 2 * (q_len + kv_len);
        let w = &m.layers[l];
        let la = &cfg.layer_attention[l];
        let rope = &self
            .ropes
            .iter()
            .find(|(p, _)| *p == la.rope)
            .expect("a table per layer RoPE")
            .1;
        // Bias i of this layer added to x (c, n).
        let biases = &self.biases[l];
        let add_bias = |x: &mut Buf, i: usize| -> Result<(), KernelError> {
            if let Some(b) = &biases[i] {
                be.add_assign(x, b)?;
            }
            Ok(())
        };
        let h = be.norm(&self.x, &w.attn_norm, cfg.norm_eps)?;
        // q (c, n_heads * head_dim), k and v (c, n_kv_heads * head_dim)
        let qkv = [(&w.wq, nh * hd), (&w.wk, nkv * hd), (&w.wv, nkv * hd)];
        let [mut q, mut k, mut v]: [Buf; 3] = be
            .matmul_many(&h, &qkv, c, dm)?
            .try_into()
            .expect("three products");
        add_bias(&mut q, 0)?;
        add_bias(&mut k, 1)?;
        add_bias(&mut v, 2)?;
        // Per-head RMSNorm: rows of head_dim.
        if let Some(qn) = &w.q_norm {
            q = be.norm(&q, qn, cfg.norm_eps)?;
        }
        if let Some(kn) = &w.k_norm {
            k = be.norm(&k, kn, cfg.norm_eps)?;
        }
        be.rotate(&mut q, nh, hd, &la.rope, rope)?;
        be.rotate(&mut k, nkv, hd, &la.rope, rope)?;
        // head-major: q (n_heads, c, d), k and v (n_kv_heads, c, d)
        let q = be.transpose_heads(&q, c, nh, hd, true)?;
        let k = be.transpose_heads(&k, c, nkv, hd, true)?;
        let v = be.transpose_heads(&v, c, nkv, hd, true)?;
        let shape = (nkv, cache.capacity, hd);
        be.store_kv(&k, &v, shape, pos0, &mut cache.k[l], &mut cache.v[l])?;
        let mut probs = if self.probs && external.is_none() {
            Some(be.zeros(nh * c * n)?)
        } else {
            None
        };
        // o: (n_heads, c, head_dim)
        let o = if let Some(f) = external {
            // Closed-loop validation attends on the host, layer by layer.
            let (qh, kh, vh) = (be.download(&q)?, be.download(&k)?, be.download(&v)?);
            let mut o = vec![0f32; nh * c * hd];
            f(l, &qh, &kh, &vh, &mut o)?;
            taps(LayerTaps {
                layer: l,
                pos0,
                q: &qh,
                k: &kh,
                v: &vh,
                o: &o,
                probs: None,
            });
            be.upload(&o)?
        } else {
            let o = be.attention_windowed(
                &q,
                &cache.k[l],
                &cache.v[l],
                self.shape,
                la.window,
                colsum,
                probs.as_mut(),
            )?;
            // Gather this layer's taps on the device; without
            // probabilities they come down together after the last
            // layer, so the host never waits on the device in the loop.
            let at = if self.probs { 0 } else { l * tap_len };
            for (buf, off, len) in [
                (&q, 0, q_len),
                (&k, q_len, kv_len),
                (&v, q_len + kv_len, kv_len),
                (&o, q_len + 2 * kv_len, q_len),
            ] {
                be.copy_within(buf, 0, &mut self.tap_buf, at + off, len)?;
            }
            if let Some(p) = &probs {
                let t = be.download(&self.tap_buf)?;
                self.emit(taps, l, &t, Some(&be.download(p)?));
            }
            // Decode: the products up to the next layer's attention ask for
            // the keys and values it will read (a hint; no result changes).
            if c == 1 && l + 1 < cfg.n_layers {
                let window = cfg.layer_attention[l + 1].window;
                be.read_ahead(&cache.k[l + 1], &cache.v[l + 1], shape, pos0, window);
            }
            o
        };
        let o_rows = be.transpose_heads(&o, c, nh, hd, false)?;
        let mut attn = be.matmul(&o_rows, &w.wo, c, nh * hd, dm)?;
        add_bias(&mut attn, 3)?;
        if let Some(pn) = &w.post_attn_norm {
            attn = be.norm(&attn, pn, cfg.norm_eps)?;
        }
        be.add_assign(&mut self.x, &attn)?;
        // Gated MLP (SwiGLU or GeGLU)
        let h = be.norm(&self.x, &w.ffn_norm, cfg.norm_eps)?;
        let gate_up = [(&w.w_gate, cfg.ffn_dim), (&w.w_up, cfg.ffn_dim)];
        let [mut gate, up]: [Buf; 2] = be
            .matmul_many(&h, &gate_up, c, dm)?
            .try_into()
            .expect("two products");
        match cfg.activation {
            Activation::Silu => be.swiglu(&mut gate, &up)?,
            Activation::GeluTanh => be.gelu_tanh_mul(&mut gate, &up)?,
        }
        let mut down = be.matmul(&gate, &w.w_down, c, cfg.ffn_dim, dm)?;
        if let Some(pn) = &w.post_ffn_norm {
            down = be.norm(&down, pn, cfg.norm_eps)?;
        }
        be.add_assign(&mut self.x, &down)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_maps_interleaved_pairs_to_halves() {
        // one head, head_dim 4, one column: GGUF rows [a0 b0 a1 b1] -> HF [a0 a1 b0 b1]
        let w = vec![10.0, 20.0, 11.0, 21.0];
        assert_eq!(unpermute_rows(&w, 1, 4, 1), vec![10.0, 11.0, 20.0, 21.0]);
    }
}
