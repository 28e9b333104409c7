//! PyramidKV: per-layer budgets that shrink with depth, around any scorer
//! (docs/methods/pyramidkv.md; default scorer SnapKV with w = 8).
//!
//! Rule (KVCache-Factory `PyramidKVCluster`): with w the scorer's protected
//! positions and P = B − w, if T_p < B no-op; else if T_p < 2P every layer
//! keeps P + w; otherwise min = ⌊P/β⌋, max = 2P − min (if max ≥ T_p − w:
//! max = T_p − w, min = 2P − max), step = ⌊(max − min)/(L − 1)⌋, and layer l
//! keeps (max − l·step) selected entries plus the protected ones. Memory is
//! charged from the actual counts (the floor can make the total exceed L·P).
//! Decode-time scorers hold each layer's own count.
//!
//! `schedule=kvpress` is kvpress PyramidKVPress's `get_layer_budget`: with
//! A = B (its P·(1 − ratio)), min = A/β, max = 2A − min (if
//! max ≥ T_p − w: max = T_p − w, min = 2A − max), in floats; if not
//! T_p ≥ max ≥ min ≥ w every layer keeps B (uniform, i.e. SnapKV); else layer
//! l keeps round(max − l·(max − min)/(L − 1)) entries (Python's round, half to
//! even) *including* the w protected ones. `preset=kvpress` sets it, β = 20
//! and the scorer's kvpress preset (SnapKVPress: w = 64, k = 5, avg).

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo, Preset};
use crate::scorer::{Allocation, TopK};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "pyramidkv",
    summary: "a pyramid of per-layer budgets (more in shallow layers) around any scorer (default: SnapKV selection)",
    paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (Cai et al., arXiv 2406.02069); Zefan-Cai/KVCache-Factory",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer whose selection gets the per-layer budgets (its parameters are accepted too)" },
        ParamInfo { name: "beta", default: "20", kind: Kind::Int, help: "min = ⌊(B − w)/beta⌋ selected entries in the last layer" },
        ParamInfo { name: "schedule", default: "factory", kind: Kind::Choice(&["factory", "kvpress"]), help: "factory: KVCache-Factory's integer schedule, w added to each layer; kvpress: PyramidKVPress's float schedule with w inside each layer's count, uniform when infeasible" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x PyramidKVPress around the scorer's kvpress preset (sets the parameters not given)" },
    ],
    caps: Caps { family: Family::Allocation, phase: Phase::AsScorer, memory: Memory::Beyond("the reference's pyramid steps between layers by ⌊(max − min)/(L − 1)⌋, which rounds the layers' counts up: their mean exceeds B by less than (L − 1)/2 entries per KV head"), ..Caps::EVICT_PREFILL },
    test: "pyramidkv_gives_every_scorer_per_layer_budgets",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[("w", "8")],
        build: |p, scorer| {
            let beta = p.int("beta")?.max(1);
            let kvpress = p.word("schedule") == "kvpress";
            Ok(Arc::new(TopK { allocation: Allocation::Pyramid { beta, kvpress }, ..TopK::new("pyramidkv", scorer) }))
        },
    },
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's PyramidKVPress
/// (β = 20) and selects the scorer's `kvpress` preset (SnapKVPress).
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[("schedule", "kvpress"), ("beta", "20")],
    },
];
