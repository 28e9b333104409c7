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

use super::{Build, Caps, Family, PolicyInfo};
use crate::scorer::{Allocation, TopK};
use crate::spec::{Kind, ParamInfo};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "pyramidkv",
    summary: "a pyramid of per-layer budgets (more in shallow layers) around any scorer (default: SnapKV selection)",
    paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (Cai et al., arXiv 2406.02069); Zefan-Cai/KVCache-Factory",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer whose selection gets the per-layer budgets (its parameters are accepted too)" },
        ParamInfo { name: "beta", default: "20", kind: Kind::Int, help: "min = ⌊(B − w)/beta⌋ selected entries in the last layer" },
    ],
    caps: Caps { family: Family::Allocation, ..Caps::EVICT_PREFILL },
    test: "pyramidkv_gives_every_scorer_per_layer_budgets",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[("w", "8")],
        build: |p, scorer| {
            let beta = p.int("beta")?.max(1);
            Ok(Arc::new(TopK { scorer, allocation: Allocation::Pyramid { beta }, merge: None }))
        },
    },
};

/// Selected entries (window excluded) of `layer` of `n_layers`, in the
/// reference's integer arithmetic; None = no compression.
pub fn layer_count(
    p_len: usize,
    b: usize,
    w: usize,
    beta: usize,
    layer: usize,
    n_layers: usize,
) -> Option<usize> {
    if p_len < b {
        return None;
    }
    let avg = b - w;
    if p_len < 2 * avg || n_layers < 2 {
        return Some(avg);
    }
    let mut min = avg / beta;
    let mut max = 2 * avg - min;
    if max >= p_len - w {
        max = p_len - w;
        min = 2 * avg - max;
    }
    let step = (max - min) / (n_layers - 1);
    Some(max - layer * step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_hand_computation() {
        // B = 72, w = 8 -> P = 64; T_p = 1000, L = 5, beta = 20:
        // min = 3, max = 125, step = (125 - 3) / 4 = 30 -> 125, 95, 65, 35, 5
        let counts: Vec<usize> = (0..5)
            .map(|l| layer_count(1000, 72, 8, 20, l, 5).unwrap())
            .collect();
        assert_eq!(counts, vec![125, 95, 65, 35, 5]);
        // T_p < 2P: uniform
        assert_eq!(layer_count(100, 72, 8, 20, 3, 5), Some(64));
        // max capped at T_p - w: T_p = 130 -> max = 122, min = 6, step = 29
        let counts: Vec<usize> = (0..5)
            .map(|l| layer_count(130, 72, 8, 20, l, 5).unwrap())
            .collect();
        assert_eq!(counts, vec![122, 93, 64, 35, 6]);
        assert_eq!(layer_count(50, 72, 8, 20, 0, 5), None);
    }
}
