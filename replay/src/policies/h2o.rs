//! H2O: heavy hitters (accumulated attention) plus a recent window
//! (docs/methods/h2o.md). s_i = Σ_j A_{j,i} over every query that has seen i
//! (the prompt queries, causal, then each decode query over the compressed
//! cache), reduced to the KV head by the group mean. Keep the r = ⌊B/2⌋ most
//! recent entries and the B − r highest scores among the rest. At decode the
//! step's attention row is added to s (a new entry starts with its own
//! self-attention), then the lowest-scoring entry outside the recent r is
//! evicted (earliest position on ties); an evicted entry's score is discarded.
//! `mean` divides position i's prompt column sum by P − i, the number of
//! prompt queries that see it (kvpress ObservedAttentionPress; prefill only).
//! `preset=kvpress` is that press: `mean=true, recent=0, decode_evict=false`.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo, Preset};
use crate::policy::{mean_rows, PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::Protect;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "h2o",
    summary: "recent window + heavy hitters by accumulated attention; evicts one entry per decode step",
    paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (Zhang et al., NeurIPS 2023, arXiv 2306.14048); FMInference/H2O",
    params: &[
        ParamInfo { name: "recent", default: "half", kind: Kind::IntOr("half"), help: "recent entries kept (inside B): `half` = ⌊B/2⌋, or a number" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode (false = KVCache-Factory's prefill-only form)" },
        ParamInfo { name: "mean", default: "false", kind: Kind::Bool, help: "divide each prompt column sum by the number of prompt queries that see it (kvpress ObservedAttentionPress; needs decode_evict=false)" },
        ParamInfo { name: "preset", default: "paper", kind: Kind::Preset(PRESETS), help: "kvpress: NVIDIA kvpress 0.5.x ObservedAttentionPress, its closest to H2O (sets the parameters not given)" },
    ],
    caps: Caps::EVICT_DECODE,
    test: "h2o_uses_the_group_mean_and_prefers_later_positions_on_ties",
    build: Build::Scorer(|p| {
        let recent = match p.word("recent") {
            "half" => None,
            _ => Some(p.int("recent")?),
        };
        let (decode_evict, mean) = (p.bool("decode_evict")?, p.bool("mean")?);
        if mean && decode_evict {
            return Err(p.bad("mean", "divides the prompt's column sums only: use it with decode_evict=false".into()));
        }
        Ok(Arc::new(H2o { recent, decode_evict, mean }))
    }),
};

/// The presets: `paper` sets nothing; `kvpress` is kvpress's
/// ObservedAttentionPress (kvpress has no H2O press).
pub static PRESETS: &[Preset] = &[
    Preset::PAPER,
    Preset {
        name: "kvpress",
        sets: &[("mean", "true"), ("recent", "0"), ("decode_evict", "false")],
    },
];

pub struct H2o {
    /// None = ⌊B/2⌋.
    pub recent: Option<usize>,
    pub decode_evict: bool,
    /// Divide position i's column sum by P − i.
    pub mean: bool,
}

impl Scorer for H2o {
    /// Reads keys, values and column sums only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let mut s = mean_rows(u.heads.clone().map(|h| ctx.colsum(h)));
        if self.mean {
            let p = ctx.prompt_len();
            s.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x /= (p - i) as f32);
        }
        s
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::new(0, self.recent.unwrap_or(b / 2), b))
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, _: &PrefillCtx, sel: &Selected) -> Option<Box<dyn StepScorer>> {
        Some(Box::new(Accumulated {
            acc: (0..sel.units.len()).map(|u| sel.kept_scores(u)).collect(),
            heads: sel.units.iter().map(|u| u.heads.clone()).collect(),
        }))
    }
}

/// Accumulated attention of every entry of each cache (H2O's decode scores).
pub struct Accumulated {
    pub acc: Vec<Vec<f32>>,
    /// Per cache, the query heads that read it.
    pub heads: Vec<std::ops::Range<usize>>,
}

impl StepScorer for Accumulated {
    fn observe(&mut self, ctx: &StepCtx, c: usize, _: &HeadCache) {
        ctx.accumulate(&mut self.acc[c], self.heads[c].clone());
    }
    fn scores(&mut self, _: &StepCtx, c: usize, _: &HeadCache) -> &[f32] {
        &self.acc[c]
    }
    fn evicted(&mut self, c: usize, e: usize) {
        self.acc[c].remove(e);
    }
}
