//! Hugging Face transformers checkpoints: a directory with `config.json`,
//! `model.safetensors` (or `model.safetensors.index.json` and its shards),
//! `tokenizer.json` and optionally `tokenizer_config.json`.
//!
//! `config.json` becomes the same [`LlamaConfig`] the GGUF path builds, for
//! the families `llama`, `mistral`, `qwen2`, `qwen3` and `gemma3_text`. Every field that
//! changes the math is read; values this build cannot run (another
//! activation, yarn/dynamic RoPE scaling, MLP biases, quantised weights, ...)
//! are refused with an error naming the file and the field rather than
//! guessed. HF checkpoints store Q and K in the rotate-half (NEOX) layout
//! that [`Llama::forward`] applies, so unlike llama GGUFs nothing is
//! un-permuted. Weights (bf16, f16 or f32) are memory-mapped and converted to
//! f32 once.
//!
//! Family facts relied on (HF transformers' modeling and configuration files):
//! - llama: `attention_bias` adds biases to q, k, v and o; `mlp_bias` (MLP
//!   biases) is refused; `rope_scaling` none, `linear` or `llama3`.
//! - mistral: `sliding_window` (null = none) applies to every layer.
//! - qwen2: q, k and v always have biases, o none; sliding windows only with
//!   `use_sliding_window`, on layers `>= max_window_layers`.
//! - qwen3: per-head RMSNorm `q_norm`/`k_norm` (plain `x / rms * w`) on q and
//!   k before RoPE; `attention_bias` as llama; windows as qwen2.
//! - gemma3_text (Gemma 3's text model): RMSNorm `x / rms * (1 + w)` on
//!   every norm (the 1 is added at load, as llama.cpp's GGUF converter does),
//!   q/k norms, `post_attention_layernorm` on the attention output and
//!   `pre_`/`post_feedforward_layernorm` around the FFN, GELU-tanh
//!   (`hidden_activation`), embeddings times sqrt(hidden_size), attention
//!   scale `query_pre_attn_scalar^-0.5`, layer l full attention when
//!   `(l + 1) % sliding_window_pattern == 0` (else window `sliding_window`
//!   with RoPE base `rope_local_base_freq`, unscaled); tied by default.
//!   The multimodal `gemma3` wrapper is refused.
//! - `layer_types` (`full_attention` / `sliding_attention`), when present,
//!   decides each layer's window instead of the rules above.
//! - a sliding window W lets the query at t see keys `t - W + 1 ..= t`
//!   (transformers' mask `kv_idx > q_idx - W`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvreplay_kernels::cpu::{Llama3Rope, RopeParams, RopeStyle};
use kvreplay_kernels::{Backend, Weight};
use serde_json::Value;

use crate::llama::{Activation, LayerAttention, LayerWeights, Llama, LlamaConfig};
use crate::CaptureError;

/// `model_type`s of config.json this build can run.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma3_text"];

/// Whether `path` looks like an HF checkpoint directory.
pub fn is_checkpoint_dir(path: &Path) -> bool {
    path.is_dir()
}

/// A config.json being read: every error names the file and the field.
struct Config<'a> {
    path: &'a Path,
    v: &'a serde_json::Map<String, Value>,
}

impl Config<'_> {
    fn err(&self, field: &str, problem: impl Into<String>) -> CaptureError {
        CaptureError::Config {
            path: self.path.into(),
            field: field.into(),
            problem: problem.into(),
        }
    }
    /// The field, treating JSON null as absent.
    fn get(&self, field: &str) -> Option<&Value> {
        self.v.get(field).filter(|v| !v.is_null())
    }
    fn opt_count(&self, field: &str) -> Result<Option<usize>, CaptureError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n <= (1 << 40) => Ok(Some(n as usize)),
                _ => Err(self.err(field, format!("{v}, expected a positive integer"))),
            },
        }
    }
    fn count(&self, field: &str) -> Result<usize, CaptureError> {
        self.opt_count(field)?
            .ok_or_else(|| self.err(field, "missing; the checkpoint's config must set it"))
    }
    fn opt_f64(&self, field: &str) -> Result<Option<f64>, CaptureError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                _ => Err(self.err(field, format!("{v}, expected a positive number"))),
            },
        }
    }
    fn f64(&self, field: &str) -> Result<f64, CaptureError> {
        self.opt_f64(field)?
            .ok_or_else(|| self.err(field, "missing; the checkpoint's config must set it"))
    }
    fn opt_bool(&self, field: &str) -> Result<Option<bool>, CaptureError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("{v}, expected true or false"))),
        }
    }
    fn opt_str(&self, field: &str) -> Result<Option<&str>, CaptureError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("{v}, expected a string"))),
        }
    }
}

fn read_json(path: &Path) -> Result<Value, CaptureError> {
    let text = std::fs::read_to_string(path).map_err(|e| CaptureError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| CaptureError::Config {
        path: path.into(),
        field: "(file)".into(),
        problem: format!("not valid JSON: {e}"),
    })
}

/// The RoPE of config.json: `rope_theta` and `rope_scaling` (or transformers
/// 5's `rope_parameters`).
fn rope_of(c: &Config<'_>, head_dim: usize) -> Result<RopeParams, CaptureError> {
    let params = c.get("rope_parameters").and_then(|v| v.as_object());
    let scaling_field = if params.is_some() {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    let scaling = match params {
        Some(p) => Some(p),
        None => match c.get("rope_scaling") {
            None => None,
            Some(v) => Some(v.as_object().ok_or_else(|| {
                c.err("rope_scaling", format!("{v}, expected an object or null"))
            })?),
        },
    };
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| {
                c.err(
                    "rope_parameters.rope_theta",
                    format!("{v}, expected a positive number"),
                )
            })?,
        None => c.opt_f64("rope_theta")?.unwrap_or(10_000.0),
    };
    let mut rope = RopeParams {
        theta,
        style: RopeStyle::Neox,
        rotated_dims: head_dim,
        linear_factor: 1.0,
        llama3: None,
    };
    if let Some(f) = c.opt_f64("partial_rotary_factor")? {
        if f != 1.0 {
            return Err(c.err(
                "partial_rotary_factor",
                format!("{f}; only RoPE over the whole head (1.0) is supported"),
            ));
        }
    }
    let Some(s) = scaling else { return Ok(rope) };
    let field = |k: &str| format!("{scaling_field}.{k}");
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let num = |k: &str| -> Result<f64, CaptureError> {
        s.get(k)
            .and_then(|v| v.as_f64())
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| c.err(&field(k), "missing or not a positive number"))
    };
    match kind {
        "default" => {}
        "linear" => rope.linear_factor = num("factor")?,
        "llama3" => {
            let l3 = Llama3Rope {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            };
            if l3.high_freq_factor <= l3.low_freq_factor {
                return Err(c.err(&field("high_freq_factor"), "must exceed low_freq_factor"));
            }
            rope.llama3 = Some(l3);
        }
        other => {
            return Err(c.err(
                &field("rope_type"),
                format!("`{other}`; supported RoPE scalings: default (none), linear, llama3"),
            ))
        }
    }
    Ok(rope)
}

/// Parse config.json into the architecture description; also returns
/// whether the embeddings are tied and which biases the projections have
/// (q/k/v, o).
pub fn config_from_json(
    path: &Path,
    json: &Value,
) -> Result<(String, LlamaConfig, bool, (bool, bool)), CaptureError> {
    let v = json.as_object().ok_or_else(|| CaptureError::Config {
        path: path.into(),
        field: "(file)".into(),
        problem: "not a JSON object".into(),
    })?;
    let c = Config { path, v };
    let model_type = c
        .opt_str("model_type")?
        .ok_or_else(|| {
            c.err(
                "model_type",
                "missing; the checkpoint's config must name its architecture",
            )
        })?
        .to_string();
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        let hint = if model_type == "gemma3" {
            " (the multimodal Gemma 3 wrapper: pass a text-only checkpoint, model_type gemma3_text, or the GGUF file)"
        } else {
            ""
        };
        return Err(c.err(
            "model_type",
            format!(
                "`{model_type}`, which is not supported (supported: {}){hint}",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        ));
    }
    if c.get("quantization_config").is_some() {
        return Err(c.err(
            "quantization_config",
            "set; quantised HF checkpoints are not supported (use bf16/f16/f32 weights)",
        ));
    }
    let n_layers = c.count("num_hidden_layers")?;
    let d_model = c.count("hidden_size")?;
    let ffn_dim = c.count("intermediate_size")?;
    let n_heads = c.count("num_attention_heads")?;
    let n_kv_heads = c.opt_count("num_key_value_heads")?.unwrap_or(n_heads);
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(c.err(
            "num_key_value_heads",
            format!("{n_kv_heads}, which does not divide num_attention_heads {n_heads}"),
        ));
    }
    let head_dim = match c.opt_count("head_dim")? {
        Some(h) => h,
        None => {
            if !d_model.is_multiple_of(n_heads) {
                return Err(c.err(
                    "head_dim",
                    format!("missing, and hidden_size {d_model} is not a multiple of num_attention_heads {n_heads}"),
                ));
            }
            d_model / n_heads
        }
    };
    if head_dim % 2 != 0 {
        return Err(c.err(
            "head_dim",
            format!("{head_dim}; RoPE needs an even head size"),
        ));
    }
    let vocab_size = c.count("vocab_size")?;
    let context_length = c.count("max_position_embeddings")?;
    let norm_eps = c.f64("rms_norm_eps")? as f32;
    let gemma = model_type == "gemma3_text";
    let (act_field, act_default, act_want) = if gemma {
        (
            "hidden_activation",
            "gelu_pytorch_tanh",
            "gelu_pytorch_tanh (GeGLU)",
        )
    } else {
        ("hidden_act", "silu", "silu (SwiGLU)")
    };
    let act = c.opt_str(act_field)?.unwrap_or(act_default);
    if act != act_default {
        return Err(c.err(act_field, format!("`{act}`; only {act_want} is supported")));
    }
    if c.opt_bool("use_bidirectional_attention")? == Some(true) {
        return Err(c.err(
            "use_bidirectional_attention",
            "true; only causal attention is supported",
        ));
    }
    if gemma && c.get("rope_parameters").is_some() {
        return Err(c.err(
            "rope_parameters",
            "set; for gemma3_text only the rope_theta / rope_local_base_freq / rope_scaling fields are supported",
        ));
    }
    if c.opt_bool("mlp_bias")? == Some(true) {
        return Err(c.err("mlp_bias", "true; MLP biases are not supported"));
    }
    for f in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if c.get(f).is_some() {
            return Err(c.err(f, "set; logit softcapping is not supported"));
        }
    }
    // transformers' default: tied for Gemma 3, untied for the others
    let tied = c.opt_bool("tie_word_embeddings")?.unwrap_or(gemma);
    let attention_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    let biases = match model_type.as_str() {
        "qwen2" => (true, false),
        "mistral" => (false, false),
        _ => (attention_bias, attention_bias),
    };
    let rope = rope_of(&c, head_dim)?;
    // Per layer: sliding window or full attention.
    let window = match model_type.as_str() {
        "mistral" => c.opt_count("sliding_window")?,
        "gemma3_text" => Some(c.count("sliding_window")?),
        "qwen2" | "qwen3" if c.opt_bool("use_sliding_window")? == Some(true) => {
            c.opt_count("sliding_window")?
        }
        _ => None,
    };
    let windows: Vec<Option<usize>> = match c.get("layer_types") {
        Some(lt) => {
            let a = lt
                .as_array()
                .filter(|a| a.len() == n_layers)
                .ok_or_else(|| {
                    c.err(
                        "layer_types",
                        format!("expected a list of {n_layers} layer types"),
                    )
                })?;
            a.iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(None),
                    Some("sliding_attention") => Ok(Some(
                        c.count("sliding_window")
                            .map_err(|_| c.err("sliding_window", "missing or not a positive integer, but layer_types has sliding_attention layers"))?,
                    )),
                    _ => Err(c.err(
                        "layer_types",
                        format!("holding {t}; supported: full_attention, sliding_attention"),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        None if gemma => {
            // Gemma 3: every `sliding_window_pattern`-th layer is full attention
            let pattern = c.opt_count("sliding_window_pattern")?.unwrap_or(6);
            (0..n_layers)
                .map(|l| window.filter(|_| (l + 1) % pattern != 0))
                .collect()
        }
        None => {
            let first_sliding = match model_type.as_str() {
                "qwen2" | "qwen3" => c.opt_count("max_window_layers")?.unwrap_or(0),
                _ => 0,
            };
            (0..n_layers)
                .map(|l| window.filter(|_| l >= first_sliding))
                .collect()
        }
    };
    let qk_norm = model_type == "qwen3" || gemma;
    // Gemma 3's sliding layers use their own base, unscaled.
    let local_rope = if gemma {
        RopeParams {
            theta: c.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0),
            linear_factor: 1.0,
            llama3: None,
            ..rope
        }
    } else {
        rope
    };
    let attn_scale = if gemma {
        (c.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0)).powf(-0.5) as f32
    } else {
        1.0 / (head_dim as f32).sqrt()
    };
    let cfg = LlamaConfig {
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
        layer_attention: windows
            .into_iter()
            .map(|window| LayerAttention {
                window,
                rope: if window.is_some() { local_rope } else { rope },
            })
            .collect(),
        qk_norm,
        post_norms: gemma,
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        // HF multiplies by hidden_size**0.5 cast to the weights' dtype; in
        // f32 (our compute) that is the f32 square root, as the GGUF path.
        embed_scale: gemma.then(|| (d_model as f32).sqrt()),
        permuted_qk: false,
    };
    Ok((model_type, cfg, tied, biases))
}

/// The checkpoint's safetensors files, memory-mapped, and which holds which tensor.
struct Tensors {
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// tensor name -> index into `files`
    index: BTreeMap<String, usize>,
    /// the file named in "tensor missing" errors
    listing: PathBuf,
}

fn map_file(path: &Path, named_by: Option<&Path>) -> Result<memmap2::Mmap, CaptureError> {
    let f = std::fs::File::open(path).map_err(|e| match named_by {
        Some(idx) if e.kind() == std::io::ErrorKind::NotFound => CaptureError::Config {
            path: idx.into(),
            field: "weight_map".into(),
            problem: format!("names the shard {}, which is missing", path.display()),
        },
        _ => CaptureError::io(path, e),
    })?;
    // SAFETY: the checkpoint is not modified while it is read (as with the
    // GGUF path's map); the bytes are parsed and copied into f32 weights.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| CaptureError::io(path, e))
}

fn header_names(path: &Path, bytes: &[u8]) -> Result<Vec<String>, CaptureError> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| CaptureError::Tensor {
        path: path.into(),
        tensor: "(header)".into(),
        msg: format!("not a valid safetensors file: {e}"),
    })?;
    Ok(st.names().into_iter().map(String::from).collect())
}

impl Tensors {
    fn open(dir: &Path) -> Result<Tensors, CaptureError> {
        let single = dir.join("model.safetensors");
        let idx = dir.join("model.safetensors.index.json");
        let mut t = Tensors {
            files: Vec::new(),
            index: BTreeMap::new(),
            listing: single.clone(),
        };
        if single.exists() {
            let m = map_file(&single, None)?;
            for n in header_names(&single, &m)? {
                t.index.insert(n, 0);
            }
            t.files.push((single, m));
        } else if idx.exists() {
            let j = read_json(&idx)?;
            let wm = j
                .get("weight_map")
                .and_then(|v| v.as_object())
                .ok_or_else(|| CaptureError::Config {
                    path: idx.clone(),
                    field: "weight_map".into(),
                    problem: "missing or not an object".into(),
                })?;
            let mut shards: Vec<String> = Vec::new();
            for (name, file) in wm {
                let file = file.as_str().ok_or_else(|| CaptureError::Config {
                    path: idx.clone(),
                    field: format!("weight_map.{name}"),
                    problem: "not a file name".into(),
                })?;
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    return Err(CaptureError::Config {
                        path: idx.clone(),
                        field: format!("weight_map.{name}"),
                        problem: format!(
                            "`{file}`, which is not a file name in the checkpoint directory"
                        ),
                    });
                }
                let i = match shards.iter().position(|s| s == file) {
                    Some(i) => i,
                    None => {
                        shards.push(file.to_string());
                        shards.len() - 1
                    }
                };
                t.index.insert(name.clone(), i);
            }
            for s in &shards {
                let p = dir.join(s);
                let m = map_file(&p, Some(&idx))?;
                let names = header_names(&p, &m)?;
                for (name, &i) in &t.index {
                    if shards[i] == *s && !names.iter().any(|n| n == name) {
                        return Err(CaptureError::Tensor {
                            path: p.clone(),
                            tensor: name.clone(),
                            msg: format!(
                                "missing from this shard, though {} places it here",
                                idx.display()
                            ),
                        });
                    }
                }
                t.files.push((p, m));
            }
            t.listing = idx;
        } else {
            return Err(CaptureError::Io {
                path: single,
                err: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors nor model.safetensors.index.json in the checkpoint directory",
                ),
            });
        }
        Ok(t)
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Tensor `name` of shape `shape` (HF order: outer first) as f32.
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Weight, CaptureError> {
        let &i = self.index.get(name).ok_or_else(|| CaptureError::Tensor {
            path: self.listing.clone(),
            tensor: name.into(),
            msg: "missing from the checkpoint".into(),
        })?;
        let (path, bytes) = &self.files[i];
        let terr = |msg: String| CaptureError::Tensor {
            path: path.clone(),
            tensor: name.into(),
            msg,
        };
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| terr(format!("not readable: {e}")))?;
        let t = st
            .tensor(name)
            .map_err(|e| terr(format!("not readable: {e}")))?;
        if t.shape() != shape {
            return Err(terr(format!(
                "has shape {:?}, expected {shape:?} from config.json",
                t.shape()
            )));
        }
        use rayon::prelude::*;
        use safetensors::Dtype;
        let d = t.data();
        let out: Vec<f32> = match t.dtype() {
            Dtype::F32 => d
                .par_chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => d
                .par_chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => d
                .par_chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(terr(format!(
                    "has dtype {other:?}; supported: BF16, F16, F32"
                )))
            }
        };
        if out.par_iter().any(|x| !x.is_finite()) {
            return Err(terr("holds NaN or infinite values".into()));
        }
        Ok(out.into())
    }
}

/// Load the weights of an HF checkpoint directory for `cfg`.
pub fn load_llama(
    dir: &Path,
    cfg: LlamaConfig,
    tied: bool,
    biases: (bool, bool),
) -> Result<Llama, CaptureError> {
    let t = Tensors::open(dir)?;
    let (d, hd, f, v) = (cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size);
    let (h, kv) = (cfg.n_heads, cfg.n_kv_heads);
    // Gemma 3 (the only family with post norms) scales by (1 + w): add the 1
    // here, so the forward pass applies x / rms(x) * w as for the others
    // (what llama.cpp's converter does to Gemma GGUFs).
    let gemma = cfg.post_norms;
    let norm = |name: &str, n: usize| -> Result<Weight, CaptureError> {
        let w = t.f32(name, &[n])?;
        Ok(if gemma {
            w.iter().map(|x| x + 1.0).collect::<Vec<f32>>().into()
        } else {
            w
        })
    };
    let embed = t.f32("model.embed_tokens.weight", &[v, d])?;
    let out_norm = norm("model.norm.weight", d)?;
    let lm_head = if tied {
        None
    } else if t.has("lm_head.weight") {
        Some(t.f32("lm_head.weight", &[v, d])?)
    } else {
        return Err(CaptureError::Tensor {
            path: t.listing.clone(),
            tensor: "lm_head.weight".into(),
            msg: "missing, and config.json's tie_word_embeddings is not true".into(),
        });
    };
    let layers = (0..cfg.n_layers)
        .map(|l| {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let opt = |on: bool, s: &str, n: usize| -> Result<Option<Weight>, CaptureError> {
                if on {
                    Ok(Some(t.f32(&p(s), &[n])?))
                } else {
                    Ok(None)
                }
            };
            let opt_norm = |on: bool, s: &str, n: usize| -> Result<Option<Weight>, CaptureError> {
                if on {
                    Ok(Some(norm(&p(s), n)?))
                } else {
                    Ok(None)
                }
            };
            Ok(LayerWeights {
                attn_norm: norm(&p("input_layernorm.weight"), d)?,
                q_norm: opt_norm(cfg.qk_norm, "self_attn.q_norm.weight", hd)?,
                k_norm: opt_norm(cfg.qk_norm, "self_attn.k_norm.weight", hd)?,
                // Gemma: post_attention_layernorm is the attention output's
                // norm; pre_feedforward_layernorm the FFN input's.
                post_attn_norm: opt_norm(gemma, "post_attention_layernorm.weight", d)?,
                post_ffn_norm: opt_norm(gemma, "post_feedforward_layernorm.weight", d)?,
                wq: t.f32(&p("self_attn.q_proj.weight"), &[h * hd, d])?,
                wk: t.f32(&p("self_attn.k_proj.weight"), &[kv * hd, d])?,
                wv: t.f32(&p("self_attn.v_proj.weight"), &[kv * hd, d])?,
                wo: t.f32(&p("self_attn.o_proj.weight"), &[d, h * hd])?,
                bq: opt(biases.0, "self_attn.q_proj.bias", h * hd)?,
                bk: opt(biases.0, "self_attn.k_proj.bias", kv * hd)?,
                bv: opt(biases.0, "self_attn.v_proj.bias", kv * hd)?,
                bo: opt(biases.1, "self_attn.o_proj.bias", d)?,
                ffn_norm: norm(
                    &p(if gemma {
                        "pre_feedforward_layernorm.weight"
                    } else {
                        "post_attention_layernorm.weight"
                    }),
                    d,
                )?,
                w_gate: t.f32(&p("mlp.gate_proj.weight"), &[f, d])?,
                w_up: t.f32(&p("mlp.up_proj.weight"), &[f, d])?,
                w_down: t.f32(&p("mlp.down_proj.weight"), &[d, f])?,
            })
        })
        .collect::<Result<_, CaptureError>>()?;
    Ok(Llama {
        cfg,
        embed,
        layers,
        out_norm,
        lm_head,
        backend: Backend::Cpu,
    })
}

/// sha256 and total size of the checkpoint's files that define the model
/// (config.json, the index if any, every safetensors file in name order,
/// tokenizer.json, tokenizer_config.json if any): the manifest's source.
pub fn fingerprint(dir: &Path) -> Result<(String, u64), CaptureError> {
    use sha2::{Digest, Sha256};
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| CaptureError::io(dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.ends_with(".safetensors")
                || matches!(
                    n.as_str(),
                    "config.json"
                        | "model.safetensors.index.json"
                        | "tokenizer.json"
                        | "tokenizer_config.json"
                )
        })
        .collect();
    names.sort();
    let mut h = Sha256::new();
    let mut size = 0u64;
    for n in &names {
        let p = dir.join(n);
        let f = std::fs::File::open(&p).map_err(|e| CaptureError::io(&p, e))?;
        // SAFETY: read-only map of a file not modified while hashed.
        let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| CaptureError::io(&p, e))?;
        h.update(n.as_bytes());
        h.update((m.len() as u64).to_le_bytes());
        h.update(&m[..]);
        size += m.len() as u64;
    }
    Ok((
        h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
        size,
    ))
}

/// Read config.json of `dir`.
pub fn read_config(dir: &Path) -> Result<(String, LlamaConfig, bool, (bool, bool)), CaptureError> {
    let p = dir.join("config.json");
    if !p.exists() {
        return Err(CaptureError::Io {
            path: p,
            err: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "missing; an HF checkpoint directory holds config.json, model.safetensors (or an index and shards) and tokenizer.json",
            ),
        });
    }
    let j = read_json(&p)?;
    config_from_json(&p, &j)
}

/// `name_or_path`-like name of the checkpoint: the config's `_name_or_path`,
/// else the directory name.
pub fn model_name(dir: &Path) -> Option<String> {
    let j = read_json(&dir.join("config.json")).ok()?;
    j.get("_name_or_path")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .map(String::from)
        .or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()))
}

pub(crate) fn read_json_file(path: &Path) -> Result<Value, CaptureError> {
    read_json(path)
}
