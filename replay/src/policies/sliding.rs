//! `+sliding`: also compress the sliding-window layers of a model such as
//! Gemma 3 (docs/methods/sliding.md). By default the engine replays a
//! sliding layer with its window uncompressed (the model's own cache there
//! is already bounded by W entries, which is what kvpress does too); composed
//! as `POLICY+sliding`, the policy compresses those layers as well, and their
//! attention still sees only the entries whose newest member lies inside the
//! window.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::policy::{DecodeState, GroupDecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "sliding",
    summary: "also compresses sliding-window layers (by default they keep their W-entry window uncompressed); compose as `X+sliding`",
    paper: "- (a replay option: Gemma 3 Technical Report, arXiv 2503.19786, for the interleaved local/global layers)",
    params: &[],
    caps: Caps {
        family: Family::Allocation,
        phase: Phase::Prefill,
        ..Caps::EVICT_PREFILL
    },
    test: "sliding_layers_keep_their_window_unless_the_policy_says_sliding",
    build: Build::Wrapper(|_, base| Ok(Arc::new(Sliding { base }))),
};

/// `base`, applied to sliding-window layers too.
pub struct Sliding {
    pub base: Arc<dyn Policy>,
}

impl Policy for Sliding {
    /// Its base's caches, so its base's count.
    fn budget_share(&self, group: usize) -> usize {
        self.base.budget_share(group)
    }
    fn name(&self) -> String {
        format!("{}+sliding", self.base.name())
    }
    fn budget_independent(&self) -> bool {
        self.base.budget_independent()
    }
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.base.prompt_queries(p, b)
    }
    fn compress_sliding(&self) -> bool {
        true
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        self.base.prefill(ctx)
    }
    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        self.base.layer_groups(n_layers, budget, prompt_len)
    }
    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        self.base.prefill_group(ctxs)
    }
}
