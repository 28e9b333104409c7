//! Retrieval heads (docs/methods/retrieval_head.md; Wu et al., arXiv
//! 2404.15574): the per-(layer, query head) retrieval score, and a policy
//! that keeps the full cache of the heads that copy and sinks + a recent
//! window elsewhere.
//!
//! **The score** (the paper's copy-paste criterion, its Eq. 1). The query at
//! position t (t = P − 1 .. T − 2: the last prompt position and every decode
//! position but the last) produces the token ids[t + 1]. At that step the
//! head *copies* when its most-attended position j (argmax over the causal
//! row 0..=t of q_t·k_j, the earliest on ties) is a prompt position inside
//! the span (the `needle` span when the trace names one, else the whole
//! prompt) and holds the generated token: ids[j] = ids[t + 1]. The score is
//! the share of the T − P steps at which the head copies. (The paper divides
//! by the needle length instead of the steps: a constant factor within a
//! trace, so the ranking is the same.) The *echo* score (RazorAttention's
//! echo heads) counts instead the steps whose most-attended prompt position
//! j < t holds the step's own input token ids[t].
//!
//! ORACLE: the scores read the trace's decode queries and continuation
//! ([`PrefillCtx::oracle_tokens`]), i.e. the very steps then replayed; the
//! papers calibrate on a separate needle (or repeated-random-token) probe.
//!
//! **The policy `retrieval_head`** (our construction from the paper's
//! finding; the paper itself evicts nothing): rank every query head of the
//! model (`scope=model`; `scope=layer`: of each layer) by its score, the
//! highest first, ties to the lower (layer, head); the top
//! ⌈frac · heads⌉ with a positive score are retrieval heads. GQA: a KV head
//! keeps its full cache when any query head of its group is a retrieval
//! head (the cache is per KV head). Every other KV head keeps min(n_sink, B)
//! sinks and the B − sinks most recent prompt positions. Prefill only.

use std::ops::Range;
use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Memory, PolicyInfo};
use crate::params::{Kind, ParamInfo, Params};
use crate::policy::{prefill_alone, DecodeState, GroupDecodeState, PerLayer, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "retrieval_head",
    summary: "full cache on the heads that copy from the prompt (retrieval score, probed on the replayed trace itself), sinks + recent window elsewhere; prefill only",
    paper: "Retrieval Head Mechanistically Explains Long-Context Factuality (Wu et al., arXiv 2404.15574); code github.com/nightdessert/Retrieval_Head",
    params: &[
        ParamInfo { name: "frac", default: "0.15", kind: Kind::Float, help: "share of query heads (of the model, or of each layer with scope=layer) kept whole: the top by retrieval score, positive scores only" },
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "first prompt positions kept by the other heads (inside B)" },
        ParamInfo { name: "scope", default: "model", kind: Kind::Choice(&["model", "layer"]), help: "rank heads over the whole model (one layer group) or within each layer" },
        ParamInfo { name: "span", default: "auto", kind: Kind::Choice(&["auto", "prompt"]), help: "where a copy must point: auto = the trace's `needle` span when it has one, else the prompt" },
    ],
    caps: Caps {
        family: Family::Eviction,
        cross_layer: false,
        memory: Memory::Beyond("the retrieval heads keep their whole cache; only the other heads keep B entries"),
        approximation: Some("ORACLE probe: retrieval scores are measured on the replayed trace's own decode steps and continuation (the paper probes a separate needle task); the head-level eviction is our construction from the paper's analysis"),
        ..Caps::EVICT_PREFILL
    },
    test: "retrieval_head_scores_count_copies_and_keep_whole_heads",
    build: Build::Policy(|p| Ok(Arc::new(HeadSplit::from_params(p, false)?))),
};

crate::params::choice_enum! {
    /// Which heads are ranked together.
    pub enum Scope {
        Model = "model",
        Layer = "layer",
    }
}

crate::params::choice_enum! {
    /// Where a copied token must sit.
    pub enum SpanChoice {
        Auto = "auto",
        Prompt = "prompt",
    }
}

/// Per query head of one layer: retrieval (copy) and echo scores, each the
/// share of the T − P steps (0 when the trace has no token ids or no decode).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeadScores {
    pub retrieval: Vec<f64>,
    pub echo: Vec<f64>,
    /// CompressKV's semantic-retrieval score: at each step whose produced
    /// token occurs in the span, the head's attention mass on the span
    /// (softmax over 0..=t), summed and divided by the steps.
    pub srh: Vec<f64>,
}

/// Memo key of [`head_scores`]: the span copies must fall in.
#[derive(Debug, PartialEq)]
struct ScoresKey(Range<usize>);
impl crate::memo::MemoKey for ScoresKey {
    type Value = HeadScores;
}

/// The span a copy must point into: the trace's `needle` span (clipped to
/// the prompt) with `SpanChoice::Auto` when it names one, else the prompt.
pub fn copy_span(ctx: &PrefillCtx, span: SpanChoice) -> Range<usize> {
    let p = ctx.prompt_len();
    let needle = ctx
        .oracle_tokens()
        .and_then(|t| t.spans.iter().find(|(n, _)| n == "needle"))
        .map(|(_, r)| r.start.min(p)..r.end.min(p));
    match (span, needle) {
        (SpanChoice::Auto, Some(r)) => r,
        _ => 0..p,
    }
}

/// Retrieval and echo scores of every query head of `ctx`'s layer (ORACLE:
/// reads the decode queries and the continuation; see the module doc).
/// Memoised per layer and span.
pub fn head_scores(ctx: &PrefillCtx, span: SpanChoice) -> Arc<HeadScores> {
    let r = copy_span(ctx, span);
    ctx.memo(ScoresKey(r.clone()), || compute_scores(ctx, r))
}

fn compute_scores(ctx: &PrefillCtx, span: Range<usize>) -> HeadScores {
    let (nh, p, t_all) = (ctx.n_heads(), ctx.prompt_len(), ctx.total_len());
    let zero = HeadScores {
        retrieval: vec![0.0; nh],
        echo: vec![0.0; nh],
        srh: vec![0.0; nh],
    };
    let ids = match ctx.oracle_tokens() {
        Some(t) if t.ids.len() == t_all && t_all > p && p > 0 => &t.ids,
        _ => return zero,
    };
    let steps = t_all - p;
    let in_span: std::collections::HashSet<u32> = ids[span.clone()].iter().copied().collect();
    let mut out = zero;
    for h in 0..nh {
        let g = h / ctx.group();
        let (mut copies, mut echoes, mut mass) = (0usize, 0usize, 0f64);
        // the query at t produces ids[t + 1]
        for t in p - 1..t_all - 1 {
            let q = ctx.oracle_query(h, t);
            let logits: Vec<f32> = (0..=t)
                .map(|j| crate::policy::dot(q, ctx.oracle_key(g, j)))
                .collect();
            // the first maximum
            let (mut best, mut arg) = (f32::NEG_INFINITY, 0usize);
            for (j, &s) in logits.iter().enumerate() {
                if s > best {
                    best = s;
                    arg = j;
                }
            }
            if arg < p && span.contains(&arg) {
                copies += usize::from(ids[arg] == ids[t + 1]);
                echoes += usize::from(arg < t && ids[arg] == ids[t]);
            }
            if in_span.contains(&ids[t + 1]) {
                let sc = ctx.scale() as f64;
                let e: Vec<f64> = logits
                    .iter()
                    .map(|&s| (sc * (s as f64 - best as f64)).exp())
                    .collect();
                let z: f64 = e.iter().sum();
                mass += e[span.clone()].iter().sum::<f64>() / z;
            }
        }
        out.retrieval[h] = copies as f64 / steps as f64;
        out.echo[h] = echoes as f64 / steps as f64;
        out.srh[h] = mass / steps as f64;
    }
    out
}

/// The top ⌈frac · n⌉ of `scores` (a flat list over the ranked heads) with a
/// positive score, by (score descending, index ascending): a mask.
pub fn top_heads(scores: &[f64], frac: f64) -> Vec<bool> {
    let n = (frac * scores.len() as f64).ceil() as usize;
    let mut order: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] > 0.0).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut mask = vec![false; scores.len()];
    for &i in order.iter().take(n) {
        mask[i] = true;
    }
    mask
}

/// Retrieval heads keep everything; the others keep sinks + a recent window
/// (and, for RazorAttention, one compensation entry for what they drop).
#[derive(Clone, Debug, PartialEq)]
pub struct HeadSplit {
    pub name: &'static str,
    /// Share of query heads selected by retrieval (copy) score.
    pub frac: f64,
    /// Share of query heads selected by echo score (RazorAttention).
    pub echo_frac: f64,
    pub n_sink: usize,
    pub scope: Scope,
    pub span: SpanChoice,
    /// Merge the dropped positions into one entry (RazorAttention Eq. 4-5).
    pub compensate: bool,
}

impl HeadSplit {
    pub fn from_params(p: &Params, razor: bool) -> Result<HeadSplit, ReplayError> {
        Ok(HeadSplit {
            name: p.policy,
            frac: p.float_in("frac", 0.0, 1.0)?,
            echo_frac: if razor {
                p.float_in("echo_frac", 0.0, 1.0)?
            } else {
                0.0
            },
            n_sink: p.int("n_sink")?,
            scope: p.choice("scope")?,
            span: p.choice("span")?,
            compensate: razor && p.bool("compensate")?,
        })
    }

    /// Per layer of the group, per KV head: whether it keeps its full cache.
    pub fn full_kv_heads(&self, ctxs: &[PrefillCtx]) -> Vec<Vec<bool>> {
        let scores: Vec<Arc<HeadScores>> = ctxs.iter().map(|c| head_scores(c, self.span)).collect();
        let flat = |f: fn(&HeadScores) -> &Vec<f64>| -> Vec<f64> {
            scores.iter().flat_map(|s| f(s).iter().copied()).collect()
        };
        let by_copy = top_heads(&flat(|s| &s.retrieval), self.frac);
        let by_echo = top_heads(&flat(|s| &s.echo), self.echo_frac);
        let mut off = 0;
        ctxs.iter()
            .map(|c| {
                let gs = c.group();
                let full = (0..c.n_kv_heads())
                    .map(|g| (g * gs..(g + 1) * gs).any(|h| by_copy[off + h] || by_echo[off + h]))
                    .collect();
                off += c.n_heads();
                full
            })
            .collect()
    }

    /// The cache of a non-retrieval KV head `g` at budget B < P.
    pub fn local_cache(&self, ctx: &PrefillCtx, g: usize) -> HeadCache {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        if !self.compensate {
            let s = self.n_sink.min(b);
            let keep: Vec<usize> = (0..s).chain(p - (b - s)..p).collect();
            return ctx.exact_cache(g, &keep);
        }
        // one entry of B goes to the compensation token
        let s = self.n_sink.min(b - 1);
        let w = b - 1 - s;
        let dropped = s..p - w;
        let d = ctx.head_dim();
        let mut c = ctx.exact_cache(g, &(0..s).collect::<Vec<_>>());
        let mean = |value: bool| -> Vec<f32> {
            let mut acc = vec![0f64; d];
            for i in dropped.clone() {
                let row = if value {
                    ctx.value(g, i)
                } else {
                    ctx.key(g, i)
                };
                acc.iter_mut().zip(row).for_each(|(a, x)| *a += *x as f64);
            }
            acc.iter()
                .map(|a| (a / dropped.len() as f64) as f32)
                .collect()
        };
        c.keys.extend(mean(false));
        c.values.extend(mean(true));
        c.bias.push((dropped.len() as f32).ln());
        c.members.push(dropped.clone().map(|i| i as u32).collect());
        // key and value in f16, and the count behind the bias
        c.bits.push(HeadCache::exact_bits(d) + F16_BITS);
        for i in p - w..p {
            c.push_exact(i, ctx.key(g, i), ctx.value(g, i));
        }
        c
    }
}

impl Policy for HeadSplit {
    fn name(&self) -> String {
        self.name.to_string()
    }

    /// The last prompt query (the first step of the probe).
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        1
    }

    fn layer_groups(&self, n_layers: usize, _: usize, _: usize) -> Vec<Vec<usize>> {
        match self.scope {
            Scope::Model => vec![(0..n_layers).collect()],
            Scope::Layer => (0..n_layers).map(|l| vec![l]).collect(),
        }
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        prefill_alone(self, ctx)
    }

    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let full = self.full_kv_heads(ctxs);
        let caches = ctxs
            .iter()
            .zip(&full)
            .map(|(c, full)| {
                (0..c.n_kv_heads())
                    .map(|g| match full[g] || c.prompt_len() <= c.budget {
                        true => c.full_cache(g),
                        false => self.local_cache(c, g),
                    })
                    .collect()
            })
            .collect();
        Ok((caches, PerLayer::append_only(ctxs.len())))
    }
}
