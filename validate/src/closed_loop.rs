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
use kvreplay_replay::engine::{group_policy, replay_groups};
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
            tokens: None,
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
    /// What the closed loop measured inside the forward pass (empty for
    /// [`decode_full`]).
    pub in_loop: InLoop,
}

/// Statistics of a closed-loop decode taken inside the forward pass, with
/// the queries the compressed model really computed (not the trace's).
#[derive(Clone, Debug, Default)]
pub struct InLoop {
    /// Per (layer, query head): Σ over steps of ‖o − o_full‖ / ‖o_full‖,
    /// o_full the attention of the same query over the uncompressed cache
    /// (the compressed model's own keys and values): replay's rel_l2
    /// without teacher forcing. Measured with a reference only (empty
    /// otherwise: it attends over a second, uncompressed cache).
    pub rel_l2: Vec<Vec<f64>>,
    /// Per (layer, query head): Σ over steps of ‖q − q_ref‖ / ‖q_ref‖
    /// against the reference run's queries (query drift), with a reference
    /// only.
    pub drift: Vec<Vec<f64>>,
    /// Per step, per layer: the queries (n_heads · head_dim).
    pub queries: Vec<Vec<Vec<f32>>>,
    pub steps: usize,
}

impl InLoop {
    /// Mean over layers, heads and steps of one of the sums.
    pub fn mean(sums: &[Vec<f64>], steps: usize) -> f64 {
        let n: usize = sums.iter().map(|l| l.len()).sum();
        sums.iter().flatten().sum::<f64>() / (n * steps).max(1) as f64
    }
    /// Per layer, the mean over heads of the squared per-head mean (over
    /// steps) of `sums`: the input of `Sensitivity::predict`.
    pub fn layer_sq(sums: &[Vec<f64>], steps: usize) -> Vec<f64> {
        sums.iter()
            .map(|l| {
                l.iter()
                    .map(|x| (x / steps.max(1) as f64).powi(2))
                    .sum::<f64>()
                    / l.len().max(1) as f64
            })
            .collect()
    }
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
        in_loop: InLoop::default(),
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
/// the caches and lets the policy act on that step's attention. Layers are
/// grouped as the policy groups them and each group gets the policy replay
/// would give it ([`group_policy`]: sliding-window layers keep their window
/// unless the policy is composed with `+sliding`).
pub fn decode_compressed(
    model: &Model,
    pre: &Prefilled,
    policy: &dyn Policy,
    b: usize,
    cont: &[u32],
    n: usize,
    feed: Feed,
) -> Result<Decoded, ValidateError> {
    decode_with(model, pre, policy, b, cont, n, feed, None, None)
}

/// A perturbation of one layer's attention outputs at every decode step:
/// each head's output o gets ε·‖o‖·u added, u a unit vector drawn per
/// (step, head) from `seed` (Gaussian components, normalised).
#[derive(Clone, Copy, Debug)]
pub struct Perturb {
    pub layer: usize,
    /// One query head of the layer only (None: every head).
    pub head: Option<usize>,
    pub eps: f64,
    pub seed: u64,
}

impl Perturb {
    /// Add the perturbation of decode step `step`, head `h` to `o` (d,).
    fn apply(&self, step: usize, h: usize, o: &mut [f32]) {
        let mut x = self
            .seed
            .wrapping_add(((self.layer as u64) << 40) ^ ((step as u64) << 20) ^ h as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            | 1;
        let mut uniform = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        // Box-Muller: Gaussian components, so u is uniform on the sphere
        let u: Vec<f64> = (0..o.len())
            .map(|_| {
                let (a, b) = (uniform(), uniform());
                (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
            })
            .collect();
        let un = u.iter().map(|v| v * v).sum::<f64>().sqrt();
        let on = o.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        for (v, g) in o.iter_mut().zip(&u) {
            *v += (self.eps * on * g / un) as f32;
        }
    }
}

/// [`decode_compressed`], with one layer's attention outputs perturbed
/// (`perturb`) after the policy's cache has produced them; with a
/// `reference` (per step, per layer, the queries of the uncompressed run:
/// its `in_loop.queries`), the in-loop error and the query drift are
/// measured too ([`InLoop`]).
#[allow(clippy::too_many_arguments)]
pub fn decode_with(
    model: &Model,
    pre: &Prefilled,
    policy: &dyn Policy,
    b: usize,
    cont: &[u32],
    n: usize,
    feed: Feed,
    perturb: Option<Perturb>,
    reference: Option<&[Vec<Vec<f32>>]>,
) -> Result<Decoded, ValidateError> {
    let cfg = &model.llama.cfg;
    let (nl, nh, d) = (cfg.n_layers, cfg.n_heads, cfg.head_dim);
    // The replay loop, over every layer of the live model: one session per
    // layer group; `at[l]` = (session, layer index within it).
    let mut sessions = Vec::new();
    let mut at = vec![(0, 0); nl];
    let sliding: Vec<bool> = pre.layers.iter().map(|l| l.window.is_some()).collect();
    // entries per cache, as replay counts them (⌊B/G⌋ for query-head caches)
    let b = kvreplay_replay::policy::cache_budget(policy, b, nh / cfg.n_kv_heads);
    for g in replay_groups(policy, &sliding, b, pre.prompt_len) {
        let layers: Vec<&LayerData> = g.iter().map(|&l| &pre.layers[l]).collect();
        let session = Session::prefill_group(group_policy(policy, &layers)?, &layers, b)?;
        for (i, &l) in g.iter().enumerate() {
            at[l] = (sessions.len(), i);
        }
        sessions.push((g, session));
    }
    // with a reference, every layer also uncompressed, for the in-loop
    // error of the same query
    static FULL: kvreplay_replay::policies::full::Full = kvreplay_replay::policies::full::Full;
    let mut full: Vec<Session> = match reference {
        Some(_) => (0..nl)
            .map(|l| Session::prefill_group(&FULL, &[&pre.layers[l]], b))
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let sums = vec![vec![0.0; nh]; if reference.is_some() { nl } else { 0 }];
    let mut in_loop = InLoop {
        rel_l2: sums.clone(),
        drift: sums,
        queries: Vec::new(),
        steps: n,
    };
    let mut kv = pre.cache.clone();
    let mut out = Decoded {
        logits: Vec::new(),
        tokens: Vec::new(),
        in_loop: InLoop::default(),
    };
    let mut last = pre.logits.clone();
    for i in 0..n {
        let pos = pre.prompt_len + i;
        let tok = next_token(feed, cont, i, &last);
        let mut probs: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); nh]; nl];
        let mut queries: Vec<Vec<f32>> = vec![Vec::new(); nl];
        {
            let sessions = &mut sessions;
            let (probs, queries, at) = (&mut probs, &mut queries, &at);
            let (full, il) = (&mut full, &mut in_loop);
            let mut o_full = vec![0f32; d];
            let mut attend = |l: usize,
                              q: &[f32],
                              k: &[f32],
                              v: &[f32],
                              o: &mut [f32]|
             -> Result<(), KernelError> {
                let (s, li) = at[l];
                let session = &mut sessions[s].1;
                session.append(li, pos, |g| {
                    (&k[g * d..(g + 1) * d], &v[g * d..(g + 1) * d])
                });
                let window = pre.layers[l].window;
                if let Some(f) = full.get_mut(l) {
                    f.append(0, pos, |g| (&k[g * d..(g + 1) * d], &v[g * d..(g + 1) * d]));
                }
                for h in 0..nh {
                    let cache = &session.caches(li)[session.cache_of(li, h)];
                    let qh = &q[h * d..(h + 1) * d];
                    probs[l][h] = attend_head(
                        &q[h * d..(h + 1) * d],
                        cache,
                        cfg.attn_scale,
                        (pos, window),
                        &mut o[h * d..(h + 1) * d],
                    );
                    if let Some(pt) =
                        perturb.filter(|pt| pt.layer == l && pt.head.is_none_or(|x| x == h))
                    {
                        pt.apply(i, h, &mut o[h * d..(h + 1) * d]);
                    }
                    if let (Some(r), Some(f)) = (reference, full.get(l)) {
                        let fc = &f.caches(0)[f.cache_of(0, h)];
                        attend_head(qh, fc, cfg.attn_scale, (pos, window), &mut o_full);
                        il.rel_l2[l][h] += rel_diff(&o[h * d..(h + 1) * d], &o_full);
                        il.drift[l][h] += rel_diff(qh, &r[i][l][h * d..(h + 1) * d]);
                    }
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
        for (g, session) in &mut sessions {
            let p: Vec<Vec<Vec<f32>>> = g.iter().map(|&l| std::mem::take(&mut probs[l])).collect();
            let qs: Vec<Vec<&[f32]>> = g
                .iter()
                .map(|&l| (0..nh).map(|h| &queries[l][h * d..(h + 1) * d]).collect())
                .collect();
            session.step(pos, &p, &qs);
        }
        in_loop.queries.push(queries);
        out.tokens.push(tok);
        out.logits.push(last.clone());
    }
    out.in_loop = in_loop;
    Ok(out)
}

/// ‖a − b‖ / ‖b‖ in f64 (0 when both are zero).
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    if num == 0.0 {
        0.0
    } else {
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    }
}

/// Attention of one query at position `pos` over a cache into `o`; returns
/// the probabilities over its entries (0 for entries a sliding `window`
/// hides). A cache without logit bias whose visible entries are its last
/// ones goes through the model's own attention kernel (so a cache holding
/// every position reproduces the uncompressed forward pass bit for bit,
/// window included); otherwise through the replay kernel, with hidden
/// entries masked.
fn attend_head(
    q: &[f32],
    cache: &HeadCache,
    scale: f32,
    (pos, window): (usize, Option<usize>),
    o: &mut [f32],
) -> Vec<f32> {
    let n = cache.len();
    let d = q.len();
    let visible: Vec<bool> = (0..n).map(|e| cache.in_window(e, pos, window)).collect();
    let shown = visible.iter().filter(|v| **v).count();
    let suffix = visible[n - shown..].iter().all(|v| *v);
    if suffix && cache.bias.iter().all(|b| *b == 0.0) {
        let mut p = vec![0f32; n];
        cpu::windowed_attention_head(
            q,
            &cache.keys,
            &cache.values,
            d,
            n - 1,
            (shown < n).then_some(shown),
            scale,
            o,
            AttentionStats {
                colsum: None,
                probs: Some(&mut p),
            },
        );
        p
    } else {
        let bias: Vec<f32> = (0..n)
            .map(|e| {
                if visible[e] {
                    cache.bias[e]
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mut w = vec![0f64; n];
        let z = cpu::attend_biased(q, &cache.keys, &cache.values, &bias, scale, &mut w, o);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// d = 1, scale 1, q = [1]: entry logits are the keys plus the bias.
    /// Entries (members): [0], [1, 6] (a merge of two, bias ln 2), [2], [7].
    /// At position 7 with a window of 3 the visible entries are those whose
    /// newest member is >= 5: [1, 6] and [7]. Not a suffix of the cache, so
    /// the masked replay path: p ∝ (2 e^k1, e^k3) over those two, 0 elsewhere.
    #[test]
    fn a_window_hides_entries_whose_newest_member_left_it() {
        let mut c = HeadCache::new(1);
        for (pos, k, v) in [
            (0, 5.0, 100.0),
            (1, 0.5, 1.0),
            (2, 9.0, 100.0),
            (7, 1.0, 3.0),
        ] {
            c.push_exact(pos, &[k], &[v]);
        }
        c.members[1] = vec![1, 6].into();
        c.bias[1] = 2f32.ln();
        let mut o = [0f32];
        let p = attend_head(&[1.0], &c, 1.0, (7, Some(3)), &mut o);
        let (a, b) = (2.0 * 0.5f64.exp(), 1f64.exp());
        let want = [0.0, a / (a + b), 0.0, b / (a + b)];
        for (g, w) in p.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{p:?} vs {want:?}");
        }
        let o_want = (a * 1.0 + b * 3.0) / (a + b);
        assert!((o[0] as f64 - o_want).abs() < 1e-5, "{} vs {o_want}", o[0]);
        // without the window every entry is visible
        let p = attend_head(&[1.0], &c, 1.0, (7, None), &mut o);
        assert!(p.iter().all(|x| *x > 0.0), "{p:?}");
    }

    /// A suffix of exact entries goes through the model's windowed kernel:
    /// positions 0..=5, window 2 at position 5: only keys 4 and 5 count.
    #[test]
    fn a_suffix_window_uses_the_models_kernel() {
        let mut c = HeadCache::new(1);
        for pos in 0..6 {
            c.push_exact(pos, &[pos as f32], &[10.0 * pos as f32]);
        }
        let mut o = [0f32];
        let p = attend_head(&[1.0], &c, 1.0, (5, Some(2)), &mut o);
        let (a, b) = (4f64.exp(), 5f64.exp());
        assert_eq!(&p[..4], &[0.0; 4]);
        assert!(
            (p[4] as f64 - a / (a + b)).abs() < 1e-6 && (p[5] as f64 - b / (a + b)).abs() < 1e-6,
            "{p:?}"
        );
        assert!(
            (o[0] as f64 - (40.0 * a + 50.0 * b) / (a + b)).abs() < 1e-4,
            "{}",
            o[0]
        );
    }
}
