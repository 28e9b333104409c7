//! What the claims share: `Verdict`, `Claim`, the measurement context `Ctx`
//! and small helpers (a leaf: the per-paper files and `measure` use it).

use std::collections::HashMap;

use serde::Serialize;

use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::select::cmp_f64;
use kvreplay_replay::{Budget, PolicySpec, ReplayError};
use kvreplay_traces::Trace;

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Agrees,
    Partly,
    Disagrees,
    NotCheckable,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Agrees => "agrees",
            Verdict::Partly => "partly",
            Verdict::Disagrees => "DISAGREES",
            Verdict::NotCheckable => "not checkable",
        }
    }
    pub(super) fn of(ok: bool) -> Verdict {
        if ok {
            Verdict::Agrees
        } else {
            Verdict::Disagrees
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Claim {
    pub method: &'static str,
    pub id: &'static str,
    pub claim: &'static str,
    pub paper: String,
    pub measured: String,
    pub verdict: Verdict,
}

/// Measurements shared by the claims: the trace's layers and cached replays.
pub(crate) struct Ctx<'a> {
    pub(super) trace: &'a Trace,
    /// Replays of the trace, sharing its layers and budget-independent results.
    pub(super) tr: kvreplay_replay::TraceReplay<'a>,
    /// Every layer as f32: the replays' own copies.
    pub(super) layers: Vec<std::sync::Arc<LayerData>>,
    pub(super) p: usize,
    /// Replays run so far, per (spec, budget).
    pub(super) runs: HashMap<(String, usize), Run>,
}

/// What the claims read from one replay.
#[derive(Clone, Debug)]
pub(crate) struct Run {
    /// Mean relative L2 error over every (layer, query head).
    pub(super) err: f64,
    /// Mean relative L2 error of each layer.
    pub(super) layer_err: Vec<f64>,
    /// Bytes kept at the end of the run, and those of the full cache.
    pub(super) bytes: u64,
    pub(super) full: u64,
}

impl Ctx<'_> {
    /// Mean relative L2 error of `spec` at budget `b` (cached).
    pub(super) fn err(&mut self, spec: &str, b: usize) -> Result<f64, ReplayError> {
        Ok(self.run(spec, b)?.err)
    }

    /// Mean relative L2 error, bytes kept and full-cache bytes of `spec` at
    /// budget `b` (cached).
    pub(super) fn run(&mut self, spec: &str, b: usize) -> Result<Run, ReplayError> {
        if let Some(r) = self.runs.get(&(spec.to_string(), b)) {
            return Ok(r.clone());
        }
        let p = PolicySpec::parse(spec)?.build()?;
        let r = self.tr.replay(p.as_ref(), Budget::Entries(b))?;
        let out = Run {
            err: r.mean(|h| h.rel_l2),
            layer_err: r
                .layers
                .iter()
                .map(|l| {
                    l.metrics.iter().map(|m| m.rel_l2).sum::<f64>() / l.metrics.len().max(1) as f64
                })
                .collect(),
            bytes: r.bytes(),
            full: r.full_bytes(),
        };
        self.runs.insert((spec.to_string(), b), out.clone());
        Ok(out)
    }

    pub(super) fn errs(&mut self, specs: &[&str], b: usize) -> Result<Vec<f64>, ReplayError> {
        specs.iter().map(|s| self.err(s, b)).collect()
    }

    /// Memory of `spec` at budget `b` as a share of the full cache.
    pub(super) fn mem(&mut self, spec: &str, b: usize) -> Result<f64, ReplayError> {
        let r = self.run(spec, b)?;
        Ok(r.bytes as f64 / r.full.max(1) as f64)
    }

    /// "B = 90 entries/KV head (P/4), memory 23-26% of the full cache": the
    /// budget and the memory the runs of `specs` at `b` actually kept.
    pub(super) fn at(&mut self, specs: &[&str], b: usize) -> Result<String, ReplayError> {
        let m: Vec<f64> = specs
            .iter()
            .map(|s| self.mem(s, b))
            .collect::<Result<_, _>>()?;
        Ok(format!("{}, {}", self.budget(b), mem_range(&m)))
    }

    /// "B = 90 entries/KV head (25% of P = 363)".
    pub(super) fn budget(&self, b: usize) -> String {
        format!(
            "B = {b} entries/KV head ({:.0}% of P = {})",
            100.0 * b as f64 / self.p as f64,
            self.p
        )
    }

    /// The largest budget at which `spec` keeps at most `target` bytes (at
    /// least 1), found by bisection: variants that clamp or redistribute
    /// their budget are compared at equal real memory this way.
    pub(super) fn budget_for_bytes(
        &mut self,
        spec: &str,
        target: u64,
    ) -> Result<usize, ReplayError> {
        let (mut lo, mut hi) = (1usize, self.p);
        if self.run(spec, hi)?.bytes <= target {
            return Ok(hi);
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.run(spec, mid)?.bytes <= target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(lo)
    }

    /// Column sums of layer l, head h over prompt keys (f64).
    pub(super) fn colsum(&self, l: usize, h: usize) -> Vec<f64> {
        self.colsum_f32(l, h).iter().map(|x| *x as f64).collect()
    }

    /// Column sums of layer l, head h over prompt keys, as stored.
    pub(super) fn colsum_f32(&self, l: usize, h: usize) -> &[f32] {
        let p = self.p;
        &self.layers[l].colsum[h * p..(h + 1) * p]
    }

    /// Sums over the last `w` prompt rows of head h's attention, per key.
    pub(super) fn window_sums(&self, l: usize, h: usize, w: usize) -> Vec<f64> {
        let p = self.p;
        let ctx = PrefillCtx::new(&self.layers[l], 1);
        let rows = ctx.attn_rows(h, p - w.min(p)..p);
        let mut s = vec![0f64; p];
        for row in rows.chunks_exact(p) {
            s.iter_mut().zip(row).for_each(|(a, x)| *a += *x as f64);
        }
        s
    }

    pub(super) fn n_heads(&self) -> usize {
        self.layers[0].n_heads
    }
    pub(super) fn n_kv(&self) -> usize {
        self.layers[0].n_kv_heads
    }
    pub(super) fn d(&self) -> usize {
        self.layers[0].d
    }
    pub(super) fn prompt_key(&self, l: usize, g: usize, i: usize) -> &[f32] {
        self.layers[l].k_row(g, i)
    }
    pub(super) fn prompt_value(&self, l: usize, g: usize, i: usize) -> &[f32] {
        self.layers[l].v_row(g, i)
    }
}

pub(super) fn top_k(s: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&a, &b| cmp_f64(s[b], s[a]).then(b.cmp(&a)));
    idx.truncate(k);
    idx
}

pub(super) fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// "memory 23-26% of the full cache" (one figure when they agree).
pub(super) fn mem_range(m: &[f64]) -> String {
    let lo = m.iter().cloned().fold(f64::MAX, f64::min);
    let hi = m.iter().cloned().fold(f64::MIN, f64::max);
    if (hi - lo) * 100.0 < 0.5 {
        format!("memory {:.0}% of the full cache", 100.0 * hi)
    } else {
        format!(
            "memory {:.0}-{:.0}% of the full cache",
            100.0 * lo,
            100.0 * hi
        )
    }
}

pub(super) fn b0(p: usize) -> usize {
    (p / 4).max(48)
}
