//! EMS's stored state: entries (one centre's unit key direction and value),
//! slots (one per member position, each with its own key norm) and a head's
//! table of both; the key spaces entries live in; a head's expansion into the
//! engine's cache (one entry per slot).

use kvreplay_kernels::cpu::{l2_norm, RopeCache};

use super::config::{Ems, Shape};
use crate::cache::{HeadCache, F16_BITS};

pub(super) const EPS: f64 = 1e-6;

/// x / (‖x‖ + ε), rounded to f32.
pub(super) fn unit(x: &[f64]) -> Vec<f32> {
    let n = x.iter().map(|v| v * v).sum::<f64>().sqrt();
    x.iter().map(|v| (v / (n + EPS)) as f32).collect()
}

/// A stored entry: a class centre (its members' merged unit key direction and
/// value), a window token, or the zero class.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) dir: Vec<f32>,
    pub(super) val: Vec<f32>,
    pub(super) window: bool,
    pub(super) anchor: usize,
    /// The zero class (zero_class=literal_zero): zero key and value, nothing stored.
    pub(super) zero: bool,
    /// Cached for the decode-time redundancy: the similarity vector of `dir`
    /// and the norms of it and of `val` (kept in step by `refresh`).
    pub(super) sim: Vec<f32>,
    pub(super) sim_norm: f64,
    pub(super) val_norm: f64,
}

impl Entry {
    pub(super) fn new(
        dir: Vec<f32>,
        val: Vec<f32>,
        window: bool,
        anchor: usize,
        zero: bool,
    ) -> Entry {
        Entry {
            dir,
            val,
            window,
            anchor,
            zero,
            sim: Vec::new(),
            sim_norm: 0.0,
            val_norm: 0.0,
        }
    }

    /// Recompute the cached similarity vector and norms after `dir` or `val` changed.
    pub(super) fn refresh(&mut self, cfg: &Ems, rope: &Option<RopeCache>) {
        self.sim = cfg.sim_vec(&self.dir, self.anchor, rope);
        self.sim_norm = l2_norm(&self.sim);
        self.val_norm = l2_norm(&self.val);
    }
}

/// max(cos, 0) from cached norms (the same value as `cos_plus`).
pub(super) fn cos_plus_normed(a: &[f32], na: f64, b: &[f32], nb: f64) -> f64 {
    let ab: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    (ab / (na * nb + EPS)).max(0.0)
}

/// One attended position: a member of an entry, restored with its own key
/// norm (and, in raw space, rotated at its own position).
#[derive(Clone, Debug)]
pub(super) struct Slot {
    pub(super) pos: usize,
    pub(super) entry: usize,
    pub(super) knorm: f32,
    pub(super) s_glo: f64,
    pub(super) s_loc_past: f64,
    pub(super) s_loc_cur: f64,
    /// The expanded key, cached; empty when its entry's direction changed.
    pub(super) key: Vec<f32>,
}

/// One head's state: stored entries (by id; None once deleted) and active slots in position order.
pub(super) struct HeadState {
    pub(super) entries: Vec<Option<Entry>>,
    pub(super) slots: Vec<Slot>,
    pub(super) loc_counter: usize,
}

impl Ems {
    /// Key as merged: raw (un-rotated at its position) or as captured.
    pub(super) fn key_space(&self, k: &[f32], pos: usize, rope: &Option<RopeCache>) -> Vec<f32> {
        let mut x = k.to_vec();
        if self.raw_space() {
            rope.as_ref()
                .expect("checked at prefill")
                .rotate(&mut x, pos, -1.0);
        }
        x
    }

    /// Similarity vector of an entry's direction (positional with sim_pos in raw space).
    pub(super) fn sim_vec(&self, dir: &[f32], anchor: usize, rope: &Option<RopeCache>) -> Vec<f32> {
        let mut x = dir.to_vec();
        if self.sim_pos && self.raw_space() {
            rope.as_ref()
                .expect("checked at prefill")
                .rotate(&mut x, anchor, 1.0);
        }
        x
    }

    /// The engine's view of a head: one entry per active slot, in slot order.
    pub(super) fn expand(&self, st: &mut HeadState, sh: &Shape) -> HeadCache {
        let mut c = HeadCache::new(sh.d);
        self.expand_into(st, sh, &mut c);
        c
    }

    /// [`expand`](Self::expand) into `c`, reusing its buffers.
    pub(super) fn expand_into(&self, st: &mut HeadState, sh: &Shape, c: &mut HeadCache) {
        let d = sh.d;
        let aux = F16_BITS + ((sh.n_budget + 1) as f64).log2().ceil() as u64;
        c.d = d;
        c.keys.clear();
        c.values.clear();
        c.bias.clear();
        c.bits.clear();
        // member lists are reused in place (one position per slot)
        c.members.truncate(st.slots.len());
        let mut charged = vec![false; st.entries.len()];
        for s in st.slots.iter_mut() {
            let e = st.entries[s.entry]
                .as_ref()
                .expect("slots point at live entries");
            if s.key.is_empty() {
                s.key = e.dir.iter().map(|x| x * s.knorm).collect();
                if self.raw_space() {
                    sh.rope
                        .as_ref()
                        .expect("checked")
                        .rotate(&mut s.key, s.pos, 1.0);
                }
            }
            c.keys.extend_from_slice(&s.key);
            c.values.extend_from_slice(&e.val);
            c.bias.push(0.0);
            let i = c.bias.len() - 1;
            match c.members.get_mut(i) {
                Some(m) => {
                    m.clear();
                    m.push(s.pos as u32);
                }
                None => c.members.push(vec![s.pos as u32]),
            }
            let entry_bits = if charged[s.entry] || e.zero {
                0
            } else {
                HeadCache::exact_bits(d)
            };
            charged[s.entry] = true;
            c.bits.push(entry_bits + aux);
        }
    }
}
