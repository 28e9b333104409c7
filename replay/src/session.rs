//! The replay loop, written once: a [`Session`] holds a policy's caches for
//! some layers and drives the policy through prefill and each decode step.
//! Every driver goes through it: the engine (captured decode queries, over a
//! trace), `kvreplay validate` (a live model, whose attention hook appends
//! and reads the caches) and the tests.
//!
//! Per decode step a driver calls [`Session::append`] for each layer (the
//! step's exact entry), attends over [`Session::caches`] itself, and hands
//! the step's attention to [`Session::step`], where the policy may evict or
//! merge.

use std::ops::Range;

use crate::cache::HeadCache;
use crate::policy::{GroupDecodeState, LayerData, Policy, PrefillCtx, StepCtx};
use crate::ReplayError;

/// A policy's caches for a set of layers, between prefill and the end of decode.
pub struct Session {
    budget: usize,
    /// Per covered layer: its index in the model, query heads per KV head,
    /// query heads, softmax scale.
    layers: Vec<LayerShape>,
    /// Per covered layer, its caches (one per KV head, or one per query head).
    caches: Vec<Vec<HeadCache>>,
    /// Per layer group of the policy: the covered layers it spans (a run).
    groups: Vec<Range<usize>>,
    states: Vec<Box<dyn GroupDecodeState>>,
}

#[derive(Clone, Copy, Debug)]
struct LayerShape {
    layer: usize,
    group: usize,
    n_heads: usize,
    scale: f32,
    /// One cache per query head.
    per_query: bool,
}

impl Session {
    /// Prefill: the policy builds the caches of `layers` (given in model
    /// order; they must be whole layer groups of the policy, e.g. one layer
    /// for most policies, adjacent pairs for MiniCache, or every layer).
    pub fn prefill(
        policy: &dyn Policy,
        layers: &[&LayerData],
        budget: usize,
    ) -> Result<Session, ReplayError> {
        let first = layers.first().expect("a session covers at least one layer");
        let covered: Vec<usize> = layers.iter().map(|d| d.layer).collect();
        let all = policy.layer_groups(first.n_layers, budget, first.prompt_len);
        let mut groups = Vec::new();
        for g in all.iter().filter(|g| g.iter().any(|l| covered.contains(l))) {
            let start = covered.iter().position(|l| *l == g[0]);
            let run = start.filter(|&s| covered.get(s..s + g.len()) == Some(g.as_slice()));
            let s = run.ok_or_else(|| ReplayError::Contract {
                policy: policy.name(),
                msg: format!(
                    "it replays layers {g:?} together, but the session covers {covered:?}"
                ),
            })?;
            groups.push(s..s + g.len());
        }
        if let Some(l) = covered.iter().find(|l| !all.iter().any(|g| g.contains(l))) {
            return Err(ReplayError::Contract {
                policy: policy.name(),
                msg: format!(
                    "its layer groups {all:?} of {} layers miss layer {l}",
                    first.n_layers
                ),
            });
        }
        Session::with_groups(policy, layers, budget, groups)
    }

    /// Prefill of `layers` as one group, whatever the policy's own
    /// `layer_groups` (the groups [`crate::engine::replay_groups`] decided,
    /// which split a policy's group that mixes sliding-window and
    /// full-attention layers).
    pub fn prefill_group(
        policy: &dyn Policy,
        layers: &[&LayerData],
        budget: usize,
    ) -> Result<Session, ReplayError> {
        assert!(!layers.is_empty(), "a session covers at least one layer");
        Session::with_groups(
            policy,
            layers,
            budget,
            std::iter::once(0..layers.len()).collect(),
        )
    }

    /// Prefill of `layers`, replayed together in runs `groups` (indices into `layers`).
    fn with_groups(
        policy: &dyn Policy,
        layers: &[&LayerData],
        budget: usize,
        groups: Vec<Range<usize>>,
    ) -> Result<Session, ReplayError> {
        let mut caches: Vec<Vec<HeadCache>> = vec![Vec::new(); layers.len()];
        let mut states = Vec::new();
        for r in &groups {
            let ctxs: Vec<PrefillCtx> = layers[r.clone()]
                .iter()
                .map(|d| PrefillCtx::new(d, budget))
                .collect();
            let (cs, st) = policy.prefill_group(&ctxs)?;
            if cs.len() != r.len() {
                return Err(ReplayError::Contract {
                    policy: policy.name(),
                    msg: format!("it returned caches for {} of {} layers", cs.len(), r.len()),
                });
            }
            for (i, c) in r.clone().zip(cs) {
                caches[i] = c;
            }
            states.push(st);
        }
        let shapes = layers
            .iter()
            .zip(&caches)
            .map(|(d, c)| {
                if c.len() != d.n_kv_heads && c.len() != d.n_heads {
                    return Err(ReplayError::Contract {
                        policy: policy.name(),
                        msg: format!(
                            "it returned {} caches for {} KV heads / {} query heads",
                            c.len(),
                            d.n_kv_heads,
                            d.n_heads
                        ),
                    });
                }
                Ok(LayerShape {
                    layer: d.layer,
                    group: d.group(),
                    n_heads: d.n_heads,
                    scale: d.scale,
                    per_query: c.len() == d.n_heads && d.n_heads != d.n_kv_heads,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Session {
            budget,
            layers: shapes,
            caches,
            groups,
            states,
        })
    }

    /// The caches of covered layer `i`.
    pub fn caches(&self, i: usize) -> &[HeadCache] {
        &self.caches[i]
    }

    /// The index, among layer `i`'s caches, of the cache query head `h` reads.
    pub fn cache_of(&self, i: usize, h: usize) -> usize {
        let s = &self.layers[i];
        if s.per_query {
            h
        } else {
            h / s.group
        }
    }

    /// The query heads that read cache `c` of layer `i`.
    pub fn heads_of(&self, i: usize, c: usize) -> Range<usize> {
        let s = &self.layers[i];
        if s.per_query {
            c..c + 1
        } else {
            c * s.group..(c + 1) * s.group
        }
    }

    /// The KV head whose entries cache `c` of layer `i` holds.
    pub fn kv_head_of(&self, i: usize, c: usize) -> usize {
        self.heads_of(i, c).start / self.layers[i].group
    }

    /// Append the exact entry of decode position `pos` to every cache of
    /// layer `i`; `kv(g)` gives KV head g's (key, value) rows.
    pub fn append<'a>(
        &mut self,
        i: usize,
        pos: usize,
        kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    ) {
        for c in 0..self.caches[i].len() {
            let (k, v) = kv(self.kv_head_of(i, c));
            self.caches[i][c].push_exact(pos, k, v);
        }
    }

    /// After the step's attention: the policy may evict or merge. Per covered
    /// layer, `probs[i][h]` is query head h's attention over its cache's
    /// entries (the new one last) and `queries[i][h]` its query.
    pub fn step(&mut self, pos: usize, probs: &[Vec<Vec<f32>>], queries: &[Vec<&[f32]>]) {
        for (r, st) in self.groups.iter().zip(self.states.iter_mut()) {
            let ctxs: Vec<StepCtx> = r
                .clone()
                .map(|i| {
                    let s = &self.layers[i];
                    debug_assert_eq!(probs[i].len(), s.n_heads);
                    StepCtx {
                        layer: s.layer,
                        pos,
                        budget: self.budget,
                        group: s.group,
                        probs: &probs[i],
                        queries: &queries[i],
                        scale: s.scale,
                    }
                })
                .collect();
            st.step(&ctxs, &mut self.caches[r.clone()]);
        }
    }

    /// The final caches, per covered layer.
    pub fn into_caches(self) -> Vec<Vec<HeadCache>> {
        self.caches
    }
}
