//! D2o's configuration: its parameters as typed values, read from a
//! spec, and the types its parts share (a leaf of the module).

use crate::params::{choice_enum, Params};
use crate::select::{top_k, Tie};
use crate::ReplayError;

choice_enum! {
    /// `preset`: the paper's switches or the official code's settings.
    pub enum Preset {
        Paper = "paper",
        Code = "code",
    }
}

choice_enum! {
    /// `sink_slot`: which share of the budget the sinks count in.
    pub enum SinkSlot {
        /// Inside N (official code).
        Important = "important",
        /// Inside M (paper wording).
        Recent = "recent",
    }
}

choice_enum! {
    /// `threshold`: which evicted tokens are merged.
    pub enum Threshold {
        /// Those whose best similarity reaches the EMA threshold τ.
        Ema = "ema",
        /// All of them.
        MergeAll = "none",
    }
}

choice_enum! {
    /// `merge`: the weights of a kept entry and the evicted ones it absorbs.
    pub enum Merge {
        /// e¹ for the kept entry and e^μ for each absorbed one, normalised (paper).
        Weighted = "weighted",
        /// The plain mean.
        Average = "average",
        /// The official code's (k + Σ μ k_x)/(1 + |B|).
        CodeScaledMean = "code_scaled_mean",
    }
}

choice_enum! {
    /// `match_on`: the similarity that matches evicted tokens to kept ones.
    pub enum MatchOn {
        Keys = "keys",
        Values = "values",
        /// Keys for the key half and values for the value half, each with its own τ.
        Split = "split",
    }
}

choice_enum! {
    /// `allocation`: the layer budget rule (Table 4's variants).
    pub enum Allocation {
        /// softmax(−s) of the min-max normalised head variances (paper).
        InvVarSoftmax = "inv_var_softmax",
        /// Without the layer operation: equal shares.
        Uniform = "uniform",
        /// Proportional to 1/variance.
        Reciprocal = "reciprocal",
        /// softmax(−variance).
        ExpDecay = "exp_decay",
        /// softmax(1/variance).
        InvVarSoftmaxRaw = "inv_var_softmax_raw",
    }
}

#[derive(Clone, Debug)]
pub struct D2o {
    pub f: f64,
    pub beta: f64,
    pub n_sink: usize,
    pub sink_slot: SinkSlot,
    pub threshold: Threshold,
    pub merge: Merge,
    pub match_on: MatchOn,
    pub allocation: Allocation,
    pub protect_layers: bool,
    /// One cache per query head (the official code repeats K/V per query head).
    pub per_query_head: bool,
    /// `budget_per=query_head`: B entries per query-head cache (G× the memory).
    pub budget_per_cache: bool,
    /// First compression at decode step 1 with the first decode query's
    /// attention in the scores and budgets from P + 1 (official code).
    pub defer_first: bool,
    /// One τ per layer shared by all its heads (official code).
    pub shared_tau: bool,
    /// Scores accumulated in f16 (official code).
    pub fp16_scores: bool,
}

impl D2o {
    pub(super) fn from_params(p: &Params) -> Result<D2o, ReplayError> {
        let unit = |k: &str| -> Result<f64, ReplayError> {
            let x = p.float(k)?;
            if (0.0..=1.0).contains(&x) {
                Ok(x)
            } else {
                Err(ReplayError::BadParam {
                    policy: "d2o".into(),
                    key: k.into(),
                    value: x.to_string(),
                    msg: "must lie in [0, 1]".into(),
                })
            }
        };
        Ok(D2o {
            f: unit("f")?,
            beta: unit("beta")?,
            n_sink: p.int("n_sink")?,
            sink_slot: p.choice("sink_slot")?,
            threshold: p.choice("threshold")?,
            merge: p.choice("merge")?,
            match_on: p.choice("match_on")?,
            allocation: p.choice("allocation")?,
            protect_layers: p.bool("protect_layers")?,
            per_query_head: false,
            budget_per_cache: p.word("budget_per") == "query_head",
            defer_first: false,
            shared_tau: false,
            fp16_scores: false,
        }
        .with_preset(p.choice("preset")?))
    }

    /// The sinks count inside M (`sink_slot=recent`).
    pub(super) fn sinks_in_recent(&self) -> bool {
        self.sink_slot == SinkSlot::Recent
    }

    /// The official code's settings (d2o.md §2.6 items a to j): protected
    /// layers, first compression at decode step 1, per-query-head caches, one τ
    /// per layer, scaled-mean merge, τ ← (τ + m)/2, sinks inside N, layers
    /// whose budget reaches P − 1 stop compressing, N:M = 1:1, f16 scores.
    pub(super) fn with_preset(self, preset: Preset) -> D2o {
        if preset == Preset::Paper {
            return self;
        }
        D2o {
            protect_layers: true,
            per_query_head: true,
            defer_first: true,
            shared_tau: true,
            fp16_scores: true,
            merge: Merge::CodeScaledMean,
            beta: 0.5,
            f: 0.5,
            sink_slot: SinkSlot::Important,
            ..self
        }
    }
}

/// Per-(layer, KV head) state: scores, anchors and sink flags of the entries, τ.
pub(super) struct HeadState {
    pub(super) score: Vec<f64>,
    pub(super) anchor: Vec<usize>,
    pub(super) sink: Vec<bool>,
    /// EMA thresholds: [the match (or key half), the value half under split].
    pub(super) tau: [Option<f64>; 2],
}

impl D2o {
    /// The first compression of a cache whose entry i is position i: keep the
    /// sinks (inside N, or inside M with `sink_slot=recent`), the N highest
    /// scores and the last M entries; returns the rest (to recall-and-merge).
    pub(super) fn initial_evictions(
        &self,
        p: usize,
        st: &mut HeadState,
        n: usize,
        m: usize,
    ) -> Vec<usize> {
        let (z, recent_start) = if self.sinks_in_recent() {
            let z = self.n_sink.min(m).min(p);
            (z, p.saturating_sub(m - z))
        } else {
            (self.n_sink.min(n).min(p), p.saturating_sub(m))
        };
        st.sink = (0..p).map(|i| i < z).collect();
        if p <= n.saturating_add(m) {
            return Vec::new();
        }
        let a = &st.score;
        let mut keep = vec![false; p];
        (0..z).for_each(|i| keep[i] = true);
        (recent_start.max(z)..p).for_each(|i| keep[i] = true);
        let n_top = if self.sinks_in_recent() { n } else { n - z };
        // the reference keeps the earlier of equal scores
        let top = top_k(a, z..recent_start.max(z), n_top, |i| i, Tie::KeepEarlier);
        top.iter().for_each(|&i| keep[i] = true);
        (0..p).filter(|&i| !keep[i]).collect()
    }
}
