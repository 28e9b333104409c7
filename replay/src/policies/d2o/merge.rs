//! D2O's recall-and-merge: each evicted token is matched to its most similar
//! kept entry (cosine), tested against the EMA threshold τ and folded into its
//! match, per head or with one τ shared by the layer's heads.

use kvreplay_kernels::cpu::{dot_error_factor, dots_norms_at, l2_norm, Blocks8};

use super::config::{D2o, HeadState, MatchOn, Merge, Threshold};
use crate::cache::HeadCache;

impl D2o {
    /// The passes of recall-and-merge: (similarity on values?, merge the keys?,
    /// merge the values?, threshold slot).
    fn passes(&self) -> &'static [(bool, bool, bool, usize)] {
        match self.match_on {
            MatchOn::Keys => &[(false, true, true, 0)],
            MatchOn::Values => &[(true, true, true, 0)],
            MatchOn::Split => &[(false, true, false, 0), (true, false, true, 1)],
        }
    }

    /// Best kept match (index, cosine) of each evicted entry on the rows of
    /// `sim` (ties: the earliest kept entry). The cosine is ab / (|a| |b| +
    /// 1e-6) in f64, the dot products summed in element order from −0.0,
    /// each row's norm computed once.
    fn matches(sim: &[f32], d: usize, evict: &[usize], kept: &[usize]) -> Vec<(usize, f64)> {
        let row = |e: usize| &sim[e * d..(e + 1) * d];
        let nk = kept.len();
        if evict.len() >= 4 {
            if let Some(m) = Self::matches_screened(sim, d, evict, kept) {
                return m;
            }
        }
        // a step's few evictions (or rows too long for f32 sums): straight
        // from the rows, with their norms
        let mut ab = vec![0f64; evict.len() * nk];
        let mut sq = vec![0f64; nk];
        for (i, &e) in evict.iter().enumerate() {
            let want = (i == 0).then_some(&mut sq[..]);
            dots_norms_at(row(e), sim, d, kept, &mut ab[i * nk..(i + 1) * nk], want);
        }
        let kept_norm: Vec<f64> = sq.iter().map(|q| q.sqrt()).collect();
        // each row's cosines first (a loop the compiler vectorises: the
        // same correctly rounded divisions), then its first maximum
        let mut u = vec![0f64; nk];
        evict
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                let nx = l2_norm(row(e));
                for ((u, a), ns) in u.iter_mut().zip(&ab[i * nk..(i + 1) * nk]).zip(&kept_norm) {
                    *u = a / (nx * ns + 1e-6);
                }
                let mut best = (kept[0], f64::MIN);
                for (k, &u) in kept.iter().zip(&u) {
                    if u > best.1 {
                        best = (*k, u);
                    }
                }
                best
            })
            .collect()
    }

    /// [`Self::matches`] for many evicted rows (the first compression): every
    /// cosine screened in f32 ([`Blocks8`]), then only the kept entries whose
    /// screened cosine lies within twice the screen's error of the row's
    /// largest computed exactly (the same sums and divisions as above).
    ///
    /// Why the exact best is among them: with S = Σ|a_t b_t| ≤ |a||b| ≤ den
    /// (den = |a||b| + 1e-6 as computed, the norms' rounding ~1e-16), the
    /// screened dot is within γ_d·S + d·2⁻¹⁴⁹ of the exact one
    /// ([`dot_error_factor`]), so its cosine s/den within γ_d + 2⁻¹²⁰; the
    /// f32 denominator and division add six roundings of 2⁻²⁴ (the two norms
    /// and 1e-6 converted, the product, the sum, the division) relative to a
    /// value of magnitude ≤ 1 + γ_d, which `err` allows ten of. Every
    /// screened cosine is thus within `err` of the exact one, and the exact
    /// largest within 2·err of the screened largest. None (the caller sums
    /// every pair exactly) when a row's norm reaches 1e18: below it every
    /// f32 product, sum and denominator stays under 1e36, in f32's range.
    fn matches_screened(
        sim: &[f32],
        d: usize,
        evict: &[usize],
        kept: &[usize],
    ) -> Option<Vec<(usize, f64)>> {
        let row = |e: usize| &sim[e * d..(e + 1) * d];
        let nk = kept.len();
        let gather = |idx: &[usize]| -> Vec<f32> {
            let mut out = Vec::with_capacity(idx.len() * d);
            idx.iter().for_each(|&e| out.extend_from_slice(row(e)));
            out
        };
        let kept_norm: Vec<f64> = kept.iter().map(|&k| l2_norm(row(k))).collect();
        let evict_norm: Vec<f64> = evict.iter().map(|&e| l2_norm(row(e))).collect();
        if kept_norm
            .iter()
            .chain(&evict_norm)
            .any(|n| *n >= 1e18 || n.is_nan())
        {
            return None;
        }
        let mut s = vec![0f32; evict.len() * nk];
        Blocks8::of_rows(&gather(kept), d).dots(&gather(evict), &mut s);
        let kept_norm32: Vec<f32> = kept_norm.iter().map(|&n| n as f32).collect();
        let err = dot_error_factor(d) + 2f64.powi(-120) + 5.0 * f32::EPSILON as f64;
        let window = (2.0 * err) as f32 * 1.01;
        let mut u32s = vec![0f32; nk];
        // compiled for AVX2 where the CPU has it (the closure is inlined
        // there): the same divisions and comparisons, eight lanes at a time
        let found = kvreplay_kernels::cpu::with_avx2(
            #[inline(always)]
            || {
                evict
                    .iter()
                    .zip(&evict_norm)
                    .enumerate()
                    .map(|(i, (&e, &nx))| {
                        let x = row(e);
                        let nx32 = nx as f32;
                        let si = &s[i * nk..(i + 1) * nk];
                        // the screened cosines (correctly rounded divisions, a
                        // loop that vectorises)
                        for ((u, a), ns) in u32s.iter_mut().zip(si).zip(&kept_norm32) {
                            *u = a / (nx32 * ns + 1e-6);
                        }
                        // their largest, passing over NaN as `f32::max` does:
                        // in eight lanes of `u > m`, then across the lanes (the
                        // largest of a set is the same whatever the order; +0
                        // and −0 give the same floor below)
                        let chunks = u32s.chunks_exact(8);
                        let mut lanes = [f32::MIN; 8];
                        for c in chunks.clone() {
                            for (m, u) in lanes.iter_mut().zip(c) {
                                if *u > *m {
                                    *m = *u;
                                }
                            }
                        }
                        let top = lanes
                            .iter()
                            .chain(chunks.remainder())
                            .fold(f32::MIN, |t, u| t.max(*u));
                        // (a sum beyond f32's range screens nothing: all exactly; a
                        // NaN is never screened out)
                        let floor = if top.is_finite() {
                            top - window
                        } else {
                            f32::NEG_INFINITY
                        };
                        // exactly, in kept order, where the exact largest can be:
                        // every u ≥ floor, or NaN, found eight at a time
                        let mut best = (kept[0], f64::MIN);
                        for (c0, c) in (0..nk).step_by(8).zip(u32s.chunks(8)) {
                            let mut hit = false;
                            for u in c {
                                hit |= *u >= floor || u.is_nan();
                            }
                            if !hit {
                                continue;
                            }
                            for (t, u32) in c.iter().enumerate() {
                                if *u32 < floor {
                                    continue;
                                }
                                let k = kept[c0 + t];
                                let ab: f64 = x
                                    .iter()
                                    .zip(row(k))
                                    .map(|(p, q)| *p as f64 * *q as f64)
                                    .sum();
                                let u = ab / (nx * kept_norm[c0 + t] + 1e-6);
                                if u > best.1 {
                                    best = (k, u);
                                }
                            }
                        }
                        best
                    })
                    .collect::<Vec<_>>()
            },
        );
        Some(found)
    }

    /// Fold the accepted evicted entries into their matches. Every row read
    /// is as it stood on entry: evicted rows are never written, and a kept
    /// row is written only after its own fold has read it.
    fn merge_pass(
        &self,
        c: &mut HeadCache,
        evict: &[usize],
        kept: &[usize],
        matches: &[(usize, f64)],
        accept: &[bool],
        merge: (bool, bool),
    ) {
        let d = c.d;
        // the accepted evicted entries of each kept entry, in eviction order
        let mut by_target: Vec<(usize, usize, f64)> = evict
            .iter()
            .zip(matches)
            .zip(accept)
            .filter(|(_, ok)| **ok)
            .map(|((&e, &(t, u)), _)| (t, e, u))
            .collect();
        by_target.sort_by_key(|x| x.0); // stable: eviction order within a target
        let mut row = vec![0f32; d];
        for group in by_target.chunk_by(|a, b| a.0 == b.0) {
            let k = group[0].0;
            debug_assert!(kept.binary_search(&k).is_ok());
            let absorbed: Vec<(usize, f64)> = group.iter().map(|&(_, e, u)| (e, u)).collect();
            let (wk, ws): (f64, Vec<f64>) = match self.merge {
                Merge::Average => (1.0, vec![1.0; absorbed.len()]),
                Merge::CodeScaledMean => (1.0, absorbed.iter().map(|x| x.1).collect()),
                Merge::Weighted => (1f64.exp(), absorbed.iter().map(|x| x.1.exp()).collect()),
            };
            let denom = match self.merge {
                Merge::Weighted => wk + ws.iter().sum::<f64>(),
                Merge::Average | Merge::CodeScaledMean => 1.0 + absorbed.len() as f64,
            };
            for (on, m) in [(merge.0, &mut c.keys), (merge.1, &mut c.values)] {
                if !on {
                    continue;
                }
                for (ch, out) in row.iter_mut().enumerate() {
                    let mut x = wk * m[k * d + ch] as f64;
                    for ((e, _), w) in absorbed.iter().zip(&ws) {
                        x += w * m[e * d + ch] as f64;
                    }
                    *out = (x / denom) as f32;
                }
                m[k * d..(k + 1) * d].copy_from_slice(&row);
            }
            if merge.0 {
                // positions follow the key half
                let mut mem = std::mem::take(&mut c.members[k]);
                for (e, _) in &absorbed {
                    mem.extend_from_slice(&c.members[*e]);
                }
                mem.sort_unstable();
                c.members[k] = mem;
            }
        }
    }

    /// The EMA threshold after observing mean best similarity `m`.
    fn update_tau(&self, tau: &mut Option<f64>, m: f64) -> f64 {
        if self.threshold == Threshold::MergeAll {
            return f64::MIN;
        }
        let t = match *tau {
            None => m,
            Some(prev) => self.beta * m + (1.0 - self.beta) * prev,
        };
        *tau = Some(t);
        t
    }

    /// Recall-and-merge: fold the entries `evict` (indices into `c`) into their
    /// most similar kept entry when similar enough, then remove them. Every
    /// similarity and weight uses the vectors as they stood on entry.
    pub(super) fn compensate(&self, c: &mut HeadCache, st: &mut HeadState, evict: &[usize]) {
        self.compensate_layer(
            std::slice::from_mut(c),
            std::slice::from_mut(st),
            &[evict.to_vec()],
            None,
        );
    }

    /// Recall-and-merge for several heads at once. With `shared` (the official
    /// code's one τ per layer) the threshold tracks the mean over heads and
    /// evicted slots, and the j-th evicted entry (in position order) of every
    /// head merges when the heads' mean best similarity for slot j reaches it;
    /// otherwise each head keeps its own τ.
    pub(super) fn compensate_layer(
        &self,
        caches: &mut [HeadCache],
        states: &mut [HeadState],
        evicts: &[Vec<usize>],
        mut shared: Option<&mut [Option<f64>; 2]>,
    ) {
        let kept: Vec<Vec<usize>> = caches
            .iter()
            .zip(evicts)
            .map(|(c, ev)| {
                let mut out = vec![true; c.len()];
                ev.iter().for_each(|&e| out[e] = false);
                (0..c.len()).filter(|&e| out[e]).collect()
            })
            .collect();
        for &(on_values, merge_k, merge_v, slot) in self.passes() {
            let live: Vec<usize> = (0..caches.len())
                .filter(|&i| !evicts[i].is_empty() && !kept[i].is_empty())
                .collect();
            let matches: Vec<Vec<(usize, f64)>> = (0..caches.len())
                .map(|i| {
                    if live.contains(&i) {
                        // keys and values as they stood on entry: a pass merges
                        // only the half the next pass does not match on
                        Self::matches(
                            if on_values {
                                &caches[i].values
                            } else {
                                &caches[i].keys
                            },
                            caches[i].d,
                            &evicts[i],
                            &kept[i],
                        )
                    } else {
                        Vec::new()
                    }
                })
                .collect();
            let accept: Vec<Vec<bool>> = match shared.as_deref_mut() {
                Some(taus) if !live.is_empty() => {
                    let slots = live.iter().map(|&i| matches[i].len()).min().unwrap();
                    let mean_slot: Vec<f64> = (0..slots)
                        .map(|j| {
                            live.iter().map(|&i| matches[i][j].1).sum::<f64>() / live.len() as f64
                        })
                        .collect();
                    let m = mean_slot.iter().sum::<f64>() / slots.max(1) as f64;
                    let tau = self.update_tau(&mut taus[slot], m);
                    (0..caches.len())
                        .map(|i| {
                            (0..matches[i].len())
                                .map(|j| j < slots && mean_slot[j] >= tau)
                                .collect()
                        })
                        .collect()
                }
                _ => (0..caches.len())
                    .map(|i| {
                        if matches[i].is_empty() {
                            return Vec::new();
                        }
                        let m =
                            matches[i].iter().map(|x| x.1).sum::<f64>() / matches[i].len() as f64;
                        let tau = self.update_tau(&mut states[i].tau[slot], m);
                        matches[i].iter().map(|x| x.1 >= tau).collect()
                    })
                    .collect(),
            };
            for &i in &live {
                self.merge_pass(
                    &mut caches[i],
                    &evicts[i],
                    &kept[i],
                    &matches[i],
                    &accept[i],
                    (merge_k, merge_v),
                );
            }
        }
        for ((c, st), ev) in caches.iter_mut().zip(states.iter_mut()).zip(evicts) {
            if ev.is_empty() {
                continue;
            }
            let mut idx = ev.clone();
            idx.sort_unstable();
            c.remove_sorted(&idx);
            let mut gone = vec![false; st.score.len()];
            idx.iter().for_each(|&e| gone[e] = true);
            retain_unmarked(&mut st.score, &gone);
            retain_unmarked(&mut st.anchor, &gone);
            retain_unmarked(&mut st.sink, &gone);
        }
    }
}

/// Drop the elements of `v` whose index is marked in `gone`, keeping order.
fn retain_unmarked<T>(v: &mut Vec<T>, gone: &[bool]) {
    let mut i = 0;
    v.retain(|_| {
        i += 1;
        !gone[i - 1]
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule written out: every cosine exactly, the first largest.
    fn straight(sim: &[f32], d: usize, evict: &[usize], kept: &[usize]) -> Vec<(usize, f64)> {
        let row = |e: usize| &sim[e * d..(e + 1) * d];
        let norm = |e: usize| {
            row(e)
                .iter()
                .map(|v| *v as f64 * *v as f64)
                .sum::<f64>()
                .sqrt()
        };
        evict
            .iter()
            .map(|&e| {
                let mut best = (kept[0], f64::MIN);
                for &k in kept {
                    let ab: f64 = row(e)
                        .iter()
                        .zip(row(k))
                        .map(|(p, q)| *p as f64 * *q as f64)
                        .sum();
                    let u = ab / (norm(e) * norm(k) + 1e-6);
                    if u > best.1 {
                        best = (k, u);
                    }
                }
                best
            })
            .collect()
    }

    #[test]
    fn screened_matches_are_the_rule_bit_for_bit_near_ties_included() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for (n, d, scale) in [
            (40usize, 64usize, 1f32),
            (75, 8, 1.0),
            (33, 3, 1.0),
            (130, 64, 1.0),
            // norms past 1e18: every pair summed exactly instead
            (40, 64, 1e19),
        ] {
            let mut sim: Vec<f32> = (0..n * d).map(|_| next() * scale).collect();
            // near ties: copies of row 1, scaled, nudged by one ulp, negated,
            // and a row of zeros
            for (r, how) in (5..12).zip(0..) {
                let src: Vec<f32> = sim[d..2 * d].to_vec();
                let dst = &mut sim[r * d..(r + 1) * d];
                dst.copy_from_slice(&src);
                match how {
                    0 => {}
                    1 => dst.iter_mut().for_each(|v| *v *= 3.0),
                    2 => dst[0] = f32::from_bits(dst[0].to_bits() + 1),
                    3 => dst[d - 1] = f32::from_bits(dst[d - 1].to_bits() - 1),
                    4 => dst.iter_mut().for_each(|v| *v = -*v),
                    5 => dst.iter_mut().for_each(|v| *v *= 1e-30),
                    _ => dst.fill(0.0),
                }
            }
            for split in [2usize, 3, 7] {
                let (evict, kept): (Vec<usize>, Vec<usize>) = (0..n).partition(|e| e % split == 1);
                // many evicted rows (the screened path), row 1 and its
                // copies on both sides
                assert!(evict.len() >= 4 && kept.len() >= 4);
                let screens = D2o::matches_screened(&sim, d, &evict, &kept).is_some();
                assert_eq!(screens, scale == 1.0, "n={n} d={d}");
                let got = D2o::matches(&sim, d, &evict, &kept);
                let want = straight(&sim, d, &evict, &kept);
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(
                        (g.0, g.1.to_bits()),
                        (w.0, w.1.to_bits()),
                        "n={n} d={d} split={split}"
                    );
                }
            }
        }
    }
}
