//! TOVA: token omission via attention of the current query.
//!
//! Rule (landscape.md B3, schwartz-lab-NLP/TOVA): the score is the current
//! query's attention averaged over all H query heads of the layer, and the same
//! positions are kept for every KV head. Prefill: keep the top B by the last
//! prompt query's row. Decode: the query attends to B + 1 entries, then the
//! lowest-scoring entry (the new one included) is evicted. No sinks, no window.
//! `per_kv_head` scores each KV head by its group's mean instead.

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{
    mean_rows, top_k, victim, AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx,
};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "tova",
    summary: "keeps what the current query attends to most (mean over all heads of the layer); evicts one entry per decode step",
    paper: "Transformers are Multi-State RNNs (Oren et al., EMNLP 2024, arXiv 2401.06104); schwartz-lab-NLP/TOVA",
    params: &[
        ParamInfo { name: "per_kv_head", default: "false", kind: Kind::Bool, help: "score each KV head by its own group (default: one layer-wide score)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false = kvpress TOVAPress, prefill only)" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(Tova { per_kv_head: p.bool("per_kv_head")?, decode_evict: p.bool("decode_evict")? }))
    },
};

pub struct Tova {
    pub per_kv_head: bool,
    pub decode_evict: bool,
}

impl Policy for Tova {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let state: Box<dyn DecodeState> = if self.decode_evict {
            Box::new(Evict {
                per_kv_head: self.per_kv_head,
            })
        } else {
            Box::new(AppendOnly)
        };
        if p <= b {
            return Ok((ctx.full_caches(), state));
        }
        let last = ctx.memo("last_prompt_rows", || {
            (0..ctx.n_heads())
                .map(|h| ctx.attn_rows(h, p - 1..p))
                .collect::<Vec<Vec<f32>>>()
        });
        let all: Vec<usize> = (0..p).collect();
        let layer_keep = top_k(
            &mean_rows(last.iter().map(|r| r.as_slice())),
            &all,
            b,
            |i| i,
        );
        let gs = ctx.group();
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                if self.per_kv_head {
                    let s = mean_rows(last[g * gs..(g + 1) * gs].iter().map(|r| r.as_slice()));
                    ctx.exact_cache(g, &top_k(&s, &all, b, |i| i))
                } else {
                    ctx.exact_cache(g, &layer_keep)
                }
            })
            .collect();
        Ok((caches, state))
    }
}

struct Evict {
    per_kv_head: bool,
}

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        if caches.iter().all(|c| c.len() <= ctx.budget) {
            return;
        }
        if self.per_kv_head {
            for (g, c) in caches.iter_mut().enumerate() {
                let s = ctx.group_mean(g);
                let pos = c.positions();
                let e = victim(&s, 0..c.len(), |e| pos[e]).expect("non-empty");
                c.remove(e);
            }
        } else {
            // Every KV head holds the same positions, so entries align across heads.
            let s = mean_rows(ctx.probs.iter().map(|r| r.as_slice()));
            let pos = caches[0].positions();
            let e = victim(&s, 0..s.len(), |e| pos[e]).expect("non-empty");
            for c in caches.iter_mut() {
                c.remove(e);
            }
        }
    }
}
