//! StreamingLLM: attention sinks plus the most recent entries
//! (docs/methods/streaming_llm.md). Keep positions 0..n_sink and the
//! B − n_sink most recent; at each decode step evict the oldest non-sink
//! entry. Original positions are kept (no position shift). As a scorer every
//! position scores 0 and everything but the sinks is the recent window.
//! `preset=kvpress` is kvpress 0.5.x's StreamingLLMPress: 4 sinks, prefill
//! only (it keeps the same positions; no position shift either).

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo, Preset};
use crate::policy::PrefillCtx;
use crate::scorer::{Equal, Scorer, Selected, StepScorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "streaming_llm",
    summary: "n_sink first positions + the most recent ones; evicts the oldest non-sink entry at each decode step",
    paper: "Efficient Streaming Language Models with Attention Sinks (Xiao et al., ICLR 2024, arXiv 2309.17453); mit-han-lab/streaming-llm",
    params: &[
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "initial positions always kept (inside B)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false: prefill only, decode appended)" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x StreamingLLMPress (sets the parameters not given)" },
    ],
    caps: Caps::EVICT_DECODE,
    test: "streaming_llm_keeps_sinks_and_recent_and_evicts_oldest_non_sink",
    build: Build::Scorer(|p| Ok(Arc::new(StreamingLlm { n_sink: p.int("n_sink")?, decode_evict: p.bool("decode_evict")? }))),
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's StreamingLLMPress.
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[("n_sink", "4"), ("decode_evict", "false")],
    },
];

pub struct StreamingLlm {
    pub n_sink: usize,
    pub decode_evict: bool,
}

impl Scorer for StreamingLlm {
    /// Reads nothing of the layer.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, _: &Unit) -> Vec<f32> {
        vec![0.0; ctx.prompt_len()]
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(self.n_sink, usize::MAX, b))
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, _: &PrefillCtx, _: &Selected) -> Option<Box<dyn StepScorer>> {
        // equal scores: the tie rule evicts the earliest non-sink entry
        Some(Box::new(Equal::default()))
    }
}
