//! Reading ahead in decode: memory that the next memory-bound step will
//! stream (the next layer's keys and values), asked for while the
//! compute-bound single-row quantised products run.
//!
//! A decode step at 2,048 positions reads about 3.2 MB of each layer's KV
//! cache, from memory: attention from memory took about 2.4 times as long
//! as from cache (criterion `capture/attention_heads/9x1 at 2111` against
//! its 30-layer form). The products between two attentions (W_o, the MLP,
//! the next layer's q/k/v) are bound by their own instructions, not by the
//! memory. So the caller names the next attention's reads
//! ([`ReadAhead::set`] on [`DECODE`]), each task of the fused product claims
//! the next slice of them in order ([`ReadAhead::claim`], [`BYTES_PER_BLOCK`]
//! per weight block it multiplies) and asks for that slice's lines, row by
//! row, into L2 ([`ReadAhead::fetch`]); the L3 keeps what L2 drops.
//!
//! A prefetch never faults and changes no value, so this is a hint: a stale
//! range, or two captures in one process setting ranges in turn, can cost
//! time, never a result. The state is process-wide (the kernels that read it
//! run on rayon's pool, not under a handle).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// At most this many ranges: a layer's key panels and two value parts per
/// KV head, for up to 21 KV heads (ranges past it are not read ahead).
pub const SLOTS: usize = 64;

/// Bytes claimed per quantised weight block a fused product multiplies:
/// SmolLM2's products between two attentions multiply about 110,000 blocks,
/// so they ask for about 3.5 MB, a layer's keys and values at 2,300
/// positions. 12, 20, 48 and 64 were no better (BENCHMARKS.md).
pub const BYTES_PER_BLOCK: usize = 32;

/// Ranges to read ahead and how much of them has been claimed.
pub struct ReadAhead {
    /// Address and byte length of each range.
    start: [AtomicUsize; SLOTS],
    len: [AtomicUsize; SLOTS],
    count: AtomicUsize,
    /// Bytes of the ranges' concatenation claimed so far, and their total.
    cursor: AtomicUsize,
    total: AtomicUsize,
}

/// The one the fused products claim from.
pub static DECODE: ReadAhead = ReadAhead::new();

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicUsize = AtomicUsize::new(0);

impl ReadAhead {
    pub const fn new() -> ReadAhead {
        ReadAhead {
            start: [ZERO; SLOTS],
            len: [ZERO; SLOTS],
            count: ZERO,
            cursor: ZERO,
            total: ZERO,
        }
    }

    /// Read `ranges` ahead from their first byte, in order, replacing what
    /// was set before. Call it between parallel regions (the fork and join
    /// of the next one order it before the tasks that claim).
    pub fn set(&self, ranges: &[&[f32]]) {
        let mut total = 0;
        let mut k = 0;
        for r in ranges.iter().filter(|r| !r.is_empty()).take(SLOTS) {
            self.start[k].store(r.as_ptr() as usize, Relaxed);
            self.len[k].store(std::mem::size_of_val(*r), Relaxed);
            total += std::mem::size_of_val(*r);
            k += 1;
        }
        self.count.store(k, Relaxed);
        self.total.store(total, Relaxed);
        self.cursor.store(0, Relaxed);
    }

    /// Nothing to read ahead.
    pub fn clear(&self) {
        self.count.store(0, Relaxed);
        self.total.store(0, Relaxed);
    }

    /// Claim the next `bytes` of the ranges: (from, to), offsets into their
    /// concatenation; empty once everything is claimed or nothing is set.
    pub fn claim(&self, bytes: usize) -> (usize, usize) {
        let total = self.total.load(Relaxed);
        if bytes == 0 || self.cursor.load(Relaxed) >= total {
            return (0, 0);
        }
        let from = self.cursor.fetch_add(bytes, Relaxed).min(total);
        (from, (from + bytes).min(total))
    }

    /// Ask for the lines of bytes `from .. to` of the ranges' concatenation
    /// (each range from its start in steps of 64 bytes).
    pub fn fetch(&self, from: usize, to: usize) {
        self.each_line(from, to, prefetch_l2);
    }

    fn each_line(&self, from: usize, to: usize, mut f: impl FnMut(usize)) {
        let mut off = 0;
        for k in 0..self.count.load(Relaxed) {
            if off >= to {
                break;
            }
            let (start, len) = (self.start[k].load(Relaxed), self.len[k].load(Relaxed));
            let mut at = from.max(off);
            while at < to.min(off + len) {
                f(start + (at - off));
                at += 64;
            }
            off += len;
        }
    }
}

impl Default for ReadAhead {
    fn default() -> Self {
        ReadAhead::new()
    }
}

/// Ask for every cache line of `s` into L2: a hint that changes no result.
pub fn prefetch_lines<T>(s: &[T]) {
    let (start, bytes) = (s.as_ptr() as usize, std::mem::size_of_val(s));
    let mut at = start & !63;
    while at < start + bytes {
        prefetch_l2(at);
        at += 64;
    }
}

#[inline(always)]
fn prefetch_l2(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(addr as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_cover_the_ranges_once_in_order() {
        let ra = ReadAhead::new();
        let (a, b) = (vec![0f32; 100], vec![0f32; 30]);
        ra.set(&[&a, &[], &b]);
        assert_eq!(ra.count.load(Relaxed), 2, "the empty range is left out");
        let mut claims = Vec::new();
        loop {
            let c = ra.claim(128);
            if c.0 == c.1 {
                break;
            }
            claims.push(c);
        }
        // 400 + 120 bytes in claims of 128, the last cut short.
        assert_eq!(
            claims,
            [(0, 128), (128, 256), (256, 384), (384, 512), (512, 520)]
        );
        // Every 64 bytes of a from its start, then of b from its start
        // (byte 400 of the concatenation), then b's last claim.
        let mut lines = Vec::new();
        for &(from, to) in &claims {
            ra.each_line(from, to, |x| lines.push(x));
        }
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        let mut want: Vec<usize> = (0..400).step_by(64).map(|o| pa + o).collect();
        want.extend([pb, pb + 64, pb + 112]);
        assert_eq!(lines, want);
        ra.clear();
        assert_eq!(ra.claim(64), (0, 0));
    }
}
