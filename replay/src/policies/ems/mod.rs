//! EMS: evict-then-merge with a global-local score, head-wise.
//!
//! Rule (docs/methods/ems.md, spec §2): per head, score tokens by
//! s = max(α·s_glo, s_loc) (accumulated attention over all prompt queries,
//! rescaled to the mean of the last-L_win-queries attention s_loc). After
//! prefill the older tokens split by the mean-pooled score into N_imp class
//! centres, N_tbm to-be-merged tokens and the evicted rest; the last L_win are
//! a window. Each to-be-merged token joins the centre with the largest
//! cos⁺(keys)·cos⁺(values) if that reaches τ, else it is evicted (zero class).
//! A centre stores one score-weighted unit key direction (in raw, pre-RoPE
//! space) and a weighted value; every member keeps a slot with its own key
//! norm, re-rotated at its own position when attended (about γ·N_budget slots
//! attend, N_budget entries are stored). Each decode step the token leaving the
//! window becomes a centre, the least important centre is merged into its most
//! similar centre (or freed), and the slot table is capped at γ·N_budget.
//!
//! Files: `entry` (entries, slots and a head's table, and how a head is
//! expanded into the engine's cache), `prefill` (scores and the first
//! classification into centres, to-be-merged and evicted tokens), `decode`
//! (the per-step update).

mod config;
mod decode;
mod entry;
mod prefill;

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub use config::*;

use decode::Decode;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "ems",
    summary: "head-wise evict-then-merge: global-local scores pick class centres; similar tokens merge into them, the rest are evicted",
    paper: "EMS: Adaptive Evict-then-Merge Strategy for Head-wise KV Cache Compression Based on Global-Local Importance (Li et al., arXiv 2412.08521)",
    params: &[
        ParamInfo { name: "window", default: "auto", kind: Kind::IntOr("auto"), help: "L_win: window kept and used for s_loc; auto = min(32, ⌊B/2⌋) (paper 32, requires B > L_win)" },
        ParamInfo { name: "tau", default: "0.6", kind: Kind::Float, help: "merge threshold on cos⁺·cos⁺ (≥ 1 evicts every candidate)" },
        ParamInfo { name: "gamma", default: "4", kind: Kind::FloatOr("inf"), help: "magnification: slots ≤ γ·N_budget, to-be-merged N_tbm = ⌊(γ−1)·N_budget⌋" },
        ParamInfo { name: "kernel", default: "7", kind: Kind::Int, help: "mean-pool width of the prefill ranking (odd)" },
        ParamInfo { name: "sim_pos", default: "false", kind: Kind::Bool, help: "similarity on post-RoPE keys (\"w. pos\") instead of raw keys" },
        ParamInfo { name: "gqa_mode", default: "per_query_head", kind: Kind::Choice(&["per_query_head", "per_kv_head"]), help: "one cache per query head (paper) or per KV head with group-mean attention" },
        crate::policy::BUDGET_PER,
        ParamInfo { name: "merge_space", default: "raw", kind: Kind::Choice(&["raw", "post_rope"]), help: "merge un-rotated keys and re-rotate each member, or merge the captured keys" },
        ParamInfo { name: "demote_rank", default: "cluster_sum", kind: Kind::Choice(&["cluster_sum", "anchor_slot"]), help: "which centre is demoted at decode" },
        ParamInfo { name: "score", default: "global_local", kind: Kind::Choice(&["global_local", "global", "local"]), help: "Table 4 ablation of the score" },
        ParamInfo { name: "zero_class", default: "free", kind: Kind::Choice(&["free", "literal_zero"]), help: "evicted to-be-merged tokens: freed, or kept as zero key/value slots that still take softmax mass" },
        ParamInfo { name: "similarity", default: "key_value", kind: Kind::Choice(&["key_value", "key", "value"]), help: "Table 8 ablation of the redundancy measure" },
    ],
    caps: Caps { family: Family::Merging, phase: Phase::Decode, merges: true, per_query_head: true, holds_capacity: true, exact_when_covering: false, memory: Memory::Metadata { share: 0.06, what: "per-slot metadata: each of up to γ·N_budget slots (N_budget = ⌊B/G⌋ per query-head cache) stores its key's f16 norm and its entry's index, 16 + ⌈log2(N_budget + 1)⌉ bits, at most 6% of the bound at d = 64, γ = 4, N_budget < 4096" }, ..Caps::EVICT_PREFILL },
    test: "ems_global_local_scores_pick_the_centres_and_weight_the_merge",
    build: Build::Policy(|p| {
        Ok(Arc::new(Ems::from_params(p)?))
    }),
};

impl Policy for Ems {
    fn name(&self) -> String {
        "ems".into()
    }
    /// Per-query-head caches (the paper's layout) share their KV head's budget.
    fn budget_share(&self, group: usize) -> usize {
        crate::policy::share_of(self.per_query_head(), self.budget_per_cache, group)
    }
    /// The window's rows (s_loc).
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.window(b).min(p)
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (b, d) = (ctx.budget, ctx.head_dim());
        let l_win = self.window(b);
        if b <= l_win {
            return Err(ReplayError::BadParam {
                policy: "ems".into(),
                key: "window".into(),
                value: l_win.to_string(),
                msg: format!("N_budget {b} must exceed the window L_win = {l_win}; lower `window` or raise the budget"),
            });
        }
        if self.raw_space() && ctx.rope().is_none() {
            return Err(ReplayError::BadParam {
                policy: "ems".into(),
                key: "merge_space".into(),
                value: "raw".into(),
                msg:
                    "needs the trace's RoPE parameters to un-rotate keys; use merge_space=post_rope"
                        .into(),
            });
        }
        let n_tbm = match self.gamma {
            None => usize::MAX / 4,
            Some(g) => ((g - 1.0) * b as f64).floor() as usize,
        };
        let sh = Shape {
            d,
            n_budget: b,
            n_imp: b - l_win,
            n_tbm,
            s_max: b.saturating_add(n_tbm),
            l_win,
            rope: ctx.rope_cache(),
        };
        let states = self.prefill_states(ctx, &sh);
        let caches = states.iter().map(|st| self.expand(st, &sh)).collect();
        Ok((caches, Box::new(Decode::new(self.clone(), sh, states))))
    }
}
