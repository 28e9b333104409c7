//! PyramidKV: SnapKV scoring with a per-layer budget that shrinks with depth.
//!
//! Rule (landscape.md B3, KVCache-Factory `PyramidKVCluster`): with P = B − w,
//! if T_p < B no-op; else if T_p < 2P every layer keeps P + w; otherwise
//! min = ⌊P/β⌋, max = 2P − min (if max ≥ T_p − w: max = T_p − w,
//! min = 2P − max), step = ⌊(max − min)/(L − 1)⌋, and layer l keeps
//! (max − l·step) selected entries plus the w window. Memory is charged from
//! the actual counts (the floor can make the total exceed L·P).

use std::sync::Arc;

use super::snapkv::{trivial_prefill, Window};
use super::PolicyInfo;
use crate::cache::HeadCache;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx};
use crate::spec::{Kind, ParamInfo};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "pyramidkv",
    summary: "SnapKV selection with a pyramid of per-layer budgets (more in shallow layers); prefill only",
    paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (Cai et al., arXiv 2406.02069); Zefan-Cai/KVCache-Factory",
    params: &[
        ParamInfo { name: "w", default: "8", kind: Kind::Int, help: "observation window (kept, inside each layer's budget)" },
        ParamInfo { name: "k", default: "7", kind: Kind::Int, help: "pooling kernel (odd)" },
        ParamInfo { name: "pool", default: "max", kind: Kind::Choice(&["max", "avg", "none"]), help: "pooling along positions" },
        ParamInfo { name: "beta", default: "20", kind: Kind::Int, help: "min = ⌊(B − w)/beta⌋ selected entries in the last layer" },
    ],
    wrapper: false,
    build: |p, inner| {
        super::base_only(p, inner)?;
        Ok(Arc::new(PyramidKv { window: Window::from_params(p)?, beta: p.int("beta")?.max(1) }))
    },
};

pub struct PyramidKv {
    pub window: Window,
    pub beta: usize,
}

/// Selected entries (window excluded) of `layer` of `n_layers`, in the
/// reference's integer arithmetic; None = no compression.
pub fn layer_count(
    p_len: usize,
    b: usize,
    w: usize,
    beta: usize,
    layer: usize,
    n_layers: usize,
) -> Option<usize> {
    if p_len < b {
        return None;
    }
    let avg = b - w;
    if p_len < 2 * avg || n_layers < 2 {
        return Some(avg);
    }
    let mut min = avg / beta;
    let mut max = 2 * avg - min;
    if max >= p_len - w {
        max = p_len - w;
        min = 2 * avg - max;
    }
    let step = (max - min) / (n_layers - 1);
    Some(max - layer * step)
}

impl Policy for PyramidKv {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        if let Some(done) = trivial_prefill(ctx, self.window.w) {
            return Ok(done);
        }
        let (p, b, w) = (ctx.prompt_len(), ctx.budget, self.window.w);
        let count = layer_count(p, b, w, self.beta, ctx.layer(), ctx.n_layers()).expect("p > b");
        let caches = (0..ctx.n_kv_heads())
            .map(|g| {
                ctx.exact_cache(
                    g,
                    &self
                        .window
                        .keep(p, &self.window.scores(ctx, g, false), count),
                )
            })
            .collect();
        Ok((caches, Box::new(AppendOnly)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_hand_computation() {
        // B = 72, w = 8 -> P = 64; T_p = 1000, L = 5, beta = 20:
        // min = 3, max = 125, step = (125 - 3) / 4 = 30 -> 125, 95, 65, 35, 5
        let counts: Vec<usize> = (0..5)
            .map(|l| layer_count(1000, 72, 8, 20, l, 5).unwrap())
            .collect();
        assert_eq!(counts, vec![125, 95, 65, 35, 5]);
        // T_p < 2P: uniform
        assert_eq!(layer_count(100, 72, 8, 20, 3, 5), Some(64));
        // max capped at T_p - w: T_p = 130 -> max = 122, min = 6, step = 29
        let counts: Vec<usize> = (0..5)
            .map(|l| layer_count(130, 72, 8, 20, l, 5).unwrap())
            .collect();
        assert_eq!(counts, vec![122, 93, 64, 35, 6]);
        assert_eq!(layer_count(50, 72, 8, 20, 0, 5), None);
    }
}
