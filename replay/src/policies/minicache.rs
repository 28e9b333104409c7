//! MiniCache: merge the KV states of adjacent deep layers along their shared
//! direction (SLERP), keep each layer's norms, and keep the rare divergent
//! token pairs unmerged.
//!
//! Rule (../shared/specs/landscape.md part A): layers S, S+1, ... form pairs
//! (a, b) = (S+2j, S+2j+1); per pair, KV head and tensor (K or V), each
//! position's two vectors become one unit direction e_p = SLERP(u_a, u_b; t)
//! (t weights the deeper layer) plus the norms n^a_p, n^b_p; the angular
//! distance dist_p = Ω_p/π decides retention: positions with
//! dist_p > d_max − γ·(d_max − d_min) keep their originals. Layer m restores
//! x̂^m_p = n^m_p·e_p. Decode positions are merged after their step against the
//! threshold frozen at prefill. Stored: directions (f16, renormalised), norms
//! (f16), retained originals (f16) and their indices (32 bits); a direction
//! is charged once per pair (to the shallower layer's entry).
//!
//! Budget (our choice; the paper has none): `start=budget` maps the budget to
//! the first merged layer, S = ⌊L·min(1, B/P)⌋, so B ≥ P merges nothing and
//! B/P = 0.5 is the paper's half-depth start; `start=0.5` fixes it.

use std::sync::Arc;

use kvreplay_kernels::cpu::l2_norm_f32;

use super::{Build, Caps, Family, Phase, PolicyInfo};
use crate::cache::{HeadCache, F16_BITS};
use crate::policy::{DecodeState, GroupDecodeState, Policy, PrefillCtx, StepCtx};
use crate::select::cmp_f64;
use crate::spec::{Kind, ParamInfo, Params};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "minicache",
    summary: "merges adjacent deep layers' KV states by SLERP of their directions, keeping per-layer norms and divergent tokens",
    paper: "MiniCache: KV Cache Compression in Depth Dimension for Large Language Models (Liu et al., NeurIPS 2024, arXiv 2405.14366)",
    params: &[
        ParamInfo { name: "start", default: "budget", kind: Kind::FloatOr("budget"), help: "first merged layer as a fraction of depth; budget = min(1, B/P) (paper: 0.5)" },
        ParamInfo { name: "t", default: "0.6", kind: Kind::Float, help: "SLERP weight of the deeper layer" },
        ParamInfo { name: "gamma", default: "0.05", kind: Kind::Float, help: "retention threshold: share of the distance range kept unmerged" },
        ParamInfo { name: "rule", default: "default", kind: Kind::Choice(&["default", "literal_low", "top_fraction"]), help: "keep the most divergent pairs, xKV's most-similar reading, or the top rho fraction" },
        ParamInfo { name: "rho", default: "0.05", kind: Kind::Float, help: "fraction kept by rule=top_fraction" },
        ParamInfo { name: "scope", default: "per_head", kind: Kind::Choice(&["per_head", "global"]), help: "distance range per KV head, or over all heads of the pair" },
        ParamInfo { name: "shared_from_k", default: "false", kind: Kind::Bool, help: "values reuse the keys' retention set" },
        ParamInfo { name: "merge_decode", default: "true", kind: Kind::Bool, help: "merge decode positions after each step (false: xKV, prefill only)" },
        ParamInfo { name: "compact", default: "false", kind: Kind::Bool, help: "store no direction for retained positions" },
        ParamInfo { name: "merge", default: "slerp", kind: Kind::Choice(&["slerp", "mean"]), help: "SLERP with norms (MiniCache) or the Mean-KV baseline (x̂ = (x^a + x^b)/2, no retention)" },
        ParamInfo { name: "b_dir", default: "16", kind: Kind::Choice(&["16", "8", "4", "2"]), help: "direction storage bits; below 16 the quantiser's per-token groups of 32 channels with f16 scale and minimum (\"MiniCache-4bit\")" },
        ParamInfo { name: "b_norm", default: "16", kind: Kind::Choice(&["16", "32"]), help: "norm storage bits (f16, or f32 for exact norms)" },
        ParamInfo { name: "merge_k", default: "true", kind: Kind::Bool, help: "merge keys" },
        ParamInfo { name: "merge_v", default: "true", kind: Kind::Bool, help: "merge values" },
    ],
    caps: Caps { family: Family::CrossLayer, phase: Phase::Decode, merges: true, cross_layer: true, ..Caps::EVICT_PREFILL },
    test: "minicache_merges_parallel_layers_losslessly_and_charges_one_direction",
    build: Build::Policy(|p| {
        Ok(Arc::new(MiniCache::from_params(p)?))
    }),
};

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
    fn from_params(p: &Params) -> Result<MiniCache, ReplayError> {
        let start = match p.word("start") {
            "budget" => None,
            _ => Some(p.float("start")?),
        };
        Ok(MiniCache {
            start,
            t: p.float("t")? as f32,
            gamma: p.float("gamma")?,
            rule: p.choice("rule")?,
            rho: p.float("rho")?,
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
    fn mean(&self) -> bool {
        self.merge == Merge::Mean
    }
}

/// Channels per quantisation group of a stored direction (b_dir < 16).
const DIR_GROUP: usize = 32;

/// One position's merge of a pair of vectors.
#[derive(Clone, Debug)]
pub struct Merged {
    /// Unit direction (f16-rounded, renormalised), or the mean vector for Mean-KV.
    pub e: Vec<f32>,
    /// Norms (f16-rounded).
    pub na: f32,
    pub nb: f32,
    /// Ω/π, None when a norm is zero.
    pub dist: Option<f64>,
    /// Must be retained (zero norm, antipodal).
    pub forced: bool,
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// SLERP merge of `a` (shallower) and `b` (deeper) with weight `t` on `b`.
pub fn merge_token(a: &[f32], b: &[f32], t: f32) -> Merged {
    let (na, nb) = (l2_norm_f32(a), l2_norm_f32(b));
    let unit = |x: &[f32], n: f32| -> Vec<f32> { x.iter().map(|v| v / n).collect() };
    let (mut e, dist, forced) = if na < 1e-8 || nb < 1e-8 {
        let e = if na >= 1e-8 {
            unit(a, na)
        } else if nb >= 1e-8 {
            unit(b, nb)
        } else {
            vec![0.0; a.len()]
        };
        (e, None, true)
    } else {
        let (ua, ub) = (unit(a, na), unit(b, nb));
        let diff: Vec<f32> = ua.iter().zip(&ub).map(|(x, y)| x - y).collect();
        let sum: Vec<f32> = ua.iter().zip(&ub).map(|(x, y)| x + y).collect();
        let omega = 2.0 * l2_norm_f32(&diff).atan2(l2_norm_f32(&sum));
        let pi = std::f32::consts::PI;
        if omega < 1e-6 {
            (
                ua.iter()
                    .zip(&ub)
                    .map(|(x, y)| (1.0 - t) * x + t * y)
                    .collect(),
                Some((omega / pi) as f64),
                false,
            )
        } else if pi - omega < 1e-6 {
            (
                if t >= 0.5 { ub } else { ua },
                Some((omega / pi) as f64),
                true,
            )
        } else {
            let (s0, s1, s) = (((1.0 - t) * omega).sin(), (t * omega).sin(), omega.sin());
            (
                ua.iter()
                    .zip(&ub)
                    .map(|(x, y)| (s0 * x + s1 * y) / s)
                    .collect(),
                Some((omega / pi) as f64),
                false,
            )
        }
    };
    // Store at f16 and renormalise, as the restore does.
    e.iter_mut().for_each(|v| *v = f16r(*v));
    let n = l2_norm_f32(&e);
    if n > 0.0 {
        e.iter_mut().for_each(|v| *v /= n);
    }
    Merged {
        e,
        na: f16r(na),
        nb: f16r(nb),
        dist,
        forced,
    }
}

/// A retention threshold frozen at prefill.
#[derive(Clone, Copy, Debug)]
enum Threshold {
    /// retained if dist > τ
    Above(f64),
    /// retained if dist <= τ'
    AtMost(f64),
    /// retained if dist >= τ_ρ
    AtLeast(f64),
}

impl Threshold {
    fn retains(&self, m: &Merged) -> bool {
        if m.forced {
            return true;
        }
        let d = m.dist.expect("non-forced merges have a distance");
        match *self {
            Threshold::Above(t) => d > t,
            Threshold::AtMost(t) => d <= t,
            Threshold::AtLeast(t) => d >= t,
        }
    }
}

impl MiniCache {
    /// The threshold for a set of prefill merges (positions in order).
    fn threshold(&self, ms: &[&Merged]) -> Threshold {
        let ds: Vec<f64> = ms
            .iter()
            .filter(|m| !m.forced)
            .filter_map(|m| m.dist)
            .collect();
        let (mn, mx) = ds
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), d| {
                (a.min(*d), b.max(*d))
            });
        match self.rule {
            Rule::LiteralLow if !ds.is_empty() => Threshold::AtMost(mn + self.gamma * (mx - mn)),
            Rule::LiteralLow => Threshold::AtMost(f64::NEG_INFINITY),
            Rule::TopFraction => {
                let n = (self.rho * ms.len() as f64).ceil() as usize;
                let mut idx: Vec<(f64, usize)> = ms
                    .iter()
                    .enumerate()
                    .map(|(i, m)| (if m.forced { 1.0 } else { m.dist.unwrap_or(1.0) }, i))
                    .collect();
                idx.sort_by(|x, y| cmp_f64(y.0, x.0).then(y.1.cmp(&x.1)));
                Threshold::AtLeast(
                    idx.iter()
                        .take(n)
                        .map(|x| x.0)
                        .fold(f64::INFINITY, f64::min),
                )
            }
            Rule::MostDivergent if !ds.is_empty() => Threshold::Above(mx - self.gamma * (mx - mn)),
            Rule::MostDivergent => Threshold::Above(f64::INFINITY),
        }
    }

    fn pair_start(&self, n_layers: usize, budget: usize, prompt_len: usize) -> usize {
        let frac = self
            .start
            .unwrap_or((budget as f64 / prompt_len as f64).min(1.0));
        ((n_layers as f64 * frac).floor() as usize).min(n_layers)
    }
}

/// Which half of an entry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    K,
    V,
}

/// Write position `e` of layer `which` (0 = a, 1 = b) restored from `m`, or
/// keep the original when `retained`; returns the bits this half costs there.
#[allow(clippy::too_many_arguments)] // one call site; the flags are the pair's settings
fn restore(
    c: &mut HeadCache,
    e: usize,
    half: Half,
    which: usize,
    m: &Merged,
    retained: bool,
    mean: bool,
    compact: bool,
    idx_bits: u64,
    dir_bits: u64,
    norm_bits: u64,
) -> u64 {
    let d = c.d as u64;
    let row = if half == Half::K {
        &mut c.keys[e * c.d..(e + 1) * c.d]
    } else {
        &mut c.values[e * c.d..(e + 1) * c.d]
    };
    if mean {
        row.copy_from_slice(&m.e);
        return if which == 0 { d * F16_BITS } else { 0 };
    }
    let n = if which == 0 { m.na } else { m.nb };
    if !retained {
        row.iter_mut().zip(&m.e).for_each(|(x, u)| *x = n * u);
    }
    let dir = if which == 0 && !(compact && retained) {
        dir_bits
    } else {
        0
    };
    let kept = if retained {
        d * F16_BITS + if which == 0 { idx_bits } else { 0 }
    } else {
        0
    };
    dir + norm_bits + kept
}

/// Mean-KV: the mean of the two vectors (stored at f16).
fn mean_merge(a: &[f32], b: &[f32]) -> Merged {
    Merged {
        e: a.iter().zip(b).map(|(x, y)| f16r((x + y) / 2.0)).collect(),
        na: 0.0,
        nb: 0.0,
        dist: None,
        forced: false,
    }
}

struct PairState {
    cfg: MiniCache,
    /// Per KV head: frozen thresholds for K and V (None when that half is not merged).
    thresholds: Vec<[Option<Threshold>; 2]>,
}

impl MiniCache {
    /// Write the merged position `e` into both layers' caches of one KV head.
    fn merge_position(
        &self,
        ca: &mut HeadCache,
        cb: &mut HeadCache,
        e: usize,
        th: &[Option<Threshold>; 2],
        merged: [Option<Merged>; 2],
    ) {
        let d = ca.d as u64;
        let (mut bits_a, mut bits_b) = (0u64, 0u64);
        let mut k_retained = false;
        for (i, half) in [Half::K, Half::V].into_iter().enumerate() {
            match (&merged[i], th[i]) {
                (Some(m), Some(t)) => {
                    let retained = !self.mean()
                        && (t.retains(m) || (half == Half::V && self.shared_from_k && k_retained));
                    if half == Half::K {
                        k_retained = retained;
                    }
                    let idx = if half == Half::V && self.shared_from_k {
                        0
                    } else {
                        32
                    };
                    bits_a += restore(
                        ca,
                        e,
                        half,
                        0,
                        m,
                        retained,
                        self.mean(),
                        self.compact,
                        idx,
                        self.dir_bits(d),
                        self.b_norm as u64,
                    );
                    bits_b += restore(
                        cb,
                        e,
                        half,
                        1,
                        m,
                        retained,
                        self.mean(),
                        self.compact,
                        idx,
                        self.dir_bits(d),
                        self.b_norm as u64,
                    );
                }
                _ => {
                    bits_a += d * F16_BITS;
                    bits_b += d * F16_BITS;
                }
            }
        }
        ca.bits[e] = bits_a;
        cb.bits[e] = bits_b;
    }

    /// Bits of one stored direction of `d` elements.
    fn dir_bits(&self, d: u64) -> u64 {
        if self.b_dir >= 16 {
            d * F16_BITS
        } else {
            d * self.b_dir as u64 + 2 * F16_BITS * d.div_ceil(DIR_GROUP as u64)
        }
    }

    fn merges(&self, a: &HeadCache, b: &HeadCache, e: usize) -> [Option<Merged>; 2] {
        let f = |x: &[f32], y: &[f32]| {
            if self.mean() {
                mean_merge(x, y)
            } else {
                let mut m = merge_token(x, y, self.t);
                if self.b_norm == 32 {
                    (m.na, m.nb) = (l2_norm_f32(x), l2_norm_f32(y));
                }
                if self.b_dir < 16 {
                    // quantise the stored direction, then re-normalise it (landscape.md A5.10)
                    for chunk in m.e.chunks_mut(DIR_GROUP) {
                        super::quant::fake_quant(chunk, self.b_dir);
                    }
                    let n = l2_norm_f32(&m.e);
                    if n > 0.0 {
                        m.e.iter_mut().for_each(|v| *v /= n);
                    }
                }
                m
            }
        };
        [
            self.merge_k.then(|| f(a.key(e), b.key(e))),
            self.merge_v.then(|| f(a.value(e), b.value(e))),
        ]
    }
}

impl Policy for MiniCache {
    /// A layer on its own is never merged.
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        Ok((ctx.full_caches(), Box::new(crate::policy::AppendOnly)))
    }

    /// Layers below S alone, then pairs (S + 2j, S + 2j + 1), a leftover top layer alone.
    fn layer_groups(&self, n_layers: usize, budget: usize, prompt_len: usize) -> Vec<Vec<usize>> {
        let s = self.pair_start(n_layers, budget, prompt_len);
        let mut g: Vec<Vec<usize>> = (0..s).map(|l| vec![l]).collect();
        let mut l = s;
        while l + 1 < n_layers {
            g.push(vec![l, l + 1]);
            l += 2;
        }
        if l < n_layers {
            g.push(vec![l]);
        }
        g
    }

    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let full: Vec<Vec<HeadCache>> = ctxs.iter().map(|c| c.full_caches()).collect();
        let none = || {
            Box::new(PairState {
                cfg: self.clone(),
                thresholds: Vec::new(),
            })
        };
        if ctxs.len() != 2 {
            return Ok((full, none()));
        }
        let a = &ctxs[0];
        let mut caches = full;
        let (left, right) = caches.split_at_mut(1);
        let (ca, cb) = (&mut left[0], &mut right[0]);
        let p = a.prompt_len();
        // Merge every prompt position, per KV head and half.
        let merged: Vec<Vec<[Option<Merged>; 2]>> = (0..a.n_kv_heads())
            .map(|g| (0..p).map(|e| self.merges(&ca[g], &cb[g], e)).collect())
            .collect();
        let mut thresholds: Vec<[Option<Threshold>; 2]> = Vec::new();
        for g in 0..a.n_kv_heads() {
            let mut th = [None, None];
            for (i, slot) in th.iter_mut().enumerate() {
                let set: Vec<&Merged> = if self.scope == Scope::Global {
                    merged
                        .iter()
                        .flat_map(|h| h.iter().filter_map(|x| x[i].as_ref()))
                        .collect()
                } else {
                    merged[g].iter().filter_map(|x| x[i].as_ref()).collect()
                };
                if !set.is_empty() {
                    *slot = Some(self.threshold(&set));
                }
            }
            thresholds.push(th);
        }
        for g in 0..a.n_kv_heads() {
            for (e, m) in merged[g].iter().enumerate() {
                self.merge_position(&mut ca[g], &mut cb[g], e, &thresholds[g], m.clone());
            }
        }
        Ok((
            caches,
            Box::new(PairState {
                cfg: self.clone(),
                thresholds,
            }),
        ))
    }
}

impl GroupDecodeState for PairState {
    fn step(&mut self, _ctxs: &[StepCtx], caches: &mut [Vec<HeadCache>]) {
        if self.thresholds.is_empty() || !self.cfg.merge_decode || caches.len() != 2 {
            return;
        }
        let (left, right) = caches.split_at_mut(1);
        for (g, th) in self.thresholds.iter().enumerate() {
            let (ca, cb) = (&mut left[0][g], &mut right[0][g]);
            let e = ca.len() - 1; // the step's new entry in both layers
            let m = self.cfg.merges(ca, cb, e);
            self.cfg.merge_position(ca, cb, e, th, m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slerp_round_trip_and_guards() {
        // Identical directions: the merge restores each vector from its own norm exactly
        // (up to f16 storage of the direction and norms).
        let a = [3.0f32, 4.0];
        let b = [6.0f32, 8.0];
        let m = merge_token(&a, &b, 0.6);
        assert_eq!(m.dist, Some(0.0));
        assert!((m.na - 5.0).abs() < 1e-3 && (m.nb - 10.0).abs() < 1e-2);
        assert!((m.e[0] - 0.6).abs() < 1e-3 && (m.e[1] - 0.8).abs() < 1e-3);
        // Orthogonal unit vectors at t = 0.5: the midpoint direction (1, 1)/√2, Ω/π = 1/2.
        let m = merge_token(&[1.0, 0.0], &[0.0, 1.0], 0.5);
        assert!((m.dist.unwrap() - 0.5).abs() < 1e-6);
        assert!(
            (m.e[0] - m.e[1]).abs() < 1e-3
                && (m.e[0] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-3
        );
        // t weights the deeper layer: at t = 0.6 the direction leans to b (angle 0.6·90°).
        let m = merge_token(&[1.0, 0.0], &[0.0, 1.0], 0.6);
        assert!((m.e[1].atan2(m.e[0]) - 0.6 * std::f32::consts::FRAC_PI_2).abs() < 1e-3);
        // Antipodal and zero-norm pairs are forced into the retention set.
        assert!(merge_token(&[1.0, 0.0], &[-1.0, 0.0], 0.6).forced);
        assert!(merge_token(&[0.0, 0.0], &[1.0, 0.0], 0.6).forced);
    }

    #[test]
    fn retention_rule_keeps_the_top_gamma_of_the_range() {
        let c = MiniCache {
            start: Some(0.0),
            t: 0.6,
            gamma: 0.25,
            rule: Rule::MostDivergent,
            rho: 0.05,
            scope: Scope::PerHead,
            shared_from_k: false,
            merge_decode: true,
            compact: false,
            merge: Merge::Slerp,
            merge_k: true,
            merge_v: true,
            b_dir: 16,
            b_norm: 16,
        };
        let ms: Vec<Merged> = [0.1, 0.2, 0.3, 0.5]
            .iter()
            .map(|d| Merged {
                e: vec![],
                na: 1.0,
                nb: 1.0,
                dist: Some(*d),
                forced: false,
            })
            .collect();
        let refs: Vec<&Merged> = ms.iter().collect();
        // τ = 0.5 − 0.25·0.4 = 0.4: only dist 0.5 is retained
        let th = c.threshold(&refs);
        assert_eq!(ms.iter().filter(|m| th.retains(m)).count(), 1);
        // literal_low keeps the most similar: τ' = 0.1 + 0.1 = 0.2 -> dist 0.1 and 0.2
        let lit = MiniCache {
            rule: Rule::LiteralLow,
            ..c.clone()
        };
        let th = lit.threshold(&refs);
        assert_eq!(ms.iter().filter(|m| th.retains(m)).count(), 2);
        // top_fraction with rho = 0.5 keeps the 2 largest
        let top = MiniCache {
            rule: Rule::TopFraction,
            rho: 0.5,
            ..c
        };
        let th = top.threshold(&refs);
        assert_eq!(ms.iter().filter(|m| th.retains(m)).count(), 2);
    }
}
