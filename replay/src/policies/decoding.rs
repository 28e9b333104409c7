//! `+decoding`: compression during decode, every `compression_interval`
//! steps, by a scorer over the whole cache (docs/methods/decoding.md;
//! kvpress `DecodingPress`).
//!
//! Rule (kvpress 0.5.4 `DecodingPress.forward_hook`), per layer: each decode
//! step's queries are appended to a buffer and a step counter counts; when
//! it reaches `compression_interval`, after that step's attention, the
//! scorer scores every entry of the cache (prompt and decode entries) and
//! each cache keeps its `target_size` best (the scorer's protected entries:
//! its first sinks and its last window, inside the target); the counter
//! and the buffer are reset. After every step the buffer is cut to its last
//! `hidden_states_buffer_size` queries, so a compression sees the last
//! min(steps since the last one, buffer + 1) steps' queries. A cache at or
//! below the target is left alone (kvpress's ratio 0). `target_size`
//! defaults to the replay budget B (kvpress's default is 2048 tokens).
//!
//! What the scorer sees: a layer built from the cache ([`DecodeView`]): its
//! entries as the positions 0..n−1 in order, keys and values as stored, the
//! buffered queries as the last rows (each the query of the step that
//! created that entry, seeing the entries before it, which is what it saw:
//! nothing is evicted between compressions), column sums over those rows.
//! kvpress's scorers recompute their queries from the buffered hidden
//! states with the current step's rotary embedding; the trace holds the
//! queries as the model rotated them, and those are used.
//!
//! Composed as `X+decoding`, X compresses at prefill and this wrapper
//! replaces X's decode-time work (kvpress `PrefillDecodingPress` runs the
//! prefill press at prefill only). Alone (`decoding` = `full+decoding`)
//! the prompt is kept whole (kvpress `DecodingPress` alone). The scorer is
//! named by `scorer` and runs with its default parameters here
//! (`prefilldecoding:scorer=...` accepts the scorer's parameters).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo, Params};
use crate::policy::{
    DecodeState, GroupDecodeState, LayerData, PerLayer, Policy, PrefillCtx, StepCtx,
};
use crate::scorer::{Scorer, Unit};
use crate::select::keep_positions;
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "decoding",
    summary: "every compression_interval decode steps, cuts each cache back to B by a scorer over all its entries (default: SnapKV); compose as `X+decoding` (X at prefill)",
    paper: "kvpress DecodingPress and PrefillDecodingPress (NVIDIA/kvpress 0.5.4)",
    params: &PARAMS,
    caps: CAPS,
    test: "decoding_compresses_every_interval_with_the_buffered_queries",
    build: Build::Wrapper(|p, base| {
        let name = p.word("scorer");
        // the registry through the crate root's re-export (policies/mod.rs
        // declares this module)
        let info = crate::REGISTRY.iter().copied().find(|i| i.name == name).ok_or_else(|| p.bad("scorer", "not a registered scorer".into()))?;
        let Build::Scorer(f) = info.build else {
            return Err(p.bad("scorer", "not a scorer".into()));
        };
        let defaults = Params {
            policy: info.name,
            values: info.params.iter().map(|x| (x.name.to_string(), x.default.to_string())).collect(),
        };
        let scorer = f(&defaults)?;
        Ok(Arc::new(Decoding { base, scorer: scorer.clone(), cfg: Interval::from_params(p, &*scorer)? }))
    }),
};

/// `decoding`'s parameters (`prefilldecoding` shares all but `scorer`).
pub const PARAMS: [ParamInfo; 4] = [
    ParamInfo {
        name: "scorer",
        default: "snapkv",
        kind: Kind::Scorer,
        help: "the scorer run over the cache at each compression (with its default parameters)",
    },
    ParamInfo {
        name: "compression_interval",
        default: "512",
        kind: Kind::Int,
        help: "decode steps between compressions (kvpress compression_interval)",
    },
    ParamInfo {
        name: "target_size",
        default: "budget",
        kind: Kind::IntOr("budget"),
        help: "entries per cache after a compression (budget: the replay budget B)",
    },
    ParamInfo {
        name: "hidden_states_buffer_size",
        default: "256",
        kind: Kind::Int,
        help:
            "decode steps whose queries are kept for the scorer (kvpress hidden_states_buffer_size)",
    },
];

/// `decoding`'s capabilities (a cache grows by up to the interval between compressions).
pub const CAPS: Caps = Caps {
    family: Family::Eviction,
    phase: Phase::Decode,
    holds_capacity: false,
    approximation: Some("the scorer reads the buffered decode queries as the trace holds them (rotated at their own positions) where kvpress recomputes them from hidden states with the current step's rotary embedding"),
    ..Caps::EVICT_PREFILL
};

/// When and how far the decode-time compression cuts.
#[derive(Clone, Copy, Debug)]
pub struct Interval {
    pub every: usize,
    /// None: the replay budget B.
    pub target: Option<usize>,
    pub buffer: usize,
}

impl Interval {
    pub fn from_params(p: &Params, scorer: &dyn Scorer) -> Result<Interval, ReplayError> {
        let every = p.int_positive("compression_interval", "must be at least 1")?;
        let target = match p.word("target_size") {
            "budget" => None,
            _ => Some(p.int("target_size")?),
        };
        if target == Some(0) {
            return Err(p.bad("target_size", "must be at least 1".into()));
        }
        let buffer = p.int("hidden_states_buffer_size")?;
        // a compression holds the last min(interval, buffer + 1) queries:
        // the scorer must read no more (asked for a long cache)
        let n = 1usize << 24;
        let needs = scorer.prompt_queries(n, target.unwrap_or(n / 2));
        let held = every.min(buffer + 1);
        if needs >= n / 2 {
            return Err(p.bad("scorer", format!("{} reads every query row of what it scores; a decode-time compression holds only the buffered steps' queries", p.word("scorer"))));
        }
        if needs > held {
            return Err(p.bad(
                "hidden_states_buffer_size",
                format!("the scorer reads the last {needs} queries but a compression holds min(compression_interval, buffer + 1) = {held}"),
            ));
        }
        Ok(Interval {
            every,
            target,
            buffer,
        })
    }
}

/// A policy at prefill, then [`Compress`] during decode.
pub struct Decoding {
    pub base: Arc<dyn Policy>,
    pub scorer: Arc<dyn Scorer>,
    pub cfg: Interval,
}

impl Decoding {
    fn state(&self, ctx: &PrefillCtx) -> Result<Box<dyn DecodeState>, ReplayError> {
        let target = self.cfg.target.unwrap_or(ctx.budget).max(1);
        Ok(Box::new(Compress {
            scorer: self.scorer.clone(),
            cfg: self.cfg,
            target,
            // what the scorer protects at the target, checked here (a
            // decode step cannot report an error)
            prot: self.scorer.protect(target)?,
            view: DecodeView::of(ctx),
            steps: 0,
            queries: Vec::new(),
        }))
    }
}

impl Policy for Decoding {
    /// Its base's caches, so its base's count.
    fn budget_share(&self, group: usize) -> usize {
        self.base.budget_share(group)
    }
    fn name(&self) -> String {
        format!("{}+decoding", self.base.name())
    }
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.base.prompt_queries(p, b)
    }
    fn compress_sliding(&self) -> bool {
        self.base.compress_sliding()
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (caches, _) = self.base.prefill(ctx)?;
        Ok((caches, self.state(ctx)?))
    }
    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        self.base.layer_groups(n_layers, budget, prompt_len)
    }
    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let (caches, _) = self.base.prefill_group(ctxs)?;
        let states = ctxs
            .iter()
            .map(|c| self.state(c))
            .collect::<Result<_, _>>()?;
        Ok((caches, Box::new(PerLayer(states))))
    }
}

/// What a decode-time view of the caches copies from the layer.
#[derive(Clone)]
pub struct DecodeView {
    layer: usize,
    n_layers: usize,
    n_heads: usize,
    d: usize,
    scale: f32,
    backend: kvreplay_kernels::Backend,
}

impl DecodeView {
    pub fn of(ctx: &PrefillCtx) -> DecodeView {
        DecodeView {
            layer: ctx.layer(),
            n_layers: ctx.n_layers(),
            n_heads: ctx.n_heads(),
            d: ctx.head_dim(),
            scale: ctx.scale(),
            backend: ctx.backend(),
        }
    }

    /// The layer a scorer sees: `caches` (equally long, n entries each) as
    /// its KV heads with entries 0..n−1 as positions; `queries[s][h]` the
    /// buffered steps' queries of the `heads` query heads, oldest first,
    /// as the last rows (q_start = n − steps).
    pub fn build(
        &self,
        caches: &[&HeadCache],
        queries: &[Vec<Vec<f32>>],
        heads: std::ops::Range<usize>,
    ) -> LayerData {
        let n = caches[0].len();
        let m = queries.len().min(n);
        let steps = &queries[queries.len() - m..];
        let mut q = Vec::with_capacity(heads.len() * m * self.d);
        for h in heads.clone() {
            for s in steps {
                q.extend_from_slice(&s[h]);
            }
        }
        LayerData {
            layer: self.layer,
            n_layers: self.n_layers,
            n_heads: heads.len(),
            n_kv_heads: caches.len(),
            d: self.d,
            scale: self.scale,
            prompt_len: n,
            total_len: n,
            q_start: n - m,
            q,
            k: caches.iter().flat_map(|c| c.keys.iter().copied()).collect(),
            v: caches
                .iter()
                .flat_map(|c| c.values.iter().copied())
                .collect(),
            colsum: Vec::new(),
            window: None,
            all_colsum: None,
            rope: None,
            memo: None,
            backend: self.backend.clone(),
            // positions are renumbered: the trace's token ids do not apply
            tokens: None,
        }
    }
}

/// Decode-time state: the step counter and the query buffer of one layer.
pub struct Compress {
    scorer: Arc<dyn Scorer>,
    cfg: Interval,
    target: usize,
    prot: crate::select::Protect,
    view: DecodeView,
    steps: usize,
    /// Per buffered step, per query head, its query (d,).
    queries: Vec<Vec<Vec<f32>>>,
}

impl Compress {
    /// Cut `caches` back to the target by the scorer.
    fn compress(&self, caches: &mut [HeadCache]) {
        let nc = caches.len();
        let gq = self.view.n_heads / nc.max(1);
        let prot = self.prot;
        let equal = caches.iter().all(|c| c.len() == caches[0].len());
        // one view of the layer when the caches are equally long; else one
        // view per cache (its query heads only)
        let keeps: Vec<Option<Vec<usize>>> = if equal {
            let refs: Vec<&HeadCache> = caches.iter().collect();
            let data = self.view.build(&refs, &self.queries, 0..self.view.n_heads);
            let ctx = PrefillCtx::of_restricted(&data, self.target);
            (0..nc)
                .map(|c| {
                    self.keep(
                        &ctx,
                        Unit {
                            kv_head: c,
                            heads: c * gq..(c + 1) * gq,
                        },
                        prot,
                    )
                })
                .collect()
        } else {
            (0..nc)
                .map(|c| {
                    let data = self
                        .view
                        .build(&[&caches[c]], &self.queries, c * gq..(c + 1) * gq);
                    let ctx = PrefillCtx::of_restricted(&data, self.target);
                    self.keep(
                        &ctx,
                        Unit {
                            kv_head: 0,
                            heads: 0..gq,
                        },
                        prot,
                    )
                })
                .collect()
        };
        for (c, k) in caches.iter_mut().zip(keeps) {
            if let Some(k) = k {
                c.retain_indices(&k);
            }
        }
    }

    fn keep(&self, ctx: &PrefillCtx, u: Unit, prot: crate::select::Protect) -> Option<Vec<usize>> {
        let n = ctx.prompt_len();
        if n <= self.target {
            return None;
        }
        let scores = self.scorer.score(ctx, &u);
        Some(keep_positions(
            n,
            prot,
            &scores,
            self.target - prot.total(),
            self.scorer.tie(),
        ))
    }
}

impl DecodeState for Compress {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        self.queries
            .push(ctx.queries.iter().map(|q| q.to_vec()).collect());
        self.steps += 1;
        if self.steps >= self.cfg.every {
            if !self.scorer.skip_layer(ctx.layer) {
                self.compress(caches);
            }
            self.steps = 0;
            self.queries.clear();
        }
        let keep = self.queries.len().min(self.cfg.buffer);
        self.queries.drain(..self.queries.len() - keep);
    }
}
