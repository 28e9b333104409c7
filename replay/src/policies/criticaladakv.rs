//! CriticalAdaKV: CriticalKV's two stages inside AdaKV's per-head budgets
//! (docs/methods/criticaladakv.md; kvpress `CriticalAdaKVPress`, arXiv
//! 2502.03805).
//!
//! Rule (kvpress 0.5.4 `CriticalAdaKVPress.compress`): per layer, each KV
//! head first reserves its own top ⌊α·B⌋ positions (the safeguard), then the
//! layer's H·B selections go to the best (head, position) pairs; head h's
//! count is its budget B_h (kvpress AdaKVPress's allocation, as
//! `adakv:safeguard=reserve`). Inside B_h: stage 1 keeps the head's top
//! ⌊B_h·first_stage_ratio⌋ by the scorer's score, the safeguard kept as
//! well; stage 2 fills B_h by (s + ε)·‖W_o v‖₁ ([`super::criticalkv`]).
//! The scorer's protected positions (its window) count first everywhere, as
//! kvpress pads them with the maximum score. Memory is charged from the
//! per-head counts. Prefill only.
//!
//! Approximation: ‖W_o v‖₁ is taken as ‖v‖₁ (a trace holds no W_o).

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::criticalkv::{Critical, Stage};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "criticaladakv",
    summary: "CriticalKV's two-stage selection inside AdaKV's per-head budgets (default scorer: SnapKV); prefill only",
    paper: "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective (Feng et al., arXiv 2502.03805); FFY0/AdaKV, kvpress CriticalAdaKVPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer compared across heads and used in stage 1 (its parameters are accepted too)" },
        ParamInfo { name: "alpha", default: "0.2", kind: Kind::Float, help: "safeguard: each head's own top ⌊alpha·B⌋ first (kvpress alpha_safeguard)" },
        ParamInfo { name: "first_stage_ratio", default: "0.5", kind: Kind::Float, help: "share of each head's budget chosen by the scorer alone" },
        ParamInfo { name: "epsilon", default: "0.0001", kind: Kind::Float, help: "added to the score before the norm weighting" },
    ],
    caps: Caps {
        family: Family::Allocation,
        phase: Phase::Prefill,
        approximation: Some("the projected value norm ‖W_o v‖₁ is taken as ‖v‖₁: a trace holds no W_o"),
        ..Caps::EVICT_PREFILL
    },
    test: "criticaladakv_spreads_b_over_heads_then_runs_two_stages",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| {
            let alpha = p.float("alpha")?;
            if !(0.0..=1.0).contains(&alpha) {
                return Err(ReplayError::BadParam { policy: "criticaladakv".into(), key: "alpha".into(), value: alpha.to_string(), msg: "must lie in [0, 1]".into() });
            }
            Ok(Arc::new(Critical { scorer, stage: Stage::from_params(p)?, ada: Some(alpha) }))
        },
    },
};
