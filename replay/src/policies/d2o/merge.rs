//! D2O's recall-and-merge: each evicted token is matched to its most similar
//! kept entry (cosine), tested against the EMA threshold τ and folded into its
//! match, per head or with one τ shared by the layer's heads.

use kvreplay_kernels::cpu::l2_norm;

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
    /// `sim` (ties: the earliest kept entry).
    fn matches(sim: &[f32], d: usize, evict: &[usize], kept: &[usize]) -> Vec<(usize, f64)> {
        let row = |e: usize| &sim[e * d..(e + 1) * d];
        // The cosine ab / (|a| |b| + 1e-6) in f64, with each row's norm computed
        // once, and four kept rows per pass over the evicted row so the f64
        // sums of different pairs overlap (each sum keeps its order).
        let norm = |e: usize| l2_norm(row(e));
        let kept_norm: Vec<f64> = kept.iter().map(|&k| norm(k)).collect();
        evict
            .iter()
            .map(|&e| {
                let (x, nx) = (row(e), norm(e));
                let mut best = (kept[0], f64::MIN);
                for (ks, ns) in kept.chunks(4).zip(kept_norm.chunks(4)) {
                    let mut ab = [0f64; 4];
                    if ks.len() == 4 {
                        let r = [row(ks[0]), row(ks[1]), row(ks[2]), row(ks[3])];
                        for t in 0..d {
                            let xt = x[t] as f64;
                            for j in 0..4 {
                                ab[j] += xt * r[j][t] as f64;
                            }
                        }
                    } else {
                        for (j, &k) in ks.iter().enumerate() {
                            ab[j] = x
                                .iter()
                                .zip(row(k))
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum();
                        }
                    }
                    for j in 0..ks.len() {
                        let u = ab[j] / (nx * ns[j] + 1e-6);
                        if u > best.1 {
                            best = (ks[j], u);
                        }
                    }
                }
                best
            })
            .collect()
    }

    /// Fold the accepted evicted entries into their matches (weights from the
    /// vectors as they stood on entry: `old_k`, `old_v`).
    #[allow(clippy::too_many_arguments)]
    fn merge_pass(
        &self,
        c: &mut HeadCache,
        old: (&[f32], &[f32]),
        evict: &[usize],
        kept: &[usize],
        matches: &[(usize, f64)],
        accept: &[bool],
        merge: (bool, bool),
    ) {
        let d = c.d;
        for &k in kept {
            let absorbed: Vec<(usize, f64)> = evict
                .iter()
                .zip(matches)
                .zip(accept)
                .filter(|((_, (t, _)), ok)| *t == k && **ok)
                .map(|((&e, (_, u)), _)| (e, *u))
                .collect();
            if absorbed.is_empty() {
                continue;
            }
            let (wk, ws): (f64, Vec<f64>) = match self.merge {
                Merge::Average => (1.0, vec![1.0; absorbed.len()]),
                Merge::CodeScaledMean => (1.0, absorbed.iter().map(|x| x.1).collect()),
                Merge::Weighted => (1f64.exp(), absorbed.iter().map(|x| x.1.exp()).collect()),
            };
            let denom = match self.merge {
                Merge::Weighted => wk + ws.iter().sum::<f64>(),
                Merge::Average | Merge::CodeScaledMean => 1.0 + absorbed.len() as f64,
            };
            for (on, dst, src) in [
                (merge.0, &mut c.keys, old.0),
                (merge.1, &mut c.values, old.1),
            ] {
                if !on {
                    continue;
                }
                for ch in 0..d {
                    let mut x = wk * src[k * d + ch] as f64;
                    for ((e, _), w) in absorbed.iter().zip(&ws) {
                        x += w * src[e * d + ch] as f64;
                    }
                    dst[k * d + ch] = (x / denom) as f32;
                }
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
            .map(|(c, ev)| (0..c.len()).filter(|e| !ev.contains(e)).collect())
            .collect();
        let old: Vec<(Vec<f32>, Vec<f32>)> = caches
            .iter()
            .map(|c| (c.keys.clone(), c.values.clone()))
            .collect();
        for &(on_values, merge_k, merge_v, slot) in self.passes() {
            let live: Vec<usize> = (0..caches.len())
                .filter(|&i| !evicts[i].is_empty() && !kept[i].is_empty())
                .collect();
            let matches: Vec<Vec<(usize, f64)>> = (0..caches.len())
                .map(|i| {
                    if live.contains(&i) {
                        Self::matches(
                            if on_values { &old[i].1 } else { &old[i].0 },
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
                    (&old[i].0, &old[i].1),
                    &evicts[i],
                    &kept[i],
                    &matches[i],
                    &accept[i],
                    (merge_k, merge_v),
                );
            }
        }
        for ((c, st), ev) in caches.iter_mut().zip(states.iter_mut()).zip(evicts) {
            let mut idx = ev.clone();
            idx.sort_unstable_by(|a, b| b.cmp(a));
            for e in idx {
                c.remove(e);
                st.score.remove(e);
                st.anchor.remove(e);
                st.sink.remove(e);
            }
        }
    }
}
