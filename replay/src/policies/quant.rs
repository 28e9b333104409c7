//! KIVI-style quantisation, standalone (`quant`, on the full cache) or
//! composed onto any policy (`snapkv+quant:bits=4`).
//!
//! Rule (docs/methods/quant.md; KIVI, Liu et al. 2024; jy-yuan/KIVI): asymmetric min-max per group
//! (scale = (max − min)/(2^b − 1), zero point = min, round, clamp; scale and
//! min stored in f16). Keys per channel: groups of `group` consecutive entries
//! along the token axis, quantised in whole chunks of `residual` entries, so
//! the newest n mod residual keys stay f16. Values per token: groups of
//! `group` channels; the newest `residual` values stay f16 and one more is
//! quantised each step. Entries hold the dequantised vectors; their cost is
//! the real one: b bits per element plus 2·16 bits of scale and min per group
//! (charged to a key group's first entry).

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{DecodeState, GroupDecodeState, Policy, PrefillCtx, StepCtx};
use crate::ReplayError;
use kvreplay_kernels::cpu::fake_quant;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "quant",
    summary: "KIVI-style quantisation: keys per channel, values per token, f16 recent window; composes with any policy (`X+quant`)",
    paper: "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache (Liu et al., ICML 2024, arXiv 2402.02750); jy-yuan/KIVI",
    params: &[
        ParamInfo { name: "bits", default: "4", kind: Kind::Choice(&["2", "4", "8"]), help: "bits per element" },
        ParamInfo { name: "group", default: "32", kind: Kind::Int, help: "group size: entries per key group, channels per value group" },
        ParamInfo { name: "residual", default: "32", kind: Kind::Int, help: "newest entries kept in f16 (keys: in whole chunks)" },
    ],
    caps: Caps { family: Family::Quantisation, phase: Phase::Prefill, quantises: true, exact_when_covering: false, ..Caps::EVICT_PREFILL },
    test: "quant_charges_real_bits",
    build: Build::Wrapper(|p, base| {
        let group = p.int_positive("group", "must be at least 1")?;
        let residual = p.int("residual")?.max(1);
        Ok(Arc::new(Quant { base, cfg: QuantCfg { bits: p.word("bits").parse().expect("validated"), group, residual } }))
    }),
};

pub struct Quant {
    pub base: Arc<dyn Policy>,
    pub cfg: QuantCfg,
}

#[derive(Clone, Copy, Default)]
struct Flags {
    k: bool,
    v: bool,
}

/// The quantiser's settings (what its decode states need).
#[derive(Clone, Copy, Debug)]
pub struct QuantCfg {
    pub bits: u32,
    pub group: usize,
    pub residual: usize,
}

impl QuantCfg {
    /// Quantise what the rule says must be quantised now.
    #[allow(clippy::needless_range_loop)] // indexes entries of both the cache and the flags
    fn settle(&self, c: &mut HeadCache, flags: &mut [Flags]) {
        let d = c.d;
        let (b, g) = (self.bits as u64, self.group);
        let n = c.len();
        // Keys: the unquantised tail, in whole chunks of `residual`.
        let first_fp = flags.iter().position(|f| !f.k).unwrap_or(n);
        let tail = n - first_fp;
        let chunk = tail / self.residual * self.residual;
        let mut start = first_fp;
        while start < first_fp + chunk {
            let end = (start + g).min(first_fp + chunk);
            for ch in 0..d {
                let mut col: Vec<f32> = (start..end).map(|e| c.keys[e * d + ch]).collect();
                fake_quant(&mut col, self.bits);
                for (i, e) in (start..end).enumerate() {
                    c.keys[e * d + ch] = col[i];
                }
            }
            for (i, e) in (start..end).enumerate() {
                flags[e].k = true;
                let overhead = if i == 0 { 2 * F16_BITS * d as u64 } else { 0 };
                c.bits[e] = c.bits[e] - d as u64 * F16_BITS + b * d as u64 + overhead;
            }
            start = end;
        }
        // Values: all but the newest `residual`, per token in groups of `group` channels.
        for e in 0..n.saturating_sub(self.residual) {
            if flags[e].v {
                continue;
            }
            for chunk in c.value_mut(e).chunks_mut(g) {
                fake_quant(chunk, self.bits);
            }
            flags[e].v = true;
            let groups = d.div_ceil(g) as u64;
            c.bits[e] = c.bits[e] - d as u64 * F16_BITS + b * d as u64 + 2 * F16_BITS * groups;
        }
    }

    /// Quantise freshly built caches; returns their flags.
    fn settle_new(&self, caches: &mut [HeadCache]) -> Vec<Vec<Flags>> {
        caches
            .iter_mut()
            .map(|c| {
                let mut f = vec![Flags::default(); c.len()];
                self.settle(c, &mut f);
                f
            })
            .collect()
    }

    /// Flags before a step, keyed by each entry's first member (entries stand
    /// for disjoint positions, so the key is unique), sorted by key. The
    /// step's new entry, appended by the engine, has no flags yet and so is
    /// unquantised.
    fn resettle(
        &self,
        caches: &mut [HeadCache],
        before: &[Vec<(u32, Flags)>],
        flags: &mut [Vec<Flags>],
    ) {
        for ((c, prev), f) in caches.iter_mut().zip(before).zip(flags.iter_mut()) {
            let mut nf: Vec<Flags> = c
                .members
                .iter()
                .map(|m| match prev.binary_search_by_key(&m[0], |x| x.0) {
                    Ok(i) => prev[i].1,
                    Err(_) => Flags::default(),
                })
                .collect();
            self.settle(c, &mut nf);
            *f = nf;
        }
    }

    /// Each entry's first position (before the base policy's step).
    fn firsts(caches: &[HeadCache]) -> Vec<Vec<u32>> {
        caches
            .iter()
            .map(|c| c.members.iter().map(|m| m[0]).collect())
            .collect()
    }

    /// After the base policy's step: the new entries quantised. Entries that
    /// were there before keep their flags (found by first position), new
    /// ones start unquantised. When the base only appended (the cache's first
    /// positions are the ones before, in order, the step's new entry last),
    /// the flags extend in place; otherwise they are looked up by position.
    fn after_step(&self, caches: &mut [HeadCache], before: &[Vec<u32>], flags: &mut [Vec<Flags>]) {
        for ((c, was), f) in caches.iter_mut().zip(before).zip(flags.iter_mut()) {
            // `was` includes the step's appended entry, which has no flags yet
            let appended_only = c.len() == was.len()
                && f.len() + 1 == was.len()
                && c.members.iter().zip(was).all(|(m, p)| m[0] == *p);
            if appended_only {
                f.push(Flags::default());
                self.settle(c, f);
            } else {
                let mut prev: Vec<(u32, Flags)> =
                    was.iter().copied().zip(f.iter().copied()).collect();
                prev.sort_unstable_by_key(|x| x.0);
                self.resettle(
                    std::slice::from_mut(c),
                    std::slice::from_ref(&prev),
                    std::slice::from_mut(f),
                );
            }
        }
    }
}

struct QState {
    inner: Box<dyn DecodeState>,
    cfg: QuantCfg,
    /// Per KV head, per entry: which halves are quantised.
    flags: Vec<Vec<Flags>>,
}

struct QGroupState {
    inner: Box<dyn GroupDecodeState>,
    cfg: QuantCfg,
    /// Per layer of the group, per KV head, per entry.
    flags: Vec<Vec<Vec<Flags>>>,
}

impl Policy for Quant {
    /// Its base's caches, so its base's count.
    fn budget_share(&self, group: usize) -> usize {
        self.base.budget_share(group)
    }
    fn name(&self) -> String {
        format!("{}+quant", self.base.name())
    }
    fn budget_independent(&self) -> bool {
        self.base.budget_independent()
    }
    /// What the policy it quantises reads.
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
        let (mut caches, inner) = self.base.prefill(ctx)?;
        let flags = self.cfg.settle_new(&mut caches);
        Ok((
            caches,
            Box::new(QState {
                inner,
                cfg: self.cfg,
                flags,
            }),
        ))
    }

    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        self.base.layer_groups(n_layers, budget, prompt_len)
    }

    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let (mut caches, inner) = self.base.prefill_group(ctxs)?;
        let flags = caches.iter_mut().map(|c| self.cfg.settle_new(c)).collect();
        Ok((
            caches,
            Box::new(QGroupState {
                inner,
                cfg: self.cfg,
                flags,
            }),
        ))
    }
}

impl DecodeState for QState {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        let before = QuantCfg::firsts(caches);
        self.inner.step(ctx, caches);
        self.cfg.after_step(caches, &before, &mut self.flags);
    }
}

impl GroupDecodeState for QGroupState {
    fn step(&mut self, ctxs: &[StepCtx], caches: &mut [Vec<HeadCache>]) {
        let before: Vec<_> = caches.iter().map(|c| QuantCfg::firsts(c)).collect();
        self.inner.step(ctxs, caches);
        for ((c, b), f) in caches.iter_mut().zip(&before).zip(self.flags.iter_mut()) {
            self.cfg.after_step(c, b, f);
        }
    }
}
