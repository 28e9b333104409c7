//! Eight f32 lanes, written once and run two ways with identical results.
//!
//! Capture's hot kernels (the fused dequantise-and-dot products in
//! `qlinear.rs`, the softmax in `attention.rs`) are generic over [`Simd`]:
//! [`Avx2`] (x86-64 with AVX2, FMA and F16C, detected at run time) and
//! [`Portable`] (plain Rust on `[f32; 8]`). Every operation of the trait is
//! exact or a single IEEE rounding (`fma` is fused in both: `f32::mul_add`),
//! and the horizontal reductions add lanes in one fixed tree, so a kernel
//! gives the same bits on either implementation: machines without AVX2 get
//! the same captures, only slower. Tests compare the two bit for bit.

#![allow(clippy::missing_safety_doc)]

/// Eight f32 lanes (`F`), eight i32 lanes (`I`) and four f64 lanes (`D`).
///
/// Loads and stores take raw pointers to 8 elements (unaligned); callers
/// guarantee they are in bounds.
pub trait Simd: Copy + Send + Sync + 'static {
    type F: Copy;
    type I: Copy;
    type D: Copy;

    fn zero() -> Self::F;
    fn splat(x: f32) -> Self::F;
    unsafe fn load(p: *const f32) -> Self::F;
    unsafe fn store(p: *mut f32, v: Self::F);
    fn add(a: Self::F, b: Self::F) -> Self::F;
    fn sub(a: Self::F, b: Self::F) -> Self::F;
    fn mul(a: Self::F, b: Self::F) -> Self::F;
    fn div(a: Self::F, b: Self::F) -> Self::F;
    /// a·b + c with one rounding.
    fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Lane-wise maximum (`b` where either is NaN, as `maxps` does).
    fn max(a: Self::F, b: Self::F) -> Self::F;
    /// Lane-wise minimum (`b` where either is NaN, as `minps` does).
    fn min(a: Self::F, b: Self::F) -> Self::F;
    /// `a >= b ? x : y` per lane (false where either is NaN).
    fn select_ge(a: Self::F, b: Self::F, x: Self::F, y: Self::F) -> Self::F;
    /// Round to the nearest integer, ties to even.
    fn round(a: Self::F) -> Self::F;
    /// 2^n for lanes holding integers n in [-126, 127].
    fn pow2(n: Self::F) -> Self::F;
    /// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
    fn hsum(a: Self::F) -> f32;
    /// The largest lane, by a tree of `max` (so with `maxps`'s NaN rule).
    fn hmax(a: Self::F) -> f32;

    /// The 8x8 transpose: lane l of result t is lane t of `r[l]`.
    fn transpose8(r: [Self::F; 8]) -> [Self::F; 8];

    /// The 8 bytes at `p`, zero-extended.
    unsafe fn u8x8(p: *const u8) -> Self::I;
    /// The 8 bytes at `p` as i8, sign-extended.
    unsafe fn i8x8(p: *const u8) -> Self::I;
    fn isplat(x: i32) -> Self::I;
    /// [0, 1, ..., 7].
    fn iota() -> Self::I;
    fn iand(a: Self::I, b: Self::I) -> Self::I;
    fn ior(a: Self::I, b: Self::I) -> Self::I;
    fn isub(a: Self::I, b: Self::I) -> Self::I;
    /// Logical right shift of every lane by `n` (< 32).
    fn ishr(a: Self::I, n: u32) -> Self::I;
    /// Left shift of every lane by `n` (< 32).
    fn ishl(a: Self::I, n: u32) -> Self::I;
    /// Logical right shift of each lane by the matching lane of `n` (< 32).
    fn ishrv(a: Self::I, n: Self::I) -> Self::I;
    /// Exact conversion (lanes are small integers here).
    fn to_f32(a: Self::I) -> Self::F;

    /// An f16 bit pattern as f32 (exact).
    fn f16(bits: u16) -> f32;

    /// A hint to fetch the cache line holding `p` (no effect on results;
    /// `p` need not be valid).
    fn prefetch(p: *const u8);

    fn dzero() -> Self::D;
    /// (lo + lanes 0..4 as f64, hi + lanes 4..8 as f64).
    fn dacc(acc: (Self::D, Self::D), v: Self::F) -> (Self::D, Self::D);
    /// (lo + (lanes 0..4 as f64)², hi + (lanes 4..8 as f64)²).
    fn dacc_sq(acc: (Self::D, Self::D), v: Self::F) -> (Self::D, Self::D);
    /// ((lo0 + hi0) + (lo2 + hi2)) + ((lo1 + hi1) + (lo3 + hi3)).
    fn dsum(acc: (Self::D, Self::D)) -> f64;
}

/// Plain Rust lanes: the reference every other implementation must match.
#[derive(Clone, Copy)]
pub struct Portable;

#[inline(always)]
fn map(a: [f32; 8], f: impl Fn(f32) -> f32) -> [f32; 8] {
    core::array::from_fn(|i| f(a[i]))
}

#[inline(always)]
fn zip(a: [f32; 8], b: [f32; 8], f: impl Fn(f32, f32) -> f32) -> [f32; 8] {
    core::array::from_fn(|i| f(a[i], b[i]))
}

#[inline(always)]
fn izip(a: [i32; 8], b: [i32; 8], f: impl Fn(i32, i32) -> i32) -> [i32; 8] {
    core::array::from_fn(|i| f(a[i], b[i]))
}

/// `maxps`/`minps` semantics: the second operand when either is NaN.
#[inline(always)]
fn max_ps(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

#[inline(always)]
fn min_ps(a: f32, b: f32) -> f32 {
    if a < b {
        a
    } else {
        b
    }
}

impl Simd for Portable {
    type F = [f32; 8];
    type I = [i32; 8];
    type D = [f64; 4];

    #[inline(always)]
    fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    fn splat(x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        p.cast::<[f32; 8]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        p.cast::<[f32; 8]>().write_unaligned(v)
    }
    #[inline(always)]
    fn add(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn mul(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn div(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        zip(a, b, |x, y| x / y)
    }
    #[inline(always)]
    fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    fn max(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        zip(a, b, max_ps)
    }
    #[inline(always)]
    fn min(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        zip(a, b, min_ps)
    }
    #[inline(always)]
    fn select_ge(a: [f32; 8], b: [f32; 8], x: [f32; 8], y: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| if a[i] >= b[i] { x[i] } else { y[i] })
    }
    #[inline(always)]
    fn round(a: [f32; 8]) -> [f32; 8] {
        map(a, f32::round_ties_even)
    }
    #[inline(always)]
    fn pow2(n: [f32; 8]) -> [f32; 8] {
        map(n, |n| f32::from_bits(((n as i32 + 127) as u32) << 23))
    }
    #[inline(always)]
    fn hsum(a: [f32; 8]) -> f32 {
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
    #[inline(always)]
    fn hmax(a: [f32; 8]) -> f32 {
        // The same tree as the AVX2 version, with maxps's NaN rule.
        let h: [f32; 4] = core::array::from_fn(|i| max_ps(a[i], a[i + 4]));
        let q = [max_ps(h[0], h[2]), max_ps(h[1], h[3])];
        max_ps(q[0], q[1])
    }
    #[inline(always)]
    fn transpose8(r: [[f32; 8]; 8]) -> [[f32; 8]; 8] {
        core::array::from_fn(|t| core::array::from_fn(|l| r[l][t]))
    }
    #[inline(always)]
    unsafe fn u8x8(p: *const u8) -> [i32; 8] {
        let b = p.cast::<[u8; 8]>().read_unaligned();
        core::array::from_fn(|i| b[i] as i32)
    }
    #[inline(always)]
    unsafe fn i8x8(p: *const u8) -> [i32; 8] {
        let b = p.cast::<[u8; 8]>().read_unaligned();
        core::array::from_fn(|i| b[i] as i8 as i32)
    }
    #[inline(always)]
    fn isplat(x: i32) -> [i32; 8] {
        [x; 8]
    }
    #[inline(always)]
    fn iota() -> [i32; 8] {
        core::array::from_fn(|i| i as i32)
    }
    #[inline(always)]
    fn iand(a: [i32; 8], b: [i32; 8]) -> [i32; 8] {
        izip(a, b, |x, y| x & y)
    }
    #[inline(always)]
    fn ior(a: [i32; 8], b: [i32; 8]) -> [i32; 8] {
        izip(a, b, |x, y| x | y)
    }
    #[inline(always)]
    fn isub(a: [i32; 8], b: [i32; 8]) -> [i32; 8] {
        izip(a, b, |x, y| x.wrapping_sub(y))
    }
    #[inline(always)]
    fn ishr(a: [i32; 8], n: u32) -> [i32; 8] {
        a.map(|x| ((x as u32) >> n) as i32)
    }
    #[inline(always)]
    fn ishl(a: [i32; 8], n: u32) -> [i32; 8] {
        a.map(|x| ((x as u32) << n) as i32)
    }
    #[inline(always)]
    fn ishrv(a: [i32; 8], n: [i32; 8]) -> [i32; 8] {
        izip(a, n, |x, s| ((x as u32) >> s) as i32)
    }
    #[inline(always)]
    fn to_f32(a: [i32; 8]) -> [f32; 8] {
        a.map(|x| x as f32)
    }
    #[inline(always)]
    fn f16(bits: u16) -> f32 {
        half::f16::from_bits(bits).to_f32()
    }
    #[inline(always)]
    fn prefetch(_: *const u8) {}
    #[inline(always)]
    fn dzero() -> [f64; 4] {
        [0.0; 4]
    }
    #[inline(always)]
    fn dacc(acc: ([f64; 4], [f64; 4]), v: [f32; 8]) -> ([f64; 4], [f64; 4]) {
        (
            core::array::from_fn(|i| acc.0[i] + v[i] as f64),
            core::array::from_fn(|i| acc.1[i] + v[i + 4] as f64),
        )
    }
    #[inline(always)]
    fn dacc_sq(acc: ([f64; 4], [f64; 4]), v: [f32; 8]) -> ([f64; 4], [f64; 4]) {
        (
            core::array::from_fn(|i| acc.0[i] + v[i] as f64 * v[i] as f64),
            core::array::from_fn(|i| acc.1[i] + v[i + 4] as f64 * v[i + 4] as f64),
        )
    }
    #[inline(always)]
    fn dsum(acc: ([f64; 4], [f64; 4])) -> f64 {
        let s: [f64; 4] = core::array::from_fn(|i| acc.0[i] + acc.1[i]);
        (s[0] + s[2]) + (s[1] + s[3])
    }
}

#[cfg(target_arch = "x86_64")]
pub use avx2::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::cpu::simd::Simd;
    use core::arch::x86_64::*;

    /// AVX2 + FMA + F16C lanes. Only reached through `simd_fn!`
    /// and functions compiled with those features, after detection.
    #[derive(Clone, Copy)]
    pub struct Avx2;

    // SAFETY (every method): callers run only where AVX2, FMA and F16C were
    // detected (`super::has_avx2`), inside `#[target_feature]` functions into
    // which these `#[inline(always)]` bodies are inlined; pointer arguments
    // are in bounds for 8 elements, as the trait documents.
    impl Simd for Avx2 {
        type F = __m256;
        type I = __m256i;
        type D = __m256d;

        #[inline(always)]
        fn zero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        fn splat(x: f32) -> __m256 {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        fn sub(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_sub_ps(a, b) }
        }
        #[inline(always)]
        fn mul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        fn div(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_div_ps(a, b) }
        }
        #[inline(always)]
        fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn max(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_max_ps(a, b) }
        }
        #[inline(always)]
        fn min(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_min_ps(a, b) }
        }
        #[inline(always)]
        fn select_ge(a: __m256, b: __m256, x: __m256, y: __m256) -> __m256 {
            unsafe { _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_GE_OQ>(a, b)) }
        }
        #[inline(always)]
        fn round(a: __m256) -> __m256 {
            unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
        }
        #[inline(always)]
        fn pow2(n: __m256) -> __m256 {
            unsafe {
                let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
            }
        }
        #[inline(always)]
        fn hsum(a: __m256) -> f32 {
            unsafe {
                // [l0+l4, l1+l5, l2+l6, l3+l7]
                let h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                // [(l0+l4)+(l2+l6), (l1+l5)+(l3+l7), ..]
                let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
                _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)))
            }
        }
        #[inline(always)]
        fn hmax(a: __m256) -> f32 {
            unsafe {
                let h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                let q = _mm_max_ps(h, _mm_movehl_ps(h, h));
                _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)))
            }
        }
        #[inline(always)]
        fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
            unsafe {
                let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                let t4 = _mm256_unpacklo_ps(r[4], r[5]);
                let t5 = _mm256_unpackhi_ps(r[4], r[5]);
                let t6 = _mm256_unpacklo_ps(r[6], r[7]);
                let t7 = _mm256_unpackhi_ps(r[6], r[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ]
            }
        }
        #[inline(always)]
        unsafe fn u8x8(p: *const u8) -> __m256i {
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
        }
        #[inline(always)]
        unsafe fn i8x8(p: *const u8) -> __m256i {
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))
        }
        #[inline(always)]
        fn isplat(x: i32) -> __m256i {
            unsafe { _mm256_set1_epi32(x) }
        }
        #[inline(always)]
        fn iota() -> __m256i {
            unsafe { _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7) }
        }
        #[inline(always)]
        fn iand(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_and_si256(a, b) }
        }
        #[inline(always)]
        fn ior(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_or_si256(a, b) }
        }
        #[inline(always)]
        fn isub(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_sub_epi32(a, b) }
        }
        #[inline(always)]
        fn ishr(a: __m256i, n: u32) -> __m256i {
            unsafe { _mm256_srl_epi32(a, _mm_cvtsi32_si128(n as i32)) }
        }
        #[inline(always)]
        fn ishl(a: __m256i, n: u32) -> __m256i {
            unsafe { _mm256_sll_epi32(a, _mm_cvtsi32_si128(n as i32)) }
        }
        #[inline(always)]
        fn ishrv(a: __m256i, n: __m256i) -> __m256i {
            unsafe { _mm256_srlv_epi32(a, n) }
        }
        #[inline(always)]
        fn to_f32(a: __m256i) -> __m256 {
            unsafe { _mm256_cvtepi32_ps(a) }
        }
        #[inline(always)]
        fn f16(bits: u16) -> f32 {
            unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
        }
        #[inline(always)]
        fn prefetch(p: *const u8) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
        #[inline(always)]
        fn dzero() -> __m256d {
            unsafe { _mm256_setzero_pd() }
        }
        #[inline(always)]
        fn dacc(acc: (__m256d, __m256d), v: __m256) -> (__m256d, __m256d) {
            unsafe {
                (
                    _mm256_add_pd(acc.0, _mm256_cvtps_pd(_mm256_castps256_ps128(v))),
                    _mm256_add_pd(acc.1, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v))),
                )
            }
        }
        #[inline(always)]
        fn dacc_sq(acc: (__m256d, __m256d), v: __m256) -> (__m256d, __m256d) {
            unsafe {
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
                (
                    _mm256_add_pd(acc.0, _mm256_mul_pd(lo, lo)),
                    _mm256_add_pd(acc.1, _mm256_mul_pd(hi, hi)),
                )
            }
        }
        #[inline(always)]
        fn dsum(acc: (__m256d, __m256d)) -> f64 {
            unsafe {
                let s = _mm256_add_pd(acc.0, acc.1);
                // [s0+s2, s1+s3]
                let h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd::<1>(s));
                _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)))
            }
        }
    }
}

/// Whether this CPU runs the [`Avx2`] lanes (AVX2, FMA and F16C), detected once.
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::env::var_os("KVREPLAY_NO_SIMD").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(args) -> R` that runs `$imp::<Avx2>` inside a function
/// compiled for AVX2/FMA/F16C when the CPU has them, else
/// `$imp::<Portable>`; both give the same bits. `$imp` must be
/// `#[inline(always)]` so that its body (and the lane methods) are compiled
/// with the features.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident ($($a:ident : $t:ty),* $(,)?) $(-> $r:ty)? = $imp:ident;) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                if $crate::cpu::simd::has_avx2() {
                    #[target_feature(enable = "avx2,fma,f16c")]
                    #[allow(clippy::too_many_arguments)]
                    unsafe fn avx2($($a: $t),*) $(-> $r)? {
                        $imp::<$crate::cpu::simd::Avx2>($($a),*)
                    }
                    // SAFETY: the features were detected at run time.
                    return unsafe { avx2($($a),*) };
                }
            }
            $imp::<$crate::cpu::simd::Portable>($($a),*)
        }
    };
}
pub(crate) use simd_fn;

/// e^x in f32 lanes, for the softmax (x <= 0 there; any x is handled).
///
/// Cody-Waite reduction x = n·ln2 + r with |r| <= ln2/2 (ln2 split in two,
/// each step one fused multiply-add), Cephes' degree-7 polynomial for e^r
/// evaluated with FMAs, then scaled by 2^n. Results that would be subnormal
/// (x < -87.336548, e^x < 2^-126) are flushed to 0 and x > 88.376259 gives
/// +inf; NaN gives NaN. Against the correctly rounded e^x, measured over
/// every f32 in [-87.336548, 88.37626]: at most 1.0104 ulp (at x =
/// -5.8778844; `exp_error_over_every_f32`). glibc's expf, which the scalar
/// code used before, is within 0.502 ulp.
#[inline(always)]
pub fn exp<S: Simd>(x: S::F) -> S::F {
    const LO: f32 = -87.33655; // ln(2^-126) (f32): below, e^x is subnormal
    const HI: f32 = 88.376_26; // n stays <= 127
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 0x3f318000: exact in 9 bits
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = S::min(S::max(x, S::splat(LO)), S::splat(HI));
    let n = S::round(S::mul(xc, S::splat(LOG2E)));
    let r = S::fma(n, S::splat(-LN2_HI), xc);
    let r = S::fma(n, S::splat(-LN2_LO), r);
    // e^r = 1 + r + r²·P(r), Cephes expf's P.
    let mut p = S::splat(1.987_569_1e-4);
    p = S::fma(p, r, S::splat(1.398_199_9e-3));
    p = S::fma(p, r, S::splat(8.333_452e-3));
    p = S::fma(p, r, S::splat(4.166_579_6e-2));
    p = S::fma(p, r, S::splat(1.666_666_5e-1));
    p = S::fma(p, r, S::splat(0.5)); // Cephes: 5.0000001201e-1, 0.5 in f32
                                     // 1 + (r + r²·P): the one rounding of the final add dominates the error.
    let r2 = S::mul(r, r);
    let e = S::add(S::fma(p, r2, r), S::splat(1.0));
    let y = S::mul(e, S::pow2(n));
    // x < LO (and -inf): 0; x > HI (and +inf): inf; NaN: the NaN itself.
    let y = S::select_ge(x, S::splat(LO), y, S::zero());
    let y = S::select_ge(S::splat(HI), x, y, S::splat(f32::INFINITY));
    // NaN fails both >= tests above (giving inf); put it back.
    S::select_ge(x, x, y, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes<S: Simd>(f: impl Fn(S::F) -> S::F, x: [f32; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        unsafe { S::store(out.as_mut_ptr(), f(S::load(x.as_ptr()))) };
        out
    }

    /// The largest error of [`exp`] in ulps, measured over every f32 in
    /// its normal range by `exp_error_over_every_f32`.
    const EXP_ULPS: f64 = 1.02;

    fn exp_portable(x: [f32; 8]) -> [f32; 8] {
        lanes::<Portable>(exp::<Portable>, x)
    }

    #[inline(always)]
    fn exp_lanes<S: Simd>(x: [f32; 8]) -> [f32; 8] {
        lanes::<S>(exp::<S>, x)
    }

    simd_fn! {
        fn exp_avx2(x: [f32; 8]) -> [f32; 8] = exp_lanes;
    }

    /// ulps between a and the correctly rounded b.
    fn ulps(a: f32, b: f64) -> f64 {
        let r = b as f32;
        let ulp = (f32::from_bits(r.to_bits() + 1) - r) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn exp_special_values() {
        let x = [
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            -87.0,
            -88.0,
            88.0,
            89.0,
        ];
        let y = exp_portable(x);
        assert_eq!(y[0], 1.0);
        assert_eq!(y[1], 1.0);
        assert_eq!(y[2], 0.0);
        assert_eq!(y[3], f32::INFINITY);
        assert!(y[4] > 0.0 && ulps(y[4], (-87f64).exp()) <= 1.0);
        assert_eq!(y[5], 0.0, "subnormal results flush to 0");
        assert!(ulps(y[6], 88f64.exp()) <= 1.0);
        assert_eq!(y[7], f32::INFINITY);
        assert!(exp_portable([f32::NAN; 8])[0].is_nan());
    }

    /// Every 61st f32 in the softmax's range [-87.33, 0] and a stride over
    /// the rest: within [`EXP_ULPS`] of e^x, and the AVX2 lanes equal the
    /// portable ones bit for bit.
    #[test]
    fn exp_is_accurate_and_identical_on_both_lanes() {
        let mut worst = 0f64;
        let mut check = |xs: [f32; 8]| {
            let p = exp_portable(xs);
            assert_eq!(
                p.map(f32::to_bits),
                exp_avx2(xs).map(f32::to_bits),
                "{xs:?}"
            );
            for (x, y) in xs.iter().zip(p) {
                let e = ulps(y, (*x as f64).exp());
                worst = worst.max(e);
                assert!(e <= EXP_ULPS, "exp({x}) = {y}: {e} ulp");
            }
        };
        let lo = (-87.33f32).to_bits();
        let mut batch = [0f32; 8];
        let mut k = 0;
        // negative floats: bits from 0x8000_0000 (-0) up to lo
        let mut b = 0x8000_0000u32;
        while b <= lo {
            batch[k] = f32::from_bits(b);
            k += 1;
            if k == 8 {
                check(batch);
                k = 0;
            }
            b += 61;
        }
        let mut x = 0f32;
        while x < 88.37 {
            batch[k] = x;
            k += 1;
            if k == 8 {
                check(batch);
                k = 0;
            }
            x = f32::from_bits(x.to_bits() + 4099).max(1e-30);
        }
        assert!(worst <= EXP_ULPS);
    }

    /// Every f32 in [-87.336548, 88.37626] (2.1e9 values; about a minute on
    /// 2 cores in release): the largest error in ulps of the correctly
    /// rounded e^x. `cargo test --release -p kvreplay-kernels --lib
    /// exp_error_over_every_f32 -- --ignored --nocapture`
    #[test]
    #[ignore = "exhaustive over 2.1e9 f32 values, about a minute on 2 cores: run with -- --ignored"]
    fn exp_error_over_every_f32() {
        use rayon::prelude::*;
        let ranges = [
            (0x8000_0000u32, (-87.33655f32).to_bits()),
            (0u32, 88.376_26f32.to_bits()),
        ];
        let (worst, at) = ranges
            .iter()
            .flat_map(|&(a, b)| {
                (a..=b)
                    .step_by(1 << 16)
                    .map(move |s| (s, b.min(s + (1 << 16) - 1)))
            })
            .collect::<Vec<_>>()
            .par_iter()
            .map(|&(s, e)| {
                let mut worst = (0f64, 0f32);
                let mut b = s;
                while b <= e {
                    let xs: [f32; 8] =
                        core::array::from_fn(|i| f32::from_bits((b + i as u32).min(e)));
                    let y = exp_avx2(xs);
                    for (x, y) in xs.iter().zip(y) {
                        let u = ulps(y, (*x as f64).exp());
                        if u > worst.0 {
                            worst = (u, *x);
                        }
                    }
                    b += 8;
                }
                worst
            })
            .reduce(|| (0.0, 0.0), |a, b| if a.0 >= b.0 { a } else { b });
        println!("exp: max error {worst:.4} ulp at x = {at:e}");
        assert!(worst <= EXP_ULPS);
    }

    #[test]
    fn transpose_moves_lane_l_of_row_t_to_lane_t_of_row_l() {
        #[inline(always)]
        fn run<S: Simd>(m: &[f32; 64]) -> [f32; 64] {
            let r: [S::F; 8] = core::array::from_fn(|i| unsafe { S::load(m.as_ptr().add(8 * i)) });
            let t = S::transpose8(r);
            let mut out = [0f32; 64];
            for (i, v) in t.iter().enumerate() {
                unsafe { S::store(out.as_mut_ptr().add(8 * i), *v) };
            }
            out
        }
        simd_fn! {
            fn run_best(m: &[f32; 64]) -> [f32; 64] = run;
        }
        let m: [f32; 64] = core::array::from_fn(|i| i as f32);
        let want: [f32; 64] = core::array::from_fn(|i| ((i % 8) * 8 + i / 8) as f32);
        assert_eq!(run::<Portable>(&m), want);
        assert_eq!(run_best(&m), want);
    }

    #[test]
    fn reductions_follow_the_documented_tree() {
        let a = [1e8f32, 1.0, -1e8, 3.0, 0.5, 7.0, 0.25, -2.0];
        let want = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        let s = unsafe { Portable::hsum(Portable::load(a.as_ptr())) };
        assert_eq!(s, want);
        #[inline(always)]
        fn run<S: Simd>(a: &[f32; 8]) -> (f32, f32, f64) {
            let v = unsafe { S::load(a.as_ptr()) };
            let d = S::dacc((S::dzero(), S::dzero()), v);
            (S::hsum(v), S::hmax(v), S::dsum(d))
        }
        simd_fn! {
            fn run_best(a: &[f32; 8]) -> (f32, f32, f64) = run;
        }
        let (s, m, d) = run_best(&a);
        assert_eq!(s.to_bits(), want.to_bits());
        assert_eq!(m, 1e8);
        assert_eq!(d, run::<Portable>(&a).2);
    }
}
