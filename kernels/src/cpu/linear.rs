//! Dense products on the `gemm` crate (AVX2/AVX-512 kernels, runtime-detected).

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (a linear layer with weight `w` stored
/// (out_features, in_features), as torch and GGUF store it). Tiles of fixed
/// size (see [`super::qlinear::linear_many`]) decide how work is split, so
/// results are bit-identical for any thread count.
pub fn linear(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    assert_eq!(x.len(), m * k, "linear: x is not (m, k)");
    assert_eq!(w.len(), n * k, "linear: w is not (n, k)");
    assert_eq!(out.len(), m * n, "linear: out is not (m, n)");
    super::qlinear::linear_many(x, m, k, &[super::qlinear::WeightRef::F32(w)], &mut [out]);
}

/// `out[m, n] = a[m, k] · b[k, n]` with explicit row strides (elements), for
/// attention's P·V and Q·Kᵀ on sub-matrices. Single-threaded: callers
/// parallelise over heads.
///
/// `b_t` = true reads `b` transposed: b is stored (n, k) and the product is a·bᵀ.
#[allow(clippy::too_many_arguments)]
pub fn matmul_strided(
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    b_t: bool,
    out: &mut [f32],
    ldo: usize,
    m: usize,
    k: usize,
    n: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= (m - 1) * lda + k);
    if b_t {
        assert!(b.len() >= (n - 1) * ldb + k);
    } else {
        assert!(k == 0 || b.len() >= (k - 1) * ldb + n);
    }
    assert!(out.len() >= (m - 1) * ldo + n);
    let (b_cs, b_rs) = if b_t {
        (ldb as isize, 1)
    } else {
        (1, ldb as isize)
    };
    // SAFETY: the asserts above bound every element gemm reads or writes.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            ldo as isize,
            false,
            a.as_ptr(),
            1,
            lda as isize,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut o = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        o
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn linear_matches_naive_on_ragged_shapes() {
        for &(m, k, n) in &[(1, 7, 5), (3, 64, 300), (70, 33, 257), (129, 16, 1)] {
            let (x, w) = (data(m * k, 1), data(n * k, 2));
            let mut out = vec![0f32; m * n];
            linear(&x, &w, &mut out, m, k, n);
            let want = naive(&x, &w, m, k, n);
            for (a, b) in out.iter().zip(&want) {
                // f32 accumulation over k <= 64 terms of magnitude <= 1
                assert!((a - b).abs() <= 1e-5 * k as f32, "{m}x{k}x{n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn linear_is_bit_identical_across_thread_counts() {
        let (m, k, n) = (200, 96, 700);
        let (x, w) = (data(m * k, 3), data(n * k, 4));
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut out = vec![0f32; m * n];
            pool.install(|| linear(&x, &w, &mut out, m, k, n));
            out
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(5));
    }

    #[test]
    fn strided_product_both_orientations() {
        let (m, k, n) = (3, 4, 5);
        let a = data(m * k, 5);
        let bt = data(n * k, 6); // (n, k)
        let mut b = vec![0f32; k * n]; // (k, n)
        for i in 0..n {
            for j in 0..k {
                b[j * n + i] = bt[i * k + j];
            }
        }
        let want = naive(&a, &bt, m, k, n);
        let mut o1 = vec![0f32; m * n];
        matmul_strided(&a, k, &bt, k, true, &mut o1, n, m, k, n);
        let mut o2 = vec![0f32; m * n];
        matmul_strided(&a, k, &b, n, false, &mut o2, n, m, k, n);
        for i in 0..m * n {
            assert!((o1[i] - want[i]).abs() < 1e-5 && (o2[i] - want[i]).abs() < 1e-5);
        }
    }
}
