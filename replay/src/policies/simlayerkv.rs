//! SimLayerKV (docs/methods/simlayerkv.md), kvpress `SimLayerKVPress`
//! (NVIDIA/kvpress 0.5.4, unchanged since): lazy layers keep StreamingLLM's
//! cache, the others keep everything.
//!
//! kvpress's lazy layer keeps the first n_initial positions and the last
//! n_recent − n_last; here that cache is B entries, so
//! n_recent = B − n_initial + n_last. A layer is lazy when the attention of its last n_last prompt
//! queries (softmax over every key each sees, the model's scale), averaged over
//! every query head of the layer and those rows, puts more than
//! `lazy_threshold` of its mass on keys 0..n_initial plus the n_recent keys
//! before the last n_last positions. With P <= n_initial + n_recent + n_last
//! (= B + 2·n_last) the layer is not compressed, as kvpress. Prefill only.
//! Our choice of default threshold: 0.9, kvpress's recommended value for
//! Llama 3 (SmolLM2 is a Llama); kvpress's dataclass default, 1.0, compresses
//! no layer (`lazy_threshold=1` reproduces it).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Memory, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "simlayerkv",
    summary: "lazy layers (the last prompt queries put more than a threshold of their attention on the sinks and recent keys) keep sinks + recent (B entries), other layers keep everything; prefill only",
    paper: "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction (Zhang et al., ICLR 2025, arXiv 2410.13846); kvpress SimLayerKVPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "lazy_threshold", default: "0.9", kind: Kind::Float, help: "a layer is lazy above this attention mass on sinks + recent, in [0, 1] (kvpress recommends 0.9 for Llama 3, 0.65 Llama 2, 0.8 Mistral, 0.85 Qwen; 1 compresses nothing)" },
        ParamInfo { name: "n_last", default: "1", kind: Kind::Int, help: "last prompt queries whose attention decides (kvpress n_last)" },
        ParamInfo { name: "n_initial", default: "4", kind: Kind::Int, help: "sink positions a lazy layer keeps (kvpress n_initial)" },
    ],
    caps: Caps {
        memory: Memory::Beyond("only lazy layers keep B entries; the others keep everything (the method's layer-level choice)"),
        approximation: Some("kvpress's fixed n_recent (1024) is replaced by the budget: a lazy layer keeps B entries (n_recent = B − n_initial + n_last); default lazy_threshold 0.9 (kvpress's recommendation for Llama 3) where kvpress's dataclass default 1.0 disables the press"),
        ..Caps::EVICT_PREFILL
    },
    test: "simlayerkv_compresses_only_lazy_layers",
    build: Build::Policy(|p| {
        let lazy_threshold = p.float_in("lazy_threshold", 0.0, 1.0)?;
        let n_last = p.int("n_last")?;
        if n_last == 0 {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "n_last".into(),
                value: "0".into(),
                msg: "at least one query decides".into(),
            });
        }
        Ok(Arc::new(SimLayerKv { lazy_threshold, n_last, n_initial: p.int("n_initial")? }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimLayerKv {
    pub lazy_threshold: f64,
    pub n_last: usize,
    pub n_initial: usize,
}

impl SimLayerKv {
    /// Recent positions a lazy layer keeps for budget `b`: B − n_initial
    /// (kvpress's n_recent − n_last).
    fn recent_kept(&self, b: usize) -> usize {
        b.saturating_sub(self.n_initial)
    }
    /// kvpress's n_recent for budget `b`.
    fn n_recent(&self, b: usize) -> usize {
        self.recent_kept(b) + self.n_last
    }

    /// The mean attention mass of the last n_last queries on the sinks and the
    /// n_recent keys before them (every query head of the layer).
    pub fn lazy_mass(&self, ctx: &PrefillCtx) -> f64 {
        let p = ctx.prompt_len();
        let (nl, ni, nr) = (self.n_last, self.n_initial, self.n_recent(ctx.budget));
        let end = p - nl; // kvpress drops the window's own columns
        let mut mass = 0f64;
        for h in 0..ctx.n_heads() {
            let rows = ctx.attn_rows(h, p - nl..p);
            for row in rows.chunks_exact(p) {
                let sinks: f64 = row[..ni.min(end)].iter().map(|&x| x as f64).sum();
                let recent: f64 = row[end.saturating_sub(nr)..end]
                    .iter()
                    .map(|&x| x as f64)
                    .sum();
                mass += sinks + recent;
            }
        }
        mass / (ctx.n_heads() * nl) as f64
    }
}

impl Policy for SimLayerKv {
    fn name(&self) -> String {
        "simlayerkv".into()
    }
    /// The last n_last rows.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        self.n_last.min(p)
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let min_length = self.n_initial + self.n_recent(b) + self.n_last;
        if self.lazy_threshold >= 1.0
            || p <= min_length
            || self.lazy_mass(ctx) <= self.lazy_threshold
        {
            return Ok((ctx.full_caches(), Box::new(AppendOnly)));
        }
        // lazy: the first n_initial and the last n_recent − n_last (= B − n_initial;
        // with B < n_initial, our choice: the first B)
        let keep: Vec<usize> = (0..self.n_initial.min(b))
            .chain(p - self.recent_kept(b)..p)
            .collect();
        let caches = (0..ctx.n_kv_heads())
            .map(|g| ctx.exact_cache(g, &keep))
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
