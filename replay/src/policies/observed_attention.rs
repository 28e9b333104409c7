//! Observed attention (docs/methods/observed_attention.md), kvpress
//! `ObservedAttentionPress`: the attention each prompt key received from the
//! prompt queries, divided by how many of them could see it (causal: P − i for
//! position i), averaged over the query heads of the KV group. Keep the top B;
//! no window, no sinks. Prefill only.

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::policy::{mean_rows, PrefillCtx};
use crate::scorer::{Scorer, Unit};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "observed_attention",
    summary: "keeps the keys with the highest mean attention over the prompt queries that saw them (column sum / causal count); prefill only",
    paper: "kvpress ObservedAttentionPress (NVIDIA/kvpress 0.5, kvpress/presses/observed_attention_press.py); related to H2O (Zhang et al., NeurIPS 2023, arXiv 2306.14048)",
    params: &[],
    caps: Caps::EVICT_PREFILL,
    test: "observed_attention_divides_column_sums_by_the_causal_count",
    build: Build::Scorer(|_| Ok(Arc::new(ObservedAttention))),
};

pub struct ObservedAttention;

impl Scorer for ObservedAttention {
    /// Reads the column sums only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    /// s_i = mean over the group's query heads of colsum_h(i) / (P − i).
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let p = ctx.prompt_len();
        let per_head: Vec<Vec<f32>> = u
            .heads
            .clone()
            .map(|h| {
                ctx.colsum(h)
                    .iter()
                    .enumerate()
                    .map(|(i, s)| s / (p - i) as f32)
                    .collect()
            })
            .collect();
        mean_rows(per_head.iter().map(|v| v.as_slice()))
    }
}
