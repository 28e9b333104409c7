//! Linear layers on GGUF-quantised weights, without an f32 copy of the model.
//!
//! A [`QuantMatrix`] keeps a weight's blocks as the model file stores them
//! (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; 0.56 to 1.06 bytes per weight
//! against 4 for f32). [`linear_quant`] multiplies by it two ways:
//!
//! - few rows (m < [`FUSED_MAX_M`], decode's m = 1): a fused dequantise-and-dot
//!   kernel reads each block once and never writes the weights out as f32.
//!   Every block type is `w = a·q + b` per group of 16 or 32 weights (`q` a
//!   small integer, `a` and `b` the group's scale and offset as the
//!   dequantiser computes them in f32), so a row's product is
//!   `Σ_g a_g·(Σ q·x) + b_g·(Σ x)`: the sum of `q·x` in eight f32 lanes with
//!   fused multiply-adds, `b_g·Σx` from sums of `x` per group made once per
//!   input row. The order is fixed per row (groups in order, lanes reduced
//!   by one tree), so a row's result does not depend on the thread count, on
//!   how rows are split into tasks or on m. It differs from `dequantise, then
//!   gemm` only in rounding: the weights it multiplies by are the exact
//!   `a·q + b` rather than their f32 roundings.
//! - many rows (prefill chunks): each task dequantises [`COLS`] weight rows
//!   into a buffer that stays in cache and multiplies every input row by
//!   them with the `gemm` crate ([`linear_many`]): bit-identical to the same
//!   product with an f32 weight, and no f32 copy of the whole weight exists.

use std::cell::RefCell;

#[allow(unused_imports)] // `dequantize` is named in the documentation
use super::dequant::{dequantize, BlockType};
use super::simd::{simd_fn, Simd};
use crate::KernelError;

/// Products with fewer input rows than this use the fused kernel.
pub const FUSED_MAX_M: usize = 8;

/// Weight rows per task of the fused kernel (a fixed size: results do not
/// depend on the thread count).
const ROWS_PER_TASK: usize = 32;

/// A (rows, cols) matrix of GGUF blocks, row-major: each row is
/// `cols / block_elems` whole blocks.
#[derive(Clone)]
pub struct QuantMatrix {
    ty: BlockType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantMatrix({:?}, {}x{})", self.ty, self.rows, self.cols)
    }
}

impl QuantMatrix {
    /// Whether `ty` has a fused kernel here (the quantised block types).
    pub fn supports(ty: BlockType) -> bool {
        matches!(
            ty,
            BlockType::Q4_0
                | BlockType::Q4_1
                | BlockType::Q5_0
                | BlockType::Q8_0
                | BlockType::Q4_K
                | BlockType::Q5_K
                | BlockType::Q6_K
        )
    }

    /// `data` holds `rows` rows of `cols` elements of type `ty`.
    pub fn new(
        ty: BlockType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<QuantMatrix, KernelError> {
        let bad = |msg: String| KernelError::Shape {
            op: "quantised matrix",
            msg,
        };
        if !Self::supports(ty) {
            return Err(bad(format!("{ty:?} has no fused kernel")));
        }
        if !cols.is_multiple_of(ty.block_elems()) {
            return Err(bad(format!(
                "rows of {cols} elements are not whole {ty:?} blocks of {}",
                ty.block_elems()
            )));
        }
        let want = rows
            .checked_mul(cols / ty.block_elems() * ty.block_bytes())
            .ok_or_else(|| bad(format!("{rows}x{cols} overflows")))?;
        if data.len() != want {
            return Err(bad(format!(
                "{} bytes for {rows}x{cols} {ty:?} (expected {want})",
                data.len()
            )));
        }
        Ok(QuantMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn block_type(&self) -> BlockType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_elems() * self.ty.block_bytes()
    }

    /// The raw blocks, row-major.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Rows `r0 .. r0 + out.len() / cols` as f32 (exactly the values
    /// [`dequantize`] gives; see [`dequant_rows`]).
    pub fn dequantize_rows(&self, r0: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let n = out.len() / self.cols.max(1);
        assert_eq!(out.len(), n * self.cols, "dequantize_rows: partial row");
        dequant_rows(self.ty, &self.data[r0 * rb..(r0 + n) * rb], out);
    }

    /// The whole matrix as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_rows(0, &mut out);
        out
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` for a quantised `w` (see the module
/// documentation for the two paths).
pub fn linear_quant(x: &[f32], w: &QuantMatrix, out: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(w.rows == n && w.cols == k, "linear: w is not (n, k)");
    linear_many(x, m, k, &[WeightRef::Quant(w)], &mut [out]);
}

/// One weight (n, k) of [`linear_many`].
#[derive(Clone, Copy, Debug)]
pub enum WeightRef<'a> {
    F32(&'a [f32]),
    Quant(&'a QuantMatrix),
}

impl WeightRef<'_> {
    fn rows(&self, k: usize) -> usize {
        match self {
            WeightRef::F32(w) => w.len() / k.max(1),
            WeightRef::Quant(q) => q.rows,
        }
    }
}

/// Weight rows (output columns) per task of the gemm path: each task
/// dequantises its rows into a buffer that stays in cache, then multiplies
/// every input row by them, [`ROW_TILE`] rows per `gemm` call. Fixed sizes,
/// so results do not depend on the thread count.
pub const COLS: usize = 48;

/// Input rows per `gemm` call.
pub const ROW_TILE: usize = 256;

/// `outs[i]` (m, n_i) = x (m, k) · `ws[i]` (n_i, k)ᵀ for several weights at
/// once (one parallel region: q, k and v, or gate and up). f32 weights and
/// many rows go through the `gemm` crate in tiles of ([`ROW_TILE`] rows,
/// [`COLS`] weight rows); quantised weights with m < [`FUSED_MAX_M`]
/// through the fused kernel, with more rows dequantised per tile.
pub fn linear_many(x: &[f32], m: usize, k: usize, ws: &[WeightRef<'_>], outs: &mut [&mut [f32]]) {
    use rayon::prelude::*;
    assert_eq!(x.len(), m * k, "linear: x is not (m, k)");
    assert_eq!(ws.len(), outs.len());
    for (w, o) in ws.iter().zip(outs.iter()) {
        if let WeightRef::Quant(q) = w {
            assert_eq!(q.cols, k, "linear: w is not (n, k)");
        }
        let n = w.rows(k);
        if let WeightRef::F32(w) = w {
            assert_eq!(w.len(), n * k, "linear: w is not (n, k)");
        }
        assert_eq!(o.len(), m * n, "linear: out is not (m, n)");
    }
    if m == 0 || k == 0 {
        outs.iter_mut().for_each(|o| o.fill(0.0));
        return;
    }
    let fused = m < FUSED_MAX_M;
    // Per input row, the lane-wise sums of x over each group of 32 (for the
    // block types with an offset), made once for every weight.
    let sums: Vec<f32> = if fused
        && ws
            .iter()
            .any(|w| matches!(w, WeightRef::Quant(q) if needs_sums(q.ty)))
    {
        let mut xs = vec![0f32; m * k / 4];
        for (xr, sr) in x.chunks_exact(k).zip(xs.chunks_exact_mut(k / 4)) {
            group_sums(xr, sr);
        }
        xs
    } else {
        Vec::new()
    };
    let tasks: Vec<(usize, usize, usize)> = ws
        .iter()
        .enumerate()
        .flat_map(|(i, w)| {
            let n = w.rows(k);
            let step = match w {
                WeightRef::Quant(_) if fused => ROWS_PER_TASK,
                _ => COLS,
            };
            (0..n)
                .step_by(step)
                .map(move |r0| (i, r0, step.min(n - r0)))
        })
        .collect();
    let outs: Vec<(SendPtr, usize)> = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|(w, o)| (SendPtr(o.as_mut_ptr()), w.rows(k)))
        .collect();
    tasks.par_iter().for_each(|&(i, r0, nr)| {
        let (out, n) = (&outs[i].0, outs[i].1);
        match ws[i] {
            WeightRef::Quant(q) if fused => {
                let rb = q.row_bytes();
                let mut part = [0f32; ROWS_PER_TASK * FUSED_MAX_M];
                let part = &mut part[..nr * m];
                let rows = &q.data[r0 * rb..(r0 + nr) * rb];
                let sums = if needs_sums(q.ty) { &sums[..] } else { &[] };
                let nb = k / q.ty.block_elems();
                let read = super::ahead::DECODE.claim(nr * nb * super::ahead::BYTES_PER_BLOCK);
                fused_rows(q.ty, rows, rb, x, sums, m, k, part, read);
                for (r, p) in part.chunks_exact(m).enumerate() {
                    for (row, v) in p.iter().enumerate() {
                        // SAFETY: this task alone writes columns r0 .. r0 + nr
                        // of out (m, n).
                        unsafe { *out.0.add(row * n + r0 + r) = *v };
                    }
                }
            }
            WeightRef::Quant(q) => TILE.with(|cell| {
                let mut fresh = Vec::new();
                let mut held = cell.try_borrow_mut();
                let buf: &mut Vec<f32> = match held.as_deref_mut() {
                    Ok(v) => v,
                    Err(_) => &mut fresh,
                };
                buf.resize(nr * k, 0.0);
                let rb = q.row_bytes();
                dequant_rows(q.ty, &q.data[r0 * rb..(r0 + nr) * rb], &mut buf[..nr * k]);
                // SAFETY: as above.
                unsafe { gemm_tiles(x, m, k, &buf[..nr * k], out, n, r0, nr) };
            }),
            // SAFETY: as above.
            WeightRef::F32(w) => unsafe {
                gemm_tiles(x, m, k, &w[r0 * k..(r0 + nr) * k], out, n, r0, nr)
            },
        }
    });
}

thread_local! {
    /// The dequantised rows of a gemm-path task, kept between tasks on a thread.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A pointer handed to rayon tasks that write disjoint parts of one buffer.
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see the callers).
unsafe impl Sync for SendPtr {}

/// out[:, c0 .. c0 + nr] (out is (m, n)) = x (m, k) · w (nr, k)ᵀ, ROW_TILE
/// rows per `gemm` call.
///
/// # Safety
/// `out` holds m · n elements and no other thread touches these columns.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tiles(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    out: &SendPtr,
    n: usize,
    c0: usize,
    nr: usize,
) {
    debug_assert!(w.len() == nr * k && x.len() == m * k && c0 + nr <= n);
    for i0 in (0..m).step_by(ROW_TILE) {
        let mr = (m - i0).min(ROW_TILE);
        gemm::gemm(
            mr,
            nr,
            k,
            out.0.add(i0 * n + c0),
            1,
            n as isize,
            false,
            x.as_ptr().add(i0 * k),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

simd_fn! {
    /// `out` = the blocks `src` of `ty` as f32: exactly [`dequantize`]'s
    /// values (the same f32 operations per element), eight at a time.
    pub fn dequant_rows(ty: BlockType, src: &[u8], out: &mut [f32]) = dequant_rows_impl;
}

#[inline(always)]
fn dequant_rows_impl<S: Simd>(ty: BlockType, src: &[u8], out: &mut [f32]) {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    assert!(out.len().is_multiple_of(be) && src.len() == out.len() / be * bb);
    let m15 = S::isplat(15);
    for (b, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        let (p, y) = (b.as_ptr(), y.as_mut_ptr());
        // SAFETY: p points at one whole block (bb bytes), y at be elements.
        unsafe {
            match ty {
                BlockType::Q8_0 => {
                    let d = S::splat(f16_at::<S>(p));
                    for g in 0..4 {
                        S::store(
                            y.add(8 * g),
                            S::mul(d, S::to_f32(S::i8x8(p.add(2 + 8 * g)))),
                        );
                    }
                }
                BlockType::Q4_0 => {
                    let d = S::splat(f16_at::<S>(p));
                    let (lo, hi, eight) = (S::u8x8(p.add(2)), S::u8x8(p.add(10)), S::isplat(8));
                    let q = [
                        S::iand(lo, m15),
                        S::iand(hi, m15),
                        S::ishr(lo, 4),
                        S::ishr(hi, 4),
                    ];
                    for (g, qg) in q.iter().enumerate() {
                        S::store(y.add(8 * g), S::mul(d, S::to_f32(S::isub(*qg, eight))));
                    }
                }
                BlockType::Q4_1 => {
                    let (d, mn) = (S::splat(f16_at::<S>(p)), S::splat(f16_at::<S>(p.add(2))));
                    let (lo, hi) = (S::u8x8(p.add(4)), S::u8x8(p.add(12)));
                    let q = [
                        S::iand(lo, m15),
                        S::iand(hi, m15),
                        S::ishr(lo, 4),
                        S::ishr(hi, 4),
                    ];
                    for (g, qg) in q.iter().enumerate() {
                        S::store(y.add(8 * g), S::add(S::mul(d, S::to_f32(*qg)), mn));
                    }
                }
                BlockType::Q5_0 => {
                    let d = S::splat(f16_at::<S>(p));
                    let qh = u32::from_le_bytes([*p.add(2), *p.add(3), *p.add(4), *p.add(5)]);
                    let (lo, hi) = (S::u8x8(p.add(6)), S::u8x8(p.add(14)));
                    let (one, sixteen, iota) = (S::isplat(1), S::isplat(16), S::iota());
                    let q = [
                        S::ior(S::iand(lo, m15), bits8::<S>(qh, iota, one)),
                        S::ior(S::iand(hi, m15), bits8::<S>(qh >> 8, iota, one)),
                        S::ior(S::ishr(lo, 4), bits8::<S>(qh >> 16, iota, one)),
                        S::ior(S::ishr(hi, 4), bits8::<S>(qh >> 24, iota, one)),
                    ];
                    for (g, qg) in q.iter().enumerate() {
                        S::store(y.add(8 * g), S::mul(d, S::to_f32(S::isub(*qg, sixteen))));
                    }
                }
                BlockType::Q4_K | BlockType::Q5_K => {
                    let (d, dmin) = (f16_at::<S>(p), f16_at::<S>(p.add(2)));
                    let k5 = ty == BlockType::Q5_K;
                    let (sc, qs) = (p.add(4), p.add(if k5 { 48 } else { 16 }));
                    let one = S::isplat(1);
                    for j in 0..4 {
                        let (s1, m1) = scale_min::<S>(sc, 2 * j);
                        let (s2, m2) = scale_min::<S>(sc, 2 * j + 1);
                        let (d1, mm1) = (S::splat(d * s1), S::splat(dmin * m1));
                        let (d2, mm2) = (S::splat(d * s2), S::splat(dmin * m2));
                        for g in 0..4 {
                            let a = S::u8x8(qs.add(32 * j + 8 * g));
                            let (mut lo, mut hi) = (S::iand(a, m15), S::ishr(a, 4));
                            if k5 {
                                let h = S::u8x8(p.add(16 + 8 * g));
                                lo = S::ior(lo, bit::<S>(h, 2 * j as u32, one));
                                hi = S::ior(hi, bit::<S>(h, 2 * j as u32 + 1, one));
                            }
                            let (lo, hi) = (S::to_f32(lo), S::to_f32(hi));
                            S::store(y.add(64 * j + 8 * g), S::sub(S::mul(d1, lo), mm1));
                            S::store(y.add(64 * j + 32 + 8 * g), S::sub(S::mul(d2, hi), mm2));
                        }
                    }
                }
                BlockType::Q6_K => {
                    let (ql, qh, sc) = (p, p.add(128), p.add(192));
                    let d = f16_at::<S>(p.add(208));
                    for n in 0..2 {
                        for r in 0..4 {
                            for h in 0..2 {
                                let l0 = 16 * h;
                                let scale = S::splat(d * (*sc.add(8 * n + h + 2 * r) as i8) as f32);
                                let qlp = ql.add(64 * n + 32 * (r & 1) + l0);
                                let qhp = qh.add(32 * n + l0);
                                let ye = y.add(128 * n + 32 * r + l0);
                                S::store(ye, S::mul(scale, q6x8::<S>(qlp, qhp, r)));
                                S::store(
                                    ye.add(8),
                                    S::mul(scale, q6x8::<S>(qlp.add(8), qhp.add(8), r)),
                                );
                            }
                        }
                    }
                }
                BlockType::F32 | BlockType::F16 | BlockType::BF16 => {
                    unreachable!("QuantMatrix holds quantised types only")
                }
            }
        }
    }
}

fn needs_sums(ty: BlockType) -> bool {
    matches!(ty, BlockType::Q4_1 | BlockType::Q4_K | BlockType::Q5_K)
}

simd_fn! {
    /// Per group of 32 elements of `x`, the lane-wise sum of its four
    /// vectors, ((v0 + v1) + v2) + v3: `xs` is (k / 4,).
    fn group_sums(x: &[f32], xs: &mut [f32]) = group_sums_impl;
}

#[inline(always)]
fn group_sums_impl<S: Simd>(x: &[f32], xs: &mut [f32]) {
    assert_eq!(xs.len() * 4, x.len());
    for (g, s) in x.chunks_exact(32).zip(xs.chunks_exact_mut(8)) {
        // SAFETY: g holds 32 elements, s 8.
        unsafe {
            let v = S::add(S::load(g.as_ptr()), S::load(g.as_ptr().add(8)));
            let v = S::add(v, S::load(g.as_ptr().add(16)));
            let v = S::add(v, S::load(g.as_ptr().add(24)));
            S::store(s.as_mut_ptr(), v);
        }
    }
}

simd_fn! {
    /// `out[r·m + i]` = row r of `rows` (each `rb` bytes of `ty`) · row i of
    /// `x` (m rows of k); `xs` the group sums of x's rows (when `ty` needs
    /// them); `read` the bytes of [`ahead::DECODE`](super::ahead::DECODE)
    /// this task claimed, asked for a share per row.
    fn fused_rows(
        ty: BlockType,
        rows: &[u8],
        rb: usize,
        x: &[f32],
        xs: &[f32],
        m: usize,
        k: usize,
        out: &mut [f32],
        read: (usize, usize),
    ) = fused_rows_impl;
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fused_rows_impl<S: Simd>(
    ty: BlockType,
    rows: &[u8],
    rb: usize,
    x: &[f32],
    xs: &[f32],
    m: usize,
    k: usize,
    out: &mut [f32],
    read: (usize, usize),
) {
    let nr = rows.len() / rb;
    // Each row's share of the bytes claimed to read ahead, in whole lines.
    let per_row = (read.1 - read.0).div_ceil(nr.max(1)).next_multiple_of(64);
    assert!(rows.len() == nr * rb && out.len() == nr * m && x.len() == m * k);
    assert!(!needs_sums(ty) || xs.len() * 4 == x.len());
    let nb = k / ty.block_elems();
    assert_eq!(nb * ty.block_bytes(), rb);
    macro_rules! each {
        ($dot:ident) => {
            for r in 0..nr {
                // The weights stream from memory: ask for two rows ahead.
                let ahead = rows.as_ptr().wrapping_add((r + 2) * rb);
                for line in (0..rb).step_by(64) {
                    S::prefetch(ahead.wrapping_add(line));
                }
                let from = read.0 + r * per_row;
                super::ahead::DECODE.fetch(from, (from + per_row).min(read.1));
                for i in 0..m {
                    // SAFETY: row r has nb blocks (rb bytes); x row i has k
                    // = nb · block_elems elements and its sums k / 4.
                    out[r * m + i] = unsafe {
                        $dot::<S>(
                            rows.as_ptr().add(r * rb),
                            nb,
                            x.as_ptr().add(i * k),
                            xs.as_ptr().wrapping_add(i * k / 4),
                        )
                    };
                }
            }
        };
    }
    match ty {
        BlockType::Q4_0 => each!(dot_q4_0),
        BlockType::Q4_1 => each!(dot_q4_1),
        BlockType::Q5_0 => each!(dot_q5_0),
        BlockType::Q8_0 => each!(dot_q8_0),
        BlockType::Q4_K => each!(dot_q4_k),
        BlockType::Q5_K => each!(dot_q5_k),
        BlockType::Q6_K => each!(dot_q6_k),
        BlockType::F32 | BlockType::F16 | BlockType::BF16 => {
            unreachable!("QuantMatrix holds quantised types only")
        }
    }
}

#[inline(always)]
unsafe fn f16_at<S: Simd>(p: *const u8) -> f32 {
    S::f16(u16::from_le_bytes([*p, *p.add(1)]))
}

/// Σ_j q_j · x_j over four groups of eight: q0·x0, then fused adds in order.
#[inline(always)]
unsafe fn dot4<S: Simd>(q: [S::I; 4], x: *const f32) -> S::F {
    let mut s = S::mul(S::to_f32(q[0]), S::load(x));
    s = S::fma(S::to_f32(q[1]), S::load(x.add(8)), s);
    s = S::fma(S::to_f32(q[2]), S::load(x.add(16)), s);
    S::fma(S::to_f32(q[3]), S::load(x.add(24)), s)
}

/// Q4_0 (18 B): f16 d; u8 qs[16]; w = d·(q − 8), low nibbles first.
#[inline(always)]
unsafe fn dot_q4_0<S: Simd>(row: *const u8, nb: usize, x: *const f32, _xs: *const f32) -> f32 {
    let (m15, eight) = (S::isplat(15), S::isplat(8));
    let mut acc = S::zero();
    for b in 0..nb {
        let p = row.add(18 * b);
        let d = f16_at::<S>(p);
        let (lo, hi) = (S::u8x8(p.add(2)), S::u8x8(p.add(10)));
        let q = [
            S::isub(S::iand(lo, m15), eight),
            S::isub(S::iand(hi, m15), eight),
            S::isub(S::ishr(lo, 4), eight),
            S::isub(S::ishr(hi, 4), eight),
        ];
        acc = S::fma(S::splat(d), dot4::<S>(q, x.add(32 * b)), acc);
    }
    S::hsum(acc)
}

/// Q4_1 (20 B): f16 d, m; u8 qs[16]; w = d·q + m.
#[inline(always)]
unsafe fn dot_q4_1<S: Simd>(row: *const u8, nb: usize, x: *const f32, xs: *const f32) -> f32 {
    let m15 = S::isplat(15);
    let (mut acc, mut accm) = (S::zero(), S::zero());
    for b in 0..nb {
        let p = row.add(20 * b);
        let (d, mn) = (f16_at::<S>(p), f16_at::<S>(p.add(2)));
        let (lo, hi) = (S::u8x8(p.add(4)), S::u8x8(p.add(12)));
        let q = [
            S::iand(lo, m15),
            S::iand(hi, m15),
            S::ishr(lo, 4),
            S::ishr(hi, 4),
        ];
        acc = S::fma(S::splat(d), dot4::<S>(q, x.add(32 * b)), acc);
        accm = S::fma(S::splat(mn), S::load(xs.add(8 * b)), accm);
    }
    S::hsum(S::add(acc, accm))
}

/// Q5_0 (22 B): f16 d; u32 qh; u8 qs[16]; w = d·(q5 − 16), the fifth bit of
/// element i in bit i of qh.
#[inline(always)]
unsafe fn dot_q5_0<S: Simd>(row: *const u8, nb: usize, x: *const f32, _xs: *const f32) -> f32 {
    let (m15, one, sixteen, iota) = (S::isplat(15), S::isplat(1), S::isplat(16), S::iota());
    let mut acc = S::zero();
    for b in 0..nb {
        let p = row.add(22 * b);
        let d = f16_at::<S>(p);
        let qh = u32::from_le_bytes([*p.add(2), *p.add(3), *p.add(4), *p.add(5)]);
        let (lo, hi) = (S::u8x8(p.add(6)), S::u8x8(p.add(14)));
        let q = [
            S::isub(S::ior(S::iand(lo, m15), bits8::<S>(qh, iota, one)), sixteen),
            S::isub(
                S::ior(S::iand(hi, m15), bits8::<S>(qh >> 8, iota, one)),
                sixteen,
            ),
            S::isub(
                S::ior(S::ishr(lo, 4), bits8::<S>(qh >> 16, iota, one)),
                sixteen,
            ),
            S::isub(
                S::ior(S::ishr(hi, 4), bits8::<S>(qh >> 24, iota, one)),
                sixteen,
            ),
        ];
        acc = S::fma(S::splat(d), dot4::<S>(q, x.add(32 * b)), acc);
    }
    S::hsum(acc)
}

/// The low 8 bits of `bits`, one per lane (lane i: bit i), as 16 or 0.
#[inline(always)]
fn bits8<S: Simd>(bits: u32, iota: S::I, one: S::I) -> S::I {
    S::ishl(S::iand(S::ishrv(S::isplat(bits as i32), iota), one), 4)
}

/// Q8_0 (34 B): f16 d; i8 qs[32]; w = d·q.
#[inline(always)]
unsafe fn dot_q8_0<S: Simd>(row: *const u8, nb: usize, x: *const f32, _xs: *const f32) -> f32 {
    let mut acc = S::zero();
    for b in 0..nb {
        let p = row.add(34 * b);
        let d = f16_at::<S>(p);
        let q = [
            S::i8x8(p.add(2)),
            S::i8x8(p.add(10)),
            S::i8x8(p.add(18)),
            S::i8x8(p.add(26)),
        ];
        acc = S::fma(S::splat(d), dot4::<S>(q, x.add(32 * b)), acc);
    }
    S::hsum(acc)
}

/// The j-th 6-bit (scale, min) pair of a K-quant super-block (as in
/// `dequant.rs`).
#[inline(always)]
unsafe fn scale_min<S: Simd>(q: *const u8, j: usize) -> (f32, f32) {
    let b = |i: usize| *q.add(i);
    let (sc, m) = if j < 4 {
        (b(j) & 63, b(j + 4) & 63)
    } else {
        (
            (b(j + 4) & 15) | ((b(j - 4) >> 6) << 4),
            (b(j + 4) >> 4) | ((b(j) >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

/// Q4_K (144 B / 256): f16 d, dmin; u8 scales[12]; u8 qs[128]; sub-block s
/// of 32: w = (d·sc_s)·q − dmin·m_s; qs[32j ..] holds sub-blocks 2j (low
/// nibbles) and 2j + 1 (high).
///
/// Q5_K (176 B / 256): as Q4_K with u8 qh[32] before qs: the fifth bit of
/// element l of sub-block 2j is bit 2j of qh[l], of sub-block 2j + 1 bit 2j + 1.
/// One kernel for both (`K5`: Q5_K), so the two share one summation order.
#[inline(always)]
unsafe fn dot_q45_k<S: Simd, const K5: bool>(
    row: *const u8,
    nb: usize,
    x: *const f32,
    xs: *const f32,
) -> f32 {
    let (m15, one) = (S::isplat(15), S::isplat(1));
    let (block, qs_at) = if K5 { (176, 48) } else { (144, 16) };
    let (mut acc, mut accm) = (S::zero(), S::zero());
    for b in 0..nb {
        let p = row.add(block * b);
        let (d, dmin) = (f16_at::<S>(p), f16_at::<S>(p.add(2)));
        let (sc, qh, qs) = (p.add(4), p.add(16), p.add(qs_at));
        let h = if K5 {
            [
                S::u8x8(qh),
                S::u8x8(qh.add(8)),
                S::u8x8(qh.add(16)),
                S::u8x8(qh.add(24)),
            ]
        } else {
            [S::isplat(0); 4]
        };
        // the fifth bit (Q5_K) of sub-block 2j + r, r = 0, 1
        let fifth = |v: S::I, hv: S::I, s: usize| {
            if K5 {
                S::ior(v, bit::<S>(hv, s as u32, one))
            } else {
                v
            }
        };
        for j in 0..4 {
            let (s1, m1) = scale_min::<S>(sc, 2 * j);
            let (s2, m2) = scale_min::<S>(sc, 2 * j + 1);
            let q = qs.add(32 * j);
            let a = [
                S::u8x8(q),
                S::u8x8(q.add(8)),
                S::u8x8(q.add(16)),
                S::u8x8(q.add(24)),
            ];
            let g = 8 * b + 2 * j; // group of 32 within the row
            let lo: [S::I; 4] = std::array::from_fn(|i| fifth(S::iand(a[i], m15), h[i], 2 * j));
            acc = S::fma(S::splat(d * s1), dot4::<S>(lo, x.add(32 * g)), acc);
            accm = S::fma(S::splat(-(dmin * m1)), S::load(xs.add(8 * g)), accm);
            let hi: [S::I; 4] = std::array::from_fn(|i| fifth(S::ishr(a[i], 4), h[i], 2 * j + 1));
            acc = S::fma(S::splat(d * s2), dot4::<S>(hi, x.add(32 * g + 32)), acc);
            accm = S::fma(S::splat(-(dmin * m2)), S::load(xs.add(8 * g + 8)), accm);
        }
    }
    S::hsum(S::add(acc, accm))
}

#[inline(always)]
unsafe fn dot_q4_k<S: Simd>(row: *const u8, nb: usize, x: *const f32, xs: *const f32) -> f32 {
    dot_q45_k::<S, false>(row, nb, x, xs)
}

#[inline(always)]
unsafe fn dot_q5_k<S: Simd>(row: *const u8, nb: usize, x: *const f32, xs: *const f32) -> f32 {
    dot_q45_k::<S, true>(row, nb, x, xs)
}

/// Bit `s` of each lane, as 16 or 0.
#[inline(always)]
fn bit<S: Simd>(v: S::I, s: u32, one: S::I) -> S::I {
    S::ishl(S::iand(S::ishr(v, s), one), 4)
}

/// Eight 6-bit Q6_K quants minus 32, as f32: the low (`r < 2`) or high
/// nibbles of ql[0..8] with bits 2r, 2r + 1 of qh[0..8] above them.
#[inline(always)]
unsafe fn q6x8<S: Simd>(ql: *const u8, qh: *const u8, r: usize) -> S::F {
    let lb = S::u8x8(ql);
    let nib = if r < 2 {
        S::iand(lb, S::isplat(15))
    } else {
        S::ishr(lb, 4)
    };
    let hb = S::iand(S::ishr(S::u8x8(qh), 2 * r as u32), S::isplat(3));
    S::to_f32(S::isub(S::ior(nib, S::ishl(hb, 4)), S::isplat(32)))
}

/// Q6_K (210 B / 256): u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d. In half
/// n, quarter r, lanes l of 32: q = (nibble of ql[64n + 32(r & 1) + l], low
/// for r < 2) | ((qh[32n + l] >> 2r) & 3) << 4, w = (d·sc)·(q − 32), one
/// scale per 16 lanes (sc[8n + l / 16 + 2r]).
#[inline(always)]
unsafe fn dot_q6_k<S: Simd>(row: *const u8, nb: usize, x: *const f32, _xs: *const f32) -> f32 {
    let mut acc = S::zero();
    for b in 0..nb {
        let p = row.add(210 * b);
        let (ql, qh, sc) = (p, p.add(128), p.add(192));
        let d = f16_at::<S>(p.add(208));
        for n in 0..2 {
            for r in 0..4 {
                for h in 0..2 {
                    let l0 = 16 * h;
                    let scale = d * (*sc.add(8 * n + h + 2 * r) as i8) as f32;
                    let qlp = ql.add(64 * n + 32 * (r & 1) + l0);
                    let qhp = qh.add(32 * n + l0);
                    let xe = x.add(256 * b + 128 * n + 32 * r + l0);
                    let s = S::mul(q6x8::<S>(qlp, qhp, r), S::load(xe));
                    let s = S::fma(q6x8::<S>(qlp.add(8), qhp.add(8), r), S::load(xe.add(8)), s);
                    acc = S::fma(S::splat(scale), s, acc);
                }
            }
        }
    }
    S::hsum(acc)
}

/// Rows `ids` of a quantised (vocab, dim) table into `out` (ids.len(), dim),
/// dequantised exactly as [`dequantize`] does.
pub fn embedding_quant(table: &QuantMatrix, ids: &[u32], out: &mut [f32]) {
    let dim = table.cols;
    assert_eq!(
        out.len(),
        ids.len() * dim,
        "embedding: out is not (ids, dim)"
    );
    for (o, &id) in out.chunks_exact_mut(dim).zip(ids) {
        assert!(
            (id as usize) < table.rows,
            "embedding: id {id} is outside the table"
        );
        table.dequantize_rows(id as usize, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::Portable;

    /// Deterministic pseudo-random bytes.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// Random blocks of `ty` whose f16 fields are finite and modest.
    fn random_matrix(ty: BlockType, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
        let nb = rows * cols / ty.block_elems();
        let bb = ty.block_bytes();
        let mut data = bytes(nb * bb, seed);
        let f16s: &[usize] = match ty {
            BlockType::Q4_0 | BlockType::Q5_0 | BlockType::Q8_0 => &[0],
            BlockType::Q4_1 | BlockType::Q4_K | BlockType::Q5_K => &[0, 2],
            BlockType::Q6_K => &[208],
            _ => &[],
        };
        for b in 0..nb {
            for (j, &off) in f16s.iter().enumerate() {
                let v = ((b * 7 + j * 3) % 23) as f32 / 64.0 - 0.15;
                let h = half::f16::from_f32(v).to_le_bytes();
                data[b * bb + off..b * bb + off + 2].copy_from_slice(&h);
            }
        }
        QuantMatrix::new(ty, rows, cols, data).unwrap()
    }

    fn xs(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    const TYPES: [BlockType; 7] = [
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q8_0,
        BlockType::Q4_K,
        BlockType::Q5_K,
        BlockType::Q6_K,
    ];

    /// x · dequantise(w)ᵀ in f64: the fused kernel differs from it only by
    /// f32 rounding (k terms: well within 1e-5 relative to Σ|w·x|).
    #[test]
    fn fused_matches_f64_product_of_the_dequantised_weights() {
        for ty in TYPES {
            let (m, k, n) = (3, 512, 70);
            let w = random_matrix(ty, n, k, ty.block_bytes() as u64);
            let wf = w.to_f32();
            let x = xs(m * k, 5);
            let mut out = vec![0f32; m * n];
            linear_quant(&x, &w, &mut out, m, k, n);
            for i in 0..m {
                for r in 0..n {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for t in 0..k {
                        let p = x[i * k + t] as f64 * wf[r * k + t] as f64;
                        want += p;
                        mag += p.abs();
                    }
                    let got = out[i * n + r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * mag + 1e-30,
                        "{ty:?} row {r} x {i}: {got} vs {want} (|terms| {mag})"
                    );
                }
            }
        }
    }

    /// The AVX2 lanes and the portable lanes give the same bits; a row's
    /// result does not depend on m or on the thread count.
    #[test]
    fn fused_is_bit_identical_across_lanes_m_and_threads() {
        for ty in TYPES {
            let (k, n) = (512, 100);
            let w = random_matrix(ty, n, k, 11 + ty.block_bytes() as u64);
            let x = xs(5 * k, 9);
            let run = |m: usize, threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut out = vec![0f32; m * n];
                pool.install(|| linear_quant(&x[..m * k], &w, &mut out, m, k, n));
                out
            };
            let one = run(1, 1);
            assert_eq!(one, run(1, 3), "{ty:?} threads");
            let five = run(5, 2);
            assert_eq!(&five[..n], &one[..], "{ty:?}: row 0 alone vs with 4 others");
            // portable lanes, row by row
            let mut sums = vec![0f32; k / 4];
            group_sums_impl::<Portable>(&x[..k], &mut sums);
            let mut port = vec![0f32; n];
            fused_rows_impl::<Portable>(
                ty,
                w.data(),
                w.row_bytes(),
                &x[..k],
                if needs_sums(ty) { &sums } else { &[] },
                1,
                k,
                &mut port,
                (0, 0),
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&port), bits(&one), "{ty:?}: portable vs best lanes");
            // Reading ahead (here x itself) asks for memory, changes nothing.
            super::super::ahead::DECODE.set(&[&x]);
            assert_eq!(bits(&run(1, 2)), bits(&one), "{ty:?}: reading ahead");
            super::super::ahead::DECODE.clear();
        }
    }

    /// Many rows: dequantise then gemm, bit-identical to `linear` on the f32
    /// weights, whatever the thread count; the SIMD dequantiser gives
    /// `dequantize`'s values.
    #[test]
    fn gemm_path_equals_linear_on_the_f32_weights() {
        for ty in TYPES {
            let w = random_matrix(ty, 20, 512, 21);
            let mut want = vec![0f32; 20 * 512];
            dequantize(ty, w.data(), &mut want).unwrap();
            assert_eq!(w.to_f32(), want, "{ty:?} dequantised");
            let mut port = vec![0f32; 20 * 512];
            dequant_rows_impl::<Portable>(ty, w.data(), &mut port);
            assert_eq!(port, want, "{ty:?} dequantised (portable)");
        }
        for (ty, n) in [(BlockType::Q4_1, 300), (BlockType::Q8_0, 1000)] {
            let (m, k) = (9, 64);
            let w = random_matrix(ty, n, k, 3);
            let x = xs(m * k, 4);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut got = vec![0f32; m * n];
                pool.install(|| linear_quant(&x, &w, &mut got, m, k, n));
                got
            };
            let mut want = vec![0f32; m * n];
            crate::cpu::linear(&x, &w.to_f32(), &mut want, m, k, n);
            assert_eq!(run(1), want, "{ty:?} n={n}");
            assert_eq!(run(3), want, "{ty:?} n={n}");
        }
    }

    #[test]
    fn embedding_rows_equal_the_dequantised_table() {
        let t = random_matrix(BlockType::Q8_0, 10, 64, 8);
        let full = t.to_f32();
        let mut out = vec![0f32; 2 * 64];
        embedding_quant(&t, &[7, 2], &mut out);
        assert_eq!(&out[..64], &full[7 * 64..8 * 64]);
        assert_eq!(&out[64..], &full[2 * 64..3 * 64]);
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(QuantMatrix::new(BlockType::Q4_1, 2, 32, vec![0; 39]).is_err());
        assert!(QuantMatrix::new(BlockType::Q4_1, 2, 48, vec![0; 60]).is_err());
        assert!(QuantMatrix::new(BlockType::F32, 1, 1, vec![0; 4]).is_err());
        assert!(QuantMatrix::new(BlockType::Q4_1, 2, 32, vec![0; 40]).is_ok());
    }
}
