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
        query_start: 0,
    }
}

fn manifest(l: &TraceLayout) -> Manifest {
    Manifest {
        format: FORMAT_NAME.into(),
        // what the writer records for a full trace: the lowest version that describes it
        format_version: 1,
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
            layers: Vec::new(),
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
            keep_queries: None,
        },
        files: vec![],
    }
}

fn val(l: usize, kind: usize, h: usize, t: usize, i: usize) -> f32 {
    ((l * 131 + kind * 37 + h * 17 + t * 7 + i) as f32 * 0.61).sin()
}

/// Write a synthetic trace whose `o` is the true causal attention of its q/k/v.
fn write_trace(dir: &Path, dtype: Dtype) -> PathBuf {
    write_trace_keeping(dir, dtype, None)
}

/// [`write_trace`], lean when `keep_queries` is set (every row is offered to
/// the writer, which stores q and o from `P - keep_queries` on).
fn write_trace_keeping(dir: &Path, dtype: Dtype, keep_queries: Option<usize>) -> PathBuf {
    let mut lay = layout(dtype);
    let mut man = manifest(&lay);
    man.capture.keep_queries = keep_queries;
    lay.query_start = man.query_start();
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
    w.finish(man).unwrap()
}

/// A lean trace keeps k and v for every position and q and o for the last
/// `keep_queries` prompt positions plus the decode steps: rows addressed by
/// position read the same values as the full trace's, earlier ones are
/// refused, `verify` recomputes o where it is stored, and the trace is
/// written as format version 2 (version 1 readers would misread it).
#[test]
fn lean_trace_round_trip() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let full = Trace::open(write_trace(a.path(), Dtype::F32)).unwrap();
    let out = write_trace_keeping(b.path(), Dtype::F32, Some(2));
    let lean = Trace::open(&out).unwrap();
    assert_eq!(lean.manifest.format_version, 2);
    assert_eq!(full.manifest.format_version, 1);
    assert_eq!(lean.manifest.query_start(), 3);
    assert!(lean.manifest.is_lean() && !full.manifest.is_lean());
    let (lf, ll) = (full.layer(1), lean.layer(1));
    assert_eq!(
        (ll.q(3).rows, ll.q(3).first, ll.q(3).positions()),
        (4, 3, 3..7)
    );
    assert_eq!((ll.o(0).rows, ll.k(0).rows, ll.v(1).rows), (4, 7, 7));
    let (mut x, mut y) = (vec![0f32; D], vec![0f32; D]);
    for t in 3..7 {
        lf.q(3).row_into(t, &mut x);
        ll.q(3).row_into(t, &mut y);
        assert_eq!(x, y, "q at position {t}");
        lf.o(2).row_into(t, &mut x);
        ll.o(2).row_into(t, &mut y);
        assert_eq!(x, y, "o at position {t}");
    }
    assert_eq!(ll.k(1).to_f32(), lf.k(1).to_f32());
    assert_eq!(ll.q(0).to_f32(), lf.q(0).to_f32()[3 * D..].to_vec());
    let e = std::panic::catch_unwind(|| ll.q(0).row_into(2, &mut [0f32; D]))
        .unwrap_err()
        .downcast::<String>()
        .unwrap();
    assert!(
        e.contains("position 2 is not stored") && e.contains("3..7"),
        "{e}"
    );
    // the layer files say version 2 too
    let bytes = std::fs::read(out.join("layer-000.safetensors")).unwrap();
    let head = String::from_utf8_lossy(&bytes[8..200]).into_owned();
    assert!(head.contains("\"format_version\":\"2\""), "{head}");
    let r = verify(&out, &VerifyOptions::default()).unwrap();
    assert!(r.max_rel_err < 1e-6, "{}", r.max_rel_err);
    // the size estimate (`inspect --estimate`) is what was written
    for (t, dir) in [(&lean, &out), (&full, &full.dir().to_path_buf())] {
        let files: u64 = t.manifest.files.iter().map(|f| f.size).sum();
        assert_eq!(
            t.manifest.layout().trace_bytes(),
            files,
            "{}",
            dir.display()
        );
        let q = t.manifest.layout().tensor_bytes();
        assert_eq!(
            q.iter().find(|x| x.0 == "q").unwrap().1,
            (4 * t.layer(0).q(0).rows * D * 4) as u64
        );
    }
    // a lean manifest labelled version 1 is refused, naming the field
    let p = out.join("manifest.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"format_version\": 2", "\"format_version\": 1");
    std::fs::write(&p, text).unwrap();
    let e = Trace::open(&out).err().unwrap().to_string();
    assert!(
        e.contains("format_version 1") && e.contains("keep_queries") && e.contains("version 2"),
        "{e}"
    );
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
fn verify_and_open_name_a_flipped_byte_and_unverified_reads_skip_the_check() {
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
    assert_checksum_refused(&out, "layer-000.safetensors");
    let t = Trace::open_unverified(&out).unwrap();
    assert!(!t.verified());
    assert!(Trace::open(write_trace(&tmp.path().join("b"), Dtype::F16))
        .unwrap()
        .verified());
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
        .replace("\"format_version\": 1", "\"format_version\": 3");
    std::fs::write(&p, text).unwrap();
    let e = verify_err(&out);
    assert!(
        e.contains("manifest.json")
            && e.contains("format version 3")
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

/// Rewrite one layer file of `out` with `edit`, and record its new sha256 in
/// the manifest as a capture that wrote those bytes would have.
fn rewrite_layer(out: &Path, layer: usize, edit: impl FnOnce(&mut Vec<u8>)) {
    let f = out.join(layer_file_name(layer));
    let mut b = std::fs::read(&f).unwrap();
    edit(&mut b);
    std::fs::write(&f, &b).unwrap();
    let p = out.join("manifest.json");
    let mut m: Manifest = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    m.files[layer].sha256 = sha256_file(&f).unwrap();
    m.files[layer].size = b.len() as u64;
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// Byte offset of element (head, row, col) of `tensor` in a layer file.
fn offset_of(file: &[u8], tensor: &str, head: usize, row: usize, col: usize) -> usize {
    let st = safetensors::SafeTensors::deserialize(file).unwrap();
    let tv = st.tensor(tensor).unwrap();
    let (rows, cols) = (tv.shape()[1], tv.shape()[2]);
    let sz = tv.data().len() / tv.shape().iter().product::<usize>();
    tv.data().as_ptr() as usize - file.as_ptr() as usize + ((head * rows + row) * cols + col) * sz
}

#[test]
fn open_refuses_swapped_k_and_v_offsets() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let f = out.join("layer-001.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let hlen = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&b[8..8 + hlen]).unwrap();
    let (k, v) = (
        h["k"]["data_offsets"].clone(),
        h["v"]["data_offsets"].clone(),
    );
    h["k"]["data_offsets"] = v;
    h["v"]["data_offsets"] = k;
    let mut text = serde_json::to_string(&h).unwrap();
    assert!(text.len() <= hlen, "the edited header fits in place");
    text.push_str(&" ".repeat(hlen - text.len()));
    b[8..8 + hlen].copy_from_slice(text.as_bytes());
    std::fs::write(&f, b).unwrap();
    // the file is a valid safetensors file whose k and v are swapped
    assert!(Trace::open_unverified(&out).is_ok());
    assert_checksum_refused(&out, "layer-001");
}

/// A verified open refuses `out` for a checksum, naming `file`.
fn assert_checksum_refused(out: &Path, file: &str) {
    let e = Trace::open(out).err().expect("refused");
    assert!(
        matches!(e, TraceError::Checksum { .. }) && e.to_string().contains(file),
        "{e}"
    );
}

#[test]
fn open_refuses_a_layer_file_linked_to_another_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let f = out.join("layer-001.safetensors");
    std::fs::remove_file(&f).unwrap();
    std::os::unix::fs::symlink(out.join("layer-000.safetensors"), &f).unwrap();
    assert_checksum_refused(&out, "layer-001");
}

#[test]
fn a_non_finite_value_is_named_by_file_tensor_layer_head_and_position() {
    for (dtype, nan) in [
        (Dtype::F16, vec![0x00, 0x7e]),
        (Dtype::Bf16, vec![0xc0, 0x7f]),
        (Dtype::F32, vec![0x00, 0x00, 0x80, 0x7f]), // +inf
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = write_trace(tmp.path(), dtype);
        rewrite_layer(&out, 1, |b| {
            let at = offset_of(b, "k", 1, 3, 5);
            b[at..at + nan.len()].copy_from_slice(&nan);
        });
        assert!(verify(&out, &VerifyOptions::default()).is_err());
        let e = Trace::open(&out)
            .err()
            .expect("a non-finite value is refused");
        let TraceError::NonFinite {
            ref path,
            ref tensor,
            layer,
            head,
            position,
            ref value,
        } = e
        else {
            panic!("{dtype:?}: {e}")
        };
        assert_eq!(
            (tensor.as_str(), layer, head, position),
            ("k", 1, 1, 3),
            "{dtype:?}"
        );
        assert!(path.ends_with("layer-001.safetensors"));
        assert_eq!(value, if dtype == Dtype::F32 { "inf" } else { "NaN" });
        assert!(e.to_string().contains("position 3"), "{e}");
    }
}

#[test]
fn a_fifo_as_a_layer_file_is_refused_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let f = out.join("layer-001.safetensors");
    std::fs::remove_file(&f).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&f).status();
    if !made.is_ok_and(|s| s.success()) {
        println!("not run: `mkfifo` is not available here");
        return;
    }
    for e in [Trace::open(&out).err(), Trace::open_unverified(&out).err()] {
        let e = e.expect("a FIFO is refused");
        assert!(matches!(e, TraceError::NotAFile { .. }), "{e}");
        assert!(e.to_string().contains("layer-001.safetensors"), "{e}");
    }
}

#[test]
fn a_file_given_as_a_trace_is_called_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F16);
    let e = Trace::open(out.join("manifest.json"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("is a file, not a trace"), "{e}");
    assert!(!e.contains("not found"), "{e}");
}

#[test]
fn manifest_version_zero_and_absurd_model_numbers_are_refused() {
    for (field, from, to) in [
        (
            "format_version",
            "\"format_version\": 1",
            "\"format_version\": 0",
        ),
        (
            "attn_scale",
            "\"attn_scale\": 0.35355339059327373",
            "\"attn_scale\": 1e300",
        ),
        ("norm_eps", "\"norm_eps\": 0.00001,", "\"norm_eps\": -1.0,"),
        ("rope.theta", "\"theta\": 10000.0", "\"theta\": 0.0"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = write_trace(tmp.path(), Dtype::F16);
        let p = out.join("manifest.json");
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains(from), "{from} in {text}");
        std::fs::write(&p, text.replace(from, to)).unwrap();
        let e = Trace::open(&out).err().expect("refused").to_string();
        assert!(
            e.contains("manifest.json") && e.contains(field),
            "{field}: {e}"
        );
    }
}

#[test]
fn the_content_id_names_the_capture_not_the_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(&tmp.path().join("a"), Dtype::F16);
    let b = write_trace(&tmp.path().join("b"), Dtype::F16);
    let c = write_trace(&tmp.path().join("c"), Dtype::F32);
    let id = |p: &Path| Trace::open(p).unwrap().content_id().to_string();
    // same content (same manifest bytes) in two folders: one id; other bytes: another
    assert_eq!(id(&a), id(&b));
    assert_ne!(id(&a), id(&c));
    assert_eq!(id(&a).len(), 64);
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

#[test]
fn version_1_traces_still_read_and_verify() {
    // replay/tests/golden/tiny.kvtrace is a full trace of a llama-style
    // model: written as format version 1 (the lowest that describes it)
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../replay/tests/golden/tiny.kvtrace");
    let m = Manifest::read(&golden).unwrap();
    assert_eq!(m.format_version, 1);
    assert!(m.model.layers.is_empty() && !m.model.has_sliding_layers());
    assert_eq!(m.model.window(0), None);
    kvreplay_traces::verify(&golden, &kvreplay_traces::VerifyOptions::default()).unwrap();
}

#[test]
fn per_layer_attention_round_trips_and_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_trace(tmp.path(), Dtype::F32);
    let p = out.join("manifest.json");
    let mut m = Manifest::read(&out).unwrap();
    assert!(!std::fs::read_to_string(&p).unwrap().contains("\"layers\""));
    let n = m.model.n_layers;
    // per-layer attention needs version 2; a version-1 label is refused
    m.format_version = 2;
    m.model.layers = (0..n)
        .map(|l| LayerAttention {
            window: (l + 1 < n).then_some(3),
            rope_theta: 1e4,
        })
        .collect();
    let text = serde_json::to_string_pretty(&m).unwrap();
    let back = Manifest::parse(&p, &text).unwrap();
    assert_eq!(back, m);
    assert!(back.model.has_sliding_layers());
    assert_eq!(back.model.window(0), Some(3));
    let mut v1 = m.clone();
    v1.format_version = 1;
    let e = Manifest::parse(&p, &serde_json::to_string_pretty(&v1).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers") && e.contains("needs version 2"),
        "{e}"
    );
    m.model.layers.pop();
    let text = serde_json::to_string_pretty(&m).unwrap();
    let e = Manifest::parse(&p, &text).unwrap_err().to_string();
    assert!(e.contains("model.layers"), "{e}");
}
