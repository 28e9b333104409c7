//! The `gemma3` architecture end to end on a tiny generated GGUF: the
//! SentencePiece tokenizer, the per-layer window and RoPE base in the
//! manifest, and `verify`'s windowed recomputation of o.

use kvreplay_capture::testing::*;
use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_traces::{verify, Dtype, Trace, VerifyOptions};

// Piece ids of `spm_vocab`: 4 control pieces, 256 byte pieces, then these.
const THE: u32 = 268;
const SP_THE: u32 = 269;
const SP_CAT: u32 = 272;
const NEWLINE: u32 = 273;
fn byte(b: u8) -> u32 {
    4 + b as u32
}

#[test]
fn spm_merges_by_score_falls_back_to_bytes_and_adds_bos() {
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny_gemma3_gguf(tmp.path())).unwrap();
    let t = &m.tokenizer;
    // "the▁cat": th (-7) first, then the (-9), ▁c (-11), at (-12), ▁cat (-13);
    // "\n" is a user-defined piece matched whole; BOS (2) first.
    assert_eq!(
        t.encode("the cat\nthe").unwrap(),
        vec![2, THE, SP_CAT, NEWLINE, THE]
    );
    // no space prefix: a leading space is a ▁ of its own text
    assert_eq!(t.encode(" the").unwrap(), vec![2, SP_THE]);
    // characters without a piece fall back to their UTF-8 bytes
    assert_eq!(
        t.encode("zé").unwrap(),
        vec![2, byte(b'z'), byte(0xC3), byte(0xA9)]
    );
    assert_eq!(t.decode(&[THE, SP_CAT, byte(0xC3), byte(0xA9)]), "the caté");
    let (ids, offs) = t.encode_with_offsets("the cat").unwrap();
    assert_eq!(ids, vec![2, THE, SP_CAT]);
    assert_eq!(offs, vec![(0, 0), (0, 3), (3, 7)]);
}

#[test]
fn gemma3_capture_records_windows_and_verifies_with_them() {
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny_gemma3_gguf(tmp.path())).unwrap();
    let cfg = &m.llama.cfg;
    assert_eq!(cfg.n_kv_heads, 1);
    assert_eq!(cfg.head_dim, HEAD_DIM as usize);
    assert_eq!(cfg.embed_scale, Some((D_MODEL as f32).sqrt()));
    let out = tmp.path().join("g.kvtrace");
    let mut o = CaptureOptions::new("the cat the cat the cat the cat", &out);
    o.n_decode = 4;
    o.dtype = Dtype::F32;
    o.prefill_chunk = 3;
    let s = capture(&m, &o, &mut |_| {}).unwrap();
    assert!(
        s.prompt_len > GEMMA3_WINDOW as usize + 2,
        "the window must cut"
    );
    let t = Trace::open(&out).unwrap();
    let layers = &t.manifest.model.layers;
    assert_eq!(layers.len(), GEMMA3_LAYERS);
    for (l, la) in layers.iter().enumerate() {
        if l == 5 {
            assert_eq!((la.window, la.rope_theta), (None, 1e6));
        } else {
            assert_eq!(
                (la.window, la.rope_theta),
                (Some(GEMMA3_WINDOW as usize), 1e4)
            );
        }
    }
    let r = verify(&out, &VerifyOptions::default()).unwrap();
    assert!(r.max_rel_err < 1e-5, "{}", r.max_rel_err);
    // Without the per-layer list, verify recomputes full attention on the
    // sliding layers and finds the stored o wrong: the window mattered.
    let p = out.join("manifest.json");
    let mut man: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    man["model"].as_object_mut().unwrap().remove("layers");
    std::fs::write(&p, serde_json::to_string_pretty(&man).unwrap()).unwrap();
    let e = verify(&out, &VerifyOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer-000"), "{e}");
}
