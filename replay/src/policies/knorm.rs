//! KNorm: keep the keys with the smallest L2 norm.
//!
//! Rule (landscape.md B3, alessiodevoto/l2compress): s_i = −‖k_i‖₂ per KV
//! head; keep the B highest. No attention, window or sinks. Layers in
//! `skip_layers` stay uncompressed (charged in full). Prefill only unless
//! `decode_evict`, which evicts the largest-norm key whenever the cache
//! exceeds B.

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{top_k, victim, AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "knorm",
    summary: "keep the keys with the smallest L2 norm (no attention needed)",
    paper: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (Devoto et al., EMNLP 2024, arXiv 2406.11430); alessiodevoto/l2compress",
    params: &[
        ParamInfo { name: "skip_layers", default: "0;1", kind: Kind::IntList, help: "layers left uncompressed, `;`-separated (none = compress all)" },
        ParamInfo { name: "decode_evict", default: "false", kind: Kind::Bool, help: "also hold B entries during decode" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(KNorm { skip_layers: p.int_list("skip_layers")?, decode_evict: p.bool("decode_evict")? }))
    },
};

pub struct KNorm {
    pub skip_layers: Vec<usize>,
    pub decode_evict: bool,
}

/// L2 norm, accumulated in f64.
pub fn norm(k: &[f32]) -> f32 {
    k.iter()
        .map(|x| (*x as f64) * (*x as f64))
        .sum::<f64>()
        .sqrt() as f32
}

impl Policy for KNorm {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        if self.skip_layers.contains(&ctx.layer()) {
            return Ok((ctx.full_caches(), Box::new(AppendOnly)));
        }
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                if p <= b {
                    return ctx.full_cache(g);
                }
                let s: Vec<f32> = (0..p).map(|i| -norm(ctx.key(g, i))).collect();
                ctx.exact_cache(g, &top_k(&s, &(0..p).collect::<Vec<_>>(), b, |i| i))
            })
            .collect();
        let state: Box<dyn DecodeState> = if self.decode_evict {
            Box::new(Evict)
        } else {
            Box::new(AppendOnly)
        };
        Ok((caches, state))
    }
}

struct Evict;

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for c in caches.iter_mut() {
            while c.len() > ctx.budget {
                let s: Vec<f32> = (0..c.len()).map(|e| -norm(c.key(e))).collect();
                let pos = c.positions();
                let e = victim(&s, 0..c.len(), |e| pos[e]).expect("non-empty");
                c.remove(e);
            }
        }
    }
}
