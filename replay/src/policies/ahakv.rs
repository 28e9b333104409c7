//! AhaKV: recent accumulation, step-gain softmax and a value prior
//! (docs/methods/ahakv.md; spec §2): per KV head, score the prompt with the
//! last W = min(B_r, n) query rows only (Recent Accumulation), each row's
//! logits multiplied by the gain g(c) = √(2·max(0, ln(c/k))), c = p + 1 keys
//! visible, k = B (Step-Gain softmax); F = group mean of the rows' sums.
//! Multiply by the value prior γ̄ = avg-pooled ‖v‖² (kernel 7, valid-count
//! edges) over its maximum (VPE). Keep the B_r most recent prompt positions and
//! the top B − B_r of the rest by F̂ (tie: smaller position). Decode: add the
//! group mean of each step's SG-softmax row over the cache (gain at the
//! absolute position); when the cache exceeds B evict the smallest score
//! outside the B_r newest (tie: the larger position).

use std::sync::Arc;

use kvreplay_kernels::cpu::{dot_rows, softmax_f64_norm};

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{choice_enum, Kind, ParamInfo, Params};
use crate::policy::{PrefillCtx, StepCtx};
use crate::scorer::{Scorer, Selected, StepScorer, Unit};
use crate::select::{Protect, Tie};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "ahakv",
    summary: "H2O-style eviction scored by recent accumulation, step-gain softmax and a value-norm prior",
    paper: "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of Large Language Models (Gu et al., arXiv 2506.03762)",
    params: &[
        ParamInfo { name: "recent", default: "auto", kind: Kind::IntOr("auto"), help: "B_r: recent window and observation rows; auto = min(32, ⌊B/2⌋) (paper: 32, requires B > B_r)" },
        ParamInfo { name: "use_ra", default: "true", kind: Kind::Bool, help: "recent accumulation (false: sum over all prompt rows, H2O-style)" },
        ParamInfo { name: "use_sg", default: "true", kind: Kind::Bool, help: "step-gain softmax for scoring (false: g = 1)" },
        ParamInfo { name: "use_vpe", default: "true", kind: Kind::Bool, help: "value-prior enhancement" },
        ParamInfo { name: "gain_form", default: "derived", kind: Kind::Choice(&["derived", "literal"]), help: "g = √(2 ln(c/k)) on the model's logits, or Eq. 12 as printed (÷ d inside the root)" },
        ParamInfo { name: "gain_count", default: "absolute", kind: Kind::Choice(&["absolute", "cache_len"]), help: "c at decode: absolute position + 1, or the cache length" },
        ParamInfo { name: "w_pool", default: "7", kind: Kind::Int, help: "average-pool kernel of the value prior (odd)" },
        ParamInfo { name: "pool_edges", default: "valid_count", kind: Kind::Choice(&["valid_count", "zero_pad"]), help: "divide edge windows by the valid count, or by w_pool (PyTorch's zero padding)" },
        ParamInfo { name: "min_gain", default: "0", kind: Kind::Float, help: "lower clamp of the step gain (0: uniform rows while c <= k)" },
        ParamInfo { name: "pool_refined", default: "false", kind: Kind::Bool, help: "also smooth the refined score with the same pool before selection" },
        ParamInfo { name: "gqa_mode", default: "per_kv_head", kind: Kind::Choice(&["per_kv_head", "per_query_head"]), help: "one cache per KV head (group-reduced scores) or per query head" },
        crate::policy::BUDGET_PER,
        ParamInfo { name: "gqa_agg", default: "mean", kind: Kind::Choice(&["mean", "sum", "max"]), help: "reduction of the group's SG probabilities" },
        ParamInfo { name: "n_sink", default: "0", kind: Kind::Int, help: "extension: first positions always kept (paper: none)" },
        ParamInfo { name: "decode_evict", default: "true", kind: Kind::Bool, help: "hold B entries during decode" },
    ],
    caps: Caps::EVICT_DECODE,
    test: "ahakv_step_gain_and_value_prior_choose_the_prefill_set",
    build: Build::Scorer(|p| Ok(Arc::new(AhaKv::from_params(p)?))),
};

choice_enum! {
    /// Reduction of a group's SG probabilities.
    pub enum Agg {
        Mean = "mean",
        Sum = "sum",
        Max = "max",
    }
}

#[derive(Clone, Copy, Debug)]
pub struct AhaKv {
    /// None = auto.
    pub recent: Option<usize>,
    pub use_ra: bool,
    pub use_sg: bool,
    pub use_vpe: bool,
    pub literal_gain: bool,
    pub gain_cache_len: bool,
    pub w_pool: usize,
    pub zero_pad: bool,
    pub n_sink: usize,
    pub decode_evict: bool,
    pub min_gain: f32,
    pub pool_refined: bool,
    pub per_query_head: bool,
    /// `budget_per=query_head`: B entries per query-head cache (G× the memory).
    pub budget_per_cache: bool,
    pub gqa_agg: Agg,
}

impl Default for AhaKv {
    /// The paper's configuration (every component on, B_r = auto).
    fn default() -> Self {
        AhaKv {
            recent: None,
            use_ra: true,
            use_sg: true,
            use_vpe: true,
            literal_gain: false,
            gain_cache_len: false,
            w_pool: 7,
            zero_pad: false,
            n_sink: 0,
            decode_evict: true,
            min_gain: 0.0,
            pool_refined: false,
            per_query_head: false,
            budget_per_cache: false,
            gqa_agg: Agg::Mean,
        }
    }
}

impl AhaKv {
    fn from_params(p: &Params) -> Result<AhaKv, ReplayError> {
        let w_pool = p.int("w_pool")?;
        if w_pool % 2 == 0 {
            return Err(ReplayError::BadParam {
                policy: "ahakv".into(),
                key: "w_pool".into(),
                value: w_pool.to_string(),
                msg: "the pooling kernel must be odd".into(),
            });
        }
        Ok(AhaKv {
            recent: if p.word("recent") == "auto" {
                None
            } else {
                Some(p.int("recent")?)
            },
            use_ra: p.bool("use_ra")?,
            use_sg: p.bool("use_sg")?,
            use_vpe: p.bool("use_vpe")?,
            literal_gain: p.word("gain_form") == "literal",
            gain_cache_len: p.word("gain_count") == "cache_len",
            w_pool,
            zero_pad: p.word("pool_edges") == "zero_pad",
            n_sink: p.int("n_sink")?,
            decode_evict: p.bool("decode_evict")?,
            min_gain: p.float("min_gain")? as f32,
            pool_refined: p.bool("pool_refined")?,
            per_query_head: p.word("gqa_mode") == "per_query_head",
            budget_per_cache: p.word("budget_per") == "query_head",
            gqa_agg: p.choice("gqa_agg")?,
        })
    }

    /// The step gain for a row that sees `c` keys, with budget `k` and head dim `d`.
    pub fn gain(&self, c: usize, k: usize, d: usize) -> f32 {
        if !self.use_sg {
            return 1.0;
        }
        let l = (c as f64 / k as f64).ln().max(0.0);
        let g = if self.literal_gain {
            (2.0 * l / d as f64).sqrt()
        } else {
            (2.0 * l).sqrt()
        };
        (g as f32).max(self.min_gain)
    }

    /// Reduce one head's row `x` into the running group aggregate `acc` (the
    /// `i`-th of `n` heads).
    fn agg(&self, acc: &mut [f32], x: &[f32], i: usize, n: usize) {
        for (a, v) in acc.iter_mut().zip(x) {
            *a = match self.gqa_agg {
                Agg::Sum => *a + v,
                Agg::Max if i == 0 => *v,
                Agg::Max => a.max(*v),
                Agg::Mean => *a + v / n as f32,
            };
        }
    }

    fn recent(&self, b: usize) -> usize {
        self.recent.unwrap_or(32.min(b / 2))
    }
}

/// Average pool with kernel `w` (odd), stride 1; edges divide by the valid count
/// or, with `zero_pad`, by w.
pub fn avg_pool(x: &[f32], w: usize, zero_pad: bool) -> Vec<f32> {
    let h = w / 2;
    (0..x.len())
        .map(|i| {
            let win = &x[i.saturating_sub(h)..(i + h + 1).min(x.len())];
            let n = if zero_pad { w } else { win.len() };
            (win.iter().map(|v| *v as f64).sum::<f64>() / n as f64) as f32
        })
        .collect()
}

impl AhaKv {
    /// F̂ of one cache: the group-reduced column sums of the SG rows, times
    /// the value prior, optionally pooled.
    fn refined(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        let (n, b, d) = (ctx.prompt_len(), ctx.budget, ctx.head_dim());
        let br = self.recent(b);
        let rows = if self.use_ra { n - br.min(n)..n } else { 0..n };
        let mut f = vec![0f32; n];
        let nheads = u.heads.len();
        for (k, h) in u.heads.clone().enumerate() {
            let a = ctx.attn_rows_with_gain(h, rows.clone(), |j| self.gain(j + 1, b, d));
            let mut col = vec![0f32; n];
            for row in a.chunks_exact(n) {
                col.iter_mut().zip(row).for_each(|(c, x)| *c += x);
            }
            self.agg(&mut f, &col, k, nheads);
        }
        if self.use_vpe {
            let nu: Vec<f32> = (0..n)
                .map(|j| ctx.value(u.kv_head, j).iter().map(|v| v * v).sum())
                .collect();
            let gamma = avg_pool(&nu, self.w_pool, self.zero_pad);
            let mx = gamma.iter().cloned().fold(0f32, f32::max);
            if mx > 0.0 {
                f.iter_mut().zip(&gamma).for_each(|(a, gm)| *a *= gm / mx);
            }
        }
        if self.pool_refined {
            f = avg_pool(&f, self.w_pool, self.zero_pad);
        }
        f
    }
}

impl Scorer for AhaKv {
    /// The recent-accumulation rows (every row without it).
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        if self.use_ra {
            self.recent(b).min(p)
        } else {
            p
        }
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        self.refined(ctx, u)
    }
    fn protect(&self, b: usize) -> Result<Protect, ReplayError> {
        let br = self.recent(b);
        if b <= br {
            return Err(ReplayError::BadParam {
                policy: "ahakv".into(),
                key: "recent".into(),
                value: br.to_string(),
                msg: format!("budget {b} must exceed the recent window B_r = {br} (B_s = B - B_r >= 1); lower `recent` or raise the budget"),
            });
        }
        Ok(Protect {
            sinks: self.n_sink.min(b - br),
            recent: br,
        })
    }
    /// The reference keeps the smaller position on ties (and evicts the larger).
    fn tie(&self) -> Tie {
        Tie::KeepEarlier
    }
    fn per_query_head(&self) -> bool {
        self.per_query_head
    }
    fn budget_share(&self, group: usize) -> usize {
        crate::policy::share_of(self.per_query_head, self.budget_per_cache, group)
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, ctx: &PrefillCtx, sel: &Selected) -> Option<Box<dyn StepScorer>> {
        Some(Box::new(StepGain {
            cfg: *self,
            d: ctx.head_dim(),
            scores: (0..sel.units.len()).map(|u| sel.kept_scores(u)).collect(),
            heads: sel.units.iter().map(|u| u.heads.clone()).collect(),
        }))
    }
}

/// Decode: each step's SG-softmax rows over the cache, group-reduced and accumulated.
struct StepGain {
    cfg: AhaKv,
    d: usize,
    scores: Vec<Vec<f32>>,
    heads: Vec<std::ops::Range<usize>>,
}

impl StepScorer for StepGain {
    fn observe(&mut self, ctx: &StepCtx, ci: usize, c: &HeadCache) {
        let f = &mut self.scores[ci];
        f.push(0.0);
        let count = if self.cfg.gain_cache_len {
            c.len()
        } else {
            ctx.pos + 1
        };
        let gain = self.cfg.gain(count, ctx.budget, self.d);
        let heads = self.heads[ci].clone();
        let nheads = heads.len();
        let n = c.len();
        let mut inc = vec![0f32; n];
        // every query head's dot products with every entry at once (the same
        // bits as `dot` pair by pair): (nheads, n)
        let qs: Vec<f32> = heads
            .clone()
            .flat_map(|h| ctx.queries[h])
            .copied()
            .collect();
        let mut z = vec![0f32; nheads * n];
        dot_rows(&qs, &c.keys, self.d, &mut z);
        for k in 0..nheads {
            // SG-softmax over the cache entries with the model's scale and the step gain.
            let zk = &mut z[k * n..(k + 1) * n];
            zk.iter_mut().for_each(|x| *x *= gain * ctx.scale);
            softmax_f64_norm(zk);
            self.cfg.agg(&mut inc, zk, k, nheads);
        }
        f.iter_mut().zip(&inc).for_each(|(a, x)| *a += x);
    }
    fn scores(&mut self, _: &StepCtx, ci: usize, _: &HeadCache) -> &[f32] {
        &self.scores[ci]
    }
    fn evicted(&mut self, c: usize, e: usize) {
        self.scores[c].remove(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AhaKv {
        AhaKv::default()
    }

    #[test]
    fn gain_values_from_the_spec() {
        let c = cfg();
        for (count, want) in [
            (1500, 0.9005),
            (4000, 1.6651),
            (8000, 2.0393),
            (32000, 2.6328),
        ] {
            assert!((c.gain(count, 1000, 128) - want).abs() < 1e-4, "g({count})");
        }
        assert_eq!(c.gain(1000, 1000, 128), 0.0);
        assert_eq!(c.gain(10, 1000, 128), 0.0);
        let lit = AhaKv {
            literal_gain: true,
            ..cfg()
        };
        assert!((lit.gain(4000, 1000, 128) - 0.1472).abs() < 1e-4);
        assert_eq!(
            AhaKv {
                use_sg: false,
                ..cfg()
            }
            .gain(4000, 1000, 128),
            1.0
        );
    }

    #[test]
    fn group_reductions() {
        let (m, s, x) = (
            cfg(),
            AhaKv {
                gqa_agg: Agg::Sum,
                ..cfg()
            },
            AhaKv {
                gqa_agg: Agg::Max,
                ..cfg()
            },
        );
        let rows = [[0.2f32, 0.8], [0.6, 0.4]];
        let run = |c: &AhaKv| {
            let mut acc = vec![0f32; 2];
            for (i, r) in rows.iter().enumerate() {
                c.agg(&mut acc, r, i, 2);
            }
            acc
        };
        assert_eq!(run(&m), vec![0.4, 0.6]);
        assert_eq!(run(&s), vec![0.8, 1.2]);
        assert_eq!(run(&x), vec![0.6, 0.8]);
    }

    #[test]
    fn value_prior_pooling_edges() {
        // constant norms: valid-count pooling keeps them constant; zero padding
        // scales position 0 by (⌊7/2⌋ + 1)/7 = 4/7
        let x = vec![2.0f32; 20];
        assert!(avg_pool(&x, 7, false)
            .iter()
            .all(|v| (*v - 2.0).abs() < 1e-6));
        let z = avg_pool(&x, 7, true);
        assert!((z[0] - 2.0 * 4.0 / 7.0).abs() < 1e-6 && (z[10] - 2.0).abs() < 1e-6);
    }
}
