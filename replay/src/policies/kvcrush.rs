//! KVCrush: the tokens an inner scorer evicts are grouped by how the heads
//! behave towards them, and one representative per group is kept beside the
//! scorer's top tokens (docs/methods/kvcrush.md).
//!
//! Rule, per cache of a layer (prefill, P > B):
//! 1. The inner scorer (default H2O's accumulated attention, prefill only)
//!    fixes its protected positions (sinks, recent window) and scores the
//!    candidates C = sinks..P − recent. Of the A = B − protected selections,
//!    R = ⌊share·A⌋ go to representatives and A − R to the scorer's top.
//! 2. Signature: for each candidate i, one bit per query head h of the layer
//!    (H bits): the inner scorer run on head h alone scores C, and bit h is 1
//!    when i is among the ⌊|C|/2⌋ highest of those scores (`bit=half`, as the
//!    authors' OpenVINO code marks the top half) or above their mean
//!    (`bit=mean`).
//! 3. Anchor: an H-bit vector (`anchor=random`: drawn from SplitMix64 seeded
//!    by (seed, layer, cache); `mean`: the majority bit of the evicted set;
//!    `zeros`, `ones`, `alternate`).
//! 4. The evicted candidates E (not among the top A − R) are sorted by the
//!    Hamming distance of their signature to the anchor (ties: earlier
//!    position first); with s = ⌊|E|/R⌋, the entries at ranks 0, s, 2s, …
//!    (R of them: one per bucket of s consecutive ranks) are kept.
//!
//! Shapes: scores (P,) or (P − recent,) per head; signatures (|C|, ⌈H/64⌉) words.
//! The kept entries are exact; decode entries are appended (prefill only).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, SplitMix64};
use crate::scorer::{units_to_compress, Scorer, Unit};
use crate::select::{keep_positions, top_k};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "kvcrush",
    summary: "a scorer's top tokens (default H2O) plus one representative per group of evicted tokens, grouped by a binary per-head signature's Hamming distance to an anchor",
    paper: "KVCrush: Key Value Cache size-reduction using similarity in head-behaviour (Jha et al., ACML 2025, arXiv 2503.00022); openvinotoolkit/openvino.genai (continuous_batching/kvcrush.cpp)",
    params: &[
        ParamInfo { name: "scorer", default: "h2o", kind: Kind::Scorer, help: "the inner scorer whose top tokens are kept and whose per-head scores make the signatures (prefill only: decode_evict=false)" },
        ParamInfo { name: "share", default: "0.25", kind: Kind::Float, help: "share of the selected (unprotected) budget given to representatives of the evicted tokens, in [0, 1]" },
        ParamInfo { name: "bit", default: "half", kind: Kind::Choice(&["half", "mean"]), help: "signature bit of head h: the token is in the top half of head h's candidate scores, or above their mean" },
        ParamInfo { name: "anchor", default: "random", kind: Kind::Choice(&["random", "mean", "zeros", "ones", "alternate"]), help: "the anchor the Hamming distances are taken to" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed of the random anchor; (seed, layer, cache) fixes it" },
    ],
    caps: Caps {
        approximation: Some("the signature bit is the top half of each head's candidate scores (the authors' OpenVINO code; the paper's text was not available to check a threshold); the random anchor comes from SplitMix64, not the reference's mt19937"),
        ..Caps::EVICT_PREFILL
    },
    test: "kvcrush_keeps_one_representative_per_hamming_bucket",
    build: Build::ScorerWrapper {
        default_scorer: "h2o",
        scorer_defaults: &[("decode_evict", "false")],
        build: |p, scorer| {
            if scorer.decode_evict() {
                return Err(p.bad("scorer", "KVCrush selects at prefill: give its scorer decode_evict=false".into()));
            }
            Ok(Arc::new(KvCrush {
                scorer,
                share: p.float_in("share", 0.0, 1.0)?,
                bit: p.choice("bit")?,
                anchor: p.choice("anchor")?,
                seed: p.int("seed")? as u64,
            }))
        },
    },
};

crate::params::choice_enum! {
    /// How a head's scores become its signature bit.
    pub enum Bit {
        Half = "half",
        Mean = "mean",
    }
}

crate::params::choice_enum! {
    /// The anchor of the Hamming distances.
    pub enum Anchor {
        Random = "random",
        Mean = "mean",
        Zeros = "zeros",
        Ones = "ones",
        Alternate = "alternate",
    }
}

pub struct KvCrush {
    pub scorer: Arc<dyn Scorer>,
    pub share: f64,
    pub bit: Bit,
    pub anchor: Anchor,
    pub seed: u64,
}

/// H-bit vectors as u64 words.
type Bits = Vec<u64>;

fn get(b: &Bits, h: usize) -> bool {
    b[h / 64] >> (h % 64) & 1 == 1
}

fn set(b: &mut Bits, h: usize) {
    b[h / 64] |= 1 << (h % 64);
}

fn hamming(a: &Bits, b: &Bits) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

impl KvCrush {
    /// Signatures of the candidates `cand` (indexed from cand.start): bit h
    /// from the inner scorer run on query head h alone.
    fn signatures(&self, ctx: &PrefillCtx, cand: std::ops::Range<usize>) -> Vec<Bits> {
        let (nh, gs) = (ctx.n_heads(), ctx.group());
        let words = nh.div_ceil(64);
        let mut sig = vec![vec![0u64; words]; cand.len()];
        for h in 0..nh {
            let unit = Unit {
                kv_head: h / gs,
                heads: h..h + 1,
            };
            let s = self.scorer.score(ctx, &unit);
            let on: Vec<usize> = match self.bit {
                Bit::Half => top_k(&s, cand.clone(), cand.len() / 2, |i| i, self.scorer.tie()),
                Bit::Mean => {
                    let mean =
                        cand.clone().map(|i| s[i] as f64).sum::<f64>() / cand.len().max(1) as f64;
                    cand.clone().filter(|&i| s[i] as f64 > mean).collect()
                }
            };
            for i in on {
                set(&mut sig[i - cand.start], h);
            }
        }
        sig
    }

    /// The anchor of cache `c` given the evicted set's signatures.
    fn anchor_bits(&self, ctx: &PrefillCtx, c: usize, evicted: &[&Bits]) -> Bits {
        let nh = ctx.n_heads();
        let mut a = vec![0u64; nh.div_ceil(64)];
        let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), c);
        for h in 0..nh {
            let on = match self.anchor {
                Anchor::Random => rng.next_u64() >> 63 == 1,
                Anchor::Mean => 2 * evicted.iter().filter(|b| get(b, h)).count() > evicted.len(),
                Anchor::Zeros => false,
                Anchor::Ones => true,
                Anchor::Alternate => h % 2 == 1,
            };
            if on {
                set(&mut a, h);
            }
        }
        a
    }
}

impl Policy for KvCrush {
    fn name(&self) -> String {
        "kvcrush".into()
    }

    fn prompt_queries(&self, prompt_len: usize, budget: usize) -> usize {
        self.scorer.prompt_queries(prompt_len, budget)
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let s = &*self.scorer;
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let units = match units_to_compress(ctx, s) {
            Ok(units) => units,
            Err(whole) => return Ok(whole),
        };
        let prot = s.protect(b)?;
        let avg = b - prot.total();
        let reps = (self.share * avg as f64).floor() as usize;
        let cand = prot.sinks..p - prot.recent;
        let sig = if reps > 0 {
            self.signatures(ctx, cand.clone())
        } else {
            Vec::new()
        };
        let mut caches = Vec::new();
        for (c, u) in units.iter().enumerate() {
            let scores = s.score(ctx, u);
            if scores.len() < cand.end {
                return Err(ReplayError::Contract {
                    policy: "kvcrush".into(),
                    msg: format!(
                        "its scorer returned {} of {} scores",
                        scores.len(),
                        cand.end
                    ),
                });
            }
            let mut keep = keep_positions(p, prot, &scores, avg - reps, s.tie());
            if reps > 0 {
                let evicted: Vec<usize> = cand
                    .clone()
                    .filter(|i| keep.binary_search(i).is_err())
                    .collect();
                let ev_sig: Vec<&Bits> = evicted.iter().map(|&i| &sig[i - cand.start]).collect();
                let anchor = self.anchor_bits(ctx, c, &ev_sig);
                // by distance, earlier position first on ties (a stable sort of ascending positions)
                let mut order: Vec<(u32, usize)> = evicted
                    .iter()
                    .zip(&ev_sig)
                    .map(|(&i, b)| (hamming(b, &anchor), i))
                    .collect();
                order.sort();
                let k = reps.min(order.len());
                let step = order.len() / k.max(1);
                keep.extend((0..k).map(|j| order[j * step].1));
                keep.sort_unstable();
            }
            caches.push(ctx.exact_cache(u.kv_head, &keep));
        }
        Ok((caches, Box::new(AppendOnly)))
    }
}
