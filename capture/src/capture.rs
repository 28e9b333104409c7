//! The capture loop: tokenize, chunked prefill, greedy decode, stream to a trace.

use std::path::PathBuf;

use kvreplay_traces::{
    CaptureInfo, Dtype, Generation, Manifest, ModelInfo, Rope, RopeScaling, RopeStyle, Span,
    TensorKind, Tokens, TraceLayout, TraceWriter,
};

use crate::llama::{ForwardOptions, KvCache, LayerTaps, Llama};
use crate::{CaptureError, Model};

/// Prompt positions per prefill step unless asked otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// Longest trace (T) for which `--attn-probs` is allowed: the tensor is
/// (n_heads, T, T) f32 per layer (SmolLM2 at T = 1024: 37.7 MB per layer).
pub const MAX_ATTN_PROBS_LEN: usize = 1024;

#[derive(Clone, Debug)]
pub struct CaptureOptions {
    /// The prompt text (before the chat template, if any).
    pub prompt: String,
    /// Pre-tokenized prompt ids; when set they are used as is (no template,
    /// no tokenization) and `prompt` is only descriptive.
    pub prompt_ids: Option<Vec<u32>>,
    /// Where the prompt came from, recorded in the manifest (`text`, `file:NAME`, ...).
    pub prompt_source: String,
    /// Wrap the prompt in the model's chat template as one user message.
    pub chat: bool,
    /// Greedy tokens to generate (each fed back through the model).
    pub n_decode: usize,
    pub dtype: Dtype,
    /// Prompt positions per prefill step (bounds memory for long prompts).
    pub prefill_chunk: usize,
    pub attn_probs: bool,
    pub out: PathBuf,
    pub force: bool,
    /// Named token spans of the prompt, recorded in the manifest.
    pub spans: Vec<Span>,
    /// Allow positions past the model's context length (RoPE extrapolates;
    /// attention patterns there are untrained). For timing benchmarks only.
    pub beyond_context: bool,
    /// A lean trace: q and o stored only for the last N prompt positions
    /// (and every decode step); None stores every position.
    pub keep_queries: Option<usize>,
}

impl CaptureOptions {
    pub fn new(prompt: impl Into<String>, out: impl Into<PathBuf>) -> Self {
        CaptureOptions {
            prompt: prompt.into(),
            prompt_ids: None,
            prompt_source: "text".into(),
            chat: false,
            n_decode: 16,
            dtype: Dtype::F16,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            attn_probs: false,
            out: out.into(),
            force: false,
            spans: Vec::new(),
            beyond_context: false,
            keep_queries: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Prefill,
    Decode,
    Finish,
}

/// Progress report: `done` of `total` positions in `phase`.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub phase: Phase,
    pub done: usize,
    pub total: usize,
}

#[derive(Clone, Debug)]
pub struct CaptureSummary {
    pub out: PathBuf,
    pub prompt_len: usize,
    pub n_decode: usize,
    /// Wall time of the prefill and of the decode loop (model compute and trace writes).
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// The generated continuation as text.
    pub continuation: String,
}

/// One layer's taps of a decode step, owned, for the writer thread.
struct OwnedTaps {
    layer: usize,
    pos0: usize,
    /// q, k, v, o as in [`LayerTaps`], one after another; o is what
    /// follows the first three, whose lengths these are.
    data: Vec<f32>,
    lens: [usize; 3],
    probs: Option<Vec<f32>>,
}

impl From<LayerTaps<'_>> for OwnedTaps {
    fn from(t: LayerTaps<'_>) -> OwnedTaps {
        let parts = [t.q, t.k, t.v, t.o];
        OwnedTaps {
            layer: t.layer,
            pos0: t.pos0,
            data: parts.concat(),
            lens: [t.q.len(), t.k.len(), t.v.len()],
            probs: t.probs.map(<[f32]>::to_vec),
        }
    }
}

impl OwnedTaps {
    fn view(&self) -> LayerTaps<'_> {
        let [nq, nk, nv] = self.lens;
        let (q, rest) = self.data.split_at(nq);
        let (k, rest) = rest.split_at(nk);
        let (v, o) = rest.split_at(nv);
        LayerTaps {
            layer: self.layer,
            pos0: self.pos0,
            q,
            k,
            v,
            o,
            probs: self.probs.as_deref(),
        }
    }
}

/// Write one layer's taps into the trace.
fn write_taps(writer: &mut TraceWriter, taps: &LayerTaps<'_>, nh: usize, hd: usize) {
    let lw = writer.layer(taps.layer);
    let c = taps.q.len() / (nh * hd);
    for (kind, data) in [
        (TensorKind::Q, taps.q),
        (TensorKind::K, taps.k),
        (TensorKind::V, taps.v),
        (TensorKind::O, taps.o),
    ] {
        for (head, rows) in data.chunks_exact(c * hd).enumerate() {
            lw.write_rows(kind, head, taps.pos0, rows);
        }
    }
    if let Some(probs) = taps.probs {
        let n = taps.pos0 + c;
        for (i, row) in probs.chunks_exact(n).enumerate() {
            lw.write_probs_row(i / c, taps.pos0 + i % c, row);
        }
    }
}

/// Capture a trace of `model` on `opts.prompt`. Nothing is left at `opts.out`
/// unless the capture completes.
pub fn capture(
    model: &Model,
    opts: &CaptureOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<CaptureSummary, CaptureError> {
    let cfg = &model.llama.cfg;
    if opts.prefill_chunk == 0 {
        return Err(CaptureError::InvalidOption(
            "prefill chunk must be at least 1".into(),
        ));
    }
    let mut ids = match &opts.prompt_ids {
        Some(ids) => {
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
                return Err(CaptureError::InvalidOption(format!(
                    "prompt token id {bad} is outside the vocabulary (size {})",
                    cfg.vocab_size
                )));
            }
            ids.clone()
        }
        None if opts.prompt.is_empty() => return Err(CaptureError::EmptyPrompt),
        None if opts.chat => {
            model
                .tokenizer
                .encode_chat(&model.tokenizer.apply_chat_template(&opts.prompt)?)?
                .0
        }
        None => model.tokenizer.encode(&opts.prompt)?,
    };
    let p = ids.len();
    if p == 0 {
        return Err(CaptureError::EmptyPrompt);
    }
    // checked: a huge --decode must not wrap T around to a few tokens
    let t = match p.checked_add(opts.n_decode) {
        Some(t) if t <= cfg.context_length || opts.beyond_context => t,
        _ => {
            return Err(CaptureError::PromptTooLong {
                prompt: p,
                decode: opts.n_decode,
                context: cfg.context_length,
            })
        }
    };
    if opts.attn_probs && t > MAX_ATTN_PROBS_LEN {
        return Err(CaptureError::InvalidOption(format!(
            "--attn-probs stores (n_heads, T, T) per layer and is limited to T <= {MAX_ATTN_PROBS_LEN}; this trace has T = {t}"
        )));
    }
    for s in &opts.spans {
        if s.start > s.end || s.end > p {
            return Err(CaptureError::InvalidOption(format!(
                "span `{}` [{}, {}) lies outside the {p}-token prompt",
                s.name, s.start, s.end
            )));
        }
    }
    let layout = TraceLayout {
        n_layers: cfg.n_layers,
        n_heads: cfg.n_heads,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        total_len: t,
        prompt_len: p,
        dtype: opts.dtype,
        attn_probs: opts.attn_probs,
        query_start: opts.keep_queries.map_or(0, |n| p - n.min(p)),
    };
    let mut writer = TraceWriter::create(&opts.out, layout, opts.force)?;
    let mut cache = KvCache::new(cfg, t);
    let (nh, hd) = (cfg.n_heads, cfg.head_dim);
    let n_layers = cfg.n_layers;

    // Prefill, `prefill_chunk` positions at a time; every query is a prompt
    // query, so the column sums accumulate here only. The taps are written
    // as they come: the cores are busy with the next chunk, so writing
    // beside it gains nothing (measured: BENCHMARKS.md, fifteenth session).
    let start = std::time::Instant::now();
    let mut colsum = model.llama.colsum_buffers(p)?; // per layer (n_heads, P), on the device
    let mut logits = Vec::new();
    let mut pos = 0;
    {
        let mut sink = |taps: LayerTaps<'_>| write_taps(&mut writer, &taps, nh, hd);
        while pos < p {
            let end = (pos + opts.prefill_chunk).min(p);
            let fo = ForwardOptions {
                colsum: Some(&mut colsum),
                probs: opts.attn_probs,
                attention: None,
            };
            logits = model
                .llama
                .forward(&ids[pos..end], pos, &mut cache, fo, &mut sink)?;
            pos = end;
            progress(Progress {
                phase: Phase::Prefill,
                done: pos,
                total: p,
            });
        }
    }
    let prefill_secs = start.elapsed().as_secs_f64();

    // Greedy decode: each generated token is fed back so its q/k/v/o exist.
    // A token's writes (about 0.5 ms of a SmolLM2 token at 2,048 positions,
    // while the pool waited) run on a thread of their own beside the next
    // token, whose workers have idle time to spare: the taps are copied and
    // handed over when the last layer's arrive. The hand-over is a
    // rendezvous, so at most two tokens' taps are held, and the decode time
    // includes the last token's writes.
    let start = std::time::Instant::now();
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<OwnedTaps>>(0);
        let w = &mut writer;
        let written = scope.spawn(move || {
            for batch in rx {
                for taps in &batch {
                    write_taps(w, &taps.view(), nh, hd);
                }
            }
        });
        let mut run = || -> Result<(), CaptureError> {
            let mut batch = Vec::with_capacity(n_layers);
            // A send fails only when the writer has panicked; joining it
            // below reports that.
            let mut sink = |taps: LayerTaps<'_>| {
                let last = taps.layer + 1 == n_layers;
                batch.push(OwnedTaps::from(taps));
                if last {
                    let _ = tx.send(std::mem::replace(&mut batch, Vec::with_capacity(n_layers)));
                }
            };
            for i in 0..opts.n_decode {
                let next = Llama::greedy(&logits);
                ids.push(next);
                let fo = ForwardOptions {
                    colsum: None,
                    probs: opts.attn_probs,
                    attention: None,
                };
                logits = model
                    .llama
                    .forward(&[next], p + i, &mut cache, fo, &mut sink)?;
                progress(Progress {
                    phase: Phase::Decode,
                    done: i + 1,
                    total: opts.n_decode,
                });
            }
            Ok(())
        };
        let done = run();
        drop(tx);
        if let Err(panic) = written.join() {
            std::panic::resume_unwind(panic);
        }
        done
    })?;
    let decode_secs = start.elapsed().as_secs_f64();

    for (l, cs) in colsum.iter().enumerate() {
        let cs = model.llama.backend.download(cs)?;
        for (head, row) in cs.chunks_exact(p).enumerate() {
            writer.layer(l).write_colsum(head, row);
        }
    }
    progress(Progress {
        phase: Phase::Finish,
        done: 0,
        total: 1,
    });
    let manifest = Manifest {
        format: kvreplay_traces::FORMAT_NAME.into(),
        format_version: kvreplay_traces::FORMAT_VERSION,
        model: ModelInfo {
            architecture: model.architecture.clone(),
            name: model.name.clone(),
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            d_model: cfg.d_model,
            ffn_dim: cfg.ffn_dim,
            vocab_size: cfg.vocab_size,
            context_length: cfg.context_length,
            norm_eps: cfg.norm_eps as f64,
            attn_scale: cfg.attn_scale as f64,
            rope: Rope {
                theta: cfg.rope.theta,
                style: match cfg.rope.style {
                    kvreplay_kernels::cpu::RopeStyle::Neox => RopeStyle::Neox,
                    kvreplay_kernels::cpu::RopeStyle::Interleaved => RopeStyle::Interleaved,
                },
                rotated_dims: cfg.rope.rotated_dims,
                scaling: match (cfg.rope.llama3, cfg.rope.linear_factor) {
                    (Some(l3), _) => RopeScaling::Llama3 {
                        factor: l3.factor,
                        low_freq_factor: l3.low_freq_factor,
                        high_freq_factor: l3.high_freq_factor,
                        original_max_position_embeddings: l3.original_max_position_embeddings,
                    },
                    (None, factor) if factor != 1.0 => RopeScaling::Linear { factor },
                    (None, _) => RopeScaling::None,
                },
            },
            source: model.source.clone(),
            // Recorded only when the layers differ from `rope` / full
            // attention (so llama manifests carry no per-layer list).
            layers: if cfg
                .layer_attention
                .iter()
                .all(|la| la.window.is_none() && la.rope == cfg.rope)
            {
                Vec::new()
            } else {
                cfg.layer_attention
                    .iter()
                    .map(|la| kvreplay_traces::LayerAttention {
                        window: la.window,
                        rope_theta: la.rope.theta,
                    })
                    .collect()
            },
        },
        tokens: Tokens {
            text: ids
                .iter()
                .map(|&id| model.tokenizer.decode_token(id))
                .collect(),
            ids: ids.clone(),
            prompt_len: p,
        },
        generation: Generation {
            method: "greedy".into(),
            n_decode: opts.n_decode,
        },
        spans: opts.spans.clone(),
        capture: CaptureInfo {
            device: model.llama.backend.describe(),
            dtype: opts.dtype,
            compute_dtype: "f32".into(),
            prefill_chunk: opts.prefill_chunk,
            threads: rayon::current_num_threads(),
            attn_probs: opts.attn_probs,
            chat_template: opts.chat,
            prompt_source: opts.prompt_source.clone(),
            kvreplay_version: env!("CARGO_PKG_VERSION").into(),
            created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            keep_queries: opts.keep_queries,
        },
        files: Vec::new(),
    };
    let out = writer.finish(manifest)?;
    Ok(CaptureSummary {
        out,
        prompt_len: p,
        n_decode: opts.n_decode,
        prefill_secs,
        decode_secs,
        continuation: model.tokenizer.decode(&ids[p..]),
    })
}
