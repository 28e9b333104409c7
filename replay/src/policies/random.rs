//! Random eviction: B prompt positions drawn uniformly without replacement
//! (docs/methods/random.md). A scorer: each position's score is minus its
//! rank in a seeded Fisher-Yates permutation, so the kept set is the first B
//! of the permutation.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{PrefillCtx, SplitMix64};
use crate::scorer::{Scorer, Unit};

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
    caps: Caps::EVICT_PREFILL,
    test: "random_keeps_the_first_b_of_a_seeded_permutation",
    build: Build::Scorer(|p| {
        Ok(Arc::new(Random {
            seed: p.int("seed")? as u64,
        }))
    }),
};

pub struct Random {
    pub seed: u64,
}

impl Scorer for Random {
    /// Reads nothing of the layer.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let p = ctx.prompt_len();
        let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), u.kv_head);
        let mut idx: Vec<usize> = (0..p).collect();
        for i in 0..p {
            let j = i + rng.below(p - i);
            idx.swap(i, j);
        }
        let mut s = vec![0f32; p];
        for (rank, &i) in idx.iter().enumerate() {
            s[i] = -(rank as f32);
        }
        s
    }
}
