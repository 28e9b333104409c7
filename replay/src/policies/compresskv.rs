//! CompressKV (docs/methods/compresskv.md; Lin et al., arXiv 2508.02401,
//! code github.com/TUDa-HWAI/CompressKV): in each layer only its top `heads`
//! query heads by retrieval score (the paper's semantic retrieval heads,
//! SRHs) score the prompt, SnapKV-style: A_h[i] = Σ over the last `w` prompt
//! queries of head h of their causal softmax weight on position i < P − w,
//! average-pooled (kernel `kernel`, zero padding counted, as
//! `F.avg_pool1d`), then the mean over the SRHs. The top B_l − w positions
//! and the last w are kept: one set for every KV head of the layer (the
//! reference code gathers the same indices for all KV heads).
//!
//! Layer budgets (`alloc=error`, the paper's error-aware allocation): a
//! calibration pass at the uniform budget B measures each layer's eviction
//! error e_l = ‖O_c − O‖_F / (‖O‖_F + 1e-5), O the attention outputs of the
//! layer's query heads for its last `w` prompt queries (full cache) and O_c
//! the same over the kept set; importance e_l / Σ e; B_l = min + round(
//! importance · (L·B − L·min)), clipped to [min, 3B], then moved one entry at
//! a time (to the most important layers below 3B, or from the least
//! important above min) until Σ B_l = L·B (the reference code's
//! `error_aware_layer_budget_allocation`, min = 32 there; here min(32,
//! ⌊B/4⌋) so small budgets still adapt, our choice).
//!
//! CALIBRATED ON THE REPLAYED TRACE: the paper measures the layer errors
//! offline on a calibration set (all prompt queries, after the output
//! projection); here on the replayed prompt's last w queries without the
//! projection (a live model has them at the end of prefill: causal). The
//! SRH ranking is an ORACLE probe on the same trace (`retrieval_head`: the
//! copy score by default; `score=srh` the paper's needle-mass score). Prefill only.

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::retrieval_head::{head_scores, SpanChoice};
use crate::policy::{
    pool1d, prefill_alone, DecodeState, GroupDecodeState, PerLayer, Policy, Pool, PrefillCtx,
};
use crate::select::{keep_positions, Protect, Tie};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "compresskv",
    summary: "each layer's top retrieval heads score the prompt SnapKV-style (one kept set per layer); layer budgets from each layer's measured eviction error; prefill only",
    paper: "CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before Generation (Lin et al., arXiv 2508.02401); code github.com/TUDa-HWAI/CompressKV",
    params: &[
        ParamInfo { name: "heads", default: "4", kind: Kind::Int, help: "query heads per layer that score (the top by head score; first_k in the reference code)" },
        ParamInfo { name: "w", default: "8", kind: Kind::Int, help: "observation window: last prompt positions, always kept, whose queries score (inside B)" },
        ParamInfo { name: "kernel", default: "5", kind: Kind::Int, help: "average-pooling kernel (odd)" },
        ParamInfo { name: "score", default: "copy", kind: Kind::Choice(&["copy", "srh"]), help: "head score: copy = retrieval (copy-paste) share; srh = the paper's attention mass on the needle span at steps producing a needle token" },
        ParamInfo { name: "span", default: "auto", kind: Kind::Choice(&["auto", "prompt"]), help: "the needle span of the head score: auto = the trace's `needle` span when it has one, else the prompt" },
        ParamInfo { name: "alloc", default: "error", kind: Kind::Choice(&["error", "uniform"]), help: "layer budgets: error-aware (calibrated on this trace at B) or B everywhere" },
    ],
    caps: Caps {
        family: Family::Eviction,
        approximation: Some("ORACLE probe: the retrieval heads are ranked on the replayed trace's own decode steps (the paper: a separate needle task), copy score by default; layer errors calibrated on the replayed prompt's last w queries, before the output projection (the paper: offline, all prompt queries, after it)"),
        ..Caps::EVICT_PREFILL
    },
    test: "compresskv_scores_with_retrieval_heads_and_allocates_by_layer_error",
    build: Build::Policy(|p| {
        let heads = p.int_positive("heads", "at least one head scores")?;
        let (w, kernel) = (p.int("w")?, p.int("kernel")?);
        if kernel % 2 == 0 {
            return Err(p.bad("kernel", "the pooling kernel must be odd".into()));
        }
        Ok(Arc::new(CompressKv {
            heads,
            w,
            kernel,
            srh: p.word("score") == "srh",
            span: p.choice("span")?,
            error_alloc: p.word("alloc") == "error",
        }))
    }),
};

#[derive(Clone, Debug, PartialEq)]
pub struct CompressKv {
    pub heads: usize,
    pub w: usize,
    pub kernel: usize,
    pub srh: bool,
    pub span: SpanChoice,
    pub error_alloc: bool,
}

/// Memo key: the window rows' attention of every query head: per head,
/// (w, P) probabilities.
#[derive(Debug, PartialEq)]
struct WindowRows(usize);
impl crate::memo::MemoKey for WindowRows {
    type Value = Vec<Vec<f32>>;
}

/// Memo key: the full-cache outputs (f64) of the window rows, per (head, row).
#[derive(Debug, PartialEq)]
struct FullOutputs(usize);
impl crate::memo::MemoKey for FullOutputs {
    type Value = Vec<Vec<f64>>;
}

/// Layer budgets from per-layer importances (summing to 1): the reference
/// code's `error_aware_layer_budget_allocation(importance, total, min, max)`.
pub fn allocate(importance: &[f64], total: usize, min: usize, max: usize) -> Vec<usize> {
    let n = importance.len();
    let remaining = total as f64 - (min * n) as f64;
    let mut b: Vec<f64> = importance
        .iter()
        .map(|x| (min as f64 + (x * remaining).round_ties_even()).clamp(min as f64, max as f64))
        .collect();
    let mut diff = total as i64 - b.iter().sum::<f64>() as i64;
    // most important first when adding, least important first when removing
    let mut by_imp: Vec<usize> = (0..n).collect();
    by_imp.sort_by(|&a, &c| importance[c].total_cmp(&importance[a]).then(a.cmp(&c)));
    while diff != 0 {
        let before = diff;
        if diff > 0 {
            for &i in &by_imp {
                if b[i] < max as f64 {
                    b[i] += 1.0;
                    diff -= 1;
                    if diff == 0 {
                        break;
                    }
                }
            }
        } else {
            for &i in by_imp.iter().rev() {
                if b[i] > min as f64 {
                    b[i] -= 1.0;
                    diff += 1;
                    if diff == 0 {
                        break;
                    }
                }
            }
        }
        if diff == before {
            break;
        }
    }
    b.iter().map(|x| *x as usize).collect()
}

impl CompressKv {
    fn rows(&self, ctx: &PrefillCtx) -> Arc<Vec<Vec<f32>>> {
        let p = ctx.prompt_len();
        let w = self.w.min(p);
        ctx.memo(WindowRows(w), || {
            (0..ctx.n_heads())
                .map(|h| ctx.attn_rows(h, p - w..p))
                .collect()
        })
    }

    /// The layer's scoring heads: the top `heads` by head score, ties to the
    /// lower index.
    pub fn scoring_heads(&self, ctx: &PrefillCtx) -> Vec<usize> {
        let s = head_scores(ctx, self.span);
        let v = if self.srh { &s.srh } else { &s.retrieval };
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        order.truncate(self.heads.min(v.len()));
        order
    }

    /// Kept prompt positions of a layer at budget `b` (< P).
    fn keep(&self, ctx: &PrefillCtx, b: usize) -> Vec<usize> {
        let p = ctx.prompt_len();
        if p <= b {
            return (0..p).collect();
        }
        let w = self.w.min(p);
        if b <= w {
            return (p - b..p).collect();
        }
        let rows = self.rows(ctx);
        let heads = self.scoring_heads(ctx);
        let n = p - w;
        let mut score = vec![0f32; n];
        for &h in &heads {
            let mut a = vec![0f32; n];
            for row in rows[h].chunks_exact(p) {
                a.iter_mut().zip(&row[..n]).for_each(|(x, y)| *x += y);
            }
            let pooled = pool1d(&a, self.kernel, Pool::Avg);
            score.iter_mut().zip(pooled).for_each(|(x, y)| *x += y);
        }
        score.iter_mut().for_each(|x| *x /= heads.len() as f32);
        keep_positions(
            p,
            Protect {
                sinks: 0,
                recent: w,
            },
            &score,
            b - w,
            Tie::KeepLater,
        )
    }

    /// The layer's eviction error at uniform budget `b` (see the module doc).
    pub fn layer_error(&self, ctx: &PrefillCtx, b: usize) -> f64 {
        let p = ctx.prompt_len();
        let keep = self.keep(ctx, b);
        let rows = self.rows(ctx);
        let d = ctx.head_dim();
        // the full outputs of the window rows: budget-independent
        let full = ctx.memo(FullOutputs(self.w.min(p)), || {
            rows.iter()
                .enumerate()
                .flat_map(|(h, r)| {
                    let g = h / ctx.group();
                    r.chunks_exact(p)
                        .map(|row| {
                            let mut o = vec![0f64; d];
                            for (j, pj) in row.iter().enumerate() {
                                o.iter_mut()
                                    .zip(ctx.value(g, j))
                                    .for_each(|(o, x)| *o += *pj as f64 * *x as f64);
                            }
                            o
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        });
        let (mut err, mut norm) = (0f64, 0f64);
        let per_head = rows.first().map_or(0, |r| r.len() / p);
        for (h, r) in rows.iter().enumerate() {
            let g = h / ctx.group();
            for (i, row) in r.chunks_exact(p).enumerate() {
                let full = &full[h * per_head + i];
                let mut comp = vec![0f64; d];
                let mut z = 0f64;
                for &j in &keep {
                    let pj = row[j] as f64;
                    z += pj;
                    comp.iter_mut()
                        .zip(ctx.value(g, j))
                        .for_each(|(o, x)| *o += pj * *x as f64);
                }
                for (c, f) in comp.iter().zip(full) {
                    let c = c / z;
                    err += (c - f) * (c - f);
                    norm += f * f;
                }
            }
        }
        err.sqrt() / (norm.sqrt() + 1e-5)
    }

    /// Per layer of the group, its budget.
    pub fn budgets(&self, ctxs: &[PrefillCtx]) -> Vec<usize> {
        let b = ctxs[0].budget;
        if !self.error_alloc || ctxs.iter().all(|c| c.prompt_len() <= b) {
            return vec![b; ctxs.len()];
        }
        let errs: Vec<f64> = ctxs.iter().map(|c| self.layer_error(c, b)).collect();
        let tot: f64 = errs.iter().sum();
        if tot.is_nan() || tot <= 0.0 {
            return vec![b; ctxs.len()];
        }
        let imp: Vec<f64> = errs.iter().map(|e| e / tot).collect();
        let min = (b / 4).min(32);
        allocate(&imp, b * ctxs.len(), min, 3 * b)
    }
}

impl Policy for CompressKv {
    fn name(&self) -> String {
        "compresskv".into()
    }

    /// The window's rows, and the last prompt query for the head probe.
    fn prompt_queries(&self, prompt_len: usize, _: usize) -> usize {
        self.w.max(1).min(prompt_len)
    }

    fn layer_groups(&self, n_layers: usize, _: usize, _: usize) -> Vec<Vec<usize>> {
        match self.error_alloc {
            true => vec![(0..n_layers).collect()],
            false => (0..n_layers).map(|l| vec![l]).collect(),
        }
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        prefill_alone(self, ctx)
    }

    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let budgets = self.budgets(ctxs);
        let caches = ctxs
            .iter()
            .zip(&budgets)
            .map(|(c, &b)| {
                let keep = self.keep(c, b.max(1));
                (0..c.n_kv_heads())
                    .map(|g| c.exact_cache(g, &keep))
                    .collect()
            })
            .collect();
        Ok((caches, PerLayer::append_only(ctxs.len())))
    }
}
