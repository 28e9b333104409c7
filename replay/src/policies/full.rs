//! Full cache: keeps everything (the reference every metric is measured
//! against; docs/methods/full.md).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "full",
    summary: "no compression: every prompt and decode entry is kept",
    paper: "-",
    params: &[],
    caps: Caps {
        family: Family::Reference,
        phase: Phase::Prefill,
        memory: Memory::Beyond("the reference: every prompt and decode entry, uncompressed"),
        ..Caps::EVICT_PREFILL
    },
    test: "full_has_zero_error_and_full_bytes",
    build: Build::Policy(|_| Ok(Arc::new(Full))),
};

pub struct Full;

impl Policy for Full {
    fn name(&self) -> String {
        "full".into()
    }
    fn budget_independent(&self) -> bool {
        true
    }
    fn keeps_full_cache(&self, _group_len: usize) -> bool {
        true
    }
    /// Reads no query.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        Ok((ctx.full_caches(), Box::new(AppendOnly)))
    }
}
