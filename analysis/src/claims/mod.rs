//! `kvreplay claims`: the seed papers' trace-checkable claims, measured.
//!
//! Each spec's section 6 lists claims a recorded trace can check. Every claim
//! here is measured on the given trace and printed next to what the paper
//! states, with a verdict. A disagreement is a finding about this model and
//! trace, not a failure of the tool.
//!
//! The claims, by id, and the file that measures them (each paper's claims
//! appear in `measure`'s output in this order):
//!
//! | ids      | method    | paper                     | file            |
//! |----------|-----------|---------------------------|-----------------|
//! | E1-E10   | ems       | EMS (Li et al.)           | `ems.rs`        |
//! | D1-D10   | d2o       | D2O (Wan et al.)          | `d2o.rs`        |
//! | K1-K10   | kvmerger  | KVMerger (Wang et al.)    | `kvmerger.rs`   |
//! | A1-A10   | ahakv     | AhaKV (Gu et al.)         | `ahakv.rs`      |
//! | M1-M5    | minicache | MiniCache (Liu et al.)    | `minicache.rs`  |
//!
//! This file holds what they share: `Verdict`, `Claim`, the measurement
//! context `Ctx`, small helpers, and `measure`, which runs them all.

use std::collections::HashMap;

use serde::Serialize;

use kvreplay_replay::engine::{load_layer_shared, prompt_colsums};
use kvreplay_replay::policy::{LayerData, PrefillCtx};
use kvreplay_replay::{Budget, PolicySpec, ReplayError};
use kvreplay_traces::Trace;

mod ahakv;
mod d2o;
mod ems;
mod kvmerger;
mod minicache;

use ahakv::ahakv;
use d2o::d2o;
use ems::ems;
use kvmerger::kvmerger;
use minicache::minicache;

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
    fn of(ok: bool) -> Verdict {
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
struct Ctx<'a> {
    trace: &'a Trace,
    /// Replays of the trace, sharing its layers and budget-independent results.
    tr: kvreplay_replay::TraceReplay<'a>,
    layers: Vec<LayerData>,
    p: usize,
    errors: HashMap<(String, usize), f64>,
}

impl Ctx<'_> {
    /// Mean relative L2 error of `spec` at budget `b` (cached).
    fn err(&mut self, spec: &str, b: usize) -> Result<f64, ReplayError> {
        if let Some(e) = self.errors.get(&(spec.to_string(), b)) {
            return Ok(*e);
        }
        let p = PolicySpec::parse(spec)?.build()?;
        let e = self.tr.replay(p.as_ref(), Budget::Entries(b))?.mean(|h| h.rel_l2);
        self.errors.insert((spec.to_string(), b), e);
        Ok(e)
    }

    fn errs(&mut self, specs: &[&str], b: usize) -> Result<Vec<f64>, ReplayError> {
        specs.iter().map(|s| self.err(s, b)).collect()
    }

    /// Column sums of layer l, head h over prompt keys (f64).
    fn colsum(&self, l: usize, h: usize) -> Vec<f64> {
        self.colsum_f32(l, h).iter().map(|x| *x as f64).collect()
    }

    /// Column sums of layer l, head h over prompt keys, as stored.
    fn colsum_f32(&self, l: usize, h: usize) -> &[f32] {
        let p = self.p;
        &self.layers[l].colsum[h * p..(h + 1) * p]
    }

    /// Sums over the last `w` prompt rows of head h's attention, per key.
    fn window_sums(&self, l: usize, h: usize, w: usize) -> Vec<f64> {
        let p = self.p;
        let ctx = PrefillCtx::new(&self.layers[l], 1);
        let rows = ctx.attn_rows(h, p - w.min(p)..p);
        let mut s = vec![0f64; p];
        for row in rows.chunks_exact(p) {
            s.iter_mut().zip(row).for_each(|(a, x)| *a += *x as f64);
        }
        s
    }

    fn n_heads(&self) -> usize {
        self.layers[0].n_heads
    }
    fn n_kv(&self) -> usize {
        self.layers[0].n_kv_heads
    }
    fn d(&self) -> usize {
        self.layers[0].d
    }
    fn prompt_key(&self, l: usize, g: usize, i: usize) -> &[f32] {
        self.layers[l].k_row(g, i)
    }
    fn prompt_value(&self, l: usize, g: usize, i: usize) -> &[f32] {
        self.layers[l].v_row(g, i)
    }
}

fn top_k(s: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&a, &b| {
        s[b].partial_cmp(&s[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(b.cmp(&a))
    });
    idx.truncate(k);
    idx
}

fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Every claim, measured on `trace`. Replays run at budgets derived from the
/// prompt length P (B = P/4 unless a claim names another).
pub fn measure(trace: &Trace) -> Result<Vec<Claim>, ReplayError> {
    let colsums = prompt_colsums(trace);
    let layers: Vec<LayerData> = (0..trace.n_layers())
        .map(|l| load_layer_shared(trace, l, &colsums))
        .collect();
    let p = trace.manifest.prompt_len();
    let mut c = Ctx {
        trace,
        tr: kvreplay_replay::TraceReplay::new(trace, &Default::default())?,
        layers,
        p,
        errors: HashMap::new(),
    };
    let mut out = Vec::new();
    ems(&mut c, &mut out)?;
    d2o(&mut c, &mut out)?;
    kvmerger(&mut c, &mut out)?;
    ahakv(&mut c, &mut out)?;
    minicache(&mut c, &mut out)?;
    Ok(out)
}

fn b0(p: usize) -> usize {
    (p / 4).max(48)
}
