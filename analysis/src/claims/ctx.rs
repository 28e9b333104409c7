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
    pub(super) errors: HashMap<(String, usize), f64>,
}

impl Ctx<'_> {
    /// Mean relative L2 error of `spec` at budget `b` (cached).
    pub(super) fn err(&mut self, spec: &str, b: usize) -> Result<f64, ReplayError> {
        if let Some(e) = self.errors.get(&(spec.to_string(), b)) {
            return Ok(*e);
        }
        let p = PolicySpec::parse(spec)?.build()?;
        let e = self
            .tr
            .replay(p.as_ref(), Budget::Entries(b))?
            .mean(|h| h.rel_l2);
        self.errors.insert((spec.to_string(), b), e);
        Ok(e)
    }

    pub(super) fn errs(&mut self, specs: &[&str], b: usize) -> Result<Vec<f64>, ReplayError> {
        specs.iter().map(|s| self.err(s, b)).collect()
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

pub(super) fn b0(p: usize) -> usize {
    (p / 4).max(48)
}
