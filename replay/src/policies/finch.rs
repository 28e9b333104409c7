//! Finch (docs/methods/finch.md), kvpress `FinchPress` (NVIDIA/kvpress 0.5.4,
//! unchanged since): SnapKV-like scoring by the question's queries.
//!
//! kvpress finds the question by a delimiter token inserted between context
//! and question; a trace has no delimiter, so here the question is the last w
//! prompt positions (parameter `question`, our choice of default 32). For query head
//! h, the window rows j = P − w .. P − 1 attend (softmax over every key they
//! see, the model's scale) to the keys i < P − w; with `normalize` (kvpress
//! normalize_scores) row j is multiplied by j (kvpress multiplies by
//! arange(P − w, P), its count of non-zero weights); the score is the mean over
//! the rows, then over the query heads of the KV head's group. No pooling. The
//! question window is always kept; keep the top B − w of the rest. Prefill only.
//! kvpress's optional chunked selection (chunk_length, default None) is not
//! implemented; kvpress re-rotates the kept keys (rerotate_keys=True): that is
//! the `keyrerotation` wrapper's job, not done here (the method page says so).

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{mean_rows, PrefillCtx};
use crate::scorer::{Scorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "finch",
    summary: "the question (the last w prompt positions) votes with its attention, each row weighted by its position, averaged over rows and the GQA group; question kept; prefill only",
    paper: "Finch: Prompt-guided Key-Value Cache Compression for Large Language Models (Corallo and Papotti, TACL 2024, doi 10.1162/tacl_a_00716); kvpress FinchPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "question", default: "32", kind: Kind::Int, help: "question length w: the last w prompt positions (kvpress: the tokens after its delimiter; our choice of default)" },
        ParamInfo { name: "normalize", default: "true", kind: Kind::Bool, help: "weight window row j by j, kvpress's count of its non-zero weights (kvpress normalize_scores)" },
    ],
    caps: Caps {
        approximation: Some("the question is the last w prompt positions (a trace has no delimiter token); kept keys are not re-rotated (kvpress rerotate_keys: compose with the keyrerotation wrapper)"),
        ..Caps::EVICT_PREFILL
    },
    test: "finch_weights_question_rows_by_position",
    build: Build::Scorer(|p| {
        let w = p.int_positive("question", "the question needs at least one position")?;
        Ok(Arc::new(Finch { w, normalize: p.bool("normalize")? }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finch {
    pub w: usize,
    pub normalize: bool,
}

impl Finch {
    /// Scores of positions 0..P − w for the query heads `heads` (the
    /// question's are added by `score`).
    fn compute(&self, ctx: &PrefillCtx, heads: std::ops::Range<usize>) -> Vec<f32> {
        let p = ctx.prompt_len();
        let w = self.w.min(p);
        let per_head: Vec<Vec<f32>> = heads
            .map(|h| {
                let rows = ctx.attn_rows(h, p - w..p);
                let mut s = vec![0f64; p - w];
                for (r, row) in rows.chunks_exact(p).enumerate() {
                    let weight = if self.normalize {
                        (p - w + r) as f64
                    } else {
                        1.0
                    };
                    s.iter_mut()
                        .zip(row)
                        .for_each(|(a, x)| *a += *x as f64 * weight);
                }
                s.iter().map(|a| (a / w as f64) as f32).collect()
            })
            .collect();
        mean_rows(per_head.iter().map(|v| v.as_slice()))
    }
}

/// Memo key of the question votes of the query heads `heads`.
#[derive(Debug, PartialEq)]
struct QuestionVotes {
    cfg: Finch,
    heads: std::ops::Range<usize>,
}
impl crate::memo::MemoKey for QuestionVotes {
    type Value = Vec<f32>;
}

impl Scorer for Finch {
    /// The question's rows.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        self.w.min(p)
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        // Budget-independent: computed once per trace and layer in a sweep.
        let key = QuestionVotes {
            cfg: *self,
            heads: u.heads.clone(),
        };
        let mut s = ctx
            .memo(key, || self.compute(ctx, u.heads.clone()))
            .as_ref()
            .clone();
        // kvpress pads the question with the maximum score + 1
        let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        s.resize(ctx.prompt_len(), top + 1.0);
        s
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.w, b))
    }
}
