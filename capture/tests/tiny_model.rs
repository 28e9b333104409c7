//! Capture end to end on tiny llama models the tests generate as GGUF files.

use kvreplay_capture::testing::*;
use kvreplay_capture::{capture, CaptureError, CaptureOptions, Model};
use kvreplay_traces::{verify, Dtype, Span, Trace, VerifyOptions};
use std::path::Path;

fn load(dir: &Path) -> Model {
    Model::load(&tiny_gguf(dir, &PLAIN)).unwrap()
}

/// A tiny model whose context fits the long task prompts (lengths are bounded by it).
fn load_with_context(dir: &Path, context: u64) -> Model {
    Model::load(&tiny_gguf(dir, &Tweak { context, ..PLAIN })).unwrap()
}

fn opts(out: &Path) -> CaptureOptions {
    let mut o = CaptureOptions::new("the cat saw the 42 dogs<|im_end|>", out);
    o.n_decode = 5;
    o.dtype = Dtype::F32;
    o
}

#[test]
fn tokenizer_follows_merges_digits_and_control_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let ids = m.tokenizer.encode(" the 42<|im_end|>").unwrap();
    // " the" -> Ġthe (id 261); digits split one by one (smollm); control token whole (id 2).
    let b = |c: u8| c as u32 + 3; // byte tokens follow the 3 control tokens
    assert_eq!(ids, vec![261, b(b' '), b(b'4'), b(b'2'), 2]);
    assert_eq!(m.tokenizer.decode_token(261), " the");
    let chat = m.tokenizer.apply_chat_template("  hi ").unwrap();
    assert_eq!(
        chat,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn capture_writes_a_trace_that_verifies() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let out = tmp.path().join("t.kvtrace");
    let mut o = opts(&out);
    o.spans = vec![Span {
        name: "needle".into(),
        start: 1,
        end: 3,
    }];
    let mut phases = Vec::new();
    let s = capture(&m, &o, &mut |p| phases.push(p.phase)).unwrap();
    let t = Trace::open(&out).unwrap();
    let man = &t.manifest;
    assert_eq!(man.total_len(), s.prompt_len + 5);
    assert_eq!(
        man.tokens.ids[..s.prompt_len],
        m.tokenizer.encode(&o.prompt).unwrap()[..]
    );
    assert_eq!(man.spans, o.spans);
    assert_eq!(
        (man.model.n_heads, man.model.n_kv_heads, man.model.head_dim),
        (4, 2, 8)
    );
    assert_eq!(
        man.model.source.size,
        std::fs::metadata(tmp.path().join("tiny-llama-0-smollm-false.gguf"))
            .unwrap()
            .len()
    );
    assert_eq!(t.layer(1).q(3).rows, man.total_len());
    assert!(phases.contains(&kvreplay_capture::Phase::Decode));
    let r = verify(
        &out,
        &VerifyOptions {
            positions_per_layer: 100,
            tolerance: None,
        },
    )
    .unwrap();
    assert!(r.max_rel_err < 1e-5, "{}", r.max_rel_err);
    // Column sums: each prompt query distributes probability 1, so the sums add to P.
    let total: f32 = t.layer(0).attn_colsum(2).iter().sum();
    assert!((total - s.prompt_len as f32).abs() < 1e-4, "{total}");
    assert!(!tmp.path().join("t.kvtrace.partial").exists());
}

/// Each supported pre-tokenizer splits digits its own way: smollm and qwen2
/// one digit per piece, llama-bpe up to three, gpt2 whole runs. With the merges
/// "1 2" and "12 3" in the vocabulary, only the latter two can form "123".
#[test]
fn pre_tokenizers_split_digits_as_their_models_do() {
    let tmp = tempfile::tempdir().unwrap();
    let digit = |c: u8| c as u32 + 3;
    let t123 = 263;
    for (pre, want) in [
        (
            "smollm",
            vec![
                digit(b'1'),
                digit(b'2'),
                digit(b'3'),
                digit(b'4'),
                digit(b'5'),
            ],
        ),
        (
            "qwen2",
            vec![
                digit(b'1'),
                digit(b'2'),
                digit(b'3'),
                digit(b'4'),
                digit(b'5'),
            ],
        ),
        ("llama-bpe", vec![t123, digit(b'4'), digit(b'5')]),
        ("gpt2", vec![t123, digit(b'4'), digit(b'5')]),
    ] {
        let m = Model::load(&tiny_gguf(tmp.path(), &Tweak { pre, ..PLAIN })).unwrap();
        assert_eq!(
            m.tokenizer.encode("12345").unwrap(),
            want,
            "pre-tokenizer {pre}"
        );
    }
    let e = err_of(Model::load(&tiny_gguf(
        tmp.path(),
        &Tweak {
            pre: "falcon",
            ..PLAIN
        },
    )));
    assert!(
        e.contains("pre-tokenizer `falcon`") && e.contains("llama-bpe"),
        "{e}"
    );
}

/// An explicit output head equal to the embedding gives the tied model's trace.
#[test]
fn untied_output_head_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let tied = load(tmp.path());
    let untied = Model::load(&tiny_gguf(
        tmp.path(),
        &Tweak {
            untied: true,
            ..PLAIN
        },
    ))
    .unwrap();
    assert!(tied.llama.lm_head.is_none() && untied.llama.lm_head.is_some());
    let (a, b) = (tmp.path().join("a.kvtrace"), tmp.path().join("b.kvtrace"));
    capture(&tied, &opts(&a), &mut |_| {}).unwrap();
    capture(&untied, &opts(&b), &mut |_| {}).unwrap();
    assert_eq!(read_all(&a), read_all(&b));
}

fn read_all(dir: &Path) -> Vec<Vec<u8>> {
    (0..LAYERS)
        .map(|l| std::fs::read(dir.join(format!("layer-{l:03}.safetensors"))).unwrap())
        .collect()
}

#[test]
fn trace_is_bit_identical_for_any_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let run = |threads: usize| {
        let out = tmp.path().join(format!("t{threads}.kvtrace"));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| capture(&m, &opts(&out), &mut |_| {}))
            .unwrap();
        read_all(&out)
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

#[test]
fn chunked_prefill_matches_one_chunk() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let a = tmp.path().join("a.kvtrace");
    let b = tmp.path().join("b.kvtrace");
    capture(&m, &opts(&a), &mut |_| {}).unwrap();
    let mut ob = opts(&b);
    ob.prefill_chunk = 3;
    capture(&m, &ob, &mut |_| {}).unwrap();
    let (ta, tb) = (Trace::open(&a).unwrap(), Trace::open(&b).unwrap());
    assert_eq!(ta.manifest.tokens.ids, tb.manifest.tokens.ids);
    for l in 0..LAYERS {
        for h in 0..4 {
            let (x, y) = (ta.layer(l).o(h).to_f32(), tb.layer(l).o(h).to_f32());
            for (p, q) in x.iter().zip(&y) {
                // same arithmetic up to gemm blocking over the chunk: f32 rounding only
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + p.abs()),
                    "layer {l} head {h}: {p} vs {q}"
                );
            }
            let (ca, cb) = (ta.layer(l).attn_colsum(h), tb.layer(l).attn_colsum(h));
            for (p, q) in ca.iter().zip(cb) {
                assert!((p - q).abs() < 1e-5, "colsum {p} vs {q}");
            }
        }
    }
}

#[test]
fn attention_probabilities_agree_with_column_sums() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let out = tmp.path().join("p.kvtrace");
    let mut o = opts(&out);
    o.attn_probs = true;
    o.prefill_chunk = 4;
    let s = capture(&m, &o, &mut |_| {}).unwrap();
    let t = Trace::open(&out).unwrap();
    let (p, n) = (s.prompt_len, t.manifest.total_len());
    let probs = t.layer(1).attn_probs(3).unwrap().to_f32(); // (T, T)
    for i in 0..n {
        let row = &probs[i * n..(i + 1) * n];
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5, "row {i}");
        assert!(row[i + 1..].iter().all(|x| *x == 0.0), "row {i} is causal");
    }
    let colsum = t.layer(1).attn_colsum(3);
    for j in 0..p {
        let want: f32 = (0..p).map(|i| probs[i * n + j]).sum();
        assert!((colsum[j] - want).abs() < 1e-5, "column {j}");
    }
}

fn err_of(r: Result<impl Sized, CaptureError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_models_are_explained() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    let e = err_of(Model::load(&p.join("nope.gguf")));
    assert!(e.contains("nope.gguf") && e.contains("No such file"), "{e}");
    std::fs::write(
        p.join("text.gguf"),
        "hello, this is not a model file at all",
    )
    .unwrap();
    let e = err_of(Model::load(&p.join("text.gguf")));
    assert!(
        e.contains("text.gguf") && e.contains("not a GGUF model file"),
        "{e}"
    );
    let e = err_of(Model::load(&tiny_gguf(
        p,
        &Tweak {
            arch: "falcon",
            ..PLAIN
        },
    )));
    assert!(
        e.contains("architecture `falcon` is not supported") && e.contains("llama"),
        "{e}"
    );
    let e = err_of(Model::load(&tiny_gguf(
        p,
        &Tweak {
            ffn_up_type: 7,
            ..PLAIN
        },
    )));
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("Q5_1") && e.contains("cannot dequantise"),
        "{e}"
    );
    let good = tiny_gguf(p, &PLAIN);
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(p.join("cut.gguf"), &bytes[..bytes.len() / 2]).unwrap();
    let e = err_of(Model::load(&p.join("cut.gguf")));
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
}

#[test]
fn bad_capture_inputs_are_explained_and_leave_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let out = tmp.path().join("x.kvtrace");
    let mut o = opts(&out);
    o.prompt = String::new();
    assert!(matches!(
        capture(&m, &o, &mut |_| {}),
        Err(CaptureError::EmptyPrompt)
    ));
    o.prompt = "word ".repeat(40); // 80 tokens > context 64
    let e = err_of(capture(&m, &o, &mut |_| {}));
    assert!(e.contains("context is 64 tokens"), "{e}");
    o.prompt = "the cat".into();
    o.spans = vec![Span {
        name: "q".into(),
        start: 2,
        end: 99,
    }];
    let e = err_of(capture(&m, &o, &mut |_| {}));
    assert!(e.contains("span `q`"), "{e}");
    assert!(!out.exists() && !tmp.path().join("x.kvtrace.partial").exists());
    // An existing output needs --force.
    capture(&m, &opts(&out), &mut |_| {}).unwrap();
    let e = err_of(capture(&m, &opts(&out), &mut |_| {}));
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
    // Unwritable output: its parent is a regular file.
    std::fs::write(tmp.path().join("file"), "x").unwrap();
    let e = err_of(capture(
        &m,
        &opts(&tmp.path().join("file/y.kvtrace")),
        &mut |_| {},
    ));
    assert!(e.contains("file"), "{e}");
}

#[test]
fn task_lengths_that_cannot_hold_the_task_are_refused() {
    // passkey:length=40 once dropped its pass key and span silently, and
    // multifact:length=1,facts=1 panicked
    let tmp = tempfile::tempdir().unwrap();
    let m = load_with_context(tmp.path(), 4096);
    for spec in ["passkey:length=40,depth=0.5", "multifact:length=1,facts=1"] {
        let e = match kvreplay_capture::tasks::build(spec, &m) {
            Ok(_) => panic!("{spec} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("cannot hold it") && e.contains("use length="),
            "{spec}: {e}"
        );
    }
    let t = kvreplay_capture::tasks::build("multifact:length=4000,facts=3", &m).unwrap();
    assert!(t.spans.iter().any(|s| s.0 == "needle"));
}

#[test]
fn absurd_task_lengths_are_refused_before_building_filler() {
    // length=10^15 once built filler sentences until memory ran out
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    for spec in [
        "passkey:length=1000000000000000",
        "multifact:length=50,facts=1000000000000",
    ] {
        let e = match kvreplay_capture::tasks::build(spec, &m) {
            Ok(_) => panic!("{spec} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(spec), "{spec}: {e}");
    }
}

#[test]
fn a_pass_key_at_depth_one_keeps_its_needle() {
    // depth 1 puts the needle after the last filler sentence, not nowhere
    let tmp = tempfile::tempdir().unwrap();
    let m = load_with_context(tmp.path(), 4096);
    let t = kvreplay_capture::tasks::build("passkey:length=2000,depth=1", &m).unwrap();
    let needle = t
        .spans
        .iter()
        .find(|s| s.0 == "needle")
        .expect("a needle span");
    assert!(t.text[needle.1.clone()].contains("68142"));
    let q = t.spans.iter().find(|s| s.0 == "question").unwrap();
    assert!(
        needle.1.end <= q.1.start,
        "the needle comes before the question"
    );
}

/// `--keep lean`: the same forward pass, with q and o stored for the last N
/// prompt positions and the decode steps only; every stored value equals the
/// full capture's, and the lean trace verifies.
#[test]
fn lean_capture_stores_the_same_values_for_the_kept_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path());
    let (full, lean) = (tmp.path().join("f.kvtrace"), tmp.path().join("l.kvtrace"));
    capture(&m, &opts(&full), &mut |_| {}).unwrap();
    let mut o = opts(&lean);
    o.keep_queries = Some(3);
    capture(&m, &o, &mut |_| {}).unwrap();
    let (f, l) = (Trace::open(&full).unwrap(), Trace::open(&lean).unwrap());
    let (p, t) = (f.manifest.prompt_len(), f.manifest.total_len());
    assert_eq!(l.manifest.capture.keep_queries, Some(3));
    assert_eq!(
        (l.manifest.query_start(), l.manifest.format_version),
        (p - 3, 2)
    );
    assert_eq!(l.manifest.tokens, f.manifest.tokens);
    for layer in 0..f.n_layers() {
        let (a, b) = (f.layer(layer), l.layer(layer));
        for g in 0..f.manifest.model.n_kv_heads {
            assert_eq!(a.k(g).bytes(), b.k(g).bytes());
            assert_eq!(a.v(g).bytes(), b.v(g).bytes());
        }
        for h in 0..f.manifest.model.n_heads {
            assert_eq!(a.attn_colsum(h), b.attn_colsum(h));
            assert_eq!(b.q(h).positions(), p - 3..t);
            let n = (t - (p - 3)) * f.manifest.model.head_dim;
            let tail = |x: &[f32]| x[x.len() - n..].to_vec();
            assert_eq!(
                b.q(h).to_f32(),
                tail(&a.q(h).to_f32()),
                "layer {layer} q{h}"
            );
            assert_eq!(
                b.o(h).to_f32(),
                tail(&a.o(h).to_f32()),
                "layer {layer} o{h}"
            );
        }
    }
    assert!(f_sizes(&lean) < f_sizes(&full));
    verify(&lean, &VerifyOptions::default()).unwrap();
}

fn f_sizes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}
