//! Full cache: keeps everything (the reference every metric is measured against).

use std::sync::Arc;

use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "full",
    summary: "no compression: every prompt and decode entry is kept",
    paper: "-",
    params: &[],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(Full))
    },
};

pub struct Full;

impl Policy for Full {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        Ok((ctx.full_caches(), Box::new(AppendOnly)))
    }
}
