//! CUR (docs/methods/cur.md), kvpress `CURPress` after CurDKV: approximate
//! leverage scores of keys and values from their squared norms. k2_i = ‖k_i‖²,
//! v2_i = ‖v_i‖², each divided by its sum over the local window of `window`
//! positions it falls in (windows from position 0), combined by `leverage`
//! (default the product), normalised to sum 1 over the prompt, and the first
//! `n_sink` positions set to 1 (kept first). Keep the top B per KV head; no
//! attention, no recent window. Prefill only. A window (or prompt) whose
//! squared norms are all 0 scores 0 (kvpress: 0/0).

use std::sync::Arc;

use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::PrefillCtx;
use crate::scorer::{Scorer, Unit};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "cur",
    summary: "approximate CUR leverage of keys and values (squared norms, normalised per local window), product by default; sinks kept; prefill only",
    paper: "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition (CurDKV, Sengupta et al., arXiv 2509.15038); kvpress CURPress (NVIDIA/kvpress 0.5)",
    params: &[
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "first positions always kept (score 1; kvpress num_sinks)" },
        ParamInfo { name: "leverage", default: "kv_product", kind: Kind::Choice(&["key", "value", "kv_avg", "kv_product"]), help: "which leverage: key, value, their mean or their product" },
        ParamInfo { name: "window", default: "16", kind: Kind::IntOr("none"), help: "local window the squared norms are normalised over (kvpress local_window_size); none = the raw squared norms" },
    ],
    caps: Caps::EVICT_PREFILL,
    test: "cur_scores_windowed_key_and_value_leverage",
    build: Build::Scorer(|p| {
        let window = match p.word("window") {
            "none" => None,
            _ => Some(p.int("window")?),
        };
        if window == Some(0) {
            return Err(ReplayError::BadParam {
                policy: p.policy.into(),
                key: "window".into(),
                value: "0".into(),
                msg: "a window holds at least one position (none = no local normalisation)".into(),
            });
        }
        let leverage = match p.word("leverage") {
            "key" => Leverage::Key,
            "value" => Leverage::Value,
            "kv_avg" => Leverage::Avg,
            _ => Leverage::Product,
        };
        Ok(Arc::new(Cur { n_sink: p.int("n_sink")?, leverage, window }))
    }),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leverage {
    Key,
    Value,
    Avg,
    Product,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cur {
    pub n_sink: usize,
    pub leverage: Leverage,
    /// None: no local normalisation.
    pub window: Option<usize>,
}

/// Squared norms (f64), each divided by its window's sum when `window`.
fn local(sq: Vec<f64>, window: Option<usize>) -> Vec<f64> {
    match window {
        None => sq,
        Some(w) => sq
            .chunks(w)
            .flat_map(|c| {
                let z: f64 = c.iter().sum();
                c.iter()
                    .map(move |x| if z > 0.0 { x / z } else { 0.0 })
                    .collect::<Vec<f64>>()
            })
            .collect(),
    }
}

impl Cur {
    pub fn scores(&self, ctx: &PrefillCtx, g: usize) -> Vec<f32> {
        let p = ctx.prompt_len();
        let sq = |x: &[f32]| x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
        let k2 = local((0..p).map(|i| sq(ctx.key(g, i))).collect(), self.window);
        let v2 = local((0..p).map(|i| sq(ctx.value(g, i))).collect(), self.window);
        let s: Vec<f64> = k2
            .iter()
            .zip(&v2)
            .map(|(k, v)| match self.leverage {
                Leverage::Key => *k,
                Leverage::Value => *v,
                Leverage::Avg => (k + v) / 2.0,
                Leverage::Product => k * v,
            })
            .collect();
        let z: f64 = s.iter().sum();
        s.iter()
            .enumerate()
            .map(|(i, x)| match i < self.n_sink {
                true => 1.0,
                false if z > 0.0 => (x / z) as f32,
                false => 0.0,
            })
            .collect()
    }
}

/// Memo key of one KV head's scores.
#[derive(Debug, PartialEq)]
struct CurScores {
    cfg: Cur,
    kv_head: usize,
}
impl crate::memo::MemoKey for CurScores {
    type Value = Vec<f32>;
}

impl Scorer for Cur {
    /// Keys and values only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        // Budget-independent: computed once per trace and layer in a sweep.
        let key = CurScores {
            cfg: *self,
            kv_head: u.kv_head,
        };
        ctx.memo(key, || self.scores(ctx, u.kv_head))
            .as_ref()
            .clone()
    }
}
