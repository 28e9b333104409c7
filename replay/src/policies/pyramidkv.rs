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

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::scorer::{Allocation, TopK};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "pyramidkv",
    summary: "a pyramid of per-layer budgets (more in shallow layers) around any scorer (default: SnapKV selection)",
    paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (Cai et al., arXiv 2406.02069); Zefan-Cai/KVCache-Factory",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer whose selection gets the per-layer budgets (its parameters are accepted too)" },
        ParamInfo { name: "beta", default: "20", kind: Kind::Int, help: "min = ⌊(B − w)/beta⌋ selected entries in the last layer" },
    ],
    caps: Caps { family: Family::Allocation, phase: Phase::AsScorer, ..Caps::EVICT_PREFILL },
    test: "pyramidkv_gives_every_scorer_per_layer_budgets",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[("w", "8")],
        build: |p, scorer| {
            let beta = p.int("beta")?.max(1);
            Ok(Arc::new(TopK { allocation: Allocation::Pyramid { beta }, ..TopK::new("pyramidkv", scorer) }))
        },
    },
};
