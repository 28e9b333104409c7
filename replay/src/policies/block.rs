//! BlockPress: block-wise iterative compression of the prompt around any
//! scorer (docs/methods/block.md; kvpress `BlockPress`, the block prompt
//! processing of the KeyDiff paper, arXiv 2504.15364).
//!
//! Rule (kvpress 0.5.4 `BlockPress.compress`): with n = B (kvpress's
//! `int(k_len·(1 − ratio))`), the cache starts with positions 0..B; then for
//! each block of `block` new positions B.., B+block.., … the scorer scores
//! the kept positions plus the block (and sees nothing else: its layer is
//! restricted to those positions, [`PrefillCtx::restricted`]) and the cache
//! is cut back to its B best. The cache after the last block is the result.
//! Prefill only, per cache (each KV head runs its own process).
//!
//! The scorer's protected positions inside each restricted set (its window:
//! the set's last w positions; its sinks: the set's first ones) score above
//! everything, as kvpress's scorers pad the window with the maximum score.
//! Ties follow the scorer's tie rule (the later position kept by default).
//!
//! The process is written once in [`block_order`] and returned to the shared
//! selection as eviction ranks (evicted first lowest, survivors highest):
//! the top B of the ranks is the block process's cache at the budget B.
//! KeyDiff's default block-wise form uses the same function.

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::PrefillCtx;
use crate::scorer::{Scorer, TopK, Unit};
use crate::select::{Protect, Tie};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "block",
    summary: "block-wise prompt compression around any scorer: keep the first B, then score kept + each block of new positions and cut back to B (default scorer: KeyDiff); prefill only",
    paper: "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments (Park et al., arXiv 2504.15364), block prompt processing; kvpress BlockPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "scorer", default: "keydiff", kind: Kind::Scorer, help: "the scorer applied to each kept + block set (its parameters are accepted too)" },
        ParamInfo { name: "block_size", default: "128", kind: Kind::Int, help: "new prompt positions per step (kvpress block_size)" },
    ],
    caps: Caps {
        family: Family::Eviction,
        phase: Phase::Prefill,
        approximation: Some("the scorer sees each kept + block set as a layer of its own (attention causal over the set, column sums of the set's own attention, keys at their original rotation, no RoPE parameters, no memo); kvpress recomputes its scorers' window queries from gathered hidden states with the last positions' rotary embeddings, which a trace cannot redo; inside adakv/pyramidkv the ranks come from the nominal B"),
        ..Caps::EVICT_PREFILL
    },
    test: "block_cuts_back_to_b_after_every_block_and_equals_keydiff",
    build: Build::ScorerWrapper {
        default_scorer: "keydiff",
        scorer_defaults: &[],
        build: |p, scorer| {
            let block = p.int_positive("block_size", "a block holds at least one position")?;
            Ok(Arc::new(TopK::new("block", Arc::new(Block { inner: scorer, block }))))
        },
    },
};

/// The block process of a prompt of `p` positions at budget `b` (0 < b < p):
/// the cache starts with 0..b, then each block of `block` new positions is
/// appended, `score_set(set)` scores the set (ascending positions, one score
/// per position of the set) and the cache keeps its `b` best (score, then
/// `tie`). Returns each position's rank in the eviction order, (p,): the
/// first evicted 0, …, the survivors the top `b` ranks (by their last
/// scores). Scores are compared with `total_cmp`.
pub fn block_order(
    p: usize,
    b: usize,
    block: usize,
    tie: Tie,
    mut score_set: impl FnMut(&[usize]) -> Vec<f64>,
) -> Vec<f32> {
    debug_assert!(b > 0 && b < p && block > 0);
    let mut order: Vec<usize> = Vec::with_capacity(p);
    let mut kept: Vec<usize> = (0..b).collect();
    let mut last: Vec<usize> = kept.clone();
    let mut start = b;
    while start < p {
        let mut cur = kept.clone();
        cur.extend(start..(start + block).min(p));
        let s = score_set(&cur);
        // ascending (score, tie): the last b are the best b
        let mut idx: Vec<usize> = (0..cur.len()).collect();
        idx.sort_by(|&x, &y| {
            s[x].total_cmp(&s[y]).then(match tie {
                Tie::KeepLater => cur[x].cmp(&cur[y]),
                Tie::KeepEarlier => cur[y].cmp(&cur[x]),
            })
        });
        let cut = cur.len() - b;
        order.extend(idx[..cut].iter().map(|&x| cur[x]));
        last = idx[cut..].iter().map(|&x| cur[x]).collect();
        kept = last.clone();
        kept.sort_unstable();
        start += block;
    }
    order.extend(last);
    let mut rank = vec![0f32; p];
    for (r, &i) in order.iter().enumerate() {
        rank[i] = r as f32;
    }
    rank
}

/// The scorer's scores of a restricted set of `n` positions as the block
/// and chunk processes read them: protected positions of the set (its first
/// `sinks`, its last `recent`, and any position past the scores the scorer
/// returned) score +∞.
pub fn with_protected(mut s: Vec<f32>, n: usize, prot: Protect) -> Vec<f32> {
    s.resize(n, f32::INFINITY);
    let (sinks, recent) = (prot.sinks.min(n), prot.recent.min(n));
    s[..sinks].iter_mut().for_each(|x| *x = f32::INFINITY);
    s[n - recent..].iter_mut().for_each(|x| *x = f32::INFINITY);
    s
}

/// A scorer run block-wise: its score is the block process's eviction rank.
pub struct Block {
    pub inner: Arc<dyn Scorer>,
    pub block: usize,
}

impl Scorer for Block {
    /// The scorer reads its own rows of every restricted set: any prompt row.
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        if self.inner.prompt_queries(p, b) == 0 {
            0
        } else {
            p
        }
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        if b == 0 || b >= p {
            return self.inner.score(ctx, u);
        }
        // the shared selection asked `protect(b)` before scoring and
        // stopped on an error, so this is the same Ok value
        let prot = self.inner.protect(b).unwrap_or_default();
        block_order(p, b, self.block, self.inner.tie(), |set| {
            let sub = ctx.restricted(set);
            let sctx = PrefillCtx::of_restricted(&sub, b);
            let s = with_protected(self.inner.score(&sctx, u), set.len(), prot);
            s.into_iter().map(f64::from).collect()
        })
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        self.inner.protect(b)
    }
    fn tie(&self) -> Tie {
        self.inner.tie()
    }
    fn per_query_head(&self) -> bool {
        self.inner.per_query_head()
    }
    fn budget_share(&self, group: usize) -> usize {
        self.inner.budget_share(group)
    }
    fn skip_layer(&self, layer: usize) -> bool {
        self.inner.skip_layer(layer)
    }
}
