//! MiniCache's configuration: its parameters as typed values, read from a
//! spec, and the types its parts share (a leaf of the module).

use crate::params::{choice_enum, Params};
use crate::ReplayError;

choice_enum! {
    /// `rule`: which merged pairs keep their originals.
    pub enum Rule {
        /// The most divergent: dist > d_max − γ·(d_max − d_min).
        MostDivergent = "default",
        /// xKV's most-similar reading: dist ≤ d_min + γ·(d_max − d_min).
        LiteralLow = "literal_low",
        /// The top ρ fraction by distance.
        TopFraction = "top_fraction",
    }
}

choice_enum! {
    /// `scope`: the set the distance range is taken over.
    pub enum Scope {
        PerHead = "per_head",
        /// All KV heads of the pair.
        Global = "global",
    }
}

choice_enum! {
    /// `merge`: how a pair of vectors becomes one.
    pub enum Merge {
        /// SLERP of the directions, per-layer norms and retention (MiniCache).
        Slerp = "slerp",
        /// The Mean-KV baseline: (x^a + x^b)/2, no retention.
        Mean = "mean",
    }
}

#[derive(Clone, Debug)]
pub struct MiniCache {
    /// None = from the budget.
    pub start: Option<f64>,
    pub t: f32,
    pub gamma: f64,
    pub rule: Rule,
    pub rho: f64,
    pub scope: Scope,
    pub shared_from_k: bool,
    pub merge_decode: bool,
    pub compact: bool,
    pub merge: Merge,
    pub merge_k: bool,
    pub merge_v: bool,
    pub b_dir: u32,
    pub b_norm: u32,
}

impl MiniCache {
    pub(super) fn from_params(p: &Params) -> Result<MiniCache, ReplayError> {
        let start = match p.word("start") {
            "budget" => None,
            _ => Some(p.float_in("start", 0.0, 1.0)?),
        };
        Ok(MiniCache {
            start,
            t: p.float_in("t", 0.0, 1.0)? as f32,
            gamma: p.float_in("gamma", 0.0, 1.0)?,
            rule: p.choice("rule")?,
            rho: p.float_in("rho", 0.0, 1.0)?,
            scope: p.choice("scope")?,
            shared_from_k: p.bool("shared_from_k")?,
            merge_decode: p.bool("merge_decode")?,
            compact: p.bool("compact")?,
            merge: p.choice("merge")?,
            merge_k: p.bool("merge_k")?,
            merge_v: p.bool("merge_v")?,
            b_dir: p.choice("b_dir")?,
            b_norm: p.choice("b_norm")?,
        })
    }

    /// The Mean-KV baseline (`merge=mean`).
    pub(super) fn mean(&self) -> bool {
        self.merge == Merge::Mean
    }

    pub(super) fn pair_start(&self, n_layers: usize, budget: usize, prompt_len: usize) -> usize {
        let frac = self
            .start
            .unwrap_or((budget as f64 / prompt_len as f64).min(1.0));
        ((n_layers as f64 * frac).floor() as usize).min(n_layers)
    }
}
