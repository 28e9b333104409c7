//! CaM: cache merging. Evicted values are merged into the entries that follow.
//!
//! Rule (landscape.md B3, zyxxmu/cam): CaM wraps an eviction policy (here its
//! default base, StreamingLLM with n_sink sinks) and never changes keys. When
//! entry e is evicted, its merge window W is the next m entries after e in
//! position order among those still cached; the gate is
//! p_e = clamp(Ā_e / mean_{j∈W} Ā_j, 0, 1) with Ā accumulated attention
//! (group mean); b ~ Bernoulli(p_e) (or b = p_e with `expected`), and
//! v_j += b·v_e/|W| for j in W. At the end of prefill the prompt's evictions
//! are applied one at a time in position order with Ā = the prompt column
//! sums, so merged values cascade forward; after that one eviction and one
//! merge happen per decode step with Ā accumulated over the compressed cache.
//! Keys are unchanged, so retention counts only the surviving entries' own
//! positions.

use std::sync::Arc;

use super::streaming_llm;
use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{mean_rows, DecodeState, Policy, PrefillCtx, SplitMix64, StepCtx};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "cam",
    summary: "StreamingLLM eviction whose evicted values are merged into the next m entries, gated by accumulated attention",
    paper: "CaM: Cache Merging for Memory-efficient LLMs Inference (Zhang et al., ICML 2024); zyxxmu/cam",
    params: &[
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "sinks of the StreamingLLM base (inside B)" },
        ParamInfo { name: "m", default: "32", kind: Kind::Int, help: "merge window: entries after the evicted one that share its value" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed of the Bernoulli merge gate; (seed, layer, head) fixes each draw" },
        ParamInfo { name: "expected", default: "false", kind: Kind::Bool, help: "use b = p_e instead of a Bernoulli draw (deterministic, lower variance)" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(Cam { n_sink: p.int("n_sink")?, m: p.int("m")?.max(1), seed: p.int("seed")? as u64, expected: p.bool("expected")? }))
    },
};

pub struct Cam {
    pub n_sink: usize,
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

impl Policy for Cam {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b, d, gs) = (ctx.prompt_len(), ctx.budget, ctx.head_dim(), ctx.group());
        let keep = streaming_llm::kept_positions(p, b, self.n_sink);
        let mut caches = Vec::new();
        let mut acc = Vec::new();
        let mut rngs = Vec::new();
        for g in 0..ctx.n_kv_heads() {
            let abar = mean_rows((g * gs..(g + 1) * gs).map(|h| ctx.colsum(h)));
            let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), g);
            let mut cache = ctx.full_cache(g);
            if p > b {
                // Stream the prompt's evictions in position order: e's window is e+1..=e+m.
                let s = self.n_sink.min(b);
                for e in s..p - (b - s) {
                    let window: Vec<usize> = (e + 1..(e + 1 + self.m).min(p)).collect();
                    let w_scores: Vec<f32> = window.iter().map(|&j| abar[j]).collect();
                    let bw = gate(abar[e], &w_scores, self.expected, &mut rng);
                    merge_into(&mut cache.values, d, e, &window, bw);
                }
                cache.retain_indices(&keep);
            }
            acc.push(keep.iter().map(|&i| abar[i]).collect::<Vec<f32>>());
            rngs.push(rng);
            caches.push(cache);
        }
        Ok((
            caches,
            Box::new(Evict {
                n_sink: self.n_sink,
                m: self.m,
                expected: self.expected,
                acc,
                rngs,
            }),
        ))
    }
}

struct Evict {
    n_sink: usize,
    m: usize,
    expected: bool,
    /// Per KV head, per entry: accumulated attention Ā.
    acc: Vec<Vec<f32>>,
    rngs: Vec<SplitMix64>,
}

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for (g, c) in caches.iter_mut().enumerate() {
            let a = &mut self.acc[g];
            a.push(0.0);
            for (x, y) in a.iter_mut().zip(ctx.group_mean(g)) {
                *x += y;
            }
            let s = self.n_sink.min(ctx.budget);
            while c.len() > ctx.budget {
                let e = s; // StreamingLLM's victim: the oldest non-sink entry
                let window: Vec<usize> = (e + 1..(e + 1 + self.m).min(c.len())).collect();
                if !window.is_empty() {
                    let w_scores: Vec<f32> = window.iter().map(|&j| a[j]).collect();
                    let bw = gate(a[e], &w_scores, self.expected, &mut self.rngs[g]);
                    let d = c.d;
                    merge_into(&mut c.values, d, e, &window, bw);
                }
                c.remove(e);
                a.remove(e);
            }
        }
    }
}
