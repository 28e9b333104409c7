//! KNorm (docs/methods/knorm.md): s_i = −‖k_i‖₂ per KV head, no attention,
//! window or sinks; `skip_layers` stay uncompressed; `decode_evict` evicts the largest-norm key.
//! `preset=kvpress` is kvpress 0.5.x's KnormPress: every layer compressed, prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo, Preset};
use crate::scorer::KeyScorer;
use kvreplay_kernels::cpu::l2_norm;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "knorm",
    summary: "keep the keys with the smallest L2 norm (no attention needed)",
    paper: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (Devoto et al., EMNLP 2024, arXiv 2406.11430); alessiodevoto/l2compress",
    params: &[
        ParamInfo { name: "skip_layers", default: "0;1", kind: Kind::IntList, help: "layers left uncompressed, `;`-separated (none = compress all)" },
        ParamInfo { name: "decode_evict", default: "false", kind: Kind::Bool, help: "also hold B entries during decode" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x KnormPress (sets the parameters not given)" },
    ],
    caps: Caps { phase: Phase::PrefillByDefault, memory: Memory::Beyond("the paper leaves layers 0 and 1 whole (skip_layers=0;1); skip_layers=none keeps B entries on every layer"), ..Caps::EVICT_PREFILL },
    test: "knorm_keeps_the_smallest_keys_and_skips_layers",
    build: Build::Scorer(|p| Ok(Arc::new(KeyScorer { score: knorm, skip_layers: p.int_list("skip_layers")?, decode_evict: p.bool("decode_evict")? }))),
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's KnormPress.
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[("skip_layers", "none"), ("decode_evict", "false")],
    },
];

/// The score of a key: minus its L2 norm (f64 sum, as the reference).
pub fn knorm(k: &[f32]) -> f32 {
    -l2_norm(k) as f32
}
