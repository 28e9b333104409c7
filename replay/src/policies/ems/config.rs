//! Ems's configuration: its parameters as typed values, read from a
//! spec, and the types its parts share (a leaf of the module).

use crate::params::{choice_enum, Params};
use crate::ReplayError;
use std::sync::Arc;

use kvreplay_kernels::cpu::RopeCache;

choice_enum! {
    /// `gqa_mode`: how many caches a layer keeps.
    pub enum GqaMode {
        /// One per query head (the paper).
        PerQueryHead = "per_query_head",
        /// One per KV head, scored with the group's mean attention.
        PerKvHead = "per_kv_head",
    }
}

choice_enum! {
    /// `merge_space`: the space keys are merged in.
    pub enum MergeSpace {
        /// Un-rotated keys; each member is re-rotated at its own position.
        Raw = "raw",
        /// The captured (post-RoPE) keys.
        PostRope = "post_rope",
    }
}

choice_enum! {
    /// `demote_rank`: how the centre demoted at decode is ranked.
    pub enum DemoteRank {
        /// By the sum of its slots' scores.
        ClusterSum = "cluster_sum",
        /// By the score of the slot at its anchor.
        AnchorSlot = "anchor_slot",
    }
}

choice_enum! {
    /// `score`: Table 4's ablation of the token score.
    pub enum Score {
        /// max(α·s_glo, s_loc).
        GlobalLocal = "global_local",
        Global = "global",
        Local = "local",
    }
}

choice_enum! {
    /// `similarity`: Table 8's ablation of the redundancy measure.
    pub enum Similarity {
        /// cos⁺(keys)·cos⁺(values).
        KeyValue = "key_value",
        Key = "key",
        Value = "value",
    }
}

impl Similarity {
    /// The redundancy from the key and value cos⁺ (each evaluated only if used).
    pub(super) fn of(self, key: impl Fn() -> f64, value: impl Fn() -> f64) -> f64 {
        match self {
            Similarity::Key => key(),
            Similarity::Value => value(),
            Similarity::KeyValue => key() * value(),
        }
    }
    pub(super) fn uses_keys(self) -> bool {
        self != Similarity::Value
    }
    pub(super) fn uses_values(self) -> bool {
        self != Similarity::Key
    }
}

choice_enum! {
    /// `zero_class`: what becomes of to-be-merged tokens no centre takes.
    pub enum ZeroClass {
        /// Evicted.
        Free = "free",
        /// Kept as zero key/value slots (ems.md A3) that still take softmax mass.
        LiteralZero = "literal_zero",
    }
}

#[derive(Clone, Debug)]
pub struct Ems {
    /// L_win; None = auto, min(32, ⌊B/2⌋).
    pub window: Option<usize>,
    pub tau: f64,
    /// None = infinite.
    pub gamma: Option<f64>,
    pub kernel: usize,
    /// Similarity on post-RoPE keys (always so with `merge_space=post_rope`).
    pub sim_pos: bool,
    pub gqa_mode: GqaMode,
    /// `budget_per=query_head`: B entries per query-head cache (G× the memory).
    pub budget_per_cache: bool,
    pub merge_space: MergeSpace,
    pub demote_rank: DemoteRank,
    pub score: Score,
    pub similarity: Similarity,
    pub zero_class: ZeroClass,
}

impl Ems {
    pub(super) fn from_params(p: &Params) -> Result<Ems, ReplayError> {
        let bad = |k: &str, v: String, m: &str| ReplayError::BadParam {
            policy: "ems".into(),
            key: k.into(),
            value: v,
            msg: m.into(),
        };
        let gamma = match p.word("gamma") {
            "inf" => None,
            _ => Some(p.float("gamma")?),
        };
        if gamma.is_some_and(|g| g < 1.0) {
            return Err(bad("gamma", p.word("gamma").into(), "must be at least 1"));
        }
        let kernel = p.int("kernel")?;
        if kernel % 2 == 0 {
            return Err(bad(
                "kernel",
                kernel.to_string(),
                "the pooling kernel must be odd",
            ));
        }
        let merge_space: MergeSpace = p.choice("merge_space")?;
        Ok(Ems {
            window: if p.word("window") == "auto" {
                None
            } else {
                Some(p.int("window")?)
            },
            tau: p.float("tau")?,
            gamma,
            kernel,
            // with post-RoPE merging there are no raw keys to compare: similarity is positional
            sim_pos: p.bool("sim_pos")? || merge_space == MergeSpace::PostRope,
            gqa_mode: p.choice("gqa_mode")?,
            budget_per_cache: p.word("budget_per") == "query_head",
            merge_space,
            demote_rank: p.choice("demote_rank")?,
            score: p.choice("score")?,
            similarity: p.choice("similarity")?,
            zero_class: p.choice("zero_class")?,
        })
    }

    pub(super) fn per_query_head(&self) -> bool {
        self.gqa_mode == GqaMode::PerQueryHead
    }

    pub(super) fn raw_space(&self) -> bool {
        self.merge_space == MergeSpace::Raw
    }

    pub(super) fn window(&self, b: usize) -> usize {
        self.window.unwrap_or(32.min(b / 2))
    }
}

/// One run's sizes: N_budget and its split into N_imp centres and the L_win
/// window, the N_tbm to-be-merged tokens, the slot cap S_max.
pub(super) struct Shape {
    pub(super) d: usize,
    pub(super) n_budget: usize,
    pub(super) n_imp: usize,
    pub(super) n_tbm: usize,
    pub(super) s_max: usize,
    pub(super) l_win: usize,
    pub(super) rope: Option<Arc<RopeCache>>,
}

impl Ems {
    pub(super) fn combine(&self, alpha: f64, glo: f64, loc: f64) -> f64 {
        match self.score {
            Score::Global => glo,
            Score::Local => loc,
            Score::GlobalLocal => (alpha * glo).max(loc),
        }
    }
}
