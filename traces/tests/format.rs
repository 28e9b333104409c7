//! The trace format end to end on small synthetic traces: write, read back,
//! verify, and every corruption `verify` must name.

use kvreplay_traces::*;
use std::path::{Path, PathBuf};

const D: usize = 8;

fn layout(dtype: Dtype) -> TraceLayout {
    TraceLayout {
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: D,
        total_len: 7,
        prompt_len: 5,
        dtype,
        attn_probs: false,
    }
}

fn manifest(l: &TraceLayout) -> Manifest {
    Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        model: ModelInfo {
            architecture: "llama".into(),
            name: Some("synthetic".into()),
            n_layers: l.n_layers,
            n_heads: l.n_heads,
            n_kv_heads: l.n_kv_heads,
            head_dim: l.head_dim,
            d_model: l.n_heads * l.head_dim,
            ffn_dim: 64,
            vocab_size: 100,
            context_length: 64,
            norm_eps: 1e-5,
            attn_scale: 1.0 / (D as f64).sqrt(),
            rope: Rope {
                theta: 10000.0,
                style: RopeStyle::Neox,
                rotated_dims: D,
                scaling: RopeScaling::None,
            },
            source: SourceFile {
                file_name: "none.gguf".into(),
                sha256: "0".repeat(64),
                size: 0,
            },
        },
        tokens: Tokens {
            ids: (0..l.total_len as u32).collect(),
            prompt_len: l.prompt_len,
            text: (0..l.total_len).map(|i| format!("t{i}")).collect(),
        },
        generation: Generation {
            method: "greedy".into(),
            n_decode: l.total_len - l.prompt_len,
        },
        spans: vec![Span {
            name: "needle".into(),
            start: 1,
            end: 3,
        }],
        capture: CaptureInfo {
            device: "cpu".into(),
            dtype: l.dtype,
            compute_dtype: "f32".into(),
            prefill_chunk: 4,
            threads: 1,
            attn_probs: false,
            chat_template: false,
            prompt_source: "test".into(),
            kvreplay_version: "test".into(),
            created: "2026-01-01T00:00:00Z".into(),
        },
        files: vec![],
    }
}

fn val(l: usize, kind: usize, h: usize, t: usize, i: usize) -> f32 {
    ((l * 131 + kind * 37 + h * 17 + t * 7 + i) as f32 * 0.61).sin()
}

/// Write a synthetic trace whose `o` is the true causal attention of its q/k/v.
fn write_trace(dir: &Path, dtype: Dtype) -> PathBuf {
    let lay = layout(dtype);
    let out = dir.join("s.kvtrace");
    let mut w = TraceWriter::create(&out, lay, false).unwrap();
    let group = lay.n_heads / lay.n_kv_heads;
    for l in 0..lay.n_layers {
        let row = |kind, h, t| -> Vec<f32> { (0..D).map(|i| val(l, kind, h, t, i)).collect() };
        let lw = w.layer(l);
        for g in 0..lay.n_kv_heads {
            for t in 0..lay.total_len {
                lw.write_rows(TensorKind::K, g, t, &row(1, g, t));
                lw.write_rows(TensorKind::V, g, t, &row(2, g, t));
            }
        }
        for h in 0..lay.n_heads {
            for t in 0..lay.total_len {
                let q = row(0, h, t);
                lw.write_rows(TensorKind::Q, h, t, &q);
                // o_t = softmax(q·k_j / sqrt(D), j <= t) v_j, in f64
                let logits: Vec<f64> = (0..=t)
                    .map(|j| {
                        q.iter()
                            .zip(row(1, h / group, j))
                            .map(|(a, b)| (*a * b) as f64)
                            .sum::<f64>()
                            / (D as f64).sqrt()
                    })
                    .collect();
                let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = logits.iter().map(|x| (x - mx).exp()).sum();
                let mut o = vec![0f32; D];
                for (j, x) in logits.iter().enumerate() {
                    for (oi, vi) in o.iter_mut().zip(row(2, h / group, j)) {
                        *oi += ((x - mx).exp() / z) as f32 * vi;
                    }
                }
                lw.write_rows(TensorKind::O, h, t, &o);
            }
            lw.write_colsum(h, &vec![h as f32; lay.prompt_len]);
        }
    }
    w.finish(manifest(&lay)).unwrap()
}

#[test]
fn round_trip_f32_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F32);
    let t = Trace::open(&out).unwrap();
    assert_eq!(t.manifest, {
        let mut m = manifest(&layout(Dtype::F32));
        m.files = t.manifest.files.clone();
        m
    });
    let layer = t.layer(1);
    let q = layer.q(3).to_f32();
    assert_eq!((layer.q(3).rows, layer.q(3).cols), (7, D));
    assert_eq!(q[5 * D + 2], val(1, 0, 3, 5, 2));
    let mut row = vec![0f32; D];
    layer.k(1).row_into(6, &mut row);
    assert_eq!(row[7], val(1, 1, 1, 6, 7));
    assert_eq!(layer.attn_colsum(2), &[2.0; 5]);
    assert!(layer.attn_probs(0).is_none());
    let r = verify(&out, &VerifyOptions::default()).unwrap();
    assert!(
        r.max_rel_err < 1e-6,
        "f32 recomputation error {}",
        r.max_rel_err
    );
    assert_eq!(r.files_checked, 2);
}

#[test]
fn round_trip_half_precision_within_rounding() {
    for dtype in [Dtype::F16, Dtype::Bf16] {
        let tmp = tempfile::tempdir().unwrap();
        let out = write_trace(tmp.path(), dtype);
        let t = Trace::open(&out).unwrap();
        let v = t.layer(0).v(1).to_f32();
        // unit-roundoff of the format: 2^-11 (f16), 2^-8 (bf16), on values in [-1, 1]
        let u = if dtype == Dtype::F16 {
            2f32.powi(-11)
        } else {
            2f32.powi(-8)
        };
        for (i, x) in v.iter().enumerate() {
            let want = val(0, 2, 1, i / D, i % D);
            assert!(
                (x - want).abs() <= u * want.abs().max(2f32.powi(-14)),
                "{dtype:?}: {x} vs {want}"
            );
        }
        verify(&out, &VerifyOptions::default()).unwrap();
    }
}

/// A layer file as Python's `safetensors` sees it: the standard header parses
/// and every tensor has the documented name, dtype and shape.
#[test]
fn layer_files_are_standard_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let bytes = std::fs::read(out.join("layer-000.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<_> = st.names().into_iter().map(String::from).collect();
    names.sort();
    assert_eq!(names, ["attn_colsum", "k", "o", "q", "v"]);
    assert_eq!(st.tensor("q").unwrap().shape(), &[4, 7, D]);
    assert_eq!(st.tensor("k").unwrap().dtype(), safetensors::Dtype::F16);
    assert_eq!(st.tensor("attn_colsum").unwrap().shape(), &[4, 5]);
}

fn verify_err(out: &Path) -> String {
    verify(out, &VerifyOptions::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn verify_names_a_truncated_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let f = out.join("layer-001.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let e = verify_err(&out);
    assert!(
        e.contains("layer-001.safetensors") && e.contains("truncated") && e.contains("recapture"),
        "{e}"
    );
    assert!(matches!(Trace::open(&out), Err(TraceError::Size { .. })));
}

#[test]
fn verify_names_a_flipped_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let f = out.join("layer-000.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x10;
    std::fs::write(&f, b).unwrap();
    let e = verify_err(&out);
    assert!(
        e.contains("layer-000.safetensors") && e.contains("sha256") && e.contains("corrupt"),
        "{e}"
    );
}

#[test]
fn verify_names_a_missing_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    std::fs::remove_file(out.join("layer-001.safetensors")).unwrap();
    let e = verify_err(&out);
    assert!(
        e.contains("layer-001.safetensors") && e.contains("missing layer file for layer 1"),
        "{e}"
    );
}

#[test]
fn verify_refuses_a_newer_format_version() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let p = out.join("manifest.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"format_version\": 1", "\"format_version\": 2");
    std::fs::write(&p, text).unwrap();
    let e = verify_err(&out);
    assert!(
        e.contains("manifest.json")
            && e.contains("format version 2")
            && e.contains("upgrade kvreplay"),
        "{e}"
    );
}

/// Consistent checksums but an `o` that is not attention of q/k/v (here: two
/// heads swapped) is caught by the recomputation.
#[test]
fn verify_recomputation_catches_inconsistent_o() {
    let tmp = tempfile::tempdir().unwrap();
    let lay = layout(Dtype::F32);
    let out = tmp.path().join("bad.kvtrace");
    let mut w = TraceWriter::create(&out, lay, false).unwrap();
    for l in 0..2 {
        for h in 0..4 {
            for t in 0..7 {
                let r: Vec<f32> = (0..D).map(|i| val(l, 0, h, t, i)).collect();
                w.layer(l).write_rows(TensorKind::Q, h, t, &r);
                w.layer(l).write_rows(TensorKind::O, h, t, &r); // not attention output
                if h < 2 {
                    w.layer(l).write_rows(TensorKind::K, h, t, &r);
                    w.layer(l).write_rows(TensorKind::V, h, t, &r);
                }
            }
        }
    }
    w.finish(manifest(&lay)).unwrap();
    let e = verify_err(&out);
    assert!(e.contains("differs from attention recomputed"), "{e}");
}

#[test]
fn writer_refuses_existing_output_and_cleans_up_when_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let e = TraceWriter::create(&out, layout(Dtype::F16), false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
    // An abandoned writer (an error mid-capture) leaves neither a trace nor a partial folder.
    let other = tmp.path().join("other.kvtrace");
    let w = TraceWriter::create(&other, layout(Dtype::F16), false).unwrap();
    assert!(tmp.path().join("other.kvtrace.partial").exists());
    drop(w);
    assert!(!other.exists() && !tmp.path().join("other.kvtrace.partial").exists());
    // --force replaces a finished trace.
    let w = TraceWriter::create(&out, layout(Dtype::F16), true).unwrap();
    w.finish(manifest(&layout(Dtype::F16))).unwrap();
    Trace::open(&out).unwrap();
}

#[test]
fn not_a_trace_is_explained() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Trace::open(tmp.path()).err().unwrap().to_string();
    assert!(e.contains("no manifest.json"), "{e}");
}

/// A manifest that promises a tensor the layer files lack names the tensor and
/// the capture flag that adds it.
#[test]
fn a_missing_tensor_is_named_with_the_flag_that_adds_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let p = out.join("manifest.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"attn_probs\": false", "\"attn_probs\": true");
    std::fs::write(&p, text).unwrap();
    let e = Trace::open(&out).err().unwrap().to_string();
    assert!(
        e.contains("layer-000.safetensors")
            && e.contains("`attn_probs`")
            && e.contains("--attn-probs"),
        "{e}"
    );
}

#[test]
fn a_manifest_whose_decode_count_overflows_is_refused() {
    // prompt_len + n_decode overflowed (a panic with overflow checks, as
    // under cargo-fuzz) instead of being reported
    let mut m = manifest(&layout(Dtype::F32));
    m.generation.n_decode = usize::MAX;
    let text = serde_json::to_string(&m).unwrap();
    let e = Manifest::parse(Path::new("t/manifest.json"), &text)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("t/manifest.json") && e.contains("generation.n_decode 18446744073709551615"),
        "{e}"
    );
}
