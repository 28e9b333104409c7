//! StreamingLLM: attention sinks plus the most recent entries.
//!
//! Rule (landscape.md B3): keep positions 0..n_sink and the B - n_sink most
//! recent; at each decode step evict the oldest non-sink entry. Original
//! positions are kept (no position shift).

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "streaming_llm",
    summary: "n_sink first positions + the most recent ones; evicts the oldest non-sink entry at each decode step",
    paper: "Efficient Streaming Language Models with Attention Sinks (Xiao et al., ICLR 2024, arXiv 2309.17453); mit-han-lab/streaming-llm",
    params: &[
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "initial positions always kept (inside B)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false: prefill only, decode appended)" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(StreamingLlm { n_sink: p.int("n_sink")?, decode_evict: p.bool("decode_evict")? }))
    },
};

pub struct StreamingLlm {
    pub n_sink: usize,
    pub decode_evict: bool,
}

/// Positions kept from a prompt of `p` with budget `b`.
pub fn kept_positions(p: usize, b: usize, n_sink: usize) -> Vec<usize> {
    if p <= b {
        return (0..p).collect();
    }
    let s = n_sink.min(b);
    (0..s).chain(p - (b - s)..p).collect()
}

impl Policy for StreamingLlm {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let keep = kept_positions(ctx.prompt_len(), ctx.budget, self.n_sink);
        let caches = (0..ctx.n_kv_heads())
            .map(|g| ctx.exact_cache(g, &keep))
            .collect();
        let state: Box<dyn DecodeState> = if self.decode_evict {
            Box::new(Evict {
                n_sink: self.n_sink,
            })
        } else {
            Box::new(AppendOnly)
        };
        Ok((caches, state))
    }
}

struct Evict {
    n_sink: usize,
}

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        let s = self.n_sink.min(ctx.budget);
        for c in caches.iter_mut() {
            while c.len() > ctx.budget {
                c.remove(s); // entries are in position order: index s is the oldest non-sink
            }
        }
    }
}
