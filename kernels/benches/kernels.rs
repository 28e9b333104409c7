//! Criterion micro-benchmarks of the CPU kernels at SmolLM2 shapes
//! (head_dim 64, d_model 576, ffn 1536; the quantised products also at
//! Gemma 3's). `cargo bench -p kvreplay-kernels`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvreplay_kernels::cpu::{self, AttentionStats, BlockType};
use std::hint::black_box;

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// A (rows, cols) matrix of `ty` blocks with modest f16 scales.
fn quant_matrix(ty: BlockType, rows: usize, cols: usize) -> cpu::QuantMatrix {
    let nb = rows * cols / ty.block_elems();
    let bb = ty.block_bytes();
    let mut raw: Vec<u8> = (0..nb * bb).map(|i| (i * 131 % 251) as u8).collect();
    let f16s: &[usize] = match ty {
        BlockType::Q6_K => &[208],
        BlockType::Q4_1 | BlockType::Q4_K | BlockType::Q5_K => &[0, 2],
        _ => &[0],
    };
    for b in 0..nb {
        for &off in f16s {
            raw[b * bb + off..b * bb + off + 2]
                .copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    cpu::QuantMatrix::new(ty, rows, cols, raw).unwrap()
}

fn decode(c: &mut Criterion) {
    let d = 64;
    let mut g = c.benchmark_group("decode");
    for n in [256usize, 2048] {
        let (q, k, v) = (data(d, 1), data(n * d, 2), data(n * d, 3));
        let bias = vec![0f32; n];
        let (mut w, mut o) = (vec![0f64; n], vec![0f32; d]);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("attend_biased/n={n}"), |b| {
            b.iter(|| cpu::attend_biased(black_box(&q), &k, &v, &bias, 0.125, &mut w, &mut o))
        });
    }
    // GQA: the three query heads of a SmolLM2 KV head over a full cache
    let (n, nq) = (2112usize, 3usize);
    let (q, k, v) = (data(nq * d, 21), data(n * d, 22), data(n * d, 23));
    let bias = vec![0f32; n];
    let (mut w, mut z, mut o) = (vec![0f64; nq * n], vec![0f64; nq], vec![0f32; nq * d]);
    g.throughput(Throughput::Elements((nq * n) as u64));
    g.bench_function(format!("attend_biased_multi/nq={nq},n={n}"), |b| {
        b.iter(|| {
            cpu::attend_biased_multi(black_box(&q), &k, &v, &bias, 0.125, &mut w, &mut z, &mut o)
        })
    });
    // As replay runs it: one query step over each of 8 such caches in turn
    // (8.6 MB, beyond L2), so keys and values come from L3 as they do there.
    let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..8u32)
        .map(|c| (data(n * d, 30 + 2 * c), data(n * d, 31 + 2 * c)))
        .collect();
    let (mut x, mut p) = (vec![0f32; nq * n], vec![0f32; nq * n]);
    g.throughput(Throughput::Elements((8 * nq * n) as u64));
    g.bench_function(
        format!("attend_biased_probs/nq={nq},n={n} x 8 caches"),
        |b| {
            b.iter(|| {
                for (k, v) in &caches {
                    cpu::attend_biased_probs(
                        black_box(&q),
                        k,
                        v,
                        &bias,
                        0.125,
                        &mut w,
                        &mut z,
                        &mut o,
                        &mut x,
                        &mut p,
                    )
                }
            })
        },
    );
    let (a, bm) = (data(64 * d, 4), data(512 * d, 5));
    let mut out = vec![0f32; 64 * 512];
    g.throughput(Throughput::Elements(64 * 512));
    g.bench_function("dot_rows/64x512", |b| {
        b.iter(|| cpu::dot_rows(black_box(&a), &bm, d, &mut out))
    });
    // EMS's prefill redundancy at budget 1024 of a 2,048-token prompt
    let (a, bm) = (data(1024 * d, 14), data(992 * d, 15));
    let mut out = vec![0f32; 1024 * 992];
    g.throughput(Throughput::Elements(1024 * 992));
    g.bench_function("dot_rows/1024x992", |b| {
        b.iter(|| cpu::dot_rows(black_box(&a), &bm, d, &mut out))
    });
    let p = 2048;
    let (q, k) = (data(32 * d, 6), data(p * d, 7));
    let lens: Vec<usize> = (p - 32..p).map(|j| j + 1).collect();
    let gains = vec![1f32; 32];
    let mut rows = vec![0f32; 32 * p];
    g.throughput(Throughput::Elements((32 * p) as u64));
    g.bench_function("attention_rows/32x2048", |b| {
        b.iter(|| cpu::attention_rows(black_box(&q), &k, d, &lens, &gains, 0.125, &mut rows))
    });
    g.finish();
}

fn capture_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("capture");
    let (m, k, n) = (256, 576, 1536);
    let (x, w) = (data(m * k, 8), data(n * k, 9));
    let mut out = vec![0f32; m * n];
    g.throughput(Throughput::Elements((2 * m * k * n) as u64)); // flops
    g.bench_function("linear/256x576x1536", |b| {
        b.iter(|| cpu::linear(black_box(&x), &w, &mut out, m, k, n))
    });
    let (d, c_len, pos0) = (64, 256, 1792);
    let (q, kk, v) = (
        data(c_len * d, 10),
        data((pos0 + c_len) * d, 11),
        data((pos0 + c_len) * d, 12),
    );
    let mut o = vec![0f32; c_len * d];
    let mut colsum = vec![0f32; pos0 + c_len];
    g.throughput(Throughput::Elements((c_len * (pos0 + c_len)) as u64));
    g.bench_function("causal_attention/256 queries at 1792", |b| {
        b.iter(|| {
            cpu::causal_attention_head(
                black_box(&q),
                &kk,
                &v,
                d,
                pos0,
                0.125,
                &mut o,
                AttentionStats {
                    colsum: Some(&mut colsum),
                    probs: None,
                },
            )
        })
    });
    // A layer's attention (SmolLM2: 9 query heads over 3 KV heads): a
    // 256-query prefill chunk at 1792, and one decode step at 2111.
    let (nh, nkv, cap) = (9, 3, 2112);
    let (k, v) = (data(nkv * cap * d, 13), data(nkv * cap * d, 14));
    // the cache in attention's layout (panels of keys, values by part)
    let cache = || {
        let (mut kc, mut vc) = (
            vec![0f32; nkv * cpu::key_cache_len(cap, d)],
            vec![0f32; nkv * cap * d],
        );
        cpu::store_kv(&k, &v, (nkv, cap, d), 0, &mut kc, &mut vc);
        (kc, vc)
    };
    let (kc, vc) = cache();
    for (c_len, pos0) in [(256usize, 1792usize), (1, 2111)] {
        let q = data(nh * c_len * d, 15);
        let mut o = vec![0f32; nh * c_len * d];
        let mut colsum = vec![0f32; nh * cap];
        g.throughput(Throughput::Elements(
            ((c_len as f64 / 2.0 + pos0 as f64) * nh as f64 * c_len as f64) as u64,
        ));
        g.bench_function(format!("attention_heads/9x{c_len} at {pos0}"), |b| {
            b.iter(|| {
                cpu::attention_heads(
                    black_box(&q),
                    &kc,
                    &vc,
                    (nh, nkv, cap, d),
                    pos0,
                    None,
                    0.125,
                    &mut o,
                    (c_len > 1).then_some(&mut colsum[..]),
                    None,
                )
            })
        });
    }
    // One decode step through 30 layers' caches in turn (97 MB, more than
    // the L3 holds), so keys and values come from memory as in capture.
    let layers: Vec<(Vec<f32>, Vec<f32>)> = (0..30).map(|_| cache()).collect();
    let q = data(nh * d, 15);
    let mut o = vec![0f32; nh * d];
    g.throughput(Throughput::Elements((30 * 2112 * nh) as u64));
    g.bench_function("attention_heads/9x1 at 2111, 30 layers", |b| {
        b.iter(|| {
            for (kc, vc) in &layers {
                cpu::attention_heads(
                    black_box(&q),
                    kc,
                    vc,
                    (nh, nkv, cap, d),
                    2111,
                    None,
                    0.125,
                    &mut o,
                    None,
                    None,
                )
            }
        })
    });
    let mut row = data(2048, 16);
    g.throughput(Throughput::Elements(2048));
    g.bench_function("softmax_row/2048", |b| {
        b.iter(|| cpu::softmax_row(black_box(&mut row), 0.01))
    });
    // Quantised products (fused for m = 1, dequantise + gemm for m = 256),
    // SmolLM2's Q4_1 FFN and Q8_0 output head, Gemma 3's Q5_0/Q4_K/Q6_K.
    for (ty, m, k, n) in [
        (BlockType::Q4_1, 1usize, 576usize, 1536usize),
        (BlockType::Q4_1, 256, 576, 1536),
        (BlockType::Q8_0, 1, 576, 49152),
        (BlockType::Q5_0, 1, 640, 2048),
        (BlockType::Q4_K, 1, 2048, 640),
        (BlockType::Q6_K, 1, 2048, 640),
    ] {
        let w = quant_matrix(ty, n, k);
        let x = data(m * k, 17);
        let mut out = vec![0f32; m * n];
        g.throughput(Throughput::Elements((2 * m * k * n) as u64)); // flops
        g.bench_function(format!("linear_quant/{ty:?} {m}x{k}x{n}"), |b| {
            b.iter(|| cpu::linear_quant(black_box(&x), &w, &mut out, m, k, n))
        });
    }
    // The element-wise passes of a 256-position chunk (SmolLM2 widths), each
    // on a fresh copy of its input (the copy is included).
    let (gate, up) = (data(256 * 1536, 18), data(256 * 1536, 19));
    let mut work = gate.clone();
    g.throughput(Throughput::Elements((256 * 1536) as u64));
    g.bench_function("silu_mul/256x1536", |b| {
        b.iter(|| {
            work.copy_from_slice(&gate);
            cpu::silu_mul(black_box(&mut work), &up)
        })
    });
    g.bench_function("gelu_tanh_mul/256x1536", |b| {
        b.iter(|| {
            work.copy_from_slice(&gate);
            cpu::gelu_tanh_mul(black_box(&mut work), &up)
        })
    });
    let (hx, nw) = (data(256 * 576, 20), data(576, 21));
    let mut hw = hx.clone();
    g.throughput(Throughput::Elements((256 * 576) as u64));
    g.bench_function("rms_norm/256x576", |b| {
        b.iter(|| {
            hw.copy_from_slice(&hx);
            cpu::rms_norm(black_box(&mut hw), &nw, 1e-5)
        })
    });
    let blocks = 1 << 15;
    let raw: Vec<u8> = (0..blocks * 20)
        .map(|i| (i * 31 % 251) as u8 & 0x3f)
        .collect();
    let mut y = vec![0f32; blocks * 32];
    g.throughput(Throughput::Elements((blocks * 32) as u64));
    g.bench_function("dequantize/q4_1 1M", |b| {
        b.iter(|| cpu::dequantize(BlockType::Q4_1, black_box(&raw), &mut y).unwrap())
    });
    g.finish();
}

/// The policies' similarity dots at D2O's shapes: its first compression
/// matches 1,024 evicted rows against 1,024 kept ones, screened in f32
/// (`screen`, what D2O runs) or exact in f64 (`dots64`, what it ran before);
/// a decode step matches one evicted row against the kept rows it indexes.
fn similarity(c: &mut Criterion) {
    let d = 64;
    let mut g = c.benchmark_group("similarity");
    let (na, nb) = (1024usize, 1024usize);
    let (a, b) = (data(na * d, 7), data(nb * d, 8));
    let blocks = cpu::ColumnBlocks::of_rows(&b, d);
    let mut out = vec![0f64; na * nb];
    g.throughput(Throughput::Elements((2 * na * nb * d) as u64));
    g.bench_function("column_blocks_dots/1024x1024", |bn| {
        bn.iter(|| blocks.dots(black_box(&a), &mut out))
    });
    let blocks8 = cpu::Blocks8::of_rows(&b, d);
    let mut out32 = vec![0f32; na * nb];
    g.bench_function("screen_blocks8_dots/1024x1024", |bn| {
        bn.iter(|| blocks8.dots(black_box(&a), &mut out32))
    });
    let idx: Vec<usize> = (0..nb).rev().collect();
    let (mut at, mut sq) = (vec![0f64; nb], vec![0f64; nb]);
    g.throughput(Throughput::Elements((2 * nb * d) as u64));
    g.bench_function("dots_norms_at/1x1024", |bn| {
        bn.iter(|| cpu::dots_norms_at(black_box(&a[..d]), &b, d, &idx, &mut at, Some(&mut sq)))
    });
    g.finish();
}

/// A decode step's products and attention through 30 SmolLM2-shaped layers
/// (Q4_1 weights, 66 MB; caches at 2,111 positions, 97 MB: together more
/// than the L3 holds, so both come from memory as in capture), the products
/// after each attention reading the next layer's cache ahead as capture's
/// do (`cpu::ahead`). Norms, RoPE and the output head are left out.
fn decode_step(c: &mut Criterion) {
    let (dm, ffn, nh, nkv, d, cap, pos) = (576, 1536, 9, 3, 64, 2112, 2111);
    let q4 = |rows, cols| quant_matrix(BlockType::Q4_1, rows, cols);
    struct Layer {
        w: [cpu::QuantMatrix; 7],
        kc: Vec<f32>,
        vc: Vec<f32>,
    }
    let layers: Vec<Layer> = (0..30)
        .map(|l| {
            let (k, v) = (data(nkv * cap * d, 40 + l), data(nkv * cap * d, 80 + l));
            let mut kc = vec![0f32; nkv * cpu::key_cache_len(cap, d)];
            let mut vc = vec![0f32; nkv * cap * d];
            cpu::store_kv(&k, &v, (nkv, cap, d), 0, &mut kc, &mut vc);
            Layer {
                w: [
                    q4(nh * d, dm),
                    q4(nkv * d, dm),
                    q4(nkv * d, dm),
                    q4(dm, nh * d),
                    q4(ffn, dm),
                    q4(ffn, dm),
                    q4(dm, ffn),
                ],
                kc,
                vc,
            }
        })
        .collect();
    let x = data(dm, 22);
    let (mut q, mut k, mut v) = (vec![0f32; nh * d], vec![0f32; nkv * d], vec![0f32; nkv * d]);
    let (mut o, mut a) = (vec![0f32; nh * d], vec![0f32; dm]);
    let (mut gate, mut up, mut down) = (vec![0f32; ffn], vec![0f32; ffn], vec![0f32; dm]);
    let mut g = c.benchmark_group("capture");
    g.sample_size(20);
    g.bench_function("decode_step/30 layers at 2111", |b| {
        b.iter(|| {
            // On a pool worker, as capture runs its layers.
            rayon::scope(|_| {
                for (l, ly) in layers.iter().enumerate() {
                    let w = |i: usize| cpu::WeightRef::Quant(&ly.w[i]);
                    let qkv: &mut [&mut [f32]] = &mut [&mut q, &mut k, &mut v];
                    cpu::linear_many(black_box(&x), 1, dm, &[w(0), w(1), w(2)], qkv);
                    cpu::attention_heads(
                        &q,
                        &ly.kc,
                        &ly.vc,
                        (nh, nkv, cap, d),
                        pos,
                        None,
                        0.125,
                        &mut o,
                        None,
                        None,
                    );
                    if let Some(next) = layers.get(l + 1) {
                        let shape = (nkv, cap, d);
                        let reads = cpu::decode_reads(&next.kc, &next.vc, shape, pos, None);
                        cpu::ahead::DECODE.set(&reads);
                    }
                    cpu::linear_many(&o, 1, nh * d, &[w(3)], &mut [&mut a]);
                    let gu: &mut [&mut [f32]] = &mut [&mut gate, &mut up];
                    cpu::linear_many(&x, 1, dm, &[w(4), w(5)], gu);
                    cpu::linear_many(&gate, 1, ffn, &[w(6)], &mut [&mut down]);
                }
                cpu::ahead::DECODE.clear();
            })
        })
    });
    g.finish();
}

criterion_group!(benches, decode, capture_ops, decode_step, similarity);
criterion_main!(benches);
