//! Capture end to end on tiny llama models the tests generate as GGUF files.

use kvreplay_capture::gguf::write::{gguf_bytes, RawTensor};
use kvreplay_capture::gguf::MetaValue;
use kvreplay_capture::{capture, CaptureError, CaptureOptions, Model};
use kvreplay_traces::{verify, Dtype, Span, Trace, VerifyOptions};
use std::path::{Path, PathBuf};

const D_MODEL: u64 = 32;
const HEADS: u64 = 4;
const KV_HEADS: u64 = 2;
const HEAD_DIM: u64 = 8;
const FFN: u64 = 64;
const LAYERS: usize = 2;
const CONTROL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [&str; 5] = ["Ġ t", "h e", "Ġt he", "1 2", "12 3"];

/// GPT-2's printable stand-in for every byte.
fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        out[*b as usize] = char::from_u32(c).unwrap();
    }
    out
}

fn vocab() -> (Vec<String>, Vec<u64>) {
    let mut tokens: Vec<String> = CONTROL.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_chars().into_iter().map(String::from));
    tokens.extend(["Ġt", "he", "Ġthe", "12", "123"].map(String::from));
    let types = tokens
        .iter()
        .enumerate()
        .map(|(i, _)| if i < 3 { 3 } else { 1 })
        .collect();
    (tokens, types)
}

fn weights(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i.wrapping_add(seed * 7919)).wrapping_mul(0x9E3779B97F4A7C15) >> 40;
            ((h % 2001) as f32 / 1000.0 - 1.0) * scale
        })
        .collect()
}

fn f32_tensor(name: &str, dims: &[u64], seed: u64, scale: f32) -> RawTensor {
    let n = dims.iter().product::<u64>() as usize;
    RawTensor {
        name: name.into(),
        dims: dims.to_vec(),
        ggml_type: 0,
        data: weights(n, seed, scale)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    }
}

/// Q8_0 blocks: scale = max|x| / 127, q = round(x / scale).
fn q8_0_tensor(name: &str, dims: &[u64], seed: u64, scale: f32) -> RawTensor {
    let n = dims.iter().product::<u64>() as usize;
    let w = weights(n, seed, scale);
    let mut data = Vec::new();
    for block in w.chunks(32) {
        let d = block.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        data.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        data.extend(block.iter().map(|x| (x / d).round() as i8 as u8));
    }
    RawTensor {
        name: name.into(),
        dims: dims.to_vec(),
        ggml_type: 8,
        data,
    }
}

struct Tweak {
    arch: &'static str,
    /// ggml type written for blk.0.ffn_up (0 = F32).
    ffn_up_type: u32,
    context: u64,
    pre: &'static str,
    /// Write an explicit output.weight (equal to the dequantised embedding).
    untied: bool,
}

const PLAIN: Tweak = Tweak {
    arch: "llama",
    ffn_up_type: 0,
    context: 64,
    pre: "smollm",
    untied: false,
};

fn tiny_gguf(dir: &Path, tweak: &Tweak) -> PathBuf {
    let (tokens, types) = vocab();
    let v = tokens.len() as u64;
    let a = tweak.arch;
    let meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.name".into(), MetaValue::Str("tiny".into())),
        (format!("{a}.block_count"), MetaValue::Uint(LAYERS as u64)),
        (format!("{a}.context_length"), MetaValue::Uint(tweak.context)),
        (format!("{a}.embedding_length"), MetaValue::Uint(D_MODEL)),
        (format!("{a}.feed_forward_length"), MetaValue::Uint(FFN)),
        (format!("{a}.attention.head_count"), MetaValue::Uint(HEADS)),
        (format!("{a}.attention.head_count_kv"), MetaValue::Uint(KV_HEADS)),
        (format!("{a}.rope.freq_base"), MetaValue::Float(10000.0)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), MetaValue::Float(1e-5)),
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), MetaValue::Str(tweak.pre.into())),
        ("tokenizer.ggml.tokens".into(), MetaValue::Array(tokens.into_iter().map(MetaValue::Str).collect())),
        ("tokenizer.ggml.token_type".into(), MetaValue::Array(types.into_iter().map(MetaValue::Uint).collect())),
        ("tokenizer.ggml.merges".into(), MetaValue::Array(MERGES.iter().map(|m| MetaValue::Str(m.to_string())).collect())),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::Uint(2)),
        ("tokenizer.chat_template".into(), MetaValue::Str("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into())),
    ];
    let (d, q, kv, f) = (D_MODEL, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, FFN);
    let embd = q8_0_tensor("token_embd.weight", &[d, v], 1, 1.0);
    let mut t = vec![f32_tensor("output_norm.weight", &[d], 2, 1.0)];
    if tweak.untied {
        let mut deq = vec![0f32; (d * v) as usize];
        kvreplay_kernels::cpu::dequantize(
            kvreplay_kernels::cpu::BlockType::Q8_0,
            &embd.data,
            &mut deq,
        )
        .unwrap();
        let data = deq.iter().flat_map(|x| x.to_le_bytes()).collect();
        t.push(RawTensor {
            name: "output.weight".into(),
            dims: vec![d, v],
            ggml_type: 0,
            data,
        });
    }
    t.push(embd);
    for l in 0..LAYERS as u64 {
        let s = 100 * (l + 1);
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        t.push(f32_tensor(&n("attn_norm"), &[d], s + 1, 1.0));
        t.push(f32_tensor(&n("attn_q"), &[d, q], s + 2, 0.5));
        t.push(f32_tensor(&n("attn_k"), &[d, kv], s + 3, 0.5));
        t.push(f32_tensor(&n("attn_v"), &[d, kv], s + 4, 0.5));
        t.push(f32_tensor(&n("attn_output"), &[q, d], s + 5, 0.3));
        t.push(f32_tensor(&n("ffn_norm"), &[d], s + 6, 1.0));
        t.push(f32_tensor(&n("ffn_gate"), &[d, f], s + 7, 0.3));
        let mut up = f32_tensor(&n("ffn_up"), &[d, f], s + 8, 0.3);
        if l == 0 && tweak.ffn_up_type != 0 {
            up.ggml_type = tweak.ffn_up_type;
        }
        t.push(up);
        t.push(f32_tensor(&n("ffn_down"), &[f, d], s + 9, 0.3));
    }
    let meta_refs: Vec<(&str, MetaValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let path = dir.join(format!(
        "tiny-{a}-{}-{}-{}.gguf",
        tweak.ffn_up_type, tweak.pre, tweak.untied
    ));
    std::fs::write(&path, gguf_bytes(&meta_refs, &t)).unwrap();
    path
}

fn load(dir: &Path) -> Model {
    Model::load(&tiny_gguf(dir, &PLAIN)).unwrap()
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
            ffn_up_type: 6,
            ..PLAIN
        },
    )));
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("Q5_0") && e.contains("cannot dequantise"),
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
