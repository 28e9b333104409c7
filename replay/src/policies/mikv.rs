//! MiKV (docs/methods/mikv.md): importance-aware mixed precision. No token
//! is evicted: the B positions an eviction scorer would keep (default H2O's
//! accumulated attention with its recent half, through the shared selection)
//! are stored at high precision, every other prompt position at low
//! precision instead of being dropped.
//!
//! Rule (Yang et al. 2024; what was confirmed and what is ours:
//! docs/methods/mikv.md): per-token asymmetric round-to-nearest
//! quantisation, scale = (max − min)/(2^b − 1) and zero point = min per group
//! of `group` channels (both stored in f16, KIVI's quantiser
//! `kernels::cpu::fake_quant`); before the keys are quantised, the outlier
//! channel balancer b_c = √(max_t |q_t,c| / max_t |k_t,c|) (maxima over the
//! prompt, queries of the KV head's query heads) scales key channel c by b_c
//! (the queries by 1/b_c, so q·k is unchanged); entries hold the dequantised
//! key divided back by b_c. Entries hold the dequantised vectors; their cost
//! is the real one: b bits per element plus 2·16 bits of scale and zero per
//! group, or 16 bits per element at `hi_bits=16`; the balancer (d f16
//! numbers per KV head) is charged to the head's first entry. Prefill only:
//! decode entries are appended in f16.

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::scorer::TopK;
use crate::ReplayError;
use kvreplay_kernels::cpu::fake_quant;

const BITS: &[&str] = &["2", "3", "4", "8", "16"];

pub static INFO: PolicyInfo = PolicyInfo {
    name: "mikv",
    summary: "mixed precision instead of eviction: the B positions a scorer keeps (default H2O) at high precision, every other position at low precision; nothing dropped",
    paper: "No Token Left Behind: Reliable KV Cache Compression via Importance-Aware Mixed Precision Quantization (Yang et al., arXiv 2402.18096); no reference code published",
    params: &[
        ParamInfo { name: "scorer", default: "h2o", kind: Kind::Scorer, help: "the eviction scorer that picks the B high-precision positions (its parameters are accepted too)" },
        ParamInfo { name: "hi_bits", default: "8", kind: Kind::Choice(BITS), help: "bits of the important positions (16: kept in f16)" },
        ParamInfo { name: "lo_bits", default: "2", kind: Kind::Choice(BITS), help: "bits of the positions the scorer would evict" },
        ParamInfo { name: "group", default: "64", kind: Kind::Int, help: "channels per quantisation group (per token)" },
        ParamInfo { name: "balance", default: "true", kind: Kind::Bool, help: "scale key channels by √(max|q|/max|k|) before quantising (the paper's outlier balancer)" },
    ],
    caps: Caps {
        family: Family::Quantisation,
        phase: Phase::Prefill,
        quantises: true,
        memory: Memory::Beyond("it drops nothing: the B positions its scorer keeps at high precision, every other position at low precision"),
        exact_when_covering: false,
        approximation: Some("prefill only: the split is made once at the end of prefill and decode entries stay f16 (the paper re-splits as the scorer evicts during decode)"),
        ..Caps::EVICT_PREFILL
    },
    test: "mikv_keeps_dropped_tokens_at_low_precision",
    build: Build::ScorerWrapper {
        default_scorer: "h2o",
        scorer_defaults: &[("decode_evict", "false")],
        build: |p, scorer| {
            let group = p.int_positive("group", "must be at least 1")?;
            let bits = |k: &str| -> u32 { p.word(k).parse().expect("validated choice") };
            Ok(Arc::new(Mikv {
                select: TopK::new("mikv", scorer),
                hi: bits("hi_bits"),
                lo: bits("lo_bits"),
                group,
                balance: p.bool("balance")?,
            }))
        },
    },
};

/// Round to the nearest f16 (what a stored scale costs 16 bits for).
pub(crate) fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Quantise one vector per token in groups of `group` channels at `bits`
/// (16: left in f16); returns its storage cost in bits.
pub(crate) fn quant_token(x: &mut [f32], bits: u32, group: usize) -> u64 {
    let d = x.len() as u64;
    if bits >= 16 {
        return d * F16_BITS;
    }
    for g in x.chunks_mut(group) {
        fake_quant(g, bits);
    }
    bits as u64 * d + 2 * F16_BITS * x.len().div_ceil(group) as u64
}

pub struct Mikv {
    pub select: TopK,
    pub hi: u32,
    pub lo: u32,
    pub group: usize,
    pub balance: bool,
}

impl Mikv {
    /// The balancer of KV head `g`: (d,), rounded to f16 (how it is stored).
    fn balancer(&self, ctx: &PrefillCtx, g: usize) -> Vec<f32> {
        let (p, d, gs) = (ctx.prompt_len(), ctx.head_dim(), ctx.group());
        let mut qmax = vec![0f32; d];
        let mut kmax = vec![0f32; d];
        for i in 0..p {
            for h in g * gs..(g + 1) * gs {
                qmax.iter_mut()
                    .zip(ctx.query(h, i))
                    .for_each(|(m, x)| *m = m.max(x.abs()));
            }
            kmax.iter_mut()
                .zip(ctx.key(g, i))
                .for_each(|(m, x)| *m = m.max(x.abs()));
        }
        qmax.iter()
            .zip(&kmax)
            .map(|(q, k)| {
                if *q > 0.0 && *k > 0.0 {
                    f16r((q / k).sqrt())
                } else {
                    1.0
                }
            })
            .collect()
    }

    /// KV head `g`'s cache: every prompt position, `important` (ascending)
    /// at `hi` bits, the others at `lo` bits.
    pub fn head_cache(&self, ctx: &PrefillCtx, g: usize, important: &[usize]) -> HeadCache {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let bal = (self.balance && self.hi.min(self.lo) < 16).then(|| self.balancer(ctx, g));
        let mut c = ctx.full_cache(g);
        let mut hi = vec![false; p];
        important.iter().for_each(|&i| hi[i] = true);
        for (e, &is_hi) in hi.iter().enumerate() {
            let bits = if is_hi { self.hi } else { self.lo };
            let mut k = c.key(e).to_vec();
            if let (Some(b), true) = (&bal, bits < 16) {
                k.iter_mut().zip(b).for_each(|(x, s)| *x *= s);
            }
            let mut cost = quant_token(&mut k, bits, self.group);
            if let (Some(b), true) = (&bal, bits < 16) {
                k.iter_mut().zip(b).for_each(|(x, s)| *x /= s);
            }
            c.keys[e * d..(e + 1) * d].copy_from_slice(&k);
            cost += quant_token(c.value_mut(e), bits, self.group);
            c.bits[e] = cost;
        }
        if bal.is_some() && p > 0 {
            c.bits[0] += d as u64 * F16_BITS;
        }
        c
    }
}

impl Policy for Mikv {
    fn name(&self) -> String {
        "mikv".into()
    }
    fn prompt_queries(&self, p: usize, b: usize) -> usize {
        let own = if self.balance && self.hi.min(self.lo) < 16 {
            p
        } else {
            0
        };
        own.max(self.select.prompt_queries(p, b))
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (kept, _) = self.select.prefill(ctx)?;
        // a per-query-head scorer keeps one set per query head: a KV head's
        // important positions are the union over its query heads
        let units = ctx.cache_units(kept.len() != ctx.n_kv_heads());
        let mut important: Vec<Vec<usize>> = vec![Vec::new(); ctx.n_kv_heads()];
        for ((g, _), c) in units.iter().zip(&kept) {
            important[*g].extend(c.positions());
        }
        let caches = important
            .iter_mut()
            .enumerate()
            .map(|(g, imp)| {
                imp.sort_unstable();
                imp.dedup();
                self.head_cache(ctx, g, imp)
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
