//! The llama-family forward pass in f32 (RMSNorm, RoPE, grouped-query
//! attention, SwiGLU MLP, tied or untied output head).
//!
//! Weights are held in the HF layout: llama GGUFs store the rows of Q and K
//! permuted so that llama.cpp's interleaved RoPE applies (see
//! `unpermute_rows`); we undo that at load time and apply NEOX ("rotate_half")
//! RoPE, so captured q and k come out exactly as HF transformers computes them.

use kvreplay_kernels::cpu::{argmax, AttentionStats, RopeParams, RopeStyle};
use kvreplay_kernels::{Backend, KernelError, Weight};
use rayon::prelude::*;

use crate::gguf::GgufFile;
use crate::CaptureError;

/// Architectures this build can run.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];

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
    pub rope: RopeParams,
    pub attn_scale: f32,
}

/// One transformer block. Shapes are (out_features, in_features), row-major.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>, // (d_model,)
    pub wq: Weight,          // (n_heads * head_dim, d_model), HF row order
    pub wk: Weight,          // (n_kv_heads * head_dim, d_model), HF row order
    pub wv: Weight,          // (n_kv_heads * head_dim, d_model)
    pub wo: Weight,          // (d_model, n_heads * head_dim)
    pub ffn_norm: Vec<f32>,  // (d_model,)
    pub w_gate: Weight,      // (ffn_dim, d_model)
    pub w_up: Weight,        // (ffn_dim, d_model)
    pub w_down: Weight,      // (d_model, ffn_dim)
}

pub struct Llama {
    pub cfg: LlamaConfig,
    pub embed: Weight, // (vocab, d_model)
    pub layers: Vec<LayerWeights>,
    pub out_norm: Vec<f32>,      // (d_model,)
    pub lm_head: Option<Weight>, // (vocab, d_model); None = tied to `embed`
    /// Where the forward pass runs (the CPU unless set with `set_backend`).
    pub backend: Backend,
}

/// GGUF rows of one Q/K head are ordered so that pairs (2i, 2i+1) rotate
/// together; HF pairs (i, i + d/2). GGUF row 2i + j holds HF row j*d/2 + i.
pub fn unpermute_rows(w: &[f32], n_heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
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
            rope: RopeParams {
                theta,
                style: RopeStyle::Neox,
                rotated_dims,
                linear_factor,
            },
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
        })
    }
}

impl Llama {
    /// Load and dequantise every weight to f32.
    pub fn from_gguf(g: &GgufFile) -> Result<Llama, CaptureError> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let (d, hd, f, v) = (
            cfg.d_model as u64,
            cfg.head_dim as u64,
            cfg.ffn_dim as u64,
            cfg.vocab_size as u64,
        );
        let (h, kv) = (cfg.n_heads as u64, cfg.n_kv_heads as u64);
        let embed = g.tensor_f32("token_embd.weight", &[d, v])?.into();
        let out_norm = g.tensor_f32("output_norm.weight", &[d])?;
        let lm_head = match g.tensor_info("output.weight") {
            Some(_) => Some(g.tensor_f32("output.weight", &[d, v])?.into()),
            None => None,
        };
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let t = |name: &str, dims: &[u64]| {
                    g.tensor_f32(&format!("blk.{l}.{name}.weight"), dims)
                };
                Ok(LayerWeights {
                    attn_norm: t("attn_norm", &[d])?,
                    wq: unpermute_rows(
                        &t("attn_q", &[d, h * hd])?,
                        cfg.n_heads,
                        cfg.head_dim,
                        cfg.d_model,
                    )
                    .into(),
                    wk: unpermute_rows(
                        &t("attn_k", &[d, kv * hd])?,
                        cfg.n_kv_heads,
                        cfg.head_dim,
                        cfg.d_model,
                    )
                    .into(),
                    wv: t("attn_v", &[d, kv * hd])?.into(),
                    wo: t("attn_output", &[h * hd, d])?.into(),
                    ffn_norm: t("ffn_norm", &[d])?,
                    w_gate: t("ffn_gate", &[d, f])?.into(),
                    w_up: t("ffn_up", &[d, f])?.into(),
                    w_down: t("ffn_down", &[f, d])?.into(),
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

    /// Run later forward passes on `backend`.
    pub fn set_backend(&mut self, backend: Backend) {
        self.backend = backend;
    }
}

/// Keys and values of every layer: per layer (n_kv_heads, capacity, head_dim).
#[derive(Clone)]
pub struct KvCache {
    pub capacity: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(cfg: &LlamaConfig, capacity: usize) -> KvCache {
        let n = cfg.n_kv_heads * capacity * cfg.head_dim;
        KvCache {
            capacity,
            k: (0..cfg.n_layers).map(|_| vec![0f32; n]).collect(),
            v: (0..cfg.n_layers).map(|_| vec![0f32; n]).collect(),
        }
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
    /// Per layer (n_heads, n_tracked): accumulate each head's attention column sums.
    pub colsum: Option<&'a mut [Vec<f32>]>,
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

/// (c, heads * d) row-major  ->  (heads, c, d) head-major.
fn to_head_major(x: &[f32], c: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for t in 0..c {
        for h in 0..heads {
            out[(h * c + t) * d..(h * c + t + 1) * d]
                .copy_from_slice(&x[(t * heads + h) * d..(t * heads + h + 1) * d]);
        }
    }
    out
}

/// (heads, c, d) head-major  ->  (c, heads * d) row-major.
fn from_head_major(x: &[f32], c: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for t in 0..c {
        for h in 0..heads {
            out[(t * heads + h) * d..(t * heads + h + 1) * d]
                .copy_from_slice(&x[(h * c + t) * d..(h * c + t + 1) * d]);
        }
    }
    out
}

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
        let group = nh / nkv;
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
        // x: (c, d_model) residual stream
        let mut x = vec![0f32; c * dm];
        be.embedding(&self.embed, dm, tokens, &mut x)?;
        for (l, w) in self.layers.iter().enumerate() {
            let mut h = x.clone();
            be.rms_norm(&mut h, &w.attn_norm, cfg.norm_eps)?;
            let mut q = vec![0f32; c * nh * hd]; // (c, n_heads * head_dim)
            let mut k = vec![0f32; c * nkv * hd]; // (c, n_kv_heads * head_dim)
            let mut v = vec![0f32; c * nkv * hd];
            be.linear(&h, &w.wq, &mut q, c, dm, nh * hd)?;
            be.linear(&h, &w.wk, &mut k, c, dm, nkv * hd)?;
            be.linear(&h, &w.wv, &mut v, c, dm, nkv * hd)?;
            be.rope(&mut q, nh, hd, pos0, &cfg.rope, 1.0)?;
            be.rope(&mut k, nkv, hd, pos0, &cfg.rope, 1.0)?;
            let (q, k, v) = (
                to_head_major(&q, c, nh, hd),
                to_head_major(&k, c, nkv, hd),
                to_head_major(&v, c, nkv, hd),
            );
            let cap = cache.capacity;
            for g in 0..nkv {
                let dst = (g * cap + pos0) * hd;
                cache.k[l][dst..dst + c * hd].copy_from_slice(&k[g * c * hd..(g + 1) * c * hd]);
                cache.v[l][dst..dst + c * hd].copy_from_slice(&v[g * c * hd..(g + 1) * c * hd]);
            }
            // Attention, one task per query head: o (n_heads, c, head_dim).
            let mut o = vec![0f32; nh * c * hd];
            let mut probs = if opts.probs {
                vec![0f32; nh * c * n]
            } else {
                Vec::new()
            };
            let colsum = opts.colsum.as_deref_mut().map(|cs| cs[l].as_mut_slice());
            let n_tracked = colsum.as_ref().map(|s| s.len() / nh).unwrap_or(0);
            let mut colsum_heads: Vec<Option<&mut [f32]>> = match colsum {
                Some(s) => s.chunks_mut(n_tracked.max(1)).map(Some).collect(),
                None => (0..nh).map(|_| None).collect(),
            };
            let mut probs_heads: Vec<Option<&mut [f32]>> = if opts.probs {
                probs.chunks_mut(c * n).map(Some).collect()
            } else {
                (0..nh).map(|_| None).collect()
            };
            let (kc, vc) = (&cache.k[l], &cache.v[l]);
            if let Some(f) = opts.attention.as_deref_mut() {
                f(l, &q, &k, &v, &mut o)?;
            } else {
                o.par_chunks_mut(c * hd)
                    .zip(colsum_heads.par_iter_mut())
                    .zip(probs_heads.par_iter_mut())
                    .enumerate()
                    .try_for_each(|(head, ((out, cs), pr))| {
                        let g = head / group;
                        let kv = g * cap * hd..(g * cap + n) * hd;
                        be.causal_attention_head(
                            &q[head * c * hd..(head + 1) * c * hd],
                            &kc[kv.clone()],
                            &vc[kv],
                            hd,
                            pos0,
                            cfg.attn_scale,
                            out,
                            AttentionStats {
                                colsum: cs.as_deref_mut(),
                                probs: pr.as_deref_mut(),
                            },
                        )
                    })?;
            }
            taps(LayerTaps {
                layer: l,
                pos0,
                q: &q,
                k: &k,
                v: &v,
                o: &o,
                probs: opts.probs.then_some(probs.as_slice()),
            });
            let o_rows = from_head_major(&o, c, nh, hd);
            let mut attn = vec![0f32; c * dm];
            be.linear(&o_rows, &w.wo, &mut attn, c, nh * hd, dm)?;
            x.iter_mut().zip(&attn).for_each(|(a, b)| *a += b);
            // SwiGLU MLP
            let mut h = x.clone();
            be.rms_norm(&mut h, &w.ffn_norm, cfg.norm_eps)?;
            let mut gate = vec![0f32; c * cfg.ffn_dim];
            let mut up = vec![0f32; c * cfg.ffn_dim];
            be.linear(&h, &w.w_gate, &mut gate, c, dm, cfg.ffn_dim)?;
            be.linear(&h, &w.w_up, &mut up, c, dm, cfg.ffn_dim)?;
            be.silu_mul(&mut gate, &up)?;
            let mut down = vec![0f32; c * dm];
            be.linear(&gate, &w.w_down, &mut down, c, cfg.ffn_dim, dm)?;
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        let mut last = x[(c - 1) * dm..].to_vec();
        be.rms_norm(&mut last, &self.out_norm, cfg.norm_eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0f32; cfg.vocab_size];
        be.linear(&last, head, &mut logits, 1, dm, cfg.vocab_size)?;
        Ok(logits)
    }

    /// Greedy next token from logits.
    pub fn greedy(logits: &[f32]) -> u32 {
        argmax(logits) as u32
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

    #[test]
    fn head_major_round_trip() {
        let x: Vec<f32> = (0..24).map(|i| i as f32).collect(); // (c=2, heads=3, d=4)
        let hm = to_head_major(&x, 2, 3, 4);
        assert_eq!(&hm[4..8], &x[12..16]); // head 0, position 1
        assert_eq!(from_head_major(&hm, 2, 3, 4), x);
    }
}
