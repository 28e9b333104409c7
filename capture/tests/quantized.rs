//! Capture on a tiny llama whose layer matrices are Q4_1 and whose tied
//! embedding is Q8_0 (SmolLM2's types): the weights stay quantised, and the
//! trace matches the same model with its weights dequantised to f32.

use kvreplay_capture::testing::*;
use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_traces::{Dtype, Trace};
use std::path::Path;

fn model(dir: &Path, layer_type: u32) -> Model {
    let path = dir.join(format!("tiny-q{layer_type}.gguf"));
    let bytes = tiny_gguf_bytes(&PLAIN, |_, t| retype_layer_matrices(t, layer_type));
    std::fs::write(&path, bytes).unwrap();
    Model::load(&path).unwrap()
}

fn opts(out: &Path) -> CaptureOptions {
    let mut o = CaptureOptions::new("the cat saw the 42 dogs<|im_end|> the cat", out);
    o.n_decode = 6;
    o.dtype = Dtype::F32;
    o
}

fn rows(t: &Trace, l: usize, h: usize) -> [Vec<f32>; 4] {
    let v = t.layer(l);
    let kv = h % t.manifest.model.n_kv_heads;
    [
        v.q(h).to_f32(),
        v.k(kv).to_f32(),
        v.v(kv).to_f32(),
        v.o(h).to_f32(),
    ]
}

#[test]
fn quantised_weights_are_never_copied_to_f32_and_match_their_f32_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let (mq, mf) = (model(tmp.path(), 3), model(tmp.path(), 0));
    let w = &mq.llama.layers[0];
    assert!(
        w.wq.quant().is_some() && w.w_down.quant().is_some() && mq.llama.embed.quant().is_some()
    );
    assert!(mf.llama.layers[0].wq.quant().is_none());
    let (a, b) = (tmp.path().join("q.kvtrace"), tmp.path().join("f.kvtrace"));
    let sa = capture(&mq, &opts(&a), &mut |_| {}).unwrap();
    capture(&mf, &opts(&b), &mut |_| {}).unwrap();
    // No f32 copy of a quantised weight was made, and they hold about a
    // sixth of f32's bytes (Q4_1: 20 bytes per 32 weights).
    let mut all = vec![&mq.llama.embed];
    for l in &mq.llama.layers {
        all.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
    }
    assert!(all.iter().all(|w| !w.has_f32_copy()));
    let q4: usize = mq.llama.layers.iter().map(|l| l.wq.host_bytes()).sum();
    let f32b: usize = mf.llama.layers.iter().map(|l| l.wq.host_bytes()).sum();
    assert_eq!(q4 * 32, f32b * 20 / 4);
    let (ta, tb) = (Trace::open(&a).unwrap(), Trace::open(&b).unwrap());
    let (p, n) = (sa.prompt_len, ta.manifest.total_len());
    assert!(p >= 8, "the prompt takes the many-row path");
    let d = ta.manifest.model.head_dim;
    for l in 0..LAYERS {
        for h in 0..HEADS as usize {
            for (x, y) in rows(&ta, l, h).iter().zip(rows(&tb, l, h)) {
                // Prompt positions: dequantise-then-gemm is the f32 product, bit for bit.
                assert_eq!(x[..p * d], y[..p * d], "layer {l} head {h}: prompt");
                // Decode steps (m = 1, the fused kernel): f32 rounding only.
                for (u, v) in x[p * d..n * d].iter().zip(&y[p * d..n * d]) {
                    assert!(
                        (u - v).abs() <= 1e-4 * (1.0 + v.abs()),
                        "layer {l} head {h}: {u} vs {v}"
                    );
                }
            }
        }
    }
    assert_eq!(ta.manifest.tokens.ids, tb.manifest.tokens.ids);
}

#[test]
fn quantised_capture_is_bit_identical_for_any_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), 3);
    let run = |threads: usize| {
        let out = tmp.path().join(format!("t{threads}.kvtrace"));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut o = opts(&out);
        o.prefill_chunk = 5;
        pool.install(|| capture(&m, &o, &mut |_| {})).unwrap();
        let t = Trace::open(&out).unwrap();
        let mut all = Vec::new();
        for l in 0..LAYERS {
            for h in 0..HEADS as usize {
                for x in rows(&t, l, h) {
                    all.extend(x.iter().map(|v| v.to_bits()));
                }
                all.extend(t.layer(l).attn_colsum(h).iter().map(|v| v.to_bits()));
            }
        }
        (t.manifest.tokens.ids.clone(), all)
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}
