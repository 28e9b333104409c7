//! Mustafar (docs/methods/mustafar.md): unstructured per-token magnitude
//! pruning of keys and values.
//!
//! Rule (Joo et al. 2025, §3; dhjoo98/mustafar `dh_prune_key` /
//! `dh_prune_value`, the Kt_Mag_Vt_Mag variant): every key and every value
//! vector keeps its d − ⌊s·d⌋ largest-magnitude elements and zeroes the rest
//! (s = `sparsity`; ties: the lower channel first). The reference code keeps
//! a dense local window: the newest `window` prompt keys, and the newest
//! P mod `window` prompt values (values are pruned in whole groups of
//! `window`, as KIVI quantises them). Storage is the paper's bitmap format:
//! per 64-element tile of a vector a 64-bit bitmap and the kept values in
//! f16, their count padded up to a multiple of 8 (kernel/compression.py);
//! dense vectors cost 16 bits per element. Prefill only: decode entries are
//! appended dense.

use std::sync::Arc;

use crate::cache::{HeadCache, F16_BITS};
use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "mustafar",
    summary: "unstructured sparsity: each key and value keeps its largest-magnitude elements (default 70% pruned), bitmap storage; a dense recent window",
    paper: "Mustafar: Promoting Unstructured Sparsity for KV Cache Pruning in LLM Inference (Joo et al., arXiv 2505.22913); dhjoo98/mustafar",
    params: &[
        ParamInfo { name: "sparsity", default: "0.7", kind: Kind::Float, help: "fraction of each vector's elements pruned, in [0, 1) (the paper's headline 70%; 0.5 its safer setting)" },
        ParamInfo { name: "window", default: "32", kind: Kind::Int, help: "dense local window (reference code residual_length): newest keys kept dense; values pruned in whole groups of this size" },
    ],
    caps: Caps {
        family: Family::LowRank,
        phase: Phase::Prefill,
        memory: Memory::Beyond("a sparse store of every position at fixed sparsities: its memory is set by them, not by B"),
        exact_when_covering: false,
        approximation: Some("prefill only: decode entries stay dense (the reference code prunes each decode key as it leaves the window); keeps exactly d − ⌊s·d⌋ elements where the code's kthvalue threshold keeps one more"),
        ..Caps::EVICT_PREFILL
    },
    test: "mustafar_prunes_each_vector_to_its_largest_elements",
    build: Build::Policy(|p| {
        let sparsity = p.float_in("sparsity", 0.0, 1.0)?;
        if sparsity >= 1.0 {
            return Err(p.bad("sparsity", "must be below 1 (a vector keeps at least one element)".into()));
        }
        let window = p.int_positive("window", "must be at least 1")?;
        Ok(Arc::new(Mustafar { sparsity, window }))
    }),
};

pub struct Mustafar {
    pub sparsity: f64,
    pub window: usize,
}

/// Zero all but the `keep` largest-|x| elements of `x` (ties: lower index
/// first); returns the bitmap format's cost in bits.
pub fn prune(x: &mut [f32], keep: usize) -> u64 {
    let keep = keep.min(x.len());
    let mut order: Vec<usize> = (0..x.len()).collect();
    if keep > 0 && keep < x.len() {
        // the `keep` first by (|x| descending, index ascending), in O(d)
        order.select_nth_unstable_by(keep - 1, |&a, &b| {
            x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b))
        });
    }
    let mut on = vec![false; x.len()];
    order[..keep].iter().for_each(|&i| on[i] = true);
    x.iter_mut()
        .zip(&on)
        .filter(|(_, o)| !**o)
        .for_each(|(v, _)| *v = 0.0);
    on.chunks(64)
        .map(|tile| {
            let kept = tile.iter().filter(|o| **o).count() as u64;
            64 + kept.div_ceil(8) * 8 * F16_BITS
        })
        .sum()
}

impl Policy for Mustafar {
    fn name(&self) -> String {
        "mustafar".into()
    }
    fn budget_independent(&self) -> bool {
        true
    }
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, d) = (ctx.prompt_len(), ctx.head_dim());
        let keep = d - (self.sparsity * d as f64).floor() as usize;
        let dense_k = self.window.min(p);
        let dense_v = p % self.window;
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                let mut c = ctx.full_cache(g);
                for e in 0..p {
                    let dense = d as u64 * F16_BITS;
                    let kb = if e < p - dense_k {
                        prune(&mut c.keys[e * d..(e + 1) * d], keep)
                    } else {
                        dense
                    };
                    let vb = if e < p - dense_v {
                        prune(c.value_mut(e), keep)
                    } else {
                        dense
                    };
                    c.bits[e] = kb + vb;
                }
                c
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}
