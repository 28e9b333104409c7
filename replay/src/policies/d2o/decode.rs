//! D2O at decode: add each step's attention to the scores, evict the lowest
//! score outside the sinks and the last M entries (or run the deferred first
//! compression), and recall-and-merge it.

use super::budgets::counts;
use super::config::{D2o, HeadState};
use crate::cache::HeadCache;
use crate::policy::{DecodeState, StepCtx};
use crate::select::{victim, Tie};

pub(super) struct Decode {
    cfg: D2o,
    cap: usize,
    m: usize,
    /// Some(r_l) until the deferred first compression has run.
    pending: Option<f64>,
    states: Vec<HeadState>,
    /// The layer's shared thresholds (shared_tau).
    layer_tau: [Option<f64>; 2],
}

impl Decode {
    pub(super) fn new(
        cfg: D2o,
        cap: usize,
        m: usize,
        pending: Option<f64>,
        states: Vec<HeadState>,
    ) -> Decode {
        Decode {
            cfg,
            cap,
            m,
            pending,
            states,
            layer_tau: [None, None],
        }
    }
}

impl DecodeState for Decode {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        if let Some(r) = self.pending {
            // from now on the caches hold the budgets of P + 1 positions; a layer
            // whose budget reaches P − 1 stops compressing (official code)
            let (n, m) = counts(r, ctx.pos + 1, self.cfg.f);
            self.cap = if n + m + 1 >= ctx.pos {
                usize::MAX
            } else {
                n + m
            };
            self.m = m;
        }
        let mut evicts: Vec<Vec<usize>> = vec![Vec::new(); caches.len()];
        for (ci, c) in caches.iter_mut().enumerate() {
            let st = &mut self.states[ci];
            st.score.push(0.0);
            st.anchor.push(ctx.pos);
            st.sink.push(false);
            let heads = ctx.heads_of(ci, self.cfg.per_query_head);
            for h in heads {
                for (s, x) in st.score.iter_mut().zip(&ctx.probs[h]) {
                    *s += *x as f64;
                    if self.cfg.fp16_scores {
                        *s = half::f16::from_f64(*s).to_f64();
                    }
                }
            }
            if let Some(r) = self.pending {
                // deferred first compression: budgets from the positions seen so far (P + 1)
                let (n, m) = counts(r, c.len(), self.cfg.f);
                evicts[ci] = self.cfg.initial_evictions(c.len(), st, n, m);
                continue;
            }
            if c.len() <= self.cap {
                continue;
            }
            // Protected: the sinks and the last M entries (M − |Z| with sinks in the recent share).
            let n = c.len();
            let sinks = st.sink.iter().filter(|x| **x).count();
            let recent = if self.cfg.sinks_in_recent() {
                self.m.saturating_sub(sinks)
            } else {
                self.m
            };
            let cand = (0..n.saturating_sub(recent)).filter(|&e| !st.sink[e]);
            if let Some(e) = victim(&st.score, cand, |e| st.anchor[e], Tie::KeepLater) {
                evicts[ci] = vec![e];
            }
        }
        let shared = self.cfg.shared_tau.then_some(&mut self.layer_tau);
        self.cfg
            .compensate_layer(caches, &mut self.states, &evicts, shared);
        self.pending = None;
    }
}
