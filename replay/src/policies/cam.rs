//! CaM: cache merging. Evicted values are merged into the entries that
//! follow (docs/methods/cam.md); a wrapper over any scorer, by default
//! StreamingLLM as in the paper's code.
//!
//! Rule (zyxxmu/cam): keys never change. When entry e is evicted, its merge
//! window W is the next m entries after e in position order among those still
//! cached; the gate is p_e = clamp(Ā_e / mean_{j∈W} Ā_j, 0, 1) with Ā
//! accumulated attention (mean over the cache's query heads); b ~ Bernoulli(p_e)
//! (or b = p_e with `expected`), and v_j += b·v_e/|W| for j in W. At the end of
//! prefill the prompt's evictions are applied one at a time in position order
//! with Ā = the prompt column sums, so merged values cascade forward; after
//! that each decode eviction merges likewise, with Ā accumulated over the
//! compressed cache. Keys are unchanged, so retention counts only the
//! surviving entries' own positions.

use std::ops::Range;
use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{mean_rows, PrefillCtx, SplitMix64, StepCtx};
use crate::scorer::{EvictMerge, EvictMergeState, TopK, Unit};

pub static INFO: PolicyInfo = PolicyInfo {
    name: "cam",
    summary: "any scorer's eviction (default StreamingLLM) whose evicted values are merged into the next m entries, gated by accumulated attention",
    paper: "CaM: Cache Merging for Memory-efficient LLMs Inference (Zhang et al., ICML 2024); zyxxmu/cam",
    params: &[
        ParamInfo { name: "scorer", default: "streaming_llm", kind: Kind::Scorer, help: "the eviction scorer whose victims are merged (its parameters are accepted too)" },
        ParamInfo { name: "m", default: "32", kind: Kind::Int, help: "merge window: entries after the evicted one that share its value" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed of the Bernoulli merge gate; (seed, layer, head) fixes each draw" },
        ParamInfo { name: "expected", default: "false", kind: Kind::Bool, help: "use b = p_e instead of a Bernoulli draw (deterministic, lower variance)" },
    ],
    caps: Caps { family: Family::Merging, phase: Phase::AsScorer, merges: true, ..Caps::EVICT_DECODE },
    test: "cam_merges_evicted_values_forward_with_the_gate",
    build: Build::ScorerWrapper {
        default_scorer: "streaming_llm",
        scorer_defaults: &[],
        build: |p, scorer| {
            let cam = Cam { m: p.int("m")?.max(1), seed: p.int("seed")? as u64, expected: p.bool("expected")? };
            Ok(Arc::new(TopK { merge: Some(Arc::new(cam)), ..TopK::new("cam", scorer) }))
        },
    },
};

#[derive(Clone, Copy, Debug)]
pub struct Cam {
    pub m: usize,
    pub seed: u64,
    pub expected: bool,
}

/// The merge gate and draw: the weight b applied to the evicted value.
fn gate(a_e: f32, window: &[f32], expected: bool, rng: &mut SplitMix64) -> f32 {
    let mean = window.iter().map(|x| *x as f64).sum::<f64>() / window.len() as f64;
    let p = if mean > 0.0 {
        (a_e as f64 / mean).clamp(0.0, 1.0)
    } else {
        1.0
    };
    if expected {
        p as f32
    } else if rng.next_f64() < p {
        1.0
    } else {
        0.0
    }
}

/// v_j += b · v_e / |W| for every j in `window` (indices into `values`, rows of d).
fn merge_into(values: &mut [f32], d: usize, e: usize, window: &[usize], b: f32) {
    if b == 0.0 {
        return;
    }
    let ve: Vec<f32> = values[e * d..(e + 1) * d].to_vec();
    let f = b / window.len() as f32;
    for &j in window {
        for (x, y) in values[j * d..(j + 1) * d].iter_mut().zip(&ve) {
            *x += f * y;
        }
    }
}

impl EvictMerge for Cam {
    /// Keys never change: an evicted value is merged into the values that
    /// follow.
    fn exact_keys(&self) -> bool {
        true
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
        unit: &Unit,
        index: usize,
        mut cache: HeadCache,
        keep: &[usize],
    ) -> (HeadCache, Box<dyn EvictMergeState>) {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let abar = mean_rows(unit.heads.clone().map(|h| ctx.colsum(h)));
        let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), index);
        if keep.len() < p {
            // The prompt's evictions in position order: every later position is
            // still cached, so e's window is e+1..=e+m.
            let mut kept = keep.iter().peekable();
            for e in 0..p {
                if kept.next_if_eq(&&e).is_some() {
                    continue;
                }
                let window: Vec<usize> = (e + 1..(e + 1 + self.m).min(p)).collect();
                let w_scores: Vec<f32> = window.iter().map(|&j| abar[j]).collect();
                let bw = gate(abar[e], &w_scores, self.expected, &mut rng);
                merge_into(&mut cache.values, d, e, &window, bw);
            }
            cache.retain_indices(keep);
        }
        let acc = keep.iter().map(|&i| abar[i]).collect();
        (
            cache,
            Box::new(Merges {
                cfg: *self,
                acc,
                rng,
            }),
        )
    }
}

/// Decode-time state of one cache.
struct Merges {
    cfg: Cam,
    /// Per entry: accumulated attention Ā.
    acc: Vec<f32>,
    rng: SplitMix64,
}

impl EvictMergeState for Merges {
    fn observe(&mut self, ctx: &StepCtx, heads: Range<usize>) {
        ctx.accumulate(&mut self.acc, heads);
    }
    fn before_evict(&mut self, c: &mut HeadCache, e: usize) {
        let window: Vec<usize> = (e + 1..(e + 1 + self.cfg.m).min(c.len())).collect();
        if !window.is_empty() {
            let w_scores: Vec<f32> = window.iter().map(|&j| self.acc[j]).collect();
            let bw = gate(self.acc[e], &w_scores, self.cfg.expected, &mut self.rng);
            let d = c.d;
            merge_into(&mut c.values, d, e, &window, bw);
        }
        self.acc.remove(e);
    }
}
