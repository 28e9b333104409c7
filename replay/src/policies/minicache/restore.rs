//! MiniCache's restore: each merged position written back into both layers'
//! caches (x̂ = n·e, or the original when retained), with the bits each half
//! costs there.

use kvreplay_kernels::cpu::l2_norm_f32;

use super::config::MiniCache;
use super::retention::Threshold;
use super::slerp::{mean_merge, merge_token, Merged};
use crate::cache::{HeadCache, F16_BITS};

/// Channels per quantisation group of a stored direction (b_dir < 16).
const DIR_GROUP: usize = 32;

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

impl MiniCache {
    /// Write the merged position `e` into both layers' caches of one KV head.
    pub(super) fn merge_position(
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
                    for (which, c, bits) in [(0, &mut *ca, &mut bits_a), (1, &mut *cb, &mut bits_b)]
                    {
                        *bits += restore(
                            c,
                            e,
                            half,
                            which,
                            m,
                            retained,
                            self.mean(),
                            self.compact,
                            idx,
                            self.dir_bits(d),
                            self.b_norm as u64,
                        );
                    }
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

    pub(super) fn merges(&self, a: &HeadCache, b: &HeadCache, e: usize) -> [Option<Merged>; 2] {
        let f = |x: &[f32], y: &[f32]| {
            if self.mean() {
                mean_merge(x, y)
            } else {
                let mut m = merge_token(x, y, self.t);
                if self.b_norm == 32 {
                    (m.na, m.nb) = (l2_norm_f32(x), l2_norm_f32(y));
                }
                if self.b_dir < 16 {
                    // quantise the stored direction, then re-normalise it (docs/methods/minicache.md)
                    for chunk in m.e.chunks_mut(DIR_GROUP) {
                        kvreplay_kernels::cpu::fake_quant(chunk, self.b_dir);
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
