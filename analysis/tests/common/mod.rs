//! Synthetic traces shared by the analysis tests.
#![allow(dead_code)] // each test file uses some of these

use kvreplay_traces::*;
use std::path::{Path, PathBuf};

/// The manifest of a synthetic trace: a llama-shaped model with the given
/// head layout, `t` positions of which `p` are the prompt, captured on the CPU.
pub fn synthetic_manifest(
    (n_layers, n_heads, n_kv_heads, head_dim): (usize, usize, usize, usize),
    p: usize,
    t: usize,
    attn_scale: f64,
    spans: Vec<Span>,
) -> Manifest {
    Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        model: ModelInfo {
            architecture: "llama".into(),
            name: None,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            d_model: n_heads * head_dim,
            ffn_dim: 0,
            vocab_size: 0,
            context_length: t,
            norm_eps: 1e-5,
            attn_scale,
            rope: Rope {
                theta: 10000.0,
                style: RopeStyle::Neox,
                rotated_dims: head_dim,
                scaling: RopeScaling::None,
            },
            source: SourceFile {
                file_name: "synthetic".into(),
                sha256: String::new(),
                size: 0,
            },
            layers: Vec::new(),
        },
        tokens: Tokens {
            ids: vec![0; t],
            prompt_len: p,
            text: vec![String::new(); t],
        },
        generation: Generation {
            method: "greedy".into(),
            n_decode: t - p,
        },
        spans,
        capture: CaptureInfo {
            device: "cpu".into(),
            dtype: Dtype::F32,
            compute_dtype: "f32".into(),
            prefill_chunk: 1,
            threads: 1,
            attn_probs: false,
            chat_template: false,
            prompt_source: "test".into(),
            kvreplay_version: "test".into(),
            created: "2026-01-01T00:00:00Z".into(),
            keep_queries: None,
        },
        files: vec![],
    }
}

pub fn write_trace(dir: &Path, name: &str, seed: u64, p: usize, t: usize) -> PathBuf {
    write_trace_scaled(dir, name, seed, p, t, 1.0)
}

pub fn write_trace_scaled(
    dir: &Path,
    name: &str,
    seed: u64,
    p: usize,
    t: usize,
    key_scale: f32,
) -> PathBuf {
    let layout = TraceLayout {
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        total_len: t,
        prompt_len: p,
        dtype: Dtype::F32,
        attn_probs: false,
        query_start: 0,
    };
    let out = dir.join(name);
    let mut w = TraceWriter::create(&out, layout, false).unwrap();
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
    };
    for l in 0..2 {
        let lw = w.layer(l);
        for h in 0..4 {
            let q: Vec<f32> = (0..t * 8).map(|_| rnd()).collect();
            lw.write_rows(TensorKind::Q, h, 0, &q);
            lw.write_rows(TensorKind::O, h, 0, &q);
            lw.write_colsum(
                h,
                &(0..p)
                    .map(|i| 1.0 / (i + 1) as f32 + rnd().abs())
                    .collect::<Vec<_>>(),
            );
        }
        for g in 0..2 {
            let k: Vec<f32> = (0..t * 8).map(|_| key_scale * rnd()).collect();
            let v: Vec<f32> = (0..t * 8).map(|_| rnd()).collect();
            lw.write_rows(TensorKind::K, g, 0, &k);
            lw.write_rows(TensorKind::V, g, 0, &v);
        }
    }
    let m = synthetic_manifest(
        (2, 4, 2, 8),
        p,
        t,
        1.0 / 8f64.sqrt(),
        vec![Span {
            name: "needle".into(),
            start: p / 2,
            end: p / 2 + 4,
        }],
    );
    w.finish(m).unwrap()
}
