//! D2O's recall-and-merge: each evicted token is matched to its most similar
//! kept entry (cosine), tested against the EMA threshold τ and folded into its
//! match, per head or with one τ shared by the layer's heads.

use kvreplay_kernels::cpu::{dots_norms_at, l2_norm, ColumnBlocks};

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
    /// 1e-6) in f64, the dot products summed in element order (every pair
    /// at once, [`ColumnBlocks::dots`]), each row's norm computed once.
    fn matches(sim: &[f32], d: usize, evict: &[usize], kept: &[usize]) -> Vec<(usize, f64)> {
        let row = |e: usize| &sim[e * d..(e + 1) * d];
        let nk = kept.len();
        let mut ab = vec![0f64; evict.len() * nk];
        let kept_norm: Vec<f64> = if evict.len() >= 4 {
            // many rows (the first compression): the kept rows transposed once
            let gather = |idx: &[usize]| -> Vec<f32> {
                let mut out = Vec::with_capacity(idx.len() * d);
                idx.iter().for_each(|&e| out.extend_from_slice(row(e)));
                out
            };
            ColumnBlocks::of_rows(&gather(kept), d).dots(&gather(evict), &mut ab);
            kept.iter().map(|&k| l2_norm(row(k))).collect()
        } else {
            // a step's few evictions: straight from the rows, with their norms
            let mut sq = vec![0f64; nk];
            for (i, &e) in evict.iter().enumerate() {
                let want = (i == 0).then_some(&mut sq[..]);
                dots_norms_at(row(e), sim, d, kept, &mut ab[i * nk..(i + 1) * nk], want);
            }
            sq.iter().map(|q| q.sqrt()).collect()
        };
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
