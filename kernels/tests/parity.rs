//! Parity suite: every kernel, on every device present, against an
//! independent straightforward implementation (f64 loops written here, or
//! values known by construction). The CPU always runs; CUDA runs when the
//! `cuda` feature is built and a GPU is usable, and otherwise each test prints
//! why it did not run there.
//!
//! Tolerances: f32 sums of k terms differ from the f64 reference by at most
//! about k·2⁻²⁴·Σ|terms| (any summation order); element-wise maps by a few
//! ulps of f32 exp/sqrt; gathers and data movement are exact (the same f32
//! operations in the same order; CUDA sources are compiled with --fmad=false).

mod common;
use common::Rng;
use std::sync::OnceLock;

use kvreplay_kernels::cpu::{AttentionStats, RopeParams, RopeStyle};
use kvreplay_kernels::{AttnShape, Backend, Buf, DeviceRequest, Weight};

fn cuda() -> &'static Result<Backend, String> {
    static CUDA: OnceLock<Result<Backend, String>> = OnceLock::new();
    CUDA.get_or_init(|| {
        if cfg!(not(feature = "cuda")) {
            return Err("this test binary was built without the `cuda` feature".into());
        }
        Backend::open(DeviceRequest::Cuda)
            .map(|o| o.backend)
            .map_err(|e| e.to_string())
    })
}

/// The backends to check: the CPU, plus CUDA when usable (else say why not).
/// A layer's KV cache on `b` (its own layout, through `kv_cache` and
/// `store_kv`) holding every position of the plain (n_kv_heads, cap, d)
/// rows `k` and `v`.
fn kv_cache(b: &Backend, k: &[f32], v: &[f32], (nkv, cap, d): (usize, usize, usize)) -> (Buf, Buf) {
    let (mut kc, mut vc) = b.kv_cache(nkv, cap, d).unwrap();
    let (k, v) = (b.upload(k).unwrap(), b.upload(v).unwrap());
    b.store_kv(&k, &v, (nkv, cap, d), 0, &mut kc, &mut vc)
        .unwrap();
    (kc, vc)
}

fn backends(test: &str) -> Vec<Backend> {
    let mut v = vec![Backend::Cpu];
    match cuda() {
        Ok(b) => v.push(b.clone()),
        Err(why) => eprintln!("{test}: CUDA not run: {why}"),
    }
    v
}

fn close(got: &[f32], want: &[f64], tol: impl Fn(usize) -> f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = (*g as f64 - w).abs();
        assert!(
            e <= tol(i),
            "{what}[{i}]: got {g}, want {w} (error {e:.3e} > {:.3e})",
            tol(i)
        );
    }
}

#[test]
fn parity_embedding() {
    for b in backends("parity_embedding") {
        let mut r = Rng(1);
        let (vocab, dim) = (50, 24);
        let table = Weight::new(r.vec(vocab * dim));
        let ids = [3u32, 0, 49, 3, 17];
        let mut out = vec![0f32; ids.len() * dim];
        b.embedding(&table, dim, &ids, &mut out).unwrap();
        for (row, &id) in out.chunks(dim).zip(&ids) {
            assert_eq!(row, &table[id as usize * dim..(id as usize + 1) * dim]);
        }
        let e = b
            .embedding(&table, dim, &[50], &mut out[..dim])
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the table"), "{e}");
    }
}

#[test]
fn parity_linear() {
    for b in backends("parity_linear") {
        let mut r = Rng(2);
        for (m, k, n) in [(1, 96, 40), (70, 96, 300), (5, 7, 3)] {
            let x = r.vec(m * k);
            let w = Weight::new(r.vec(n * k));
            let mut out = vec![0f32; m * n];
            b.linear(&x, &w, &mut out, m, k, n).unwrap();
            let mut want = vec![0f64; m * n];
            let mut mag = vec![0f64; m * n];
            for i in 0..m {
                for j in 0..n {
                    for t in 0..k {
                        let p = x[i * k + t] as f64 * w[j * k + t] as f64;
                        want[i * n + j] += p;
                        mag[i * n + j] += p.abs();
                    }
                }
            }
            close(
                &out,
                &want,
                |i| k as f64 * 2f64.powi(-24) * mag[i] + 1e-30,
                "linear",
            );
        }
    }
}

#[test]
fn parity_rms_norm() {
    for b in backends("parity_rms_norm") {
        let mut r = Rng(3);
        let (rows, dim) = (6, 300);
        let x0: Vec<f32> = r.vec(rows * dim).iter().map(|v| v * 5.0).collect();
        let w = r.vec(dim);
        let mut x = x0.clone();
        b.rms_norm(&mut x, &w, 1e-5).unwrap();
        let mut want = vec![0f64; rows * dim];
        for i in 0..rows {
            let row = &x0[i * dim..(i + 1) * dim];
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            for j in 0..dim {
                want[i * dim + j] = row[j] as f64 / (ms + 1e-5).sqrt() * w[j] as f64;
            }
        }
        // three f32 roundings of the product
        close(
            &x,
            &want,
            |i| 4.0 * 2f64.powi(-24) * want[i].abs() + 1e-30,
            "rms_norm",
        );
    }
}

#[test]
fn parity_silu_mul() {
    for b in backends("parity_silu_mul") {
        let mut r = Rng(4);
        let g0: Vec<f32> = r.vec(1000).iter().map(|v| v * 12.0).collect();
        let up = r.vec(1000);
        let mut g = g0.clone();
        b.silu_mul(&mut g, &up).unwrap();
        let want: Vec<f64> = g0
            .iter()
            .zip(&up)
            .map(|(g, u)| *g as f64 / (1.0 + (-*g as f64).exp()) * *u as f64)
            .collect();
        // exp within 2 ulps (CUDA expf) plus four roundings
        close(
            &g,
            &want,
            |i| 8.0 * 2f64.powi(-24) * want[i].abs() + 1e-37,
            "silu_mul",
        );
    }
}

#[test]
fn parity_rope_both_styles() {
    for b in backends("parity_rope_both_styles") {
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let mut r = Rng(5);
            let p = RopeParams {
                theta: 10000.0,
                style,
                rotated_dims: 16,
                linear_factor: 1.0,
                llama3: None,
            };
            let (rows, heads, hd, pos0) = (5, 3, 20, 997);
            let x0 = r.vec(rows * heads * hd);
            let mut x = x0.clone();
            b.rope(&mut x, heads, hd, pos0, &p, 1.0).unwrap();
            let mut want: Vec<f64> = x0.iter().map(|v| *v as f64).collect();
            for row in 0..rows {
                for h in 0..heads {
                    let base = (row * heads + h) * hd;
                    for i in 0..8 {
                        let a = (pos0 + row) as f64 * 10000f64.powf(-(2.0 * i as f64) / 16.0);
                        let (ia, ib) = if style == RopeStyle::Neox {
                            (i, i + 8)
                        } else {
                            (2 * i, 2 * i + 1)
                        };
                        let (x0a, x0b) = (x0[base + ia] as f64, x0[base + ib] as f64);
                        want[base + ia] = x0a * a.cos() - x0b * a.sin();
                        want[base + ib] = x0b * a.cos() + x0a * a.sin();
                    }
                }
            }
            // cos/sin rounded to f32, then two products and a sum in f32
            close(
                &x,
                &want,
                |_| 4.0 * 2f64.powi(-24) * 2.0,
                &format!("rope {style:?}"),
            );
            b.rope(&mut x, heads, hd, pos0, &p, -1.0).unwrap();
            close(
                &x,
                &x0.iter().map(|v| *v as f64).collect::<Vec<_>>(),
                |_| 1e-6,
                "rope undo",
            );
        }
    }
}

// ---------------------------------------------------------------- attention

/// softmax(scale·q·kᵀ + mask) in f64 for query i at position pos0 + i, over
/// keys 0 ..= pos0 + i; with a sliding `window` of W keys, the keys before
/// the last W get exactly 0.
fn ref_probs(
    q: &[f32],
    k: &[f32],
    d: usize,
    pos0: usize,
    scale: f64,
    gain: &[f64],
    window: Option<usize>,
) -> Vec<Vec<f64>> {
    let c = q.len() / d;
    (0..c)
        .map(|i| {
            let valid = pos0 + i + 1;
            let lo = window.map_or(0, |w| valid.saturating_sub(w));
            let l: Vec<f64> = (lo..valid)
                .map(|j| {
                    (0..d)
                        .map(|t| q[i * d + t] as f64 * k[j * d + t] as f64)
                        .sum::<f64>()
                        * scale
                        * gain[i]
                })
                .collect();
            let mx = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = l.iter().map(|x| (x - mx).exp()).sum();
            let mut p = vec![0.0; lo];
            p.extend(l.iter().map(|x| (x - mx).exp() / z));
            p
        })
        .collect()
}

#[test]
fn parity_causal_attention_with_column_sums_and_probs() {
    for b in backends("parity_causal_attention_with_column_sums_and_probs") {
        let mut r = Rng(6);
        let (d, pos0, c) = (32, 300, 20);
        let n = pos0 + c;
        let (q, k, v) = (r.vec(c * d), r.vec(n * d), r.vec(n * d));
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0f32; c * d];
        let mut colsum = vec![0.5f32; 310];
        let mut probs = vec![0f32; c * n];
        b.causal_attention_head(
            &q,
            &k,
            &v,
            d,
            pos0,
            scale,
            &mut out,
            AttentionStats {
                colsum: Some(&mut colsum),
                probs: Some(&mut probs),
            },
        )
        .unwrap();
        let p = ref_probs(&q, &k, d, pos0, scale as f64, &vec![1.0; c], None);
        let mut want_out = vec![0f64; c * d];
        let mut want_p = vec![0f64; c * n];
        let mut want_cs = vec![0.5f64; 310];
        for i in 0..c {
            for (j, pj) in p[i].iter().enumerate() {
                want_p[i * n + j] = *pj;
                if j < 310 {
                    want_cs[j] += pj;
                }
                for t in 0..d {
                    want_out[i * d + t] += pj * v[j * d + t] as f64;
                }
            }
        }
        // logits: d-term dot products (|l| < 6) in f32; a logit error e moves a
        // probability by about e·p; outputs sum n terms of |p·v| <= p
        close(&probs, &want_p, |i| 1e-5 * want_p[i] + 1e-9, "probs");
        close(&out, &want_out, |_| 2e-6, "out");
        close(&colsum, &want_cs, |_| 2e-6 * c as f64, "colsum");
    }
}

#[test]
fn parity_layer_attention_all_heads_in_one_call() {
    // The forward pass's batched attention: 6 query heads over 2 KV heads
    // (group 3) in a cache with spare capacity, a chunk at pos0 > 0, column
    // sums tracked over fewer columns than keys, probabilities on.
    for b in backends("parity_layer_attention_all_heads_in_one_call") {
        let mut r = Rng(11);
        let (nh, nkv, d, pos0, c, cap, tracked) = (6, 2, 20, 70, 9, 100, 75);
        let n = pos0 + c;
        let (q, k, v) = (
            r.vec(nh * c * d),
            r.vec(nkv * cap * d),
            r.vec(nkv * cap * d),
        );
        let scale = 1.0 / (d as f32).sqrt();
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            c,
            pos0,
            cap,
            head_dim: d,
            scale,
        };
        let mut cs = b.upload(&vec![0.25f32; nh * tracked]).unwrap();
        let mut pr = b.zeros(nh * c * n).unwrap();
        let (kc, vc) = kv_cache(&b, &k, &v, (nkv, cap, d));
        let o = b
            .attention(
                &b.upload(&q).unwrap(),
                &kc,
                &vc,
                shape,
                Some(&mut cs),
                Some(&mut pr),
            )
            .unwrap();
        let (o, cs, pr) = (
            b.download(&o).unwrap().into_owned(),
            b.download(&cs).unwrap().into_owned(),
            b.download(&pr).unwrap().into_owned(),
        );
        for h in 0..nh {
            let g = h / (nh / nkv);
            let (kh, vh) = (
                &k[g * cap * d..(g * cap + n) * d],
                &v[g * cap * d..(g * cap + n) * d],
            );
            let p = ref_probs(
                &q[h * c * d..(h + 1) * c * d],
                kh,
                d,
                pos0,
                scale as f64,
                &[1.0; 9],
                None,
            );
            let mut want_o = vec![0f64; c * d];
            let mut want_p = vec![0f64; c * n];
            let mut want_cs = vec![0.25f64; tracked];
            for i in 0..c {
                for (j, pj) in p[i].iter().enumerate() {
                    want_p[i * n + j] = *pj;
                    if j < tracked {
                        want_cs[j] += pj;
                    }
                    for t in 0..d {
                        want_o[i * d + t] += pj * vh[j * d + t] as f64;
                    }
                }
            }
            // tolerances as in parity_causal_attention_with_column_sums_and_probs
            let what = |x: &str| format!("head {h} {x}");
            close(
                &pr[h * c * n..(h + 1) * c * n],
                &want_p,
                |i| 1e-5 * want_p[i] + 1e-9,
                &what("probs"),
            );
            close(
                &o[h * c * d..(h + 1) * c * d],
                &want_o,
                |_| 2e-6,
                &what("out"),
            );
            close(
                &cs[h * tracked..(h + 1) * tracked],
                &want_cs,
                |_| 2e-6 * c as f64,
                &what("colsum"),
            );
        }
    }
}

#[test]
fn parity_gelu_tanh_mul_and_scale() {
    // Gemma 3's GeGLU gate and embedding scale.
    for b in backends("parity_gelu_tanh_mul_and_scale") {
        let mut r = Rng(13);
        let g0: Vec<f32> = r.vec(1000).iter().map(|v| v * 8.0).collect();
        let up = r.vec(1000);
        let mut g = b.upload(&g0).unwrap();
        b.gelu_tanh_mul(&mut g, &b.upload(&up).unwrap()).unwrap();
        let g = b.download(&g).unwrap().into_owned();
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let want: Vec<f64> = g0
            .iter()
            .zip(&up)
            .map(|(&x, &u)| {
                let x = x as f64;
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh()) * u as f64
            })
            .collect();
        // the f32 constant sqrt(2/pi) (relative 3e-8), tanh within a few ulps
        // and six roundings, relative to |x·u| (1 + tanh cancels for x << 0)
        close(
            &g,
            &want,
            |i| 32.0 * 2f64.powi(-24) * (g0[i] as f64 * up[i] as f64).abs() + 1e-37,
            "gelu_tanh_mul",
        );
        let x0 = r.vec(640);
        let mut x = b.upload(&x0).unwrap();
        b.scale(&mut x, 25.298_22).unwrap();
        let x = b.download(&x).unwrap().into_owned();
        let want: Vec<f64> = x0.iter().map(|v| *v as f64 * 25.298_22f32 as f64).collect();
        // one rounding
        close(&x, &want, |i| 2f64.powi(-24) * want[i].abs(), "scale");
    }
}

#[test]
fn parity_sliding_window_attention() {
    // Gemma 3's local layers: 4 query heads over 1 KV head, a window of 37
    // keys, a chunk at pos0 = 60 (every row's window starts inside the
    // cache), column sums and probabilities; keys before the window get 0.
    for b in backends("parity_sliding_window_attention") {
        let mut r = Rng(14);
        let (nh, nkv, d, pos0, c, cap, w) = (4, 1, 16, 60, 7, 70, 37usize);
        let n = pos0 + c;
        let (q, k, v) = (
            r.vec(nh * c * d),
            r.vec(nkv * cap * d),
            r.vec(nkv * cap * d),
        );
        let scale = 1.0 / (d as f32).sqrt();
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            c,
            pos0,
            cap,
            head_dim: d,
            scale,
        };
        let mut cs = b.upload(&vec![0f32; nh * n]).unwrap();
        let mut pr = b.zeros(nh * c * n).unwrap();
        let (kc, vc) = kv_cache(&b, &k, &v, (nkv, cap, d));
        let o = b
            .attention_windowed(
                &b.upload(&q).unwrap(),
                &kc,
                &vc,
                shape,
                Some(w),
                Some(&mut cs),
                Some(&mut pr),
            )
            .unwrap();
        let (o, cs, pr) = (
            b.download(&o).unwrap().into_owned(),
            b.download(&cs).unwrap().into_owned(),
            b.download(&pr).unwrap().into_owned(),
        );
        for h in 0..nh {
            let mut want_p = vec![0f64; c * n];
            let mut want_o = vec![0f64; c * d];
            let mut want_cs = vec![0f64; n];
            let p = ref_probs(
                &q[h * c * d..(h + 1) * c * d],
                &k,
                d,
                pos0,
                scale as f64,
                &[1.0; 7],
                Some(w),
            );
            for i in 0..c {
                for (j, pj) in p[i].iter().enumerate() {
                    want_p[i * n + j] = *pj;
                    want_cs[j] += pj;
                    for e in 0..d {
                        want_o[i * d + e] += pj * v[j * d + e] as f64;
                    }
                }
            }
            let what = |x: &str| format!("head {h} {x}");
            // tolerances as in parity_causal_attention_with_column_sums_and_probs;
            // keys outside the window exactly 0
            close(
                &pr[h * c * n..(h + 1) * c * n],
                &want_p,
                |i| 1e-5 * want_p[i] + if want_p[i] == 0.0 { 0.0 } else { 1e-9 },
                &what("probs"),
            );
            close(
                &o[h * c * d..(h + 1) * c * d],
                &want_o,
                |_| 2e-6,
                &what("out"),
            );
            close(
                &cs[h * n..(h + 1) * n],
                &want_cs,
                |i| {
                    if want_cs[i] == 0.0 {
                        0.0
                    } else {
                        2e-6 * c as f64
                    }
                },
                &what("colsum"),
            );
        }
    }
}

#[test]
fn parity_residual_add_transpose_and_copy() {
    // Data movement and an element-wise add: exact on every device.
    for b in backends("parity_residual_add_transpose_and_copy") {
        let mut r = Rng(12);
        let (c, heads, d) = (7, 3, 5);
        let x = r.vec(c * heads * d);
        let y = r.vec(c * heads * d);
        let mut xb = b.upload(&x).unwrap();
        b.add_assign(&mut xb, &b.upload(&y).unwrap()).unwrap();
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        assert_eq!(*b.download(&xb).unwrap(), sum[..], "add");
        let hm = b
            .transpose_heads(&b.upload(&x).unwrap(), c, heads, d, true)
            .unwrap();
        let hm_host = b.download(&hm).unwrap().into_owned();
        for t in 0..c {
            for h in 0..heads {
                for e in 0..d {
                    assert_eq!(
                        hm_host[(h * c + t) * d + e],
                        x[(t * heads + h) * d + e],
                        "to heads"
                    );
                }
            }
        }
        let back = b.transpose_heads(&hm, c, heads, d, false).unwrap();
        assert_eq!(*b.download(&back).unwrap(), x[..], "round trip");
        let mut dst = b.zeros(40).unwrap();
        b.copy_within(&b.upload(&x).unwrap(), 3, &mut dst, 10, 12)
            .unwrap();
        let got = b.download(&dst).unwrap();
        assert_eq!(got[10..22], x[3..15]);
        assert!(got[..10].iter().chain(&got[22..]).all(|&v| v == 0.0));
        // Empty buffers are fine everywhere (CUDA refuses 0-byte allocations).
        let e = b.upload(&[]).unwrap();
        assert!(b.download(&e).unwrap().is_empty());
        assert!(b.transpose_heads(&e, 0, heads, d, true).unwrap().is_empty());
        // No rows: nothing is launched (a one-block launch over an empty
        // buffer wrote out of bounds on CUDA; found by the emulated ASan run).
        let w = Weight::new(vec![1.0; 4]);
        assert!(b.norm(&e, &w, 1e-5).unwrap().is_empty());
        let shape = AttnShape {
            n_heads: 2,
            n_kv_heads: 1,
            c: 0,
            pos0: 3,
            cap: 3,
            head_dim: 4,
            scale: 0.5,
        };
        let (kc, vc) = kv_cache(&b, &[0.5; 12], &[0.5; 12], (1, 3, 4));
        let mut cs = b.upload(&[0.25; 6]).unwrap();
        let o = b
            .attention(&e, &kc, &vc, shape, Some(&mut cs), None)
            .unwrap();
        assert!(o.is_empty());
        assert_eq!(
            *b.download(&cs).unwrap(),
            [0.25f32; 6][..],
            "no queries add nothing"
        );
    }
}

#[test]
fn parity_attend_biased() {
    for b in backends("parity_attend_biased") {
        let mut r = Rng(7);
        let (nq, n, d) = (3, 500, 64);
        let (q, keys, vals) = (r.vec(nq * d), r.vec(n * d), r.vec(n * d));
        let bias: Vec<f32> = (0..n)
            .map(|e| if e % 7 == 0 { (3.0f32).ln() } else { 0.0 })
            .collect();
        let scale = 0.125f32;
        let (mut w, mut z, mut out) = (vec![0f64; nq * n], vec![0f64; nq], vec![0f32; nq * d]);
        b.attend_biased(&q, &keys, &vals, &bias, scale, &mut w, &mut z, &mut out)
            .unwrap();
        for i in 0..nq {
            let l: Vec<f64> = (0..n)
                .map(|e| {
                    (0..d)
                        .map(|t| q[i * d + t] as f64 * keys[e * d + t] as f64)
                        .sum::<f64>()
                        * scale as f64
                        + bias[e] as f64
                })
                .collect();
            let mx = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let wr: Vec<f64> = l.iter().map(|x| (x - mx).exp()).collect();
            let zr: f64 = wr.iter().sum();
            for e in 0..n {
                // |logit| < 8: f32 dot error ~ d·2⁻²⁴·8 moves a weight relatively by as much
                assert!(
                    (w[i * n + e] / z[i] - wr[e] / zr).abs() <= 1e-5 * wr[e] / zr,
                    "w[{i},{e}]"
                );
            }
            let want: Vec<f64> = (0..d)
                .map(|t| (0..n).map(|e| wr[e] / zr * vals[e * d + t] as f64).sum())
                .collect();
            close(&out[i * d..(i + 1) * d], &want, |_| 2e-6, "attend out");
        }
    }
}

#[test]
fn parity_attention_rows_with_gains() {
    for b in backends("parity_attention_rows_with_gains") {
        let mut r = Rng(8);
        let (d, n) = (16, 400);
        let lens = [1usize, 37, 400, 256];
        let gains = [1.0f32, 0.5, 2.0, 1.0];
        let (q, keys) = (r.vec(lens.len() * d), r.vec(n * d));
        let mut out = vec![f32::NAN; lens.len() * n];
        b.attention_rows(&q, &keys, d, &lens, &gains, 0.25, &mut out)
            .unwrap();
        for (i, &len) in lens.iter().enumerate() {
            // row i: a query "at position len - 1" over keys 0..len
            let p = ref_probs(
                &q[i * d..(i + 1) * d],
                &keys,
                d,
                len - 1,
                0.25,
                &[gains[i] as f64],
                None,
            );
            let mut want = vec![0f64; n];
            want[..len].copy_from_slice(&p[0]);
            close(
                &out[i * n..(i + 1) * n],
                &want,
                |j| 1e-5 * want[j] + 1e-9,
                "rows",
            );
        }
    }
}
