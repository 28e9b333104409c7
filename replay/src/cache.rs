//! The compressed cache of one KV head: one representation for eviction,
//! merging, quantisation and sharing.

/// Storage bits of one f16 number.
pub const F16_BITS: u64 = 16;

/// The original positions one entry stands for, ascending. Stored inline
/// for up to two positions (an exact entry, a pair merged), so reading an
/// entry's positions is no pointer chase and pushing an exact entry no
/// allocation.
pub type Members = smallvec::SmallVec<[u32; 2]>;

/// The (n, d) keys or values of a [`HeadCache`]: a `Vec<f32>` whose live
/// rows may start past its front, so that removing a row moves whichever
/// side of it is shorter. Removing row e of n moves the e rows before it one
/// row back (the front advances) or the n − e − 1 after it one row forward;
/// eviction policies remove mostly old entries, near the front. Derefs to the
/// live rows, in order.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    buf: Vec<f32>,
    /// Index in `buf` of the first live element.
    start: usize,
}

impl Rows {
    pub fn with_capacity(n: usize) -> Rows {
        Rows {
            buf: Vec::with_capacity(n),
            start: 0,
        }
    }

    /// Append `x` after the live rows. Where the buffer is full and its dead
    /// front is at least half of it, the live rows move to the front first
    /// (so each row moved is paid for by a row removed at the front).
    pub fn extend_from_slice(&mut self, x: &[f32]) {
        if self.buf.len() + x.len() > self.buf.capacity() && 2 * self.start >= self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(x);
    }

    /// Keep the first `n` live elements.
    pub fn truncate(&mut self, n: usize) {
        self.buf.truncate(self.start + n);
    }

    /// Remove row `e` of `d` elements, keeping the order of the others.
    pub fn remove_row(&mut self, e: usize, d: usize) {
        self.remove_rows(&[e], d);
    }

    /// Remove the rows `idx` (ascending, distinct) of `d` elements, keeping
    /// the order of the others. Either the rows before the last removed one
    /// move back (the front advances) or the rows after the first move
    /// forward, whichever moves fewer; each run between removed rows moves
    /// once.
    pub fn remove_rows(&mut self, idx: &[usize], d: usize) {
        let n = self.len() / d.max(1);
        let (Some(&first), Some(&last)) = (idx.first(), idx.last()) else {
            return;
        };
        assert!(last < n, "row {last} of {n}");
        let s = self.start;
        let r = idx.len();
        if last + 1 - r < n - first - r {
            // runs from the back: run k is idx[k − 1] + 1 .. idx[k]
            let mut to = s + (last + 1) * d;
            for k in (0..r).rev() {
                let from = if k == 0 { 0 } else { idx[k - 1] + 1 };
                let len = (idx[k] - from) * d;
                to -= len;
                self.buf.copy_within(s + from * d..s + idx[k] * d, to);
            }
            self.start += r * d;
        } else {
            let mut to = s + first * d;
            for (k, &e) in idx.iter().enumerate() {
                let end = idx.get(k + 1).copied().unwrap_or(n);
                self.buf.copy_within(s + (e + 1) * d..s + end * d, to);
                to += (end - e - 1) * d;
            }
            self.buf.truncate(to);
        }
    }
}

impl std::ops::Deref for Rows {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.start..]
    }
}

impl std::ops::DerefMut for Rows {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..]
    }
}

impl PartialEq for Rows {
    fn eq(&self, other: &Rows) -> bool {
        **self == **other
    }
}

impl PartialEq<Vec<f32>> for Rows {
    fn eq(&self, other: &Vec<f32>) -> bool {
        **self == **other
    }
}

impl From<Vec<f32>> for Rows {
    fn from(buf: Vec<f32>) -> Rows {
        Rows { buf, start: 0 }
    }
}

impl Extend<f32> for Rows {
    fn extend<I: IntoIterator<Item = f32>>(&mut self, it: I) {
        self.buf.extend(it);
    }
}

/// One KV head's cache. Entry `e` is (key, value, additive logit bias, the
/// original positions it stands for, its storage cost in bits). Every policy
/// here keeps entries in the order of the positions that created them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeadCache {
    pub d: usize,
    /// (n, d)
    pub keys: Rows,
    /// (n, d)
    pub values: Rows,
    /// (n,) added to the entry's logit: log(count) for a merge of count positions, 0 otherwise.
    pub bias: Vec<f32>,
    /// (n,) original positions each entry stands for, ascending.
    pub members: Vec<Members>,
    /// (n,) storage cost: key + value + metadata (e.g. bias, quantisation scales).
    pub bits: Vec<u64>,
}

impl HeadCache {
    pub fn new(d: usize) -> HeadCache {
        HeadCache {
            d,
            ..Default::default()
        }
    }

    /// An empty cache with room for `n` entries (no reallocation while it
    /// holds at most `n`).
    pub fn with_capacity(d: usize, n: usize) -> HeadCache {
        HeadCache {
            d,
            keys: Rows::with_capacity(n * d),
            values: Rows::with_capacity(n * d),
            bias: Vec::with_capacity(n),
            members: Vec::with_capacity(n),
            bits: Vec::with_capacity(n),
        }
    }

    /// Cost of one exact f16 entry: key and value, no metadata.
    pub fn exact_bits(d: usize) -> u64 {
        2 * d as u64 * F16_BITS
    }

    /// Whether entry `e` is visible to the query at `pos` through a sliding
    /// window of `w` (always, without one): its newest member lies in
    /// pos − w + 1 ..= pos.
    pub fn in_window(&self, e: usize, pos: usize, w: Option<usize>) -> bool {
        match w {
            None => true,
            Some(w) => self.members[e]
                .iter()
                .max()
                .is_some_and(|&m| m as usize + w > pos),
        }
    }

    pub fn len(&self) -> usize {
        self.bias.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bias.is_empty()
    }

    pub fn key(&self, e: usize) -> &[f32] {
        &self.keys[e * self.d..(e + 1) * self.d]
    }

    pub fn value(&self, e: usize) -> &[f32] {
        &self.values[e * self.d..(e + 1) * self.d]
    }

    pub fn value_mut(&mut self, e: usize) -> &mut [f32] {
        &mut self.values[e * self.d..(e + 1) * self.d]
    }

    /// Append the exact entry of position `pos`.
    pub fn push_exact(&mut self, pos: usize, key: &[f32], value: &[f32]) {
        debug_assert_eq!(key.len(), self.d);
        self.keys.extend_from_slice(key);
        self.values.extend_from_slice(value);
        self.bias.push(0.0);
        self.members.push(smallvec::smallvec![pos as u32]);
        self.bits.push(Self::exact_bits(self.d));
    }

    /// Remove entry `e`, keeping the order of the others.
    pub fn remove(&mut self, e: usize) {
        let d = self.d;
        self.keys.remove_row(e, d);
        self.values.remove_row(e, d);
        self.bias.remove(e);
        self.members.remove(e);
        self.bits.remove(e);
    }

    /// Remove the entries at `idx` (ascending, distinct) in place, keeping
    /// the order of the others: each run between removed entries moves once.
    pub fn remove_sorted(&mut self, idx: &[usize]) {
        let (d, n) = (self.d, self.len());
        debug_assert!(idx.windows(2).all(|w| w[0] < w[1]) && idx.last().is_none_or(|&i| i < n));
        let Some(&first) = idx.first() else {
            return;
        };
        self.keys.remove_rows(idx, d);
        self.values.remove_rows(idx, d);
        let mut w = first;
        for (k, &r) in idx.iter().enumerate() {
            // the run after removed entry r: r + 1 .. the next removed one
            let end = idx.get(k + 1).copied().unwrap_or(n);
            let run = r + 1..end;
            if !run.is_empty() {
                self.bias.copy_within(run.clone(), w);
                self.bits.copy_within(run.clone(), w);
                for (j, i) in run.clone().enumerate() {
                    self.members.swap(w + j, i);
                }
                w += run.len();
            }
        }
        self.bias.truncate(w);
        self.bits.truncate(w);
        self.members.truncate(w);
    }

    /// Keep only the entries whose indices are in `keep` (ascending).
    pub fn retain_indices(&mut self, keep: &[usize]) {
        let d = self.d;
        let mut out = HeadCache::new(d);
        for &e in keep {
            out.keys.extend_from_slice(&self.keys[e * d..(e + 1) * d]);
            out.values
                .extend_from_slice(&self.values[e * d..(e + 1) * d]);
            out.bias.push(self.bias[e]);
            out.members.push(std::mem::take(&mut self.members[e]));
            out.bits.push(self.bits[e]);
        }
        *self = out;
    }

    /// Each entry's original positions as a `Vec` (for display and tests).
    pub fn member_lists(&self) -> Vec<Vec<u32>> {
        self.members.iter().map(|m| m.to_vec()).collect()
    }

    /// First original position of each entry.
    pub fn positions(&self) -> Vec<usize> {
        self.members.iter().map(|m| m[0] as usize).collect()
    }

    pub fn total_bits(&self) -> u64 {
        self.bits.iter().sum()
    }

    /// Bytes of storage, rounded up.
    pub fn bytes(&self) -> u64 {
        self.total_bits().div_ceil(8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One operation on a cache of rows: append a row, remove one row (by a
    /// fraction of the length), or remove a sorted set (by a bit mask).
    #[derive(Clone, Debug)]
    enum Op {
        Push,
        Remove(f64),
        RemoveMany(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Push),
            (0.0..1.0f64).prop_map(Op::Remove),
            any::<u64>().prop_map(Op::RemoveMany),
        ]
    }

    proptest! {
        /// `Rows` against a plain `Vec` doing the same removals with `drain`:
        /// the same live rows in the same order after every operation,
        /// whichever side each removal moved, and with compactions on append.
        #[test]
        fn rows_equal_a_vec_through_any_pushes_and_removals(
            d in 1usize..5,
            cap in 0usize..8,
            ops in proptest::collection::vec(op(), 0..200),
        ) {
            let mut rows = Rows::with_capacity(cap * d);
            let mut model: Vec<f32> = Vec::new();
            let (mut next, mut peak) = (0f32, 0usize);
            for op in ops {
                let n = model.len() / d;
                match op {
                    Op::Push => {
                        let row: Vec<f32> = (0..d).map(|j| next + j as f32 / 8.0).collect();
                        next += 1.0;
                        rows.extend_from_slice(&row);
                        model.extend_from_slice(&row);
                    }
                    Op::Remove(f) if n > 0 => {
                        let e = ((f * n as f64) as usize).min(n - 1);
                        rows.remove_row(e, d);
                        model.drain(e * d..(e + 1) * d);
                    }
                    Op::RemoveMany(mask) => {
                        let idx: Vec<usize> = (0..n.min(64)).filter(|i| mask >> i & 1 == 1).collect();
                        rows.remove_rows(&idx, d);
                        for &e in idx.iter().rev() {
                            model.drain(e * d..(e + 1) * d);
                        }
                    }
                    Op::Remove(_) => {}
                }
                prop_assert_eq!(&*rows, &model[..]);
                // the dead front does not make the buffer grow without bound:
                // it grows only while more than half of it is live
                peak = peak.max(model.len());
                prop_assert!(rows.buf.capacity() <= (cap * d).max(4 * (peak + d) + 8));
            }
        }
    }

    #[test]
    fn a_removal_moves_the_shorter_side() {
        let mut r = Rows::from((0..10).map(|i| i as f32).collect::<Vec<_>>());
        // row 1 of 10: the one row before it moves back
        r.remove_row(1, 1);
        assert_eq!(
            (r.start, &*r),
            (1, &[0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0][..])
        );
        // row 6 of 9: the two rows after it move forward
        r.remove_row(6, 1);
        assert_eq!(
            (r.start, &*r),
            (1, &[0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 9.0][..])
        );
        // rows 0 and 2 of 8: the one row between them moves back
        r.remove_rows(&[0, 2], 1);
        assert_eq!((r.start, &*r), (3, &[2.0, 4.0, 5.0, 6.0, 8.0, 9.0][..]));
        // a full buffer whose dead front is at least half of it compacts
        let mut r = Rows::with_capacity(4);
        r.extend_from_slice(&[0.0, 1.0, 2.0, 3.0]);
        r.remove_rows(&[0, 1], 1);
        r.extend_from_slice(&[4.0]);
        assert_eq!(
            (r.start, r.buf.capacity(), &*r),
            (0, 4, &[2.0, 3.0, 4.0][..])
        );
    }

    #[test]
    fn push_remove_retain_keep_everything_aligned() {
        let mut c = HeadCache::new(2);
        for p in 0..4 {
            c.push_exact(p, &[p as f32, 0.0], &[0.0, p as f32]);
        }
        c.remove(1);
        assert_eq!(c.positions(), vec![0, 2, 3]);
        assert_eq!(c.key(1), &[2.0, 0.0]);
        c.retain_indices(&[0, 2]);
        assert_eq!(c.positions(), vec![0, 3]);
        assert_eq!(c.value(1), &[0.0, 3.0]);
        let mut r = HeadCache::new(2);
        for p in 0..7 {
            r.push_exact(p, &[p as f32, 1.0], &[1.0, p as f32]);
            r.bits[p] = p as u64;
        }
        let mut want = r.clone();
        want.retain_indices(&[0, 3, 4, 6]);
        r.remove_sorted(&[1, 2, 5]);
        assert_eq!(r, want);
        r.remove_sorted(&[]);
        assert_eq!(r, want);
        r.remove_sorted(&[3]);
        want.retain_indices(&[0, 1, 2]);
        assert_eq!(r, want);
        assert_eq!(c.total_bits(), 2 * 2 * 2 * 16);
        assert_eq!(c.bytes(), 16);
    }
}
