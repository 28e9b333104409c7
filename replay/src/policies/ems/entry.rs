//! EMS's stored state: entries (one centre's unit key direction and value),
//! slots (one per member position, each with its own key norm) and a head's
//! table of both; the key spaces entries live in; a head's expansion into the
//! engine's cache (one entry per slot).

use std::sync::Arc;

use kvreplay_kernels::cpu::{l2_norm, ColumnBlocks, RopeCache};

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
    pub(super) fn refresh(&mut self, cfg: &Ems, rope: &Option<Arc<RopeCache>>) {
        self.sim = cfg.sim_vec(&self.dir, self.anchor, rope);
        self.sim_norm = l2_norm(&self.sim);
        self.val_norm = l2_norm(&self.val);
    }
}

/// max(cos, 0) from cached norms (the same value as `cos_plus`); decode
/// computes it four entries at a time with [`block_dots`].
#[cfg(test)]
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
}

/// One head's state: stored entries (by id; None once deleted) and active
/// slots in position order (slot i is entry i of the engine's cache).
pub(super) struct HeadState {
    pub(super) entries: Vec<Option<Entry>>,
    pub(super) slots: Vec<Slot>,
    pub(super) loc_counter: usize,
    /// The window entries' ids, oldest anchor first.
    pub(super) windows: std::collections::VecDeque<usize>,
    /// Live entries that are neither window nor zero class: the centres.
    pub(super) n_centres: usize,
    /// Every entry's similarity vector and value by entry id, in column
    /// blocks (the decode-time redundancy, four entries per vector operation).
    pub(super) simt: ColumnBlocks,
    pub(super) valt: ColumnBlocks,
}

impl HeadState {
    /// The window queue and centre count, from the entries (after prefill).
    pub(super) fn index(&mut self) {
        let mut w: Vec<usize> = (0..self.entries.len())
            .filter(|&e| self.entries[e].as_ref().is_some_and(|x| x.window))
            .collect();
        w.sort_by_key(|&e| self.entries[e].as_ref().unwrap().anchor);
        self.windows = w.into();
        self.n_centres = self
            .entries
            .iter()
            .flatten()
            .filter(|x| !x.window && !x.zero)
            .count();
        let d = self
            .entries
            .iter()
            .flatten()
            .next()
            .map_or(0, |x| x.val.len());
        self.simt = ColumnBlocks::new(d);
        self.valt = ColumnBlocks::new(d);
        for e in 0..self.entries.len() {
            self.put(e);
        }
    }

    /// Store entry `e`'s similarity vector and value in the blocks (after it
    /// was created or changed).
    pub(super) fn put(&mut self, e: usize) {
        if let Some(x) = self.entries[e].as_ref() {
            self.simt.set(e, &x.sim);
            self.valt.set(e, &x.val);
        }
    }
}

impl Ems {
    /// Key as merged: raw (un-rotated at its position) or as captured.
    pub(super) fn key_space(
        &self,
        k: &[f32],
        pos: usize,
        rope: &Option<Arc<RopeCache>>,
    ) -> Vec<f32> {
        let mut x = k.to_vec();
        if self.raw_space() {
            rope.as_ref()
                .expect("checked at prefill")
                .rotate(&mut x, pos, -1.0);
        }
        x
    }

    /// Similarity vector of an entry's direction (positional with sim_pos in raw space).
    pub(super) fn sim_vec(
        &self,
        dir: &[f32],
        anchor: usize,
        rope: &Option<Arc<RopeCache>>,
    ) -> Vec<f32> {
        let mut x = dir.to_vec();
        if self.sim_pos && self.raw_space() {
            rope.as_ref()
                .expect("checked at prefill")
                .rotate(&mut x, anchor, 1.0);
        }
        x
    }

    /// The engine's view of a head: one entry per active slot, in slot order.
    pub(super) fn expand(&self, st: &HeadState, sh: &Shape) -> HeadCache {
        let mut c = HeadCache::new(sh.d);
        for s in &st.slots {
            let e = st.entries[s.entry]
                .as_ref()
                .expect("slots point at live entries");
            c.push_exact(s.pos, &e.dir, &e.val);
        }
        let all: Vec<usize> = (0..st.slots.len()).collect();
        self.write_slots(st, sh, &mut c, &all);
        c
    }

    /// Rewrite rows `rows` of `c` (slot i is row i) from their entries: the
    /// key direction times the slot's key norm (re-rotated at the slot's
    /// position in raw space) and the entry's value; then every row's bits
    /// (an entry's storage charged to its first slot, an index per slot).
    pub(super) fn write_slots(
        &self,
        st: &HeadState,
        sh: &Shape,
        c: &mut HeadCache,
        rows: &[usize],
    ) {
        let d = sh.d;
        debug_assert_eq!(c.len(), st.slots.len());
        for &i in rows {
            let s = &st.slots[i];
            let e = st.entries[s.entry]
                .as_ref()
                .expect("slots point at live entries");
            let key = &mut c.keys[i * d..(i + 1) * d];
            for (k, x) in key.iter_mut().zip(&e.dir) {
                *k = x * s.knorm;
            }
            if self.raw_space() {
                sh.rope.as_ref().expect("checked").rotate(key, s.pos, 1.0);
            }
            c.values[i * d..(i + 1) * d].copy_from_slice(&e.val);
        }
        let aux = F16_BITS + ((sh.n_budget + 1) as f64).log2().ceil() as u64;
        let mut charged = vec![false; st.entries.len()];
        for (s, b) in st.slots.iter().zip(c.bits.iter_mut()) {
            let zero = st.entries[s.entry].as_ref().is_some_and(|e| e.zero);
            let entry_bits = if charged[s.entry] || zero {
                0
            } else {
                HeadCache::exact_bits(d)
            };
            charged[s.entry] = true;
            *b = entry_bits + aux;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_block_dots_sum_as_cos_plus_normed_does() {
        let d = 64;
        let f = |i: usize| (((i * 2654435761 + 3) >> 7) % 1999) as f32 / 999.0 - 1.0;
        let x: Vec<f32> = (0..d).map(f).collect();
        let rows: Vec<Vec<f32>> = (0..4)
            .map(|r| (0..d).map(|t| f(t * 7 + r * 1000 + 5)).collect())
            .collect();
        let mut cols = ColumnBlocks::new(d);
        for (j, r) in rows.iter().enumerate() {
            cols.set(j, r);
        }
        let xd: Vec<f64> = x.iter().map(|v| *v as f64).collect();
        let got = cols.block_dots(&xd, 0);
        for (j, r) in rows.iter().enumerate() {
            let (nx, nr) = (l2_norm(&x), l2_norm(r));
            let want = cos_plus_normed(&x, nx, r, nr);
            assert_eq!(
                ((got[j] / (nx * nr + EPS)).max(0.0)).to_bits(),
                want.to_bits(),
                "row {j}"
            );
        }
    }
}
