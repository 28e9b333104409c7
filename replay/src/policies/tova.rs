//! TOVA: token omission via attention of the current query
//! (docs/methods/tova.md). The score is the current query's attention
//! averaged over all H query heads of the layer, and the same positions are
//! kept for every KV head. Prefill: keep the top B by the last prompt query's
//! row. Decode: the query attends to B + 1 entries, then the lowest-scoring
//! entry (the new one included) is evicted. No sinks, no window.
//! `per_kv_head` scores each KV head by its group's mean instead.
//! `keep_last` always keeps the newest entry (the last prompt position at
//! prefill, each step's new entry at decode), as kvpress TOVAPress pads the
//! last position's score above every other. `preset=kvpress` is kvpress
//! 0.5.x's TOVAPress: `keep_last=true`, `decode_evict=false`.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo, Preset};
use crate::policy::{mean_rows, PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "tova",
    summary: "keeps what the current query attends to most (mean over all heads of the layer); evicts one entry per decode step",
    paper: "Transformers are Multi-State RNNs (Oren et al., EMNLP 2024, arXiv 2401.06104); schwartz-lab-NLP/TOVA",
    params: &[
        ParamInfo { name: "per_kv_head", default: "false", kind: Kind::Bool, help: "score each KV head by its own group (default: one layer-wide score)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false: prefill only, as kvpress TOVAPress)" },
        ParamInfo { name: "keep_last", default: "false", kind: Kind::Bool, help: "always keep the newest entry (inside B), as kvpress TOVAPress keeps the last prompt position" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x TOVAPress (sets the parameters not given)" },
    ],
    caps: Caps::EVICT_DECODE,
    test: "tova_scores_with_the_mean_over_all_heads_of_the_layer",
    build: Build::Scorer(|p| Ok(Arc::new(Tova { per_kv_head: p.bool("per_kv_head")?, decode_evict: p.bool("decode_evict")?, keep_last: p.bool("keep_last")? }))),
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's TOVAPress.
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[
            ("keep_last", "true"),
            ("decode_evict", "false"),
            ("per_kv_head", "false"),
        ],
    },
];

pub struct Tova {
    pub per_kv_head: bool,
    pub decode_evict: bool,
    pub keep_last: bool,
}

impl Tova {
    /// The query heads whose attention scores a cache read by `heads`.
    fn scoring_heads(
        &self,
        heads: &std::ops::Range<usize>,
        n_heads: usize,
    ) -> std::ops::Range<usize> {
        if self.per_kv_head {
            heads.clone()
        } else {
            0..n_heads
        }
    }
}

/// Memo key: every query head's attention row of the last prompt query.
#[derive(Debug, PartialEq)]
struct LastPromptRows;
impl crate::memo::MemoKey for LastPromptRows {
    type Value = Vec<Vec<f32>>;
}

impl Scorer for Tova {
    /// The last prompt query's row.
    fn prompt_queries(&self, p: usize, _: usize) -> usize {
        1.min(p)
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let p = ctx.prompt_len();
        let last = ctx.memo(LastPromptRows, || {
            (0..ctx.n_heads())
                .map(|h| ctx.attn_rows(h, p - 1..p))
                .collect::<Vec<Vec<f32>>>()
        });
        let heads = self.scoring_heads(&u.heads, ctx.n_heads());
        mean_rows(last[heads].iter().map(|r| r.as_slice()))
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, usize::from(self.keep_last), b))
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, ctx: &PrefillCtx, sel: &Selected) -> Option<Box<dyn StepScorer>> {
        let heads = sel
            .units
            .iter()
            .map(|u| self.scoring_heads(&u.heads, ctx.n_heads()))
            .collect();
        Some(Box::new(StepMean { heads, last: None }))
    }
}

/// Decode: the step's attention averaged over the scoring heads (computed
/// once per step when every cache shares them, as in the layer-wide default).
struct StepMean {
    heads: Vec<std::ops::Range<usize>>,
    /// (step, scoring heads, mean) of the last mean computed.
    last: Option<(usize, std::ops::Range<usize>, Vec<f32>)>,
}

impl StepScorer for StepMean {
    fn scores(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) -> &[f32] {
        let heads = self.heads[c].clone();
        let fresh = !matches!(&self.last, Some((pos, h, _)) if *pos == ctx.pos && *h == heads);
        if fresh {
            let mean = mean_rows(ctx.probs[heads.clone()].iter().map(|r| r.as_slice()));
            self.last = Some((ctx.pos, heads, mean));
        }
        &self.last.as_ref().expect("set above").2
    }
}
