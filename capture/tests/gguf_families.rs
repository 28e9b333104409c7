//! qwen2 and qwen3 from GGUF: the same random weights written once as a tiny
//! GGUF in llama.cpp's layout (architecture `qwen2`/`qwen3`, tensors
//! `blk.N.attn_q.bias`, `blk.N.attn_q_norm.weight`, ..., Q/K rows in the HF
//! order because llama.cpp runs these with NEOX RoPE and its converter does
//! not permute them) and once as a tiny HF checkpoint (config.json +
//! safetensors). Both must load to the same architecture description and
//! compute the same q/k/v/o, logits and greedy tokens. The HF path itself is
//! checked against an f64 reference in hf_tiny.rs. GGUFs with parts this
//! build does not run are refused naming the file and the key or tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvreplay_capture::gguf::write::RawTensor;
use kvreplay_capture::gguf::MetaValue;
use kvreplay_capture::llama::{ForwardOptions, KvCache, Llama};
use kvreplay_capture::testing::{tiny_gguf_bytes, vocab, weights, Tweak, PLAIN};
use kvreplay_capture::{capture, CaptureOptions, Model};
use serde_json::json;

const D: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FFN: usize = 48;
const LAYERS: usize = 2;
const CONTEXT: usize = 64;

struct Family {
    arch: &'static str,
    head_dim: usize,
    qkv_bias: bool,
    qk_norm: bool,
    tied: bool,
}

const QWEN2: Family = Family {
    arch: "qwen2",
    head_dim: 8,
    qkv_bias: true,
    qk_norm: false,
    tied: true,
};

const QWEN3: Family = Family {
    arch: "qwen3",
    head_dim: 12, // not D / HEADS: GGUF says so with attention.key_length
    qkv_bias: false,
    qk_norm: true,
    tied: false,
};

/// One tensor under both names: HF name, GGUF name, HF shape (out, in).
struct T {
    hf: String,
    gguf: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

fn tensors(f: &Family, v: usize) -> Vec<T> {
    let mut out = Vec::new();
    let mut seed = 7u64;
    let mut add = |hf: String, gguf: String, shape: Vec<usize>, scale: f32, offset: f32| {
        seed += 1;
        let n = shape.iter().product();
        let data = weights(n, seed, scale).iter().map(|x| x + offset).collect();
        out.push(T {
            hf,
            gguf,
            shape,
            data,
        });
    };
    let (hd, q, kv) = (f.head_dim, HEADS * f.head_dim, KV_HEADS * f.head_dim);
    add(
        "model.embed_tokens.weight".into(),
        "token_embd.weight".into(),
        vec![v, D],
        1.0,
        0.0,
    );
    add(
        "model.norm.weight".into(),
        "output_norm.weight".into(),
        vec![D],
        0.2,
        1.0,
    );
    if !f.tied {
        add(
            "lm_head.weight".into(),
            "output.weight".into(),
            vec![v, D],
            0.3,
            0.0,
        );
    }
    for l in 0..LAYERS {
        let mut t = |hf: &str, gguf: &str, shape: Vec<usize>, scale: f32, offset: f32| {
            add(
                format!("model.layers.{l}.{hf}"),
                format!("blk.{l}.{gguf}"),
                shape,
                scale,
                offset,
            )
        };
        t(
            "input_layernorm.weight",
            "attn_norm.weight",
            vec![D],
            0.2,
            1.0,
        );
        t(
            "self_attn.q_proj.weight",
            "attn_q.weight",
            vec![q, D],
            0.3,
            0.0,
        );
        t(
            "self_attn.k_proj.weight",
            "attn_k.weight",
            vec![kv, D],
            0.3,
            0.0,
        );
        t(
            "self_attn.v_proj.weight",
            "attn_v.weight",
            vec![kv, D],
            0.3,
            0.0,
        );
        t(
            "self_attn.o_proj.weight",
            "attn_output.weight",
            vec![D, q],
            0.3,
            0.0,
        );
        if f.qkv_bias {
            t("self_attn.q_proj.bias", "attn_q.bias", vec![q], 0.5, 0.0);
            t("self_attn.k_proj.bias", "attn_k.bias", vec![kv], 0.5, 0.0);
            t("self_attn.v_proj.bias", "attn_v.bias", vec![kv], 0.5, 0.0);
        }
        if f.qk_norm {
            t(
                "self_attn.q_norm.weight",
                "attn_q_norm.weight",
                vec![hd],
                0.3,
                1.0,
            );
            t(
                "self_attn.k_norm.weight",
                "attn_k_norm.weight",
                vec![hd],
                0.3,
                1.0,
            );
        }
        t(
            "post_attention_layernorm.weight",
            "ffn_norm.weight",
            vec![D],
            0.2,
            1.0,
        );
        t(
            "mlp.gate_proj.weight",
            "ffn_gate.weight",
            vec![FFN, D],
            0.3,
            0.0,
        );
        t(
            "mlp.up_proj.weight",
            "ffn_up.weight",
            vec![FFN, D],
            0.3,
            0.0,
        );
        t(
            "mlp.down_proj.weight",
            "ffn_down.weight",
            vec![D, FFN],
            0.3,
            0.0,
        );
    }
    out
}

fn raw(name: &str, shape: &[usize], data: &[f32]) -> RawTensor {
    RawTensor {
        name: name.into(),
        // GGUF lists dimensions innermost first; the bytes are the same
        // row-major (out, in) matrix as the safetensors'.
        dims: shape.iter().rev().map(|&n| n as u64).collect(),
        ggml_type: 0,
        data: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn tweak(arch: &'static str) -> Tweak {
    Tweak {
        arch,
        context: CONTEXT as u64,
        ..PLAIN
    }
}

/// The family's GGUF bytes, as llama.cpp's converter lays them out, after
/// `edit`.
fn gguf_bytes(
    f: &Family,
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<RawTensor>),
) -> Vec<u8> {
    let v = vocab().0.len();
    let ts = tensors(f, v);
    tiny_gguf_bytes(&tweak(f.arch), |meta, raws| {
        let a = f.arch;
        for (k, val) in [
            ("rope.freq_base", MetaValue::Float(1_000_000.0)),
            ("attention.layer_norm_rms_epsilon", MetaValue::Float(1e-6)),
            ("feed_forward_length", MetaValue::Uint(FFN as u64)),
            ("attention.key_length", MetaValue::Uint(f.head_dim as u64)),
            ("attention.value_length", MetaValue::Uint(f.head_dim as u64)),
        ] {
            meta.retain(|(kk, _)| *kk != format!("{a}.{k}"));
            meta.push((format!("{a}.{k}"), val));
        }
        *raws = ts.iter().map(|t| raw(&t.gguf, &t.shape, &t.data)).collect();
        edit(meta, raws);
    })
}

fn write_gguf(dir: &Path, f: &Family) -> PathBuf {
    let path = dir.join(format!("tiny-{}.gguf", f.arch));
    std::fs::write(&path, gguf_bytes(f, |_, _| {})).unwrap();
    path
}

fn write_hf(dir: &Path, f: &Family) -> PathBuf {
    let v = vocab().0.len();
    let dir = dir.join(format!("{}-hf", f.arch));
    std::fs::create_dir_all(&dir).unwrap();
    let ts = tensors(f, v);
    let bytes: BTreeMap<&str, Vec<u8>> = ts
        .iter()
        .map(|t| {
            (
                t.hf.as_str(),
                t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = ts
        .iter()
        .map(|t| {
            (
                t.hf.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    t.shape.clone(),
                    &bytes[t.hf.as_str()],
                )
                .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let cfg = json!({
        "model_type": f.arch,
        "hidden_size": D, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": f.head_dim,
        "vocab_size": v, "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_scaling": null,
        "hidden_act": "silu", "tie_word_embeddings": f.tied, "attention_bias": false,
        "use_sliding_window": false, "sliding_window": null,
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    // A WordLevel tokenizer is enough: the comparison feeds token ids.
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "b": 2}, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    dir
}

/// Per layer q, k, v, o of a prefill, its logits, then `n` greedy tokens.
fn run(m: &Llama, ids: &[u32], n: usize) -> (Vec<[Vec<f32>; 4]>, Vec<f32>, Vec<u32>) {
    let opts = || ForwardOptions {
        colsum: None,
        probs: false,
        attention: None,
    };
    let mut cache = KvCache::new(&m.cfg, ids.len() + n);
    let mut taps = Vec::new();
    let logits = m
        .forward(ids, 0, &mut cache, opts(), &mut |t| {
            taps.push([t.q.to_vec(), t.k.to_vec(), t.v.to_vec(), t.o.to_vec()])
        })
        .unwrap();
    let mut tokens = vec![Llama::greedy(&logits)];
    for i in 0..n - 1 {
        let l = m
            .forward(
                &tokens[i..i + 1],
                ids.len() + i,
                &mut cache,
                opts(),
                &mut |_| {},
            )
            .unwrap();
        tokens.push(Llama::greedy(&l));
    }
    (taps, logits, tokens)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check(f: &Family) {
    let tmp = tempfile::tempdir().unwrap();
    let g = Model::load(&write_gguf(tmp.path(), f)).unwrap();
    let h = Model::load(&write_hf(tmp.path(), f)).unwrap();
    assert_eq!(g.architecture, f.arch);
    assert_eq!(h.architecture, f.arch);
    // The whole architecture description agrees: no permutation (NEOX
    // RoPE), q/k norms for qwen3, head_dim from key_length, eps, RoPE base.
    assert_eq!(g.llama.cfg, h.llama.cfg);
    assert!(!g.llama.cfg.permuted_qk);
    assert_eq!(g.llama.cfg.qk_norm, f.qk_norm);
    assert_eq!(g.llama.cfg.head_dim, f.head_dim);
    for w in &g.llama.layers {
        assert_eq!(w.bq.is_some(), f.qkv_bias);
        assert_eq!(w.bk.is_some(), f.qkv_bias);
        assert_eq!(w.bv.is_some(), f.qkv_bias);
        assert!(w.bo.is_none());
    }
    assert_eq!(g.llama.lm_head.is_none(), f.tied);
    let v = g.llama.cfg.vocab_size as u32;
    let ids: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % v).collect();
    let (ta, la, ga) = run(&g.llama, &ids, 8);
    let (tb, lb, gb) = run(&h.llama, &ids, 8);
    assert_eq!(ta.len(), LAYERS);
    // Same f32 weights, same config, same code path: the results must be
    // bit-identical; any difference means the GGUF path mapped something
    // differently (a permutation, a missing bias or norm).
    let mut worst = 0f32;
    for (l, (a, b)) in ta.iter().zip(&tb).enumerate() {
        for (name, x, y) in [
            ("q", &a[0], &b[0]),
            ("k", &a[1], &b[1]),
            ("v", &a[2], &b[2]),
            ("o", &a[3], &b[3]),
        ] {
            let e = max_abs_diff(x, y);
            assert_eq!(e, 0.0, "{}: layer {l} {name} differs by {e:e}", f.arch);
            worst = worst.max(e);
        }
    }
    let el = max_abs_diff(&la, &lb);
    assert_eq!(el, 0.0, "{}: logits differ by {el:e}", f.arch);
    assert_eq!(ga, gb, "{}: greedy tokens", f.arch);
    eprintln!(
        "{} GGUF vs HF: q/k/v/o max |diff| {worst:e}, logits {el:e}, greedy {ga:?}",
        f.arch
    );
    // End to end from the GGUF: the manifest names the architecture and NEOX RoPE.
    let out = tmp.path().join("trace");
    let mut o = CaptureOptions::new("the 123 the", &out);
    o.n_decode = 3;
    o.dtype = kvreplay_traces::Dtype::F32;
    capture(&g, &o, &mut |_| {}).unwrap();
    let tr = kvreplay_traces::Trace::open(&out).unwrap();
    assert_eq!(tr.manifest.model.architecture, f.arch);
    assert_eq!(
        tr.manifest.model.rope.style,
        kvreplay_traces::RopeStyle::Neox
    );
}

#[test]
fn qwen2_gguf_with_qkv_biases_matches_the_hf_checkpoint() {
    check(&QWEN2);
}

#[test]
fn qwen3_gguf_with_qk_norms_matches_the_hf_checkpoint() {
    check(&QWEN3);
}

fn err_of(bytes: Vec<u8>) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.gguf");
    std::fs::write(&path, bytes).unwrap();
    match Model::load(&path) {
        Ok(_) => panic!("loaded"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("bad.gguf"), "{msg}");
            msg
        }
    }
}

#[test]
fn unsupported_gguf_architectures_and_parts_are_refused_naming_file_and_key() {
    // An architecture llama.cpp writes but this build does not run.
    let e = err_of(tiny_gguf_bytes(&tweak("qwen2moe"), |_, _| {}));
    assert!(e.contains("`qwen2moe` is not supported"), "{e}");
    // qwen2 without its q bias
    let e = err_of(gguf_bytes(&QWEN2, |_, t| {
        t.retain(|t| t.name != "blk.1.attn_q.bias")
    }));
    assert!(e.contains("blk.1.attn_q.bias"), "{e}");
    // an o bias (llama.cpp's qwen2 has none): refused, not ignored
    let e = err_of(gguf_bytes(&QWEN2, |_, t| {
        t.push(raw("blk.0.attn_output.bias", &[D], &[0.5; D]))
    }));
    assert!(e.contains("blk.0.attn_output.bias"), "{e}");
    // qwen3 without a k norm
    let e = err_of(gguf_bytes(&QWEN3, |_, t| {
        t.retain(|t| t.name != "blk.0.attn_k_norm.weight")
    }));
    assert!(e.contains("blk.0.attn_k_norm.weight"), "{e}");
    // q/k norms on a llama file are not applied, so they are refused
    let e = err_of(tiny_gguf_bytes(&PLAIN, |_, t| {
        t.push(raw("blk.0.attn_q_norm.weight", &[8], &[1.0; 8]))
    }));
    assert!(e.contains("blk.0.attn_q_norm.weight"), "{e}");
    // YaRN (what llama.cpp's Qwen2 converter writes for rope_scaling yarn)
    let e = err_of(gguf_bytes(&QWEN2, |m, _| {
        m.push((
            "qwen2.rope.scaling.type".into(),
            MetaValue::Str("yarn".into()),
        ));
        m.push(("qwen2.rope.scaling.factor".into(), MetaValue::Float(4.0)));
    }));
    assert!(e.contains("qwen2.rope.scaling.type"), "{e}");
    // a sliding window on an architecture llama.cpp runs without one
    let e = err_of(gguf_bytes(&QWEN3, |m, _| {
        m.push(("qwen3.attention.sliding_window".into(), MetaValue::Uint(4)))
    }));
    assert!(e.contains("qwen3.attention.sliding_window"), "{e}");
    // Llama 3.1-style frequency factors stay refused on the new architectures
    let e = err_of(gguf_bytes(&QWEN2, |_, t| {
        t.push(raw("rope_freqs.weight", &[4], &[1.0; 4]))
    }));
    assert!(e.contains("rope_freqs.weight"), "{e}");
}
