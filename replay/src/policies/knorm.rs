//! KNorm (docs/methods/knorm.md): s_i = −‖k_i‖₂ per KV head, no attention,
//! window or sinks; `skip_layers` stay uncompressed; `decode_evict` evicts the largest-norm key.

use crate::info::{Build, Caps, Phase, PolicyInfo};
use crate::{
    params::{Kind, ParamInfo},
    scorer::{Computed, Scorer, Selected, StepScorer, Unit},
    HeadCache, PrefillCtx, StepCtx,
};
use kvreplay_kernels::cpu::l2_norm;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "knorm",
    summary: "keep the keys with the smallest L2 norm (no attention needed)",
    paper: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (Devoto et al., EMNLP 2024, arXiv 2406.11430); alessiodevoto/l2compress",
    params: &[
        ParamInfo { name: "skip_layers", default: "0;1", kind: Kind::IntList, help: "layers left uncompressed, `;`-separated (none = compress all)" },
        ParamInfo { name: "decode_evict", default: "false", kind: Kind::Bool, help: "also hold B entries during decode" },
    ],
    caps: Caps { phase: Phase::PrefillByDefault, ..Caps::EVICT_PREFILL },
    test: "knorm_keeps_the_smallest_keys_and_skips_layers",
    build: Build::Scorer(|p| Ok(std::sync::Arc::new(KNorm { skip_layers: p.int_list("skip_layers")?, decode_evict: p.bool("decode_evict")? }))),
};

pub struct KNorm {
    pub skip_layers: Vec<usize>,
    pub decode_evict: bool,
}
impl Scorer for KNorm {
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        (0..ctx.prompt_len())
            .map(|i| -l2_norm(ctx.key(u.kv_head, i)) as f32)
            .collect()
    }
    fn skip_layer(&self, layer: usize) -> bool {
        self.skip_layers.contains(&layer)
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, _: &PrefillCtx, _: &Selected) -> Option<Box<dyn StepScorer>> {
        Computed::boxed(|_: &StepCtx, _: usize, c: &HeadCache| {
            (0..c.len()).map(|e| -l2_norm(c.key(e)) as f32).collect()
        })
    }
}
