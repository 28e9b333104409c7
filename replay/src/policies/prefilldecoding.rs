//! PrefillDecoding: a scorer's selection at prefill, then the same scorer's
//! compression every `compression_interval` decode steps
//! (docs/methods/prefilldecoding.md; kvpress `PrefillDecodingPress` with a
//! `ScorerPress` as its prefilling press and a `DecodingPress` around the
//! same scorer as its decoding press).
//!
//! Prefill: the scorer's own selection at B (as `NAME` alone, its decode
//! eviction not used). Decode: [`super::decoding`]'s rule with the
//! scorer's parameters as given. Our choice: one scorer for both phases
//! (kvpress accepts two presses; `X+decoding` composes any policy X at
//! prefill with a default-parameter scorer during decode).

use std::sync::Arc;

use crate::info::{Build, PolicyInfo};
use crate::params::ParamInfo;
use crate::policies::decoding::{Decoding, Interval, CAPS, PARAMS};
use crate::scorer::TopK;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "prefilldecoding",
    summary: "a scorer's selection at prefill, then every compression_interval decode steps the same scorer cuts each cache back to B (default: SnapKV)",
    paper: "kvpress PrefillDecodingPress with DecodingPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "scorer", default: "snapkv", kind: crate::params::Kind::Scorer, help: "the scorer of both phases (its parameters are accepted too)" },
        PARAMS[1],
        PARAMS[2],
        PARAMS[3],
    ],
    caps: CAPS,
    test: "prefilldecoding_selects_at_prefill_and_compresses_during_decode",
    build: Build::ScorerWrapper {
        default_scorer: "snapkv",
        scorer_defaults: &[],
        build: |p, scorer| {
            let cfg = Interval::from_params(p, &*scorer)?;
            let base = Arc::new(TopK::new("prefilldecoding", scorer.clone()));
            Ok(Arc::new(Decoding { base, scorer, cfg }))
        },
    },
};
