//! Random eviction: B prompt positions drawn uniformly without replacement.

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, SplitMix64};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "random",
    summary: "keep B prompt positions drawn uniformly at random per KV head (seeded)",
    paper: "baseline (kvpress RandomPress)",
    params: &[ParamInfo {
        name: "seed",
        default: "0",
        kind: Kind::Int,
        help: "generator seed; (seed, layer, head) fixes each draw",
    }],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(Random {
            seed: p.int("seed")? as u64,
        }))
    },
};

pub struct Random {
    pub seed: u64,
}

impl Policy for Random {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        if p <= b {
            return Ok((ctx.full_caches(), Box::new(AppendOnly)));
        }
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                // Partial Fisher-Yates: the first b of a random permutation.
                let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), g);
                let mut idx: Vec<usize> = (0..p).collect();
                for i in 0..b {
                    let j = i + rng.below(p - i);
                    idx.swap(i, j);
                }
                let mut keep = idx[..b].to_vec();
                keep.sort_unstable();
                ctx.exact_cache(g, &keep)
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
