//! AdaKV: head-adaptive budgets around any scorer (docs/methods/adakv.md;
//! default scorer SnapKV in its cross-head form: window means).
//!
//! Rule (FFY0/AdaKV `AdaptiveSnapKVCluster`): with w the scorer's protected
//! positions and P = B − w, score each KV head; take the top H_kv·P (head,
//! position) pairs of the layer and let n_h be head h's count;
//! B_h = round((1 − α)·n_h + ⌊α·P⌋); head h keeps its own top B_h plus the
//! protected positions. Optional `normalize` scales head h's scores by
//! (sum of its top P) / (sum of all its scores). Memory is charged from the
//! actual per-head counts; decode-time scorers hold each head's own count.
//!
//! `safeguard=reserve` is kvpress AdaKVPress's rule instead: each head first
//! keeps its own top ⌊α·B⌋ entries, the protected ones counted first (kvpress
//! scores them above everything), then the layer's remaining selections go to
//! the best (head, position) pairs of the rest, H·(B − w) in all.
//! `preset=kvpress` sets it and the scorer's kvpress preset (SnapKVPress).

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo, Preset};
use crate::scorer::{Allocation, TopK};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "adakv",
    summary: "redistributes a layer's budget across KV heads by where a scorer's top scores fall (default: SnapKV)",
    paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (Feng et al., arXiv 2407.11550); FFY0/AdaKV",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: Kind::Scorer, help: "the scorer compared across heads (its parameters are accepted too)" },
        ParamInfo { name: "alpha", default: "0.2", kind: Kind::Float, help: "safeguard: share of P every head keeps" },
        ParamInfo { name: "normalize", default: "false", kind: Kind::Bool, help: "scale each head's scores by its top-P share" },
        ParamInfo { name: "safeguard", default: "blend", kind: Kind::Choice(&["blend", "reserve"]), help: "blend: B_h = round((1 − α)·n_h + ⌊α·P⌋) (AdaKV); reserve: each head's top ⌊α·B⌋ first (protected ones included), then a global top-k (kvpress)" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x AdaKVPress around the scorer's kvpress preset (sets the parameters not given)" },
    ],
    caps: Caps { family: Family::Allocation, phase: Phase::AsScorer, ..Caps::EVICT_PREFILL },
    test: "adakv_gives_every_scorer_per_head_budgets",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| {
            let alpha = p.float("alpha")?;
            if !(0.0..=1.0).contains(&alpha) {
                return Err(ReplayError::BadParam { policy: "adakv".into(), key: "alpha".into(), value: alpha.to_string(), msg: "must lie in [0, 1]".into() });
            }
            let reserve_first = p.word("safeguard") == "reserve";
            let allocation = Allocation::Ada { alpha, normalize: p.bool("normalize")?, reserve_first };
            Ok(Arc::new(TopK { allocation, ..TopK::new("adakv", scorer) }))
        },
    },
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's AdaKVPress
/// (alpha_safeguard 0.2, no normalisation) and selects the scorer's `kvpress`
/// preset (SnapKVPress for the default scorer).
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[
            ("safeguard", "reserve"),
            ("alpha", "0.2"),
            ("normalize", "false"),
        ],
    },
];
