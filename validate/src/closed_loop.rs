//! The closed loop: prefill the model once with full attention, hand every
//! layer's prompt to a policy through the same causal interface replay uses
//! (`PrefillCtx`), then decode with each layer attending over the policy's
//! compressed cache and the policy acting after every step (`StepCtx`).

use std::sync::Arc;

use kvreplay_capture::llama::{ForwardOptions, KvCache, LayerTaps, Llama};
use kvreplay_capture::Model;
use kvreplay_kernels::cpu::{self, AttentionStats};
use kvreplay_kernels::{Backend, KernelError};
use kvreplay_replay::cache::HeadCache;
use kvreplay_replay::policy::{LayerData, Policy};
use kvreplay_replay::{ReplayError, Session};

use crate::ValidateError;

/// The model's state after prefilling a prompt: what every closed-loop run
/// of that prompt starts from.
pub struct Prefilled {
    /// KV cache of the prompt (capacity prompt + continuation).
    pub cache: KvCache,
    /// Per layer, the prompt as a policy sees it (f32, live values).
    pub layers: Vec<LayerData>,
    /// Logits after the last prompt token.
    pub logits: Vec<f32>,
    pub prompt_len: usize,
}

/// Prefill `prompt` (chunks of 256) keeping q/k/v and column sums per layer.
pub fn prefill(model: &Model, prompt: &[u32], capacity: usize) -> Result<Prefilled, ValidateError> {
    let cfg = &model.llama.cfg;
    // the closed loop's compressed attention (attend_head) has no window yet
    if cfg.layer_attention.iter().any(|a| a.window.is_some()) {
        return Err(ValidateError::Input {
            path: model.source.file_name.clone(),
            msg: "has sliding-window layers (Gemma 3): closed-loop validation of sliding-window models is not supported yet; replay and capture are".into(),
        });
    }
    let (p, d, nh, nkv, nl) = (
        prompt.len(),
        cfg.head_dim,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.n_layers,
    );
    let mut cache = KvCache::new(cfg, capacity);
    let mut q = vec![vec![0f32; nh * p * d]; nl];
    let mut k = vec![vec![0f32; nkv * p * d]; nl];
    let mut v = vec![vec![0f32; nkv * p * d]; nl];
    let mut colsum_dev = model.llama.colsum_buffers(p)?;
    let mut logits = Vec::new();
    let mut pos = 0;
    while pos < p {
        let end = (pos + 256).min(p);
        let c = end - pos;
        let mut sink = |t: LayerTaps<'_>| {
            // taps are head-major for this chunk: (heads, c, d) into (heads, P, d)
            for (dst, src, heads) in [
                (&mut q[t.layer], t.q, nh),
                (&mut k[t.layer], t.k, nkv),
                (&mut v[t.layer], t.v, nkv),
            ] {
                for h in 0..heads {
                    dst[(h * p + pos) * d..(h * p + end) * d]
                        .copy_from_slice(&src[h * c * d..(h + 1) * c * d]);
                }
            }
        };
        let fo = ForwardOptions {
            colsum: Some(&mut colsum_dev),
            probs: false,
            attention: None,
        };
        logits = model
            .llama
            .forward(&prompt[pos..end], pos, &mut cache, fo, &mut sink)?;
        pos = end;
    }
    let colsum = colsum_dev
        .iter()
        .map(|b| model.llama.backend.download(b).map(|c| c.into_owned()))
        .collect::<Result<Vec<_>, _>>()?;
    let all = Arc::new(colsum.clone());
    let layers = (0..nl)
        .map(|l| LayerData {
            layer: l,
            n_layers: nl,
            n_heads: nh,
            n_kv_heads: nkv,
            d,
            scale: cfg.attn_scale,
            prompt_len: p,
            total_len: p,
            q_start: 0,
            window: cfg.layer_attention.get(l).and_then(|a| a.window),
            q: std::mem::take(&mut q[l]),
            k: std::mem::take(&mut k[l]),
            v: std::mem::take(&mut v[l]),
            colsum: colsum[l].clone(),
            all_colsum: Some(all.clone()),
            rope: Some(cfg.layer_attention.get(l).map_or(cfg.rope, |a| a.rope)),
            memo: None,
            backend: Backend::Cpu,
        })
        .collect();
    Ok(Prefilled {
        cache,
        layers,
        logits,
        prompt_len: p,
    })
}

/// How the continuation is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    /// Feed the given tokens (the trace's continuation).
    Teacher,
    /// Feed the model's own greedy choice.
    Greedy,
}

/// One closed-loop decode: the logits after each fed token, and the tokens fed.
pub struct Decoded {
    /// logits[i]: after feeding tokens[i] at position P + i.
    pub logits: Vec<Vec<f32>>,
    pub tokens: Vec<u32>,
}

/// Decode `n` tokens after `pre` with full attention (no policy): the reference.
pub fn decode_full(
    model: &Model,
    pre: &Prefilled,
    cont: &[u32],
    n: usize,
    feed: Feed,
) -> Result<Decoded, ValidateError> {
    let mut cache = pre.cache.clone();
    let mut out = Decoded {
        logits: Vec::new(),
        tokens: Vec::new(),
    };
    let mut last = pre.logits.clone();
    for i in 0..n {
        let tok = next_token(feed, cont, i, &last);
        let fo = ForwardOptions {
            colsum: None,
            probs: false,
            attention: None,
        };
        last = model
            .llama
            .forward(&[tok], pre.prompt_len + i, &mut cache, fo, &mut |_| {})?;
        out.tokens.push(tok);
        out.logits.push(last.clone());
    }
    Ok(out)
}

fn next_token(feed: Feed, cont: &[u32], i: usize, last: &[f32]) -> u32 {
    match feed {
        Feed::Teacher => cont[i],
        Feed::Greedy => Llama::greedy(last),
    }
}

/// Decode `n` tokens after `pre` with `policy` at budget `b` inside the
/// forward pass: after prefill every layer's cache is the policy's
/// compressed cache; each step appends the new exact entry, attends over
/// the caches and lets the policy act on that step's attention.
pub fn decode_compressed(
    model: &Model,
    pre: &Prefilled,
    policy: &dyn Policy,
    b: usize,
    cont: &[u32],
    n: usize,
    feed: Feed,
) -> Result<Decoded, ValidateError> {
    let cfg = &model.llama.cfg;
    let (nl, nh, d) = (cfg.n_layers, cfg.n_heads, cfg.head_dim);
    // The replay loop, over every layer of the live model.
    let layers: Vec<&LayerData> = pre.layers.iter().collect();
    let mut session = Session::prefill(policy, &layers, b).map_err(ValidateError::Replay)?;
    let mut kv = pre.cache.clone();
    let mut out = Decoded {
        logits: Vec::new(),
        tokens: Vec::new(),
    };
    let mut last = pre.logits.clone();
    for i in 0..n {
        let pos = pre.prompt_len + i;
        let tok = next_token(feed, cont, i, &last);
        let mut probs: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); nh]; nl];
        let mut queries: Vec<Vec<f32>> = vec![Vec::new(); nl];
        {
            let session = &mut session;
            let probs = &mut probs;
            let queries = &mut queries;
            let mut attend = |l: usize,
                              q: &[f32],
                              k: &[f32],
                              v: &[f32],
                              o: &mut [f32]|
             -> Result<(), KernelError> {
                session.append(l, pos, |g| (&k[g * d..(g + 1) * d], &v[g * d..(g + 1) * d]));
                for h in 0..nh {
                    let cache = &session.caches(l)[session.cache_of(l, h)];
                    probs[l][h] = attend_head(
                        &q[h * d..(h + 1) * d],
                        cache,
                        cfg.attn_scale,
                        &mut o[h * d..(h + 1) * d],
                    );
                }
                queries[l] = q.to_vec();
                Ok(())
            };
            let fo = ForwardOptions {
                colsum: None,
                probs: false,
                attention: Some(&mut attend),
            };
            last = model.llama.forward(&[tok], pos, &mut kv, fo, &mut |_| {})?;
        }
        let qs: Vec<Vec<&[f32]>> = queries
            .iter()
            .map(|q| (0..nh).map(|h| &q[h * d..(h + 1) * d]).collect())
            .collect();
        session.step(pos, &probs, &qs);
        out.tokens.push(tok);
        out.logits.push(last.clone());
    }
    Ok(out)
}

/// Attention of one query over a cache into `o`; returns the probabilities
/// over its entries. A cache without logit bias goes through the model's own
/// attention kernel (so a cache holding every position reproduces the
/// uncompressed forward pass bit for bit); with bias, through the replay
/// kernel.
fn attend_head(q: &[f32], cache: &HeadCache, scale: f32, o: &mut [f32]) -> Vec<f32> {
    let n = cache.len();
    let d = q.len();
    if cache.bias.iter().all(|b| *b == 0.0) {
        let mut p = vec![0f32; n];
        cpu::causal_attention_head(
            q,
            &cache.keys,
            &cache.values,
            d,
            n - 1,
            scale,
            o,
            AttentionStats {
                colsum: None,
                probs: Some(&mut p),
            },
        );
        p
    } else {
        let mut w = vec![0f64; n];
        let z = cpu::attend_biased(q, &cache.keys, &cache.values, &cache.bias, scale, &mut w, o);
        w.iter().map(|x| (x / z) as f32).collect()
    }
}

impl From<KernelError> for ValidateError {
    fn from(e: KernelError) -> Self {
        ValidateError::Kernel(e)
    }
}

impl From<ReplayError> for ValidateError {
    fn from(e: ReplayError) -> Self {
        ValidateError::Replay(e)
    }
}
