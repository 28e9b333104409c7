//! ChunkPress: the prompt cut into chunks, each compressed on its own to the
//! same ratio by any scorer (docs/methods/chunk.md; kvpress `ChunkPress`,
//! after FINCH, TACL 2024).
//!
//! Rule (kvpress 0.5.4 `ChunkPress.compress`): chunks j = [jL, (j+1)L) of
//! the prompt (the last one shorter); the scorer scores chunk j seeing only
//! that chunk (its layer restricted to the chunk's positions,
//! [`PrefillCtx::restricted`]: attention causal inside the chunk, column sums
//! of the chunk's own attention, no memo or RoPE parameters), and each cache
//! keeps the top n_j = max(1, ⌊|j|·(1 − ratio)⌋) of the chunk, where
//! ratio = 1 − B/P (n_j = ⌊|j|·B/P⌋ in exact arithmetic): "the same ratio" is B/P of
//! every chunk, so the layer keeps about B entries per cache. The scorer
//! runs at the chunk's own budget n_j, and its protected positions inside
//! the chunk (its window: the chunk's last w positions) score above
//! everything, as kvpress's scorers pad their window with the maximum score.
//! Prefill only, per cache.
//!
//! Our choice: kvpress's `max(1, ·)` can push the total past B when there
//! are more chunks than B; a chunk gets its one entry only while the total
//! stays within B (in chunk order).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::block::with_protected;
use crate::policies::chunkkv::kvpress_kept;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::scorer::{units_to_compress, Scorer};
use crate::select::top_k;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "chunk",
    summary: "cuts the prompt into chunks and lets a scorer compress each chunk on its own to the ratio B/P (default: SnapKV); prefill only",
    paper: "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models (Corallo & Papotti, TACL 2024); kvpress ChunkPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer run on each chunk alone (its parameters are accepted too)" },
        ParamInfo { name: "chunk_length", default: "1024", kind: Kind::Int, help: "positions per chunk (kvpress chunk_length)" },
    ],
    caps: Caps {
        family: Family::Eviction,
        phase: Phase::Prefill,
        approximation: Some("the scorer sees each chunk as a layer of its own (attention causal inside the chunk, keys at their original rotation); kvpress recomputes its scorers' window queries from the chunk's hidden states with the whole prompt's last rotary embeddings, which a trace cannot redo"),
        ..Caps::EVICT_PREFILL
    },
    test: "chunk_compresses_each_chunk_alone_to_the_same_ratio",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| {
            let chunk = p.int_positive("chunk_length", "a chunk holds at least one position")?;
            Ok(Arc::new(Chunk { scorer, chunk }))
        },
    },
};

pub struct Chunk {
    pub scorer: Arc<dyn Scorer>,
    pub chunk: usize,
}

impl Chunk {
    /// n_j per chunk of a `p`-position prompt at budget `b`.
    pub fn counts(&self, p: usize, b: usize) -> Vec<usize> {
        let mut total = 0;
        (0..p.div_ceil(self.chunk))
            .map(|j| {
                let len = ((j + 1) * self.chunk).min(p) - j * self.chunk;
                let mut n = kvpress_kept(len, b, p);
                if n == 0 && total < b {
                    n = 1;
                }
                n = n.min(b - total);
                total += n;
                n
            })
            .collect()
    }
}

impl Policy for Chunk {
    /// The scorer's caches share a KV head's budget as the scorer says.
    fn budget_share(&self, group: usize) -> usize {
        self.scorer.budget_share(group)
    }
    fn name(&self) -> String {
        "chunk".into()
    }
    /// Each chunk's scorer reads its own last rows: any prompt row.
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        if self.scorer.prompt_queries(p, b) == 0 {
            0
        } else {
            p
        }
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
        let mut keep: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
        for (j, n) in self.counts(p, b).into_iter().enumerate() {
            if n == 0 {
                continue;
            }
            let start = j * self.chunk;
            let positions: Vec<usize> = (start..(start + self.chunk).min(p)).collect();
            let len = positions.len();
            let sub = ctx.restricted(&positions);
            let sctx = PrefillCtx::of_restricted(&sub, n);
            let prot = s.protect(n)?;
            for (u, unit) in units.iter().enumerate() {
                let sc = with_protected(s.score(&sctx, unit), len, prot);
                keep[u].extend(
                    top_k(&sc, 0..len, n, |i| i, s.tie())
                        .into_iter()
                        .map(|i| start + i),
                );
            }
        }
        let caches = units
            .iter()
            .zip(&keep)
            .map(|(u, k)| ctx.exact_cache(u.kv_head, k))
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
