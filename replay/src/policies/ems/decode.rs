//! EMS at decode: each step adds the new token as a window entry, updates the
//! scores, turns the token leaving the window into a centre, demotes the least
//! important centre (merged into its most similar centre, or freed) and caps
//! the slot table at S_max.
//!
//! The engine's cache mirrors the slot table row for row and is kept in step
//! with it: a step rewrites only the rows whose entry changed (the new slot,
//! the slots of a merged centre) and removes the rows of removed slots, which
//! gives the same cache as expanding every slot anew.

use kvreplay_kernels::cpu::l2_norm;

use super::config::{DemoteRank, Ems, Shape, ZeroClass};
use super::entry::{unit, Entry, HeadState, Slot, EPS};
use crate::cache::HeadCache;
use crate::policy::{DecodeState, StepCtx};
use crate::select::{victim, Tie};

pub(super) struct Decode {
    cfg: Ems,
    sh: Shape,
    states: Vec<HeadState>,
    /// Reused buffers of one head's step.
    sgl: Vec<f64>,
    sums: Vec<f64>,
    at_anchor: Vec<Option<f64>>,
    best: Vec<f64>,
    ranks: Vec<f64>,
    counts: Vec<usize>,
    /// Positions of the slots removed in this step.
    removed: Vec<usize>,
    /// Entries whose slots' rows must be rewritten in this step.
    dirty: Vec<usize>,
}

impl Decode {
    pub(super) fn new(cfg: Ems, sh: Shape, states: Vec<HeadState>) -> Decode {
        Decode {
            cfg,
            sh,
            states,
            sgl: Vec::new(),
            sums: Vec::new(),
            at_anchor: Vec::new(),
            best: Vec::new(),
            ranks: Vec::new(),
            counts: Vec::new(),
            removed: Vec::new(),
            dirty: Vec::new(),
        }
    }
}

/// Each slot's s_gl = combine(α, s_glo, s_loc) with α the ratio of the
/// slots' mean s_loc to their mean s_glo, into `out`.
fn sgl_into(cfg: &Ems, st: &HeadState, out: &mut Vec<f64>) {
    let n = st.slots.len() as f64;
    let mg = st.slots.iter().map(|s| s.s_glo).sum::<f64>() / n;
    let ml = st
        .slots
        .iter()
        .map(|s| s.s_loc_past + s.s_loc_cur)
        .sum::<f64>()
        / n;
    let alpha = ml / mg.max(1e-30);
    out.clear();
    out.extend(
        st.slots
            .iter()
            .map(|s| cfg.combine(alpha, s.s_glo, s.s_loc_past + s.s_loc_cur)),
    );
}

impl DecodeState for Decode {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for (hi, cache) in caches.iter_mut().enumerate() {
            let mean;
            let a: &[f32] = if self.cfg.per_query_head() {
                &ctx.probs[hi]
            } else {
                mean = ctx.group_mean(hi);
                &mean
            };
            self.head_step(hi, ctx.pos, a, cache);
        }
    }
}

impl Decode {
    /// One head's step; `a` is its attention over the cache (the slots, the
    /// new token last).
    fn head_step(&mut self, hi: usize, pos: usize, a: &[f32], cache: &mut HeadCache) {
        let (cfg, sh) = (&self.cfg, &self.sh);
        let st = &mut self.states[hi];
        self.removed.clear();
        self.dirty.clear();
        let last = cache.len() - 1;
        // 1. the new token: a window entry and its slot
        let (k_new, v_new) = (cache.key(last), cache.value(last).to_vec());
        let kt = cfg.key_space(k_new, pos, &sh.rope);
        let id = st.entries.len();
        let mut e = Entry::new(
            unit(&kt.iter().map(|x| *x as f64).collect::<Vec<_>>()),
            v_new,
            true,
            pos,
            false,
        );
        e.refresh(cfg, &sh.rope);
        st.entries.push(Some(e));
        st.put(id);
        st.windows.push_back(id);
        st.slots.push(Slot {
            pos,
            entry: id,
            knorm: l2_norm(k_new) as f32,
            s_glo: 0.0,
            s_loc_past: 0.0,
            s_loc_cur: 0.0,
        });
        self.dirty.push(id);
        // 3. scores (a covers every active slot, the new one last)
        for (s, x) in st.slots.iter_mut().zip(a) {
            s.s_glo += *x as f64;
            s.s_loc_cur += *x as f64;
        }
        st.loc_counter += 1;
        if st.loc_counter == sh.l_win {
            for s in st.slots.iter_mut() {
                s.s_loc_past = s.s_loc_cur;
                s.s_loc_cur = 0.0;
            }
            st.loc_counter = 0;
        }
        // 4. the oldest window entry beyond L_win becomes a centre
        if st.windows.len() > sh.l_win {
            let w = st.windows.pop_front().expect("more than L_win windows");
            st.entries[w].as_mut().unwrap().window = false;
            st.n_centres += 1;
        }
        // 5. demote the least important centre
        if st.n_centres > sh.n_imp {
            sgl_into(cfg, st, &mut self.sgl);
            // Per entry, in one pass over the slots: the cluster sum of sgl, the
            // sgl of the slot at the anchor, and the largest slot sgl.
            let n_e = st.entries.len();
            let (sums, at_anchor, best) = (&mut self.sums, &mut self.at_anchor, &mut self.best);
            sums.clear();
            sums.resize(n_e, 0.0);
            at_anchor.clear();
            at_anchor.resize(n_e, None);
            best.clear();
            best.resize(n_e, f64::MIN);
            // (the anchor's slot and the largest only rank with `anchor_slot`)
            let by_anchor = cfg.demote_rank == DemoteRank::AnchorSlot;
            for (sl, v) in st.slots.iter().zip(&self.sgl) {
                sums[sl.entry] += v;
                if by_anchor {
                    best[sl.entry] = best[sl.entry].max(*v);
                    if st.entries[sl.entry]
                        .as_ref()
                        .is_some_and(|e| e.anchor == sl.pos)
                    {
                        at_anchor[sl.entry] = Some(*v);
                    }
                }
            }
            let is_centre = |e: &usize| {
                st.entries[*e]
                    .as_ref()
                    .is_some_and(|x| !x.window && !x.zero)
            };
            let anchor = |e: usize| st.entries[e].as_ref().unwrap().anchor;
            self.ranks.clear();
            self.ranks.extend((0..n_e).map(|e| {
                if st.entries[e].is_none() {
                    0.0
                } else if cfg.demote_rank == DemoteRank::AnchorSlot {
                    at_anchor[e].unwrap_or(best[e])
                } else {
                    sums[e]
                }
            }));
            let c = victim(
                &self.ranks,
                (0..n_e).filter(is_centre),
                anchor,
                Tie::KeepLater,
            )
            .unwrap();
            let mut target = None;
            if sh.n_tbm > 0 && cfg.tau < 1.0 {
                let ec = st.entries[c].as_ref().unwrap();
                let (xs, xv): (Vec<f64>, Vec<f64>) = (
                    ec.sim.iter().map(|x| *x as f64).collect(),
                    ec.val.iter().map(|x| *x as f64).collect(),
                );
                let (use_k, use_v) = (cfg.similarity.uses_keys(), cfg.similarity.uses_values());
                let mut best: Option<(usize, f64)> = None;
                for b in 0..n_e.div_ceil(4) {
                    let cands = (4 * b..(4 * b + 4).min(n_e)).filter(|&e| e != c && is_centre(&e));
                    if cands.clone().next().is_none() {
                        continue;
                    }
                    // cos⁺ as `cos_plus_normed` computes it, four entries at a time
                    let kd = if use_k {
                        st.simt.block_dots(&xs, b)
                    } else {
                        [0.0; 4]
                    };
                    let vd = if use_v {
                        st.valt.block_dots(&xv, b)
                    } else {
                        [0.0; 4]
                    };
                    for e in cands {
                        let ee = st.entries[e].as_ref().unwrap();
                        let kc = || (kd[e % 4] / (ec.sim_norm * ee.sim_norm + EPS)).max(0.0);
                        let vc = || (vd[e % 4] / (ec.val_norm * ee.val_norm + EPS)).max(0.0);
                        let r = cfg.similarity.of(kc, vc);
                        let better = match best {
                            None => true,
                            Some((b, rb)) => r > rb || (r == rb && ee.anchor < anchor(b)),
                        };
                        if better {
                            best = Some((e, r));
                        }
                    }
                }
                if let Some((e, r)) = best {
                    if r >= cfg.tau {
                        target = Some(e);
                    }
                }
            }
            match target {
                Some(t) => {
                    let (s_t, s_c) = (sums[t], sums[c]);
                    let ec = st.entries[c].clone().unwrap();
                    let et = st.entries[t].as_mut().unwrap();
                    let den = s_t + s_c;
                    let (wt, wc) = if den > 0.0 {
                        (s_t / den, s_c / den)
                    } else {
                        (0.5, 0.5)
                    };
                    let dir: Vec<f64> = et
                        .dir
                        .iter()
                        .zip(&ec.dir)
                        .map(|(x, y)| s_t * *x as f64 + s_c * *y as f64)
                        .collect();
                    et.dir = unit(&dir);
                    et.val = et
                        .val
                        .iter()
                        .zip(&ec.val)
                        .map(|(x, y)| (wt * *x as f64 + wc * *y as f64) as f32)
                        .collect();
                    et.refresh(cfg, &sh.rope);
                    st.put(t);
                    st.slots
                        .iter_mut()
                        .filter(|s| s.entry == c)
                        .for_each(|s| s.entry = t);
                    self.dirty.push(t);
                }
                None if cfg.zero_class == ZeroClass::LiteralZero => {
                    let z = match st
                        .entries
                        .iter()
                        .position(|e| e.as_ref().is_some_and(|x| x.zero))
                    {
                        Some(z) => z,
                        None => {
                            let mut z = Entry::new(
                                vec![0.0; sh.d],
                                vec![0.0; sh.d],
                                false,
                                anchor(c),
                                true,
                            );
                            z.refresh(cfg, &sh.rope);
                            st.entries.push(Some(z));
                            st.put(st.entries.len() - 1);
                            st.entries.len() - 1
                        }
                    };
                    st.slots
                        .iter_mut()
                        .filter(|s| s.entry == c)
                        .for_each(|s| s.entry = z);
                    self.dirty.push(z);
                }
                None => {
                    let removed = &mut self.removed;
                    st.slots.retain(|s| {
                        if s.entry == c {
                            removed.push(s.pos);
                        }
                        s.entry != c
                    });
                }
            }
            st.entries[c] = None;
            st.n_centres -= 1;
        }
        // 6. cap the slot table: drop the lowest-sgl slot of a centre that keeps another slot
        while st.slots.len() > sh.s_max {
            sgl_into(cfg, st, &mut self.sgl);
            let counts = &mut self.counts;
            counts.clear();
            counts.resize(st.entries.len(), 0);
            st.slots.iter().for_each(|sl| counts[sl.entry] += 1);
            // zero-class slots go first (lowest sgl), then centre slots whose cluster keeps another
            let is_zero = |i: usize| st.entries[st.slots[i].entry].as_ref().unwrap().zero;
            let lowest = |pred: &dyn Fn(usize) -> bool| {
                let cand = (0..st.slots.len()).filter(|&i| pred(i));
                victim(&self.sgl, cand, |i| st.slots[i].pos, Tie::KeepLater)
            };
            // (zero-class entries exist only with `zero_class=literal_zero`)
            let zeros = cfg.zero_class == ZeroClass::LiteralZero;
            let v = zeros.then(|| lowest(&is_zero)).flatten().or_else(|| {
                lowest(&|i: usize| {
                    let e = st.slots[i].entry;
                    let en = st.entries[e].as_ref().unwrap();
                    !en.window && !en.zero && counts[e] >= 2
                })
            });
            match v {
                Some(i) => {
                    self.removed.push(st.slots.remove(i).pos);
                }
                None => break,
            }
        }
        // 7. the cache follows: removed slots' rows go, changed entries' rows are rewritten
        if !self.removed.is_empty() {
            self.removed.sort_unstable();
            let (removed, mut k) = (&self.removed, 0);
            let mut rows = Vec::with_capacity(removed.len());
            for (i, m) in cache.members.iter().enumerate() {
                if k < removed.len() && m[0] as usize == removed[k] {
                    rows.push(i);
                    k += 1;
                }
            }
            debug_assert_eq!(k, removed.len(), "every removed slot has a row");
            cache.remove_sorted(&rows);
        }
        let dirty = &self.dirty;
        let rows: Vec<usize> = (0..st.slots.len())
            .filter(|&i| dirty.contains(&st.slots[i].entry))
            .collect();
        self.cfg.write_slots(st, &self.sh, cache, &rows);
    }
}
