//! e^x in f64, four lanes at a time, bit-identical to the C library's `exp`.
//!
//! Replay computes one f64 exponential per cache entry and decode query
//! (attention weights exp(logit − max)). glibc (2.28 and later, from Arm's
//! optimized-routines) computes `exp` with a 128-entry table of 2^(k/128)
//! and a degree-5 polynomial; on a CPU with FMA it runs the build of that
//! algorithm whose products are fused. [`exp4`] is the same arithmetic, the
//! same operations fused, on four lanes of AVX2: x = k·ln2/128 + r, then
//! 2^(k/128)·(1 + tail + r + r²(C2 + r·C3) + r⁴(C4 + r·C5)). Lanes outside
//! the table path (|x| < 2^−54, |x| ≥ 256·2, NaN, ±inf) are handed to the
//! library's scalar `exp`, as is every lane where FMA or AVX2 is missing.
//!
//! So results never depend on this module: [`fast_exp_active`] turns it on
//! only after checking, once per process, that it reproduces `f64::exp` bit
//! for bit on inputs that reach every table entry; otherwise (another libm,
//! another CPU) the scalar library call is used. The tests check it against
//! `f64::exp` on every f32 input in [−745, 0] (the inputs replay gives it:
//! f32 logit differences) and on random f64 inputs.
//!
//! EXP_TAB is derived by `scripts/gen_exp_table.py` from 60-digit decimal
//! arithmetic; the constants are the algorithm's published coefficients.

use std::sync::OnceLock;

/// 128 / ln 2.
const INV_LN2_N: f64 = f64::from_bits(0x40671547652b82fe);
/// −ln 2 / 128 in two parts (high has trailing zero bits, so k·high is exact).
const NEG_LN2_HI_N: f64 = f64::from_bits(0xbf762e42fefa0000);
const NEG_LN2_LO_N: f64 = f64::from_bits(0xbd0cf79abc9e3b3a);
/// The polynomial's coefficients C2 ... C5 (≈ 1/2, 1/6, 1/24, 1/120).
const C2: f64 = f64::from_bits(0x3fdffffffffffdbd);
const C3: f64 = f64::from_bits(0x3fc555555555543c);
const C4: f64 = f64::from_bits(0x3fa55555cf172b91);
const C5: f64 = f64::from_bits(0x3f81111167a4d017);
/// 1.5 · 2^52: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338000000000000);

/// Pairs (bits of T_k, bits of H_k − (k << 45)) with 2^(k/128) = H_k (1 + T_k).
#[rustfmt::skip]
static EXP_TAB: [u64; 256] = [
    0x0000000000000000, 0x3ff0000000000000,
    0x3c9b3b4f1a88bf6e, 0x3feff63da9fb3335,
    0xbc7160139cd8dc5d, 0x3fefec9a3e778061,
    0xbc905e7a108766d1, 0x3fefe315e86e7f85,
    0x3c8cd2523567f613, 0x3fefd9b0d3158574,
    0xbc8bce8023f98efa, 0x3fefd06b29ddf6de,
    0x3c60f74e61e6c861, 0x3fefc74518759bc8,
    0x3c90a3e45b33d399, 0x3fefbe3ecac6f383,
    0x3c979aa65d837b6d, 0x3fefb5586cf9890f,
    0x3c8eb51a92fdeffc, 0x3fefac922b7247f7,
    0x3c3ebe3d702f9cd1, 0x3fefa3ec32d3d1a2,
    0xbc6a033489906e0b, 0x3fef9b66affed31b,
    0xbc9556522a2fbd0e, 0x3fef9301d0125b51,
    0xbc5080ef8c4eea55, 0x3fef8abdc06c31cc,
    0xbc91c923b9d5f416, 0x3fef829aaea92de0,
    0x3c80d3e3e95c55af, 0x3fef7a98c8a58e51,
    0xbc801b15eaa59348, 0x3fef72b83c7d517b,
    0xbc8f1ff055de323d, 0x3fef6af9388c8dea,
    0x3c8b898c3f1353bf, 0x3fef635beb6fcb75,
    0xbc96d99c7611eb26, 0x3fef5be084045cd4,
    0x3c9aecf73e3a2f60, 0x3fef54873168b9aa,
    0xbc8fe782cb86389d, 0x3fef4d5022fcd91d,
    0x3c8a6f4144a6c38d, 0x3fef463b88628cd6,
    0x3c807a05b0e4047d, 0x3fef3f49917ddc96,
    0x3c968efde3a8a894, 0x3fef387a6e756238,
    0x3c875e18f274487d, 0x3fef31ce4fb2a63f,
    0x3c80472b981fe7f2, 0x3fef2b4565e27cdd,
    0xbc96b87b3f71085e, 0x3fef24dfe1f56381,
    0x3c82f7e16d09ab31, 0x3fef1e9df51fdee1,
    0xbc3d219b1a6fbffa, 0x3fef187fd0dad990,
    0x3c8b3782720c0ab4, 0x3fef1285a6e4030b,
    0x3c6e149289cecb8f, 0x3fef0cafa93e2f56,
    0x3c834d754db0abb6, 0x3fef06fe0a31b715,
    0x3c864201e2ac744c, 0x3fef0170fc4cd831,
    0x3c8fdd395dd3f84a, 0x3feefc08b26416ff,
    0xbc86a3803b8e5b04, 0x3feef6c55f929ff1,
    0xbc924aedcc4b5068, 0x3feef1a7373aa9cb,
    0xbc9907f81b512d8e, 0x3feeecae6d05d866,
    0xbc71d1e83e9436d2, 0x3feee7db34e59ff7,
    0xbc991919b3ce1b15, 0x3feee32dc313a8e5,
    0x3c859f48a72a4c6d, 0x3feedea64c123422,
    0xbc9312607a28698a, 0x3feeda4504ac801c,
    0xbc58a78f4817895b, 0x3feed60a21f72e2a,
    0xbc7c2c9b67499a1b, 0x3feed1f5d950a897,
    0x3c4363ed60c2ac11, 0x3feece086061892d,
    0x3c9666093b0664ef, 0x3feeca41ed1d0057,
    0x3c6ecce1daa10379, 0x3feec6a2b5c13cd0,
    0x3c93ff8e3f0f1230, 0x3feec32af0d7d3de,
    0x3c7690cebb7aafb0, 0x3feebfdad5362a27,
    0x3c931dbdeb54e077, 0x3feebcb299fddd0d,
    0xbc8f94340071a38e, 0x3feeb9b2769d2ca7,
    0xbc87deccdc93a349, 0x3feeb6daa2cf6642,
    0xbc78dec6bd0f385f, 0x3feeb42b569d4f82,
    0xbc861246ec7b5cf6, 0x3feeb1a4ca5d920f,
    0x3c93350518fdd78e, 0x3feeaf4736b527da,
    0x3c7b98b72f8a9b05, 0x3feead12d497c7fd,
    0x3c9063e1e21c5409, 0x3feeab07dd485429,
    0x3c34c7855019c6ea, 0x3feea9268a5946b7,
    0x3c9432e62b64c035, 0x3feea76f15ad2148,
    0xbc8ce44a6199769f, 0x3feea5e1b976dc09,
    0xbc8c33c53bef4da8, 0x3feea47eb03a5585,
    0xbc845378892be9ae, 0x3feea34634ccc320,
    0xbc93cedd78565858, 0x3feea23882552225,
    0x3c5710aa807e1964, 0x3feea155d44ca973,
    0xbc93b3efbf5e2228, 0x3feea09e667f3bcd,
    0xbc6a12ad8734b982, 0x3feea012750bdabf,
    0xbc6367efb86da9ee, 0x3fee9fb23c651a2f,
    0xbc80dc3d54e08851, 0x3fee9f7df9519484,
    0xbc781f647e5a3ecf, 0x3fee9f75e8ec5f74,
    0xbc86ee4ac08b7db0, 0x3fee9f9a48a58174,
    0xbc8619321e55e68a, 0x3fee9feb564267c9,
    0x3c909ccb5e09d4d3, 0x3feea0694fde5d3f,
    0xbc7b32dcb94da51d, 0x3feea11473eb0187,
    0x3c94ecfd5467c06b, 0x3feea1ed0130c132,
    0x3c65ebe1abd66c55, 0x3feea2f336cf4e62,
    0xbc88a1c52fb3cf42, 0x3feea427543e1a12,
    0xbc9369b6f13b3734, 0x3feea589994cce13,
    0xbc805e843a19ff1e, 0x3feea71a4623c7ad,
    0xbc94d450d872576e, 0x3feea8d99b4492ed,
    0x3c90ad675b0e8a00, 0x3feeaac7d98a6699,
    0x3c8db72fc1f0eab4, 0x3feeace5422aa0db,
    0xbc65b6609cc5e7ff, 0x3feeaf3216b5448c,
    0x3c7bf68359f35f44, 0x3feeb1ae99157736,
    0xbc93091fa71e3d83, 0x3feeb45b0b91ffc6,
    0xbc5da9b88b6c1e29, 0x3feeb737b0cdc5e5,
    0xbc6c23f97c90b959, 0x3feeba44cbc8520f,
    0xbc92434322f4f9aa, 0x3feebd829fde4e50,
    0xbc85ca6cd7668e4b, 0x3feec0f170ca07ba,
    0x3c71affc2b91ce27, 0x3feec49182a3f090,
    0x3c6dd235e10a73bb, 0x3feec86319e32323,
    0xbc87c50422622263, 0x3feecc667b5de565,
    0x3c8b1c86e3e231d5, 0x3feed09bec4a2d33,
    0xbc91bbd1d3bcbb15, 0x3feed503b23e255d,
    0x3c90cc319cee31d2, 0x3feed99e1330b358,
    0x3c8469846e735ab3, 0x3feede6b5579fdbf,
    0xbc82dfcd978e9db4, 0x3feee36bbfd3f37a,
    0x3c8c1a7792cb3387, 0x3feee89f995ad3ad,
    0xbc907b8f4ad1d9fa, 0x3feeee07298db666,
    0xbc55c3d956dcaeba, 0x3feef3a2b84f15fb,
    0xbc90a40e3da6f640, 0x3feef9728de5593a,
    0xbc68d6f438ad9334, 0x3feeff76f2fb5e47,
    0xbc91eee26b588a35, 0x3fef05b030a1064a,
    0x3c74ffd70a5fddcd, 0x3fef0c1e904bc1d2,
    0xbc91bdfbfa9298ac, 0x3fef12c25bd71e09,
    0x3c736eae30af0cb3, 0x3fef199bdd85529c,
    0x3c8ee3325c9ffd94, 0x3fef20ab5fffd07a,
    0x3c84e08fd10959ac, 0x3fef27f12e57d14b,
    0x3c63cdaf384e1a67, 0x3fef2f6d9406e7b5,
    0x3c676b2c6c921968, 0x3fef3720dcef9069,
    0xbc808a1883ccb5d2, 0x3fef3f0b555dc3fa,
    0xbc8fad5d3ffffa6f, 0x3fef472d4a07897c,
    0xbc900dae3875a949, 0x3fef4f87080d89f2,
    0x3c74a385a63d07a7, 0x3fef5818dcfba487,
    0xbc82919e2040220f, 0x3fef60e316c98398,
    0x3c8e5a50d5c192ac, 0x3fef69e603db3285,
    0x3c843a59ac016b4b, 0x3fef7321f301b460,
    0xbc82d52107b43e1f, 0x3fef7c97337b9b5f,
    0xbc892ab93b470dc9, 0x3fef864614f5a129,
    0x3c74b604603a88d3, 0x3fef902ee78b3ff6,
    0x3c83c5ec519d7271, 0x3fef9a51fbc74c83,
    0xbc8ff7128fd391f0, 0x3fefa4afa2a490da,
    0xbc8dae98e223747d, 0x3fefaf482d8e67f1,
    0x3c8ec3bc41aa2008, 0x3fefba1bee615a27,
    0x3c842b94c3a9eb32, 0x3fefc52b376bba97,
    0x3c8a64a931d185ee, 0x3fefd0765b6e4540,
    0xbc8e37bae43be3ed, 0x3fefdbfdad9cbe14,
    0x3c77893b4d91cd9d, 0x3fefe7c1819e90d8,
    0x3c5305c14160cc89, 0x3feff3c22b8f71f1,
];

/// Whether [`exp_shifted`] uses the four-lane path: AVX2 and FMA are present
/// and it reproduced `f64::exp` on the check inputs (decided once).
pub fn fast_exp_active() -> bool {
    static ACTIVE: OnceLock<bool> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return agrees_with_libm(&check_inputs());
        }
        false
    })
}

/// Inputs that reach every table entry, both polynomial signs, the edges of
/// the table path and the scalar lanes.
fn check_inputs() -> Vec<f64> {
    let mut x: Vec<f64> = (0..4096)
        .map(|i| -(i as f64) * 0.18 - (i % 7) as f64 * 1e-3)
        .collect();
    x.extend((0..1024).map(|i| (i as f64 - 512.0) * 0.011));
    x.extend([
        0.0,
        -0.0,
        1e-17,
        -1e-17,
        255.9,
        -255.9,
        256.0,
        -256.0,
        511.9,
        -511.9,
        -700.0,
        -745.2,
        -746.0,
        709.7,
        710.0,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NAN,
    ]);
    x
}

fn agrees_with_libm(x: &[f64]) -> bool {
    let mut y = vec![0f64; x.len()];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: only called after AVX2 and FMA were detected.
    unsafe {
        exp_slice_avx2(x, &mut y)
    };
    x.iter()
        .zip(&y)
        .all(|(a, b)| a.exp().to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
}

/// `w[e] = exp((l[e] − mx) as f64)`, the difference taken in f32: the
/// attention weights of logits `l` (n,) shifted by their maximum `mx`.
pub fn exp_shifted(l: &[f32], mx: f32, w: &mut [f64]) {
    assert_eq!(l.len(), w.len(), "exp_shifted: l and w differ in length");
    #[cfg(target_arch = "x86_64")]
    if fast_exp_active() {
        // SAFETY: fast_exp_active checked AVX2 and FMA.
        unsafe { exp_shifted_avx2(l, mx, w) };
        return;
    }
    for (we, le) in w.iter_mut().zip(l) {
        *we = ((le - mx) as f64).exp();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(l: &[f32], mx: f32, w: &mut [f64]) {
    use std::arch::x86_64::*;
    let n = l.len();
    let m = _mm_set1_ps(mx);
    let mut e = 0;
    while e + 4 <= n {
        let x = _mm256_cvtps_pd(_mm_sub_ps(_mm_loadu_ps(l.as_ptr().add(e)), m));
        _mm256_storeu_pd(w.as_mut_ptr().add(e), exp4(x));
        e += 4;
    }
    for i in e..n {
        w[i] = ((l[i] - mx) as f64).exp();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_slice_avx2(x: &[f64], y: &mut [f64]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let mut e = 0;
    while e + 4 <= n {
        let v = exp4(_mm256_loadu_pd(x.as_ptr().add(e)));
        _mm256_storeu_pd(y.as_mut_ptr().add(e), v);
        e += 4;
    }
    for i in e..n {
        y[i] = x[i].exp();
    }
}

/// exp of four lanes: the table path where 2^−54 ≤ |x| < 512, the library's
/// `exp` elsewhere.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp4(x: std::arch::x86_64::__m256d) -> std::arch::x86_64::__m256d {
    use std::arch::x86_64::*;
    let xi = _mm256_castpd_si256(x);
    // abstop = top 12 bits without the sign; the table path needs
    // abstop − 0x3c9 in 0 ..= 0x3e
    let top = _mm256_sub_epi64(
        _mm256_and_si256(_mm256_srli_epi64(xi, 52), _mm256_set1_epi64x(0x7ff)),
        _mm256_set1_epi64x(0x3c9),
    );
    let special = _mm256_or_si256(
        _mm256_cmpgt_epi64(_mm256_setzero_si256(), top),
        _mm256_cmpgt_epi64(top, _mm256_set1_epi64x(0x3e)),
    );
    let z = _mm256_fmadd_pd(x, _mm256_set1_pd(INV_LN2_N), _mm256_set1_pd(SHIFT));
    let ki = _mm256_castpd_si256(z);
    let kd = _mm256_sub_pd(z, _mm256_set1_pd(SHIFT));
    let r = _mm256_fmadd_pd(kd, _mm256_set1_pd(NEG_LN2_HI_N), x);
    let r = _mm256_fmadd_pd(kd, _mm256_set1_pd(NEG_LN2_LO_N), r);
    // 2 · (k mod 128): the pair's first element
    let idx = _mm256_slli_epi64(_mm256_and_si256(ki, _mm256_set1_epi64x(127)), 1);
    let (tail, hbits) = {
        // each lane's pair (T_k, H_k) in one 16-byte load, then transposed
        // (with two `vgatherqpd` instead, this exp ran 1.3x slower on Zen 3);
        // idx ≤ 254, so both elements lie in the table
        let mut ix = [0i64; 4];
        _mm256_storeu_si256(ix.as_mut_ptr() as *mut __m256i, idx);
        let tp = EXP_TAB.as_ptr() as *const f64;
        let pair = |i: usize| _mm_loadu_pd(tp.add(ix[i] as usize));
        let (p0, p1, p2, p3) = (pair(0), pair(1), pair(2), pair(3));
        let a = _mm256_insertf128_pd::<1>(_mm256_castpd128_pd256(p0), p2); // t0 h0 t2 h2
        let b = _mm256_insertf128_pd::<1>(_mm256_castpd128_pd256(p1), p3); // t1 h1 t3 h3
        (
            _mm256_unpacklo_pd(a, b),
            _mm256_castpd_si256(_mm256_unpackhi_pd(a, b)),
        )
    };
    let sbits = _mm256_add_epi64(hbits, _mm256_slli_epi64(ki, 45));
    let p23 = _mm256_fmadd_pd(r, _mm256_set1_pd(C3), _mm256_set1_pd(C2));
    let t1 = _mm256_add_pd(r, tail);
    let r2 = _mm256_mul_pd(r, r);
    let p45 = _mm256_fmadd_pd(r, _mm256_set1_pd(C5), _mm256_set1_pd(C4));
    let t = _mm256_fmadd_pd(p23, r2, t1);
    let r4 = _mm256_mul_pd(r2, r2);
    let tmp = _mm256_fmadd_pd(r4, p45, t);
    let scale = _mm256_castsi256_pd(sbits);
    let y = _mm256_fmadd_pd(scale, tmp, scale);
    let mask = _mm256_movemask_pd(_mm256_castsi256_pd(special));
    if mask == 0 {
        return y;
    }
    let (mut xs, mut ys) = ([0f64; 4], [0f64; 4]);
    _mm256_storeu_pd(xs.as_mut_ptr(), x);
    _mm256_storeu_pd(ys.as_mut_ptr(), y);
    for i in 0..4 {
        if mask & (1 << i) != 0 {
            ys[i] = xs[i].exp();
        }
    }
    _mm256_loadu_pd(ys.as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u64) -> u64 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *s >> 11
    }

    #[test]
    fn exp_shifted_equals_the_library_exp_on_random_logits() {
        let mut s = 7;
        for n in [0usize, 1, 3, 4, 5, 17, 1000] {
            let l: Vec<f32> = (0..n)
                .map(|_| (lcg(&mut s) % 200_000) as f32 / 1000.0 - 150.0)
                .collect();
            let mx = l.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            let mut w = vec![0f64; n];
            exp_shifted(&l, mx, &mut w);
            for (we, le) in w.iter().zip(&l) {
                assert_eq!(we.to_bits(), ((le - mx) as f64).exp().to_bits());
            }
        }
    }

    #[test]
    fn the_four_lane_path_is_used_on_this_machine_where_it_can_be() {
        // On x86_64 with AVX2 + FMA and glibc's exp, the fast path must agree
        // (if it did not, replay would silently run the slow path).
        #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            assert!(
                fast_exp_active(),
                "the four-lane exp disagrees with glibc's exp"
            );
        }
    }

    /// Every f32 in [−745, 0] (about 1.1e9 inputs, the differences replay
    /// exponentiates), plus 4M random f64 in (−800, 800). Where the fast path
    /// is not active this compares the library with itself.
    #[test]
    fn four_lane_exp_equals_the_library_exp_on_every_f32_input() {
        if !fast_exp_active() {
            eprintln!("four-lane exp not active on this machine (no AVX2/FMA or another libm): nothing to compare");
            return;
        }
        use rayon::prelude::*;
        let lo = (-745f32).to_bits(); // negative floats: larger bits = more negative
        let hi = (-0f32).to_bits();
        let chunks: Vec<u32> = (hi..=lo).step_by(1 << 20).collect();
        let bad: usize = chunks
            .par_iter()
            .map(|&c0| {
                let c1 = c0.saturating_add(1 << 20).min(lo + 1);
                let x: Vec<f64> = (c0..c1).map(|b| f32::from_bits(b) as f64).collect();
                let mut y = vec![0f64; x.len()];
                // SAFETY: fast_exp_active checked AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    exp_slice_avx2(&x, &mut y)
                };
                x.iter()
                    .zip(&y)
                    .filter(|(a, b)| a.exp().to_bits() != b.to_bits())
                    .count()
            })
            .sum();
        assert_eq!(bad, 0, "{bad} f32 inputs differ from the library exp");
        let mut s = 11;
        let x: Vec<f64> = (0..1 << 22)
            .map(|_| (lcg(&mut s) as f64 / (1u64 << 53) as f64) * 1600.0 - 800.0)
            .collect();
        assert!(agrees_with_libm(&x));
        assert!(agrees_with_libm(&check_inputs()));
    }
}
