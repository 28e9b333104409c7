//! `+keyrerotation`: after the policy's prefill compression, the kept keys
//! are re-rotated to consecutive positions (docs/methods/keyrerotation.md;
//! kvpress `KeyRerotationPress`, as in transformers' SinkCache and FINCH).
//!
//! Rule (kvpress 0.5.4 `KeyRerotationPress.rerotate_keys`): the n entries a
//! cache keeps, in position order, move to positions 0..n−1: entry e, first
//! created at position p_e, is rotated by RoPE's angle of e − p_e (undoing
//! its rotation at p_e and applying the one at e, done as one rotation by
//! −θ(p_e − e), the angles in f64 as kvreplay's RoPE tables). Values are
//! untouched. The decode steps' queries and keys keep their positions in the
//! trace: kvpress does not move `cache_position`, so the query of step t is
//! rotated at P + t and sees the moved prompt keys farther away than it
//! would have seen them (the replay attends with the trace's queries).
//! Entries appended during decode are not moved (kvpress re-rotates once,
//! at prefill). The RoPE parameters come from the trace's manifest. Alone
//! (`keyrerotation` = `full+keyrerotation`) nothing is evicted and nothing
//! moves.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::policy::{DecodeState, GroupDecodeState, Policy, PrefillCtx};
use crate::ReplayError;
use kvreplay_kernels::cpu::{rope_table, rotate_with_table, RopeParams};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "keyrerotation",
    summary: "re-rotates the keys a policy keeps to consecutive positions 0..n−1 after prefill (kvpress KeyRerotationPress); compose as `X+keyrerotation`",
    paper: "kvpress KeyRerotationPress (NVIDIA/kvpress 0.5.4), the key re-rotation of transformers' SinkCache (Xiao et al., StreamingLLM, arXiv 2309.17453) and of FINCH (Corallo & Papotti, TACL 2024)",
    params: &[],
    caps: Caps {
        family: Family::Eviction,
        phase: Phase::Prefill,
        ..Caps::EVICT_PREFILL
    },
    test: "keyrerotation_moves_kept_keys_to_consecutive_positions",
    build: Build::Wrapper(|_, base| Ok(Arc::new(KeyRerotation { base }))),
};

/// `base`, with its prefill caches' keys moved to consecutive positions.
pub struct KeyRerotation {
    pub base: Arc<dyn Policy>,
}

/// Move each entry e of `cache` from its first position to position e.
pub fn rerotate(cache: &mut HeadCache, rope: &RopeParams) {
    let d = cache.d;
    for e in 0..cache.len() {
        let p = cache.members[e][0] as usize;
        if p == e {
            continue;
        }
        // kept entries are in position order, so e <= p: rotate by −θ(p − e)
        debug_assert!(e < p);
        let table = rope_table(1, p - e, rope, -1.0);
        let key = &mut cache.keys[e * d..(e + 1) * d];
        rotate_with_table(key, 1, d, rope.style, rope.rotated_dims, &table);
    }
}

fn rope_of(ctx: &PrefillCtx) -> Result<RopeParams, ReplayError> {
    ctx.rope().ok_or_else(|| ReplayError::TraceLacks {
        path: format!("layer {}", ctx.layer()),
        msg: "no RoPE parameters: keyrerotation needs them (recapture with a current kvreplay)"
            .into(),
    })
}

impl Policy for KeyRerotation {
    /// Its base's caches, so its base's count.
    fn budget_share(&self, group: usize) -> usize {
        self.base.budget_share(group)
    }
    fn name(&self) -> String {
        format!("{}+keyrerotation", self.base.name())
    }
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.base.prompt_queries(p, b)
    }
    fn compress_sliding(&self) -> bool {
        self.base.compress_sliding()
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let rope = rope_of(ctx)?;
        let (mut caches, st) = self.base.prefill(ctx)?;
        caches.iter_mut().for_each(|c| rerotate(c, &rope));
        Ok((caches, st))
    }
    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        self.base.layer_groups(n_layers, budget, prompt_len)
    }
    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let ropes = ctxs.iter().map(rope_of).collect::<Result<Vec<_>, _>>()?;
        let (mut caches, st) = self.base.prefill_group(ctxs)?;
        for (layer, rope) in caches.iter_mut().zip(&ropes) {
            layer.iter_mut().for_each(|c| rerotate(c, rope));
        }
        Ok((caches, st))
    }
}
