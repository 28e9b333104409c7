//! KVCrush: the tokens an inner scorer evicts are grouped by how the heads
//! behave towards them, and one representative per group is kept beside the
//! scorer's top tokens (docs/methods/kvcrush.md).
//!
//! Rule, per layer (prefill, P > B), following the authors' two
//! implementations (OpenVINO GenAI's kvcrush.cpp, vLLM PR #47967) where they
//! agree:
//! 1. The inner scorer (default H2O's accumulated attention, prefill only)
//!    fixes its protected positions (sinks, recent window) and scores the
//!    candidates C = sinks..P − recent. Of the A = B − protected selections,
//!    R = ⌊share·A⌋ go to representatives and A − R to the scorer's top.
//! 2. Signature: for each candidate i, one bit per signature unit u (H_u
//!    bits): the inner scorer run on u alone scores C, and bit u is 1 when i
//!    is among the ⌊|C|/2⌋ highest of those scores (`bit=half`, both
//!    references) or above their mean (`bit=mean`, a kvreplay extension).
//!    `bits_per=kv` (default, vLLM's): u ranges over the layer's KV heads,
//!    each scored on its whole query group (the group mean, as a KV-head
//!    cache is scored); `bits_per=query`: u ranges over the query heads.
//! 3. Anchor, one per layer, shared by its caches: `random` (bits from
//!    SplitMix64 seeded by (seed, layer) only), `mean` (bit u = 1 when a
//!    strict majority of C has bit u), `inv_mean` (bit u = 1 when a strict
//!    minority of C has it: vLLM's rule, the complement of `mean` except at
//!    exactly half, where both are 0), `zeros`, `ones`, `alternate`
//!    (bit u = u mod 2).
//! 4. Per cache, the evicted candidates E (not among its top A − R) are
//!    sorted by the Hamming distance of their signature to the anchor (ties:
//!    earlier position first) and R of the n = |E| ranks are kept:
//!    `pick=step` (OpenVINO): ranks i·⌊n/R⌋; `pick=linspace` (vLLM): PyTorch's
//!    integer linspace(0, n − 1, R), see [`pick_ranks`].
//!
//! Shapes: scores (P,) or (P − recent,) per unit; signatures (|C|, ⌈H_u/64⌉)
//! words. The kept entries are exact; decode entries are appended (prefill
//! only).

use std::sync::Arc;

use crate::cache::HeadCache;
use crate::info::{Build, Caps, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, SplitMix64};
use crate::scorer::{units_of, units_to_compress, Scorer, Unit};
use crate::select::{keep_positions, top_k};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "kvcrush",
    summary: "a scorer's top tokens (default H2O) plus one representative per group of evicted tokens, grouped by a binary per-head signature's Hamming distance to an anchor",
    paper: "KVCrush: Key Value Cache size-reduction using similarity in head-behaviour (Jha et al., ACML 2025, arXiv 2503.00022); openvinotoolkit/openvino.genai (src/cpp/src/continuous_batching/cache/kvcrush.cpp) and vllm-project/vllm PR #47967 (vllm/v1/attention/backends/kvcrush.py)",
    params: &[
        ParamInfo { name: "scorer", default: "h2o", kind: Kind::Scorer, help: "the inner scorer whose top tokens are kept and whose per-unit scores make the signatures (prefill only: decode_evict=false)" },
        ParamInfo { name: "share", default: "0.25", kind: Kind::Float, help: "share of the selected (unprotected) budget given to representatives of the evicted tokens, in [0, 1]; R = floor(share * A)" },
        ParamInfo { name: "bits_per", default: "kv", kind: Kind::Choice(&["kv", "query"]), help: "one signature bit per KV head (its query group scored together, vLLM's) or per query head" },
        ParamInfo { name: "bit", default: "half", kind: Kind::Choice(&["half", "mean"]), help: "signature bit: the token is in the top half of the unit's candidate scores (both references), or above their mean (kvreplay extension)" },
        ParamInfo { name: "anchor", default: "random", kind: Kind::Choice(&["random", "mean", "inv_mean", "zeros", "ones", "alternate"]), help: "the anchor the Hamming distances are taken to, one per layer (mean / inv_mean: strict majority / minority bit over all candidates)" },
        ParamInfo { name: "pick", default: "step", kind: Kind::Choice(&["step", "linspace"]), help: "which of the n distance-sorted evicted tokens are kept: ranks i*floor(n/R) (OpenVINO) or PyTorch's integer linspace(0, n-1, R) (vLLM)" },
        ParamInfo { name: "seed", default: "0", kind: Kind::Int, help: "seed of the random anchor; (seed, layer) fixes it" },
    ],
    caps: Caps {
        approximation: Some("token granularity: the references build signatures and keep representatives per block/page of 16-32 tokens, and pick one set per layer (OpenVINO scores reduced over heads; vLLM filters by KV head 0's top and shares its picks), where kvreplay picks per KV head from that head's evicted set; the random anchor comes from SplitMix64, not mt19937 / torch.randint; the default inner scorer H2O accumulates every prompt row, where both references score with a SnapKV-style window of the last prompt queries (scorer=snapkv comes closer)"),
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
                bits_per: p.choice("bits_per")?,
                bit: p.choice("bit")?,
                anchor: p.choice("anchor")?,
                pick: p.choice("pick")?,
                seed: p.int("seed")? as u64,
            }))
        },
    },
};

crate::params::choice_enum! {
    /// What one signature bit stands for.
    pub enum BitsPer {
        Kv = "kv",
        Query = "query",
    }
}

crate::params::choice_enum! {
    /// How a unit's scores become its signature bit.
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
        InvMean = "inv_mean",
        Zeros = "zeros",
        Ones = "ones",
        Alternate = "alternate",
    }
}

crate::params::choice_enum! {
    /// Which distance ranks become representatives.
    pub enum Pick {
        Step = "step",
        Linspace = "linspace",
    }
}

pub struct KvCrush {
    pub scorer: Arc<dyn Scorer>,
    pub share: f64,
    pub bits_per: BitsPer,
    pub bit: Bit,
    pub anchor: Anchor,
    pub pick: Pick,
    pub seed: u64,
}

/// H_u-bit vectors as u64 words.
type Bits = Vec<u64>;

fn get(b: &Bits, u: usize) -> bool {
    b[u / 64] >> (u % 64) & 1 == 1
}

fn set(b: &mut Bits, u: usize) {
    b[u / 64] |= 1 << (u % 64);
}

fn hamming(a: &Bits, b: &Bits) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

/// The `k` ranks kept of `n` distance-sorted evicted tokens (k ≤ n).
/// `Step`: i·⌊n/k⌋. `Linspace`: PyTorch's `linspace(0, n − 1, k,
/// dtype=long)` on CPU: step = (n − 1)/(k − 1) in f64, the first ⌊k/2⌋
/// values i·step and the rest (n − 1) − (k − 1 − i)·step, each truncated
/// toward zero; k = 1 gives [0], k = 0 nothing.
pub fn pick_ranks(pick: Pick, n: usize, k: usize) -> Vec<usize> {
    match pick {
        Pick::Step => {
            let s = n / k.max(1);
            (0..k).map(|i| i * s).collect()
        }
        Pick::Linspace => {
            if k <= 1 {
                return vec![0; k];
            }
            let end = (n - 1) as f64;
            let step = end / (k - 1) as f64;
            (0..k)
                .map(|i| {
                    if i < k / 2 {
                        (step * i as f64) as usize
                    } else {
                        (end - step * (k - 1 - i) as f64) as usize
                    }
                })
                .collect()
        }
    }
}

impl KvCrush {
    /// The signature units of the layer: its KV heads (each with its query
    /// group) or its query heads.
    fn sig_units(&self, ctx: &PrefillCtx) -> Vec<Unit> {
        units_of(ctx, self.bits_per == BitsPer::Query)
    }

    /// Signatures of the candidates `cand` (indexed from cand.start): bit u
    /// from the inner scorer run on signature unit u alone.
    fn signatures(
        &self,
        ctx: &PrefillCtx,
        units: &[Unit],
        cand: std::ops::Range<usize>,
    ) -> Vec<Bits> {
        let words = units.len().div_ceil(64);
        let mut sig = vec![vec![0u64; words]; cand.len()];
        for (b, unit) in units.iter().enumerate() {
            let s = self.scorer.score(ctx, unit);
            let on: Vec<usize> = match self.bit {
                Bit::Half => top_k(&s, cand.clone(), cand.len() / 2, |i| i, self.scorer.tie()),
                Bit::Mean => {
                    let mean =
                        cand.clone().map(|i| s[i] as f64).sum::<f64>() / cand.len().max(1) as f64;
                    cand.clone().filter(|&i| s[i] as f64 > mean).collect()
                }
            };
            for i in on {
                set(&mut sig[i - cand.start], b);
            }
        }
        sig
    }

    /// The layer's anchor (`nbits` bits) given every candidate's signature.
    fn anchor_bits(&self, ctx: &PrefillCtx, nbits: usize, sig: &[Bits]) -> Bits {
        let mut a = vec![0u64; nbits.div_ceil(64)];
        let mut rng = SplitMix64::for_head(self.seed, ctx.layer(), 0);
        for u in 0..nbits {
            let count = || sig.iter().filter(|b| get(b, u)).count();
            let on = match self.anchor {
                Anchor::Random => rng.next_u64() >> 63 == 1,
                Anchor::Mean => 2 * count() > sig.len(),
                Anchor::InvMean => 2 * count() < sig.len(),
                Anchor::Zeros => false,
                Anchor::Ones => true,
                Anchor::Alternate => u % 2 == 1,
            };
            if on {
                set(&mut a, u);
            }
        }
        a
    }
}

impl Policy for KvCrush {
    /// The scorer's caches share a KV head's budget as the scorer says.
    fn budget_share(&self, group: usize) -> usize {
        self.scorer.budget_share(group)
    }
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
        let (sig, anchor) = if reps > 0 {
            let su = self.sig_units(ctx);
            let sig = self.signatures(ctx, &su, cand.clone());
            let anchor = self.anchor_bits(ctx, su.len(), &sig);
            (sig, anchor)
        } else {
            (Vec::new(), Vec::new())
        };
        let mut caches = Vec::new();
        for u in &units {
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
                // by distance, earlier position first on ties (ascending positions)
                let mut order: Vec<(u32, usize)> = cand
                    .clone()
                    .filter(|i| keep.binary_search(i).is_err())
                    .map(|i| (hamming(&sig[i - cand.start], &anchor), i))
                    .collect();
                order.sort_unstable();
                let k = reps.min(order.len());
                keep.extend(
                    pick_ranks(self.pick, order.len(), k)
                        .into_iter()
                        .map(|j| order[j].1),
                );
                keep.sort_unstable();
            }
            caches.push(ctx.exact_cache(u.kv_head, &keep));
        }
        Ok((caches, Box::new(AppendOnly)))
    }
}
