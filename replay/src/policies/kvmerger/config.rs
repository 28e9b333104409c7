//! KvMerger's configuration: its parameters as typed values, read from a
//! spec, and the types its parts share (a leaf of the module).

use crate::params::{choice_enum, Params};
use crate::ReplayError;

choice_enum! {
    /// `budget_mode`: whether the budget bounds the prompt entries.
    pub enum BudgetMode {
        /// At most B prompt entries (the spec's extension for matched memory).
        Hard = "hard",
        /// The paper: the budget is ignored.
        Soft = "soft",
    }
}

choice_enum! {
    /// `sigma`: the Gaussian kernel's width.
    pub enum Sigma {
        /// Σ‖k_t − k_p‖ / (√2·|S|).
        Adaptive = "adaptive",
        /// Σ‖k_t − k_p‖² / (√2·|S|).
        AdaptiveSq = "adaptive_sq",
        /// `sigma0`.
        Fixed = "fixed",
    }
}

choice_enum! {
    /// `pivot`: the member the kernel is centred on.
    pub enum Pivot {
        /// The largest accumulated attention (tie: larger position).
        AttnArgmax = "attn_argmax",
        /// The largest attention from the set's own queries.
        WithinSet = "within_set",
        LastIndex = "last_index",
        Random = "random",
    }
}

choice_enum! {
    /// `weighting`: the members' weights.
    pub enum Weighting {
        Gaussian = "gaussian",
        Equal = "equal",
    }
}

choice_enum! {
    /// `value_mode`: how a merged value stands for its |S| members.
    pub enum ValueMode {
        /// v̂ = |S|·Σ w v (paper).
        ScaleBySetSize = "scale_by_set_size",
        /// v̂ = Σ w v with an attention bias ln|S|.
        LogcountBias = "logcount_bias",
        /// v̂ = Σ w v.
        Plain = "plain",
    }
}

choice_enum! {
    /// `linkage`: the key a scanned token is compared with.
    pub enum Linkage {
        /// The next token.
        Chain = "chain",
        /// The set's first-scanned token.
        Anchor = "anchor",
    }
}

choice_enum! {
    /// `adjacency`: what makes pool tokens one run.
    pub enum Adjacency {
        /// Consecutive positions (a protected token splits a run).
        Positions = "positions",
        /// The whole pool, in order.
        PoolOrder = "pool_order",
    }
}

#[derive(Clone, Debug)]
pub struct KvMerger {
    pub eps: f64,
    pub r_rec: f64,
    pub r_hh: f64,
    pub beta: f64,
    pub budget_mode: BudgetMode,
    pub sigma: Sigma,
    pub sigma0: f64,
    pub exclude_pivot: bool,
    pub pivot: Pivot,
    pub seed: u64,
    pub weighting: Weighting,
    pub value_mode: ValueMode,
    pub linkage: Linkage,
    pub adjacency: Adjacency,
    pub n_sink: usize,
}

impl KvMerger {
    pub(super) fn from_params(p: &Params) -> Result<KvMerger, ReplayError> {
        let frac = |k: &str| -> Result<f64, ReplayError> {
            let x = p.float(k)?;
            if (0.0..=1.0).contains(&x) {
                Ok(x)
            } else {
                Err(ReplayError::BadParam {
                    policy: "kvmerger".into(),
                    key: k.into(),
                    value: x.to_string(),
                    msg: "must lie in [0, 1]".into(),
                })
            }
        };
        let beta = frac("beta")?;
        if beta == 0.0 {
            return Err(ReplayError::BadParam {
                policy: "kvmerger".into(),
                key: "beta".into(),
                value: "0".into(),
                msg: "must be positive".into(),
            });
        }
        Ok(KvMerger {
            eps: p.float("eps")?,
            r_rec: frac("recent_ratio")?,
            r_hh: frac("hh_ratio")?,
            beta,
            budget_mode: p.choice("budget_mode")?,
            sigma: p.choice("sigma")?,
            sigma0: p.float_positive("sigma0")?,
            exclude_pivot: p.bool("exclude_pivot_in_sigma")?,
            pivot: p.choice("pivot")?,
            seed: p.int("seed")? as u64,
            weighting: p.choice("weighting")?,
            value_mode: p.choice("value_mode")?,
            linkage: p.choice("linkage")?,
            adjacency: p.choice("adjacency")?,
            n_sink: p.int("n_sink")?,
        })
    }

    pub(super) fn hard(&self) -> bool {
        self.budget_mode == BudgetMode::Hard
    }
}
