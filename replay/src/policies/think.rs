//! ThinK (docs/methods/think.md), kvpress `ThinKPress` (NVIDIA/kvpress 0.5.4,
//! unchanged since): query-driven pruning of key channels, composed onto any
//! policy (`snapkv+think`, kvpress's `ComposedPress([SnapKVPress, ThinKPress])`)
//! or alone (`think`, onto `full`).
//!
//! After the base policy's prefill, per cache (KV head): for each channel c,
//! q̄²_c = the mean of q_c² over the last w prompt queries of each query head,
//! averaged over the cache's query heads (the GQA group), k̄²_c = the mean of
//! k_c² over the cache's entries (the keys the base kept); the ⌊d·ratio⌋
//! channels with the smallest q̄²_c·k̄²_c are set to zero in every entry (ties:
//! the lower channel first, our choice). Values are untouched; decode entries
//! are appended whole (kvpress prunes at prefill only). kvpress keeps the
//! zeros in memory; here a pruned channel is not stored: each prefill entry
//! costs (2d − ⌊d·ratio⌋)·16 bits.

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{DecodeState, GroupDecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "think",
    summary: "prunes the key channels with the smallest query-weighted magnitude (last w prompt queries) from every prompt entry; composes onto any policy (`X+think`)",
    paper: "ThinK: Thinner Key Cache by Query-Driven Pruning (Xu et al., ICLR 2025, arXiv 2407.21018); kvpress ThinKPress (NVIDIA/kvpress 0.5.4)",
    params: &[
        ParamInfo { name: "ratio", default: "0.5", kind: Kind::Float, help: "fraction of key channels pruned, in [0, 1] (kvpress key_channel_compression_ratio; our default, kvpress's example: its dataclass default 0 prunes nothing)" },
        ParamInfo { name: "w", default: "32", kind: Kind::Int, help: "last prompt queries that weigh the channels (kvpress window_size)" },
    ],
    caps: Caps {
        family: Family::LowRank,
        phase: Phase::Prefill,
        exact_when_covering: false,
        ..Caps::EVICT_PREFILL
    },
    test: "think_prunes_the_least_queried_key_channels",
    build: Build::Wrapper(|p, base| {
        let ratio = p.float_in("ratio", 0.0, 1.0)?;
        let w = p.int("w")?;
        if w == 0 {
            return Err(ReplayError::BadParam {
                policy: "think".into(),
                key: "w".into(),
                value: "0".into(),
                msg: "at least one query weighs the channels".into(),
            });
        }
        Ok(Arc::new(Think { base, ratio, w }))
    }),
};

pub struct Think {
    pub base: Arc<dyn Policy>,
    pub ratio: f64,
    pub w: usize,
}

impl Think {
    /// Channels pruned of a head of dimension `d`.
    pub fn n_pruned(&self, d: usize) -> usize {
        (d as f64 * self.ratio).floor() as usize
    }

    /// Prune the key channels of freshly built caches (one per KV head, or one
    /// per query head when the base keeps per-query-head caches).
    fn prune(&self, ctx: &PrefillCtx, caches: &mut [HeadCache]) {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let n = self.n_pruned(d);
        if n == 0 || p == 0 {
            return;
        }
        let w = self.w.min(p);
        let per_query_head = caches.len() == ctx.n_heads() && ctx.group() > 1;
        let units = ctx.cache_units(per_query_head);
        for (c, (_, heads)) in caches.iter_mut().zip(units) {
            if c.is_empty() {
                continue;
            }
            // q̄²: mean over the window, then over the cache's query heads
            let nh = heads.len() as f64;
            let mut qn = vec![0f64; d];
            for h in heads {
                for i in p - w..p {
                    for (a, x) in qn.iter_mut().zip(ctx.query(h, i)) {
                        *a += (*x as f64).powi(2) / w as f64 / nh;
                    }
                }
            }
            let mut kn = vec![0f64; d];
            for e in 0..c.len() {
                for (a, x) in kn.iter_mut().zip(c.key(e)) {
                    *a += (*x as f64).powi(2) / c.len() as f64;
                }
            }
            let mut order: Vec<usize> = (0..d).collect();
            order.sort_by(|&a, &b| {
                crate::select::cmp_f64(qn[a] * kn[a], qn[b] * kn[b]).then(a.cmp(&b))
            });
            let pruned = &order[..n];
            for e in 0..c.len() {
                for &ch in pruned {
                    c.keys[e * d + ch] = 0.0;
                }
                c.bits[e] -= n as u64 * F16_BITS;
            }
        }
    }
}

impl Policy for Think {
    /// Its base's caches, so its base's count.
    fn budget_share(&self, group: usize) -> usize {
        self.base.budget_share(group)
    }
    fn name(&self) -> String {
        format!("{}+think", self.base.name())
    }
    fn budget_independent(&self) -> bool {
        self.base.budget_independent()
    }
    /// The base's rows and the last w.
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        self.base.prompt_queries(p, b).max(self.w.min(p))
    }
    fn compress_sliding(&self) -> bool {
        self.base.compress_sliding()
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (mut caches, state) = self.base.prefill(ctx)?;
        self.prune(ctx, &mut caches);
        Ok((caches, state))
    }
    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        self.base.layer_groups(n_layers, budget, prompt_len)
    }
    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let (mut caches, state) = self.base.prefill_group(ctxs)?;
        for (ctx, c) in ctxs.iter().zip(caches.iter_mut()) {
            self.prune(ctx, c);
        }
        Ok((caches, state))
    }
}
