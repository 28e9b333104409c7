//! ChunkKV: whole chunks of positions kept by their summed score, around any
//! scorer (docs/methods/chunkkv.md; kvpress `ChunkKVPress`, arXiv 2502.00299).
//!
//! Rule (kvpress 0.5.4 `ChunkKVPress.compress`): the prompt is cut into
//! chunks of `chunk_length` positions (the last one shorter when L does not
//! divide P). A chunk's score is the mean over its positions of the scores
//! summed over the layer's caches (one score per chunk for the whole layer):
//! c_j = (1/|j|) Σ_{i in j} Σ_u s_u(i). The layer keeps
//! k = max(1, ⌊n_chunks·(1 − ratio)⌋) chunks, ratio = 1 − B/P (so
//! k = max(1, ⌊n_chunks·B/P⌋), in exact arithmetic), the k best by chunk score, the same positions in
//! every cache. Prefill only.
//!
//! A prompt shorter than one chunk is left to the scorer's own selection
//! (kvpress delegates to the scorer press when there is no complete chunk).
//!
//! Our choices where kvreplay's budget is stricter than kvpress's rounding
//! (⌊n_chunks·B/P⌋ whole chunks can hold more than B positions): the
//! scorer's protected positions (its window) are kept inside B as every
//! kvreplay scorer keeps them, scoring as the layer's highest score in the
//! chunk means (kvpress pads the window with the maximum score); chunks are
//! then taken best first while their unprotected positions fit in what is
//! left of B, a chunk that does not fit being skipped, until k are taken.
//! Ties between chunk scores follow the scorer's tie rule (the later chunk
//! by default). kvpress does not reuse indices across layers (the paper's
//! layer-wise index reuse), and neither does this.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::scorer::{units_to_compress, Scorer};
use crate::select::ranked;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "chunkkv",
    summary: "keeps whole chunks of positions (the same in every head) by the mean of a scorer's scores summed over heads (default: SnapKV); prefill only",
    paper: "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference (Liu et al., arXiv 2502.00299); kvpress ChunkKVPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer whose scores are summed per chunk (its parameters are accepted too)" },
        ParamInfo { name: "chunk_length", default: "20", kind: Kind::Int, help: "positions per chunk (kvpress chunk_length)" },
    ],
    caps: Caps {
        family: Family::Eviction,
        phase: Phase::Prefill,
        approximation: Some("kvpress's chunk count ⌊n_chunks·(1 − ratio)⌋ can exceed B positions: chunks that no longer fit in B are skipped, and the scorer's window is kept inside B (kvpress only pads it with the maximum score)"),
        ..Caps::EVICT_PREFILL
    },
    test: "chunkkv_keeps_whole_chunks_by_their_mean_summed_score",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| {
            let chunk = p.int_positive("chunk_length", "a chunk holds at least one position")?;
            Ok(Arc::new(ChunkKv { scorer, chunk }))
        },
    },
};

pub struct ChunkKv {
    pub scorer: Arc<dyn Scorer>,
    pub chunk: usize,
}

/// kvpress's kept count `int(n·(1 − ratio))` of `n` items at budget `b` of a
/// `p`-position prompt, ratio = 1 − b/p, in exact arithmetic: ⌊n·b/p⌋ (the
/// float product can land just below an integer and lose one).
pub fn kvpress_kept(n: usize, b: usize, p: usize) -> usize {
    n * b / p
}

impl Policy for ChunkKv {
    /// The scorer's caches share a KV head's budget as the scorer says.
    fn budget_share(&self, group: usize) -> usize {
        self.scorer.budget_share(group)
    }
    fn name(&self) -> String {
        "chunkkv".into()
    }
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.scorer.prompt_queries(p, b)
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let s = &*self.scorer;
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let units = match units_to_compress(ctx, s) {
            Ok(units) => units,
            Err(whole) => return Ok(whole),
        };
        let prot = s.protect(b)?;
        if p < self.chunk {
            // no complete chunk: kvpress delegates to the scorer's own selection
            // (its prefill selection: chunkkv is prefill-only)
            let (caches, _) =
                crate::scorer::TopK::new("chunkkv", self.scorer.clone()).prefill(ctx)?;
            return Ok((caches, Box::new(AppendOnly)));
        }
        let (sinks, recent) = (prot.sinks, prot.recent);
        let protected = |i: usize| i < sinks || i >= p - recent;
        // (units, P): scores summed over the caches; protected positions
        // (and any the scorer does not score) take the layer's maximum
        let scores: Vec<Vec<f32>> = units.iter().map(|u| s.score(ctx, u)).collect();
        let max = scores
            .iter()
            .flat_map(|v| v.iter().enumerate().filter(|(i, _)| !protected(*i)))
            .map(|(_, x)| *x)
            .fold(f32::NEG_INFINITY, f32::max);
        let summed: Vec<f64> = (0..p)
            .map(|i| {
                scores
                    .iter()
                    .map(|v| match v.get(i) {
                        Some(x) if !protected(i) => *x as f64,
                        _ => max as f64,
                    })
                    .sum()
            })
            .collect();
        let n_chunks = p.div_ceil(self.chunk);
        // c_j: mean over the chunk's positions (a shorter last chunk too)
        let chunk_scores: Vec<f64> = (0..n_chunks)
            .map(|j| {
                let r = j * self.chunk..((j + 1) * self.chunk).min(p);
                let n = r.len() as f64;
                summed[r].iter().sum::<f64>() / n
            })
            .collect();
        let k = kvpress_kept(n_chunks, b, p).max(1);
        let mut keep = vec![false; p];
        (0..p)
            .filter(|&i| protected(i))
            .for_each(|i| keep[i] = true);
        let mut room = b - prot.total();
        let mut taken = 0;
        for j in ranked(&chunk_scores, 0..n_chunks, |j| j, s.tie()) {
            if taken == k {
                break;
            }
            let r = j * self.chunk..((j + 1) * self.chunk).min(p);
            let new = r.clone().filter(|&i| !keep[i]).count();
            if new <= room {
                r.for_each(|i| keep[i] = true);
                room -= new;
                taken += 1;
            }
        }
        let keep: Vec<usize> = (0..p).filter(|&i| keep[i]).collect();
        let caches = units
            .iter()
            .map(|u| ctx.exact_cache(u.kv_head, &keep))
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
