//! EMS at decode: each step adds the new token as a window entry, updates the
//! scores, turns the token leaving the window into a centre, demotes the least
//! important centre (merged into its most similar centre, or freed) and caps
//! the slot table at S_max.

use kvreplay_kernels::cpu::l2_norm;

use super::config::{DemoteRank, Ems, Shape, ZeroClass};
use super::entry::{cos_plus_normed, unit, Entry, HeadState, Slot};
use crate::cache::HeadCache;
use crate::policy::{DecodeState, StepCtx};
use crate::select::{victim, Tie};

pub(super) struct Decode {
    cfg: Ems,
    sh: Shape,
    states: Vec<HeadState>,
}

impl Decode {
    pub(super) fn new(cfg: Ems, sh: Shape, states: Vec<HeadState>) -> Decode {
        Decode { cfg, sh, states }
    }

    fn sgl(&self, st: &HeadState) -> Vec<f64> {
        let n = st.slots.len() as f64;
        let mg = st.slots.iter().map(|s| s.s_glo).sum::<f64>() / n;
        let ml = st
            .slots
            .iter()
            .map(|s| s.s_loc_past + s.s_loc_cur)
            .sum::<f64>()
            / n;
        let alpha = ml / mg.max(1e-30);
        st.slots
            .iter()
            .map(|s| self.cfg.combine(alpha, s.s_glo, s.s_loc_past + s.s_loc_cur))
            .collect()
    }
}

impl DecodeState for Decode {
    #[allow(clippy::needless_range_loop)] // hi indexes the states and the caches alike
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for hi in 0..self.states.len() {
            let a: Vec<f32> = if self.cfg.per_query_head() {
                ctx.probs[hi].clone()
            } else {
                ctx.group_mean(hi)
            };
            let c = &caches[hi];
            let last = c.len() - 1;
            let (k_new, v_new) = (c.key(last).to_vec(), c.value(last).to_vec());
            let (cfg, sh) = (&self.cfg, &self.sh);
            let st = &mut self.states[hi];
            // 1. the new token: a window entry and its slot
            let kt = cfg.key_space(&k_new, ctx.pos, &sh.rope);
            let id = st.entries.len();
            let mut e = Entry::new(
                unit(&kt.iter().map(|x| *x as f64).collect::<Vec<_>>()),
                v_new,
                true,
                ctx.pos,
                false,
            );
            e.refresh(cfg, &sh.rope);
            st.entries.push(Some(e));
            st.slots.push(Slot {
                pos: ctx.pos,
                entry: id,
                knorm: l2_norm(&k_new) as f32,
                s_glo: 0.0,
                s_loc_past: 0.0,
                s_loc_cur: 0.0,
                key: Vec::new(),
            });
            // 3. scores (a covers every active slot, the new one last)
            for (s, x) in st.slots.iter_mut().zip(&a) {
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
            let mut windows: Vec<usize> = (0..st.entries.len())
                .filter(|&e| st.entries[e].as_ref().is_some_and(|x| x.window))
                .collect();
            windows.sort_by_key(|&e| st.entries[e].as_ref().unwrap().anchor);
            if windows.len() > sh.l_win {
                st.entries[windows[0]].as_mut().unwrap().window = false;
            }
            // 5. demote the least important centre
            let centres: Vec<usize> = (0..st.entries.len())
                .filter(|&e| st.entries[e].as_ref().is_some_and(|x| !x.window && !x.zero))
                .collect();
            if centres.len() > sh.n_imp {
                let sgl = self.sgl_of(hi);
                let st = &mut self.states[hi];
                // Per entry, in one pass over the slots: the cluster sum of sgl, the
                // sgl of the slot at the anchor, and the largest slot sgl.
                let n_e = st.entries.len();
                let (mut sums, mut at_anchor, mut best) =
                    (vec![0f64; n_e], vec![None; n_e], vec![f64::MIN; n_e]);
                for (sl, v) in st.slots.iter().zip(&sgl) {
                    sums[sl.entry] += v;
                    best[sl.entry] = best[sl.entry].max(*v);
                    if st.entries[sl.entry]
                        .as_ref()
                        .is_some_and(|e| e.anchor == sl.pos)
                    {
                        at_anchor[sl.entry] = Some(*v);
                    }
                }
                let cluster = |e: usize| sums[e];
                let rank = |e: usize| {
                    if cfg.demote_rank == DemoteRank::AnchorSlot {
                        at_anchor[e].unwrap_or(best[e])
                    } else {
                        sums[e]
                    }
                };
                let anchor = |e: usize| st.entries[e].as_ref().unwrap().anchor;
                let ranks: Vec<f64> = (0..st.entries.len())
                    .map(|e| {
                        if st.entries[e].is_some() {
                            rank(e)
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let c = victim(&ranks, centres.iter().copied(), anchor, Tie::KeepLater).unwrap();
                let mut target = None;
                if sh.n_tbm > 0 && cfg.tau < 1.0 {
                    let ec = st.entries[c].as_ref().unwrap();
                    let mut best: Option<(usize, f64)> = None;
                    for &e in centres.iter().filter(|&&e| e != c) {
                        let ee = st.entries[e].as_ref().unwrap();
                        let kc = || cos_plus_normed(&ec.sim, ec.sim_norm, &ee.sim, ee.sim_norm);
                        let vc = || cos_plus_normed(&ec.val, ec.val_norm, &ee.val, ee.val_norm);
                        let r = cfg.similarity.of(kc, vc);
                        let better = match best {
                            None => true,
                            Some((b, rb)) => r > rb || (r == rb && ee.anchor < anchor(b)),
                        };
                        if better {
                            best = Some((e, r));
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
                        let (s_t, s_c) = (cluster(t), cluster(c));
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
                        st.slots
                            .iter_mut()
                            .filter(|s| s.entry == c || s.entry == t)
                            .for_each(|s| {
                                s.entry = t;
                                s.key.clear();
                            });
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
                                st.entries.len() - 1
                            }
                        };
                        st.slots.iter_mut().filter(|s| s.entry == c).for_each(|s| {
                            s.entry = z;
                            s.key.clear();
                        });
                    }
                    None => st.slots.retain(|s| s.entry != c),
                }
                st.entries[c] = None;
            }
            // 6. cap the slot table: drop the lowest-sgl slot of a centre that keeps another slot
            loop {
                if self.states[hi].slots.len() <= self.sh.s_max {
                    break;
                }
                let sgl = self.sgl_of(hi);
                let st = &mut self.states[hi];
                let mut counts = vec![0usize; st.entries.len()];
                st.slots.iter().for_each(|sl| counts[sl.entry] += 1);
                let count = |e: usize| counts[e];
                // zero-class slots go first (lowest sgl), then centre slots whose cluster keeps another
                let is_zero = |i: usize| st.entries[st.slots[i].entry].as_ref().unwrap().zero;
                let lowest = |pred: &dyn Fn(usize) -> bool| {
                    let cand = (0..st.slots.len()).filter(|&i| pred(i));
                    victim(&sgl, cand, |i| st.slots[i].pos, Tie::KeepLater)
                };
                let victim = lowest(&is_zero).or_else(|| {
                    lowest(&|i: usize| {
                        let e = st.slots[i].entry;
                        let en = st.entries[e].as_ref().unwrap();
                        !en.window && !en.zero && count(e) >= 2
                    })
                });
                match victim {
                    Some(i) => {
                        st.slots.remove(i);
                    }
                    None => break,
                }
            }
            self.cfg
                .expand_into(&mut self.states[hi], &self.sh, &mut caches[hi]);
        }
    }
}

impl Decode {
    fn sgl_of(&self, hi: usize) -> Vec<f64> {
        self.sgl(&self.states[hi])
    }
}
