//! ZipCache (docs/methods/zipcache.md): mixed-precision quantisation by
//! normalised attention saliency.
//!
//! Rule (He et al. 2024, §4.1–4.2): the saliency of prompt position i is its
//! accumulated attention normalised by the number of causal rows that see
//! it, s_i = Σ_{j≥i} A_{j,i} / (P − i) (eq. 8; the column sums of the
//! prompt's causal attention, averaged over the KV head's query heads). The
//! top B positions per KV head by s (or a fraction `salient` of the prompt)
//! are quantised at `hi_bits`, the rest at `lo_bits`. Quantisation is
//! channel-separable token-wise (eq. 5–6), for keys and values alike: each
//! channel j is divided by c_j = √(max_i |X_i,j|) (over the prompt, stored in
//! f16), then every token is quantised as one group (asymmetric min-max,
//! scale and zero point in f16), dequantised and multiplied back by c_j.
//! Cost per entry: b bits per element + 2·16 bits (scale, zero) for the key
//! and for the value; the two channel-scale vectors (2·d f16 numbers per KV
//! head) are charged to the head's first entry. Ties in s: the later
//! position first. Prefill only: decode entries are appended in f16.

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::mikv::{f16r, quant_token};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

const BITS: &[&str] = &["2", "3", "4", "8"];

pub static INFO: PolicyInfo = PolicyInfo {
    name: "zipcache",
    summary: "mixed-precision quantisation: salient positions by normalised accumulated attention at high bits, the rest at low bits; channel-separable token-wise quantiser",
    paper: "ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token Identification (He et al., NeurIPS 2024, arXiv 2405.14256); ThisisBillhe/ZipCache",
    params: &[
        ParamInfo { name: "hi_bits", default: "4", kind: Kind::Choice(BITS), help: "bits of the salient positions" },
        ParamInfo { name: "lo_bits", default: "2", kind: Kind::Choice(BITS), help: "bits of the other positions" },
        ParamInfo { name: "salient", default: "budget", kind: Kind::FloatOr("budget"), help: "salient positions per KV head: `budget` = B, or a fraction of the prompt in [0, 1] (the reference demo: 0.6)" },
    ],
    caps: Caps {
        family: Family::Quantisation,
        phase: Phase::Prefill,
        quantises: true,
        memory: Memory::Beyond("it drops nothing: salient positions at high bits, every other position at low bits; its memory is set by the bit widths and the salient ratio"),
        exact_when_covering: false,
        approximation: Some("the exact normalised attention from every prompt row (the paper's default metric; its probe-query approximation is not implemented); each KV head quantised on its own where the reference code takes a token's min/max over all heads; prefill only, decode entries f16"),
        ..Caps::EVICT_PREFILL
    },
    test: "zipcache_quantises_salient_tokens_at_high_bits",
    build: Build::Policy(|p| {
        let salient = match p.word("salient") {
            "budget" => None,
            _ => Some(p.float_in("salient", 0.0, 1.0)?),
        };
        let bits = |k: &str| -> u32 { p.word(k).parse().expect("validated choice") };
        Ok(Arc::new(ZipCache { hi: bits("hi_bits"), lo: bits("lo_bits"), salient }))
    }),
};

pub struct ZipCache {
    pub hi: u32,
    pub lo: u32,
    /// None: B salient positions per KV head; Some(f): ⌊f·P⌋.
    pub salient: Option<f64>,
}

/// Channel-separable token-wise quantisation of the rows of `x` (n, d) at
/// `bits[i]` per row; returns each row's cost (the channel scales excluded).
pub(crate) fn separable_tokenwise(x: &mut [f32], d: usize, bits: &[u32]) -> Vec<u64> {
    let mut c = vec![0f32; d];
    for row in x.chunks(d) {
        c.iter_mut().zip(row).for_each(|(m, v)| *m = m.max(v.abs()));
    }
    let c: Vec<f32> = c
        .iter()
        .map(|m| if *m > 0.0 { f16r(m.sqrt()) } else { 1.0 })
        .collect();
    x.chunks_mut(d)
        .zip(bits)
        .map(|(row, &b)| {
            row.iter_mut().zip(&c).for_each(|(v, s)| *v /= s);
            let cost = quant_token(row, b, d);
            row.iter_mut().zip(&c).for_each(|(v, s)| *v *= s);
            cost
        })
        .collect()
}

impl ZipCache {
    /// Normalised saliency of KV head `g`'s prompt positions: (P,).
    pub fn saliency(ctx: &PrefillCtx, g: usize) -> Vec<f32> {
        let (p, gs) = (ctx.prompt_len(), ctx.group());
        let mut s = vec![0f32; p];
        for h in g * gs..(g + 1) * gs {
            for (i, (x, a)) in s.iter_mut().zip(ctx.colsum(h)).enumerate() {
                *x += a / (p - i) as f32;
            }
        }
        s.iter_mut().for_each(|x| *x /= gs as f32);
        s
    }
}

impl Policy for ZipCache {
    fn name(&self) -> String {
        "zipcache".into()
    }
    /// Column sums only.
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let n = match self.salient {
            None => ctx.budget.min(p),
            Some(f) => ((f * p as f64).floor() as usize).min(p),
        };
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                let s = Self::saliency(ctx, g);
                let mut order: Vec<usize> = (0..p).collect();
                // saliency descending, the later position first on ties
                order.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(b.cmp(&a)));
                let mut bits = vec![self.lo; p];
                order[..n].iter().for_each(|&i| bits[i] = self.hi);
                let mut c = ctx.full_cache(g);
                let kb = separable_tokenwise(&mut c.keys, d, &bits);
                let vb = separable_tokenwise(&mut c.values, d, &bits);
                for e in 0..p {
                    c.bits[e] = kb[e] + vb[e];
                }
                if p > 0 {
                    c.bits[0] += 2 * d as u64 * F16_BITS;
                }
                c
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
