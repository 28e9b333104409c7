//! KeyDiff (docs/methods/keydiff.md): s_i = −cos(k_i, ā) per KV head, where
//! the anchor ā is the mean of the unit-normalised keys; the keys least like
//! the average key are kept. No attention, window or sinks. Default (the
//! paper's block-wise prompt processing, as kvpress `BlockPress(KeyDiffPress)`):
//! the cache starts with the first B positions, then each block of `block`
//! prompt positions is appended and the cache is cut back to the B best by the
//! scores of what it holds (its own anchor). `preset=kvpress` scores the whole
//! prompt at once (kvpress `KeyDiffPress`). Prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{cosine, l2_norm, PrefillCtx};
use crate::scorer::{Scorer, Unit};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "keydiff",
    summary: "keeps the keys least similar (cosine) to the mean key direction of their head; block-wise over the prompt; prefill only",
    paper: "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments (Park et al., arXiv 2504.15364); kvpress KeyDiffPress and BlockPress (NVIDIA/kvpress 0.5)",
    params: &[
        ParamInfo { name: "block", default: "128", kind: Kind::Int, help: "prompt positions appended per step before the cache is cut back to B (kvpress BlockPress block_size)" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Choice(&["paper", "kvpress"]), help: "paper = block-wise; kvpress = KeyDiffPress alone, the whole prompt scored at once" },
    ],
    caps: Caps { approximation: Some("the default block-wise form is returned as eviction ranks: exact at the policy's own budget; inside adakv/pyramidkv the ranks come from the nominal B (use preset=kvpress there)"), ..Caps::EVICT_PREFILL },
    test: "keydiff_keeps_the_keys_least_like_the_anchor_block_by_block",
    build: Build::Scorer(|p| {
        let block = p.int_positive("block", "a block holds at least one position")?;
        let block = match p.word("preset") {
            "kvpress" => None,
            _ => Some(block),
        };
        Ok(Arc::new(KeyDiff { block }))
    }),
};

pub struct KeyDiff {
    /// None: the whole prompt at once (kvpress `KeyDiffPress`).
    pub block: Option<usize>,
}

/// −cos(k_i, ā) for each position of `set`, ā the mean of the set's
/// unit-normalised keys (kvpress: `F.normalize` then mean).
pub fn keydiff_scores(ctx: &PrefillCtx, g: usize, set: &[usize]) -> Vec<f64> {
    let d = ctx.head_dim();
    let mut anchor = vec![0f64; d];
    for &i in set {
        let k = ctx.key(g, i);
        let n = l2_norm(k).max(1e-12);
        anchor
            .iter_mut()
            .zip(k)
            .for_each(|(a, x)| *a += *x as f64 / n);
    }
    let anchor: Vec<f32> = anchor
        .iter()
        .map(|a| (a / set.len() as f64) as f32)
        .collect();
    set.iter()
        .map(|&i| -cosine(ctx.key(g, i), &anchor))
        .collect()
}

impl Scorer for KeyDiff {
    /// Keys only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    /// One-shot: the scores. Block-wise: the rank of each position in the
    /// order the block process evicts them (first evicted lowest, survivors
    /// highest, by their last scores), so the top B is the block process's
    /// cache at the nominal budget B.
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let p = ctx.prompt_len();
        let g = u.kv_head;
        let (block, b) = match self.block {
            Some(block) if ctx.budget > 0 && ctx.budget < p => (block, ctx.budget),
            _ => {
                let all: Vec<usize> = (0..p).collect();
                return keydiff_scores(ctx, g, &all)
                    .iter()
                    .map(|&s| s as f32)
                    .collect();
            }
        };
        // the shared block process (kvpress BlockPress), scored by the
        // anchor of what the cache holds
        crate::policies::block::block_order(p, b, block, crate::select::Tie::KeepLater, |set| {
            keydiff_scores(ctx, g, set)
        })
    }
}
