//! The compressed cache of one KV head: one representation for eviction,
//! merging, quantisation and sharing.

/// Storage bits of one f16 number.
pub const F16_BITS: u64 = 16;

/// The original positions one entry stands for, ascending. Stored inline
/// for up to two positions (an exact entry, a pair merged), so reading an
/// entry's positions is no pointer chase and pushing an exact entry no
/// allocation.
pub type Members = smallvec::SmallVec<[u32; 2]>;

/// One KV head's cache. Entry `e` is (key, value, additive logit bias, the
/// original positions it stands for, its storage cost in bits). Every policy
/// here keeps entries in the order of the positions that created them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeadCache {
    pub d: usize,
    /// (n, d)
    pub keys: Vec<f32>,
    /// (n, d)
    pub values: Vec<f32>,
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
            keys: Vec::with_capacity(n * d),
            values: Vec::with_capacity(n * d),
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
        self.keys.drain(e * d..(e + 1) * d);
        self.values.drain(e * d..(e + 1) * d);
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
        let mut w = first;
        for (k, &r) in idx.iter().enumerate() {
            // the run after removed entry r: r + 1 .. the next removed one
            let end = idx.get(k + 1).copied().unwrap_or(n);
            let run = r + 1..end;
            if !run.is_empty() {
                self.keys.copy_within(run.start * d..run.end * d, w * d);
                self.values.copy_within(run.start * d..run.end * d, w * d);
                self.bias.copy_within(run.clone(), w);
                self.bits.copy_within(run.clone(), w);
                for (j, i) in run.clone().enumerate() {
                    self.members.swap(w + j, i);
                }
                w += run.len();
            }
        }
        self.keys.truncate(w * d);
        self.values.truncate(w * d);
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
