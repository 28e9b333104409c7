//! TriForce's retrieval cache: the draft of its hierarchical speculative
//! decoding attends to prompt chunks retrieved by the latest query
//! (docs/methods/triforce.md). kvreplay measures that draft's attention
//! against full attention; the speculation and verification are not replayed.
//!
//! Rule (Infini-AI-Lab/TriForce `RetrievalCache`): the prompt is split into
//! chunks of c positions (the last may be shorter), each represented by its
//! mean key m_k (post-RoPE, as cached). A query q scores chunk k by q·m_k
//! (per KV head: the sum over the query heads that read it); chunk 0 is
//! always retrieved, then the others by descending score. The retrieval
//! cache holds B entries: the decode entries so far (newest B if more) and
//! the first B − n_dec prompt positions of that ranked chunk list (decode
//! tokens take the lowest-ranked chunks' slots, as TriForce writes them over
//! the end of its budget). The query at step t sees that cache plus its own
//! entry; the cache is rebuilt from the query of step t − 1 (at prefill:
//! the last prompt query), every `refresh` steps (TriForce: once per
//! verification round of γ drafted tokens).
//!
//! Shapes: chunk means (n_chunks, d) f64 per KV head; full prompt entries per cache.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx};
use crate::select::{ranked, Tie};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "triforce",
    summary: "TriForce's retrieval draft: prompt chunks ranked by the latest query against their mean keys (chunk 0 always), re-retrieved as decoding goes",
    paper: "TriForce: Lossless Acceleration of Long Sequence Generation with Hierarchical Speculative Decoding (Sun et al., COLM 2024, arXiv 2404.11912); Infini-AI-Lab/TriForce",
    params: &[
        ParamInfo { name: "chunk", default: "8", kind: Kind::Int, help: "chunk size c in positions (TriForce: 8)" },
        ParamInfo { name: "refresh", default: "1", kind: Kind::Int, help: "re-retrieve every this many decode steps (TriForce: once per verification round of gamma drafted tokens)" },
        ParamInfo { name: "per_query_head", default: "false", kind: Kind::Bool, help: "one retrieval cache per query head (TriForce's MHA form) instead of one per KV head scored by the group's summed logits" },
        crate::policy::BUDGET_PER,
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "re-retrieve during decode holding B entries (false: retrieve once at prefill and append the decode entries)" },
    ],
    caps: Caps {
        per_query_head: false,
        approximation: Some("only the retrieval draft's attention is measured (no speculation or verification); the retrieval uses the previous step's query, and the last prompt query before the first step"),
        ..Caps::EVICT_DECODE
    },
    test: "triforce_retrieves_chunks_by_the_previous_query",
    build: Build::Policy(|p| {
        let chunk = p.int_positive("chunk", "must be at least 1")?;
        let refresh = p.int_positive("refresh", "must be at least 1")?;
        Ok(Arc::new(TriForce {
            chunk,
            refresh,
            per_query_head: p.bool("per_query_head")?,
            budget_per_cache: p.word("budget_per") == "query_head",
            decode_evict: p.bool("decode_evict")?,
        }))
    }),
};

#[derive(Clone, Copy, Debug)]
pub struct TriForce {
    pub chunk: usize,
    pub refresh: usize,
    pub per_query_head: bool,
    /// `budget_per=query_head`: B entries per query-head cache (G× the memory).
    pub budget_per_cache: bool,
    pub decode_evict: bool,
}

/// One cache's retrieval source: every prompt entry and the chunk means.
struct Source {
    full: HeadCache,
    /// (n_chunks, d)
    means: Vec<Vec<f64>>,
    heads: std::ops::Range<usize>,
}

impl Source {
    fn new(ctx: &PrefillCtx, kv_head: usize, heads: std::ops::Range<usize>, c: usize) -> Source {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let means = (0..p.div_ceil(c))
            .map(|k| {
                let members = k * c..((k + 1) * c).min(p);
                let n = members.len() as f64;
                let mut m = vec![0f64; d];
                for i in members {
                    m.iter_mut()
                        .zip(ctx.key(kv_head, i))
                        .for_each(|(a, x)| *a += *x as f64);
                }
                m.iter_mut().for_each(|a| *a /= n);
                m
            })
            .collect();
        Source {
            full: ctx.full_cache(kv_head),
            means,
            heads,
        }
    }

    /// Every prompt position in retrieval order for `queries` (one per head
    /// of the cache): chunk 0, then the other chunks by descending score
    /// (the later chunk first on equal scores), each chunk's positions in order.
    fn ranking(&self, queries: &[&[f32]], c: usize) -> Vec<usize> {
        let p = self.full.len();
        let scores: Vec<f64> = self
            .means
            .iter()
            .map(|m| {
                queries
                    .iter()
                    .map(|q| q.iter().zip(m).map(|(a, b)| *a as f64 * b).sum::<f64>())
                    .sum()
            })
            .collect();
        let mut order = vec![0];
        order.extend(ranked(&scores, 1..self.means.len(), |k| k, Tie::KeepLater));
        order
            .iter()
            .flat_map(|&k| k * c..((k + 1) * c).min(p))
            .collect()
    }
}

/// The first `slots` positions of a ranking, ascending.
fn take(ranking: &[usize], slots: usize) -> Vec<usize> {
    let mut keep: Vec<usize> = ranking.iter().copied().take(slots).collect();
    keep.sort_unstable();
    keep
}

impl Policy for TriForce {
    fn budget_share(&self, group: usize) -> usize {
        crate::policy::share_of(self.per_query_head, self.budget_per_cache, group)
    }
    fn name(&self) -> String {
        "triforce".into()
    }
    /// The last prompt query retrieves the first cache.
    fn prompt_queries(&self, prompt_len: usize, _: usize) -> usize {
        1.min(prompt_len)
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let sources: Vec<Source> = ctx
            .cache_units(self.per_query_head)
            .into_iter()
            .map(|(g, heads)| Source::new(ctx, g, heads, self.chunk))
            .collect();
        let rankings: Vec<Vec<usize>> = sources
            .iter()
            .map(|s| {
                let q: Vec<&[f32]> = s.heads.clone().map(|h| ctx.query(h, p - 1)).collect();
                s.ranking(&q, self.chunk)
            })
            .collect();
        let caches = sources
            .iter()
            .zip(&rankings)
            .map(|(s, r)| {
                let mut c = HeadCache::new(ctx.head_dim());
                for i in take(r, b) {
                    c.push_exact(i, s.full.key(i), s.full.value(i));
                }
                c
            })
            .collect();
        let state: Box<dyn DecodeState> = if self.decode_evict {
            Box::new(Retrieval {
                sources,
                rankings,
                cfg: *self,
                prompt_len: p,
                steps: 0,
            })
        } else {
            Box::new(AppendOnly)
        };
        Ok((caches, state))
    }
}

/// Decode-time re-retrieval.
struct Retrieval {
    sources: Vec<Source>,
    /// Per cache, the latest retrieval order of the prompt positions.
    rankings: Vec<Vec<usize>>,
    cfg: TriForce,
    prompt_len: usize,
    steps: usize,
}

impl DecodeState for Retrieval {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        self.steps += 1;
        let b = ctx.budget;
        let refresh = self.steps.is_multiple_of(self.cfg.refresh);
        for ((s, ranking), cache) in self
            .sources
            .iter()
            .zip(&mut self.rankings)
            .zip(caches.iter_mut())
        {
            let p = self.prompt_len;
            // the decode entries, oldest first; the newest B when more
            let decode: Vec<usize> = (0..cache.len())
                .filter(|&e| cache.members[e][0] as usize >= p)
                .collect();
            let n_dec = decode.len().min(b);
            let decode = &decode[decode.len() - n_dec..];
            if refresh {
                let q: Vec<&[f32]> = s.heads.clone().map(|h| ctx.queries[h]).collect();
                *ranking = s.ranking(&q, self.cfg.chunk);
            }
            // decode entries take the slots of the lowest-ranked positions
            let prompt = take(ranking, b - n_dec);
            let mut next = HeadCache::new(cache.d);
            for &i in &prompt {
                next.push_exact(i, s.full.key(i), s.full.value(i));
            }
            for &e in decode {
                let pos = cache.members[e][0] as usize;
                next.push_exact(pos, cache.key(e), cache.value(e));
            }
            *cache = next;
        }
    }
}
