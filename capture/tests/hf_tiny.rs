//! HF checkpoint directories: tiny random-weight checkpoints of each family
//! (qwen2 q/k/v biases, qwen3 q/k norms and an explicit head_dim, mistral
//! with a sliding window shorter than the prompt, llama with Llama 3 RoPE
//! scaling, o bias and sharded weights), written here as config.json +
//! safetensors + a WordLevel tokenizer.json, loaded by `Model::load`, and
//! checked against a straightforward f64 forward pass written in this file
//! from the HF modeling code (not from capture's). Bad checkpoints give
//! errors naming the file and the field or tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvreplay_capture::llama::{ForwardOptions, KvCache};
use kvreplay_capture::testing::weights;
use kvreplay_capture::{capture, CaptureOptions, Model};
use serde_json::{json, Value};

const VOCAB_WORDS: usize = 30;

#[derive(Clone, Copy, PartialEq)]
enum Dt {
    F32,
    F16,
    Bf16,
}

struct Spec {
    model_type: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    layers: usize,
    vocab: usize,
    dtype: Dt,
    tied: bool,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool,
    /// per layer window
    windows: Vec<Option<usize>>,
    theta: f64,
    /// (factor, low, high, original)
    llama3: Option<(f64, f64, f64, f64)>,
    shards: bool,
    config: Value,
}

fn base(model_type: &'static str) -> Spec {
    Spec {
        model_type,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn: 48,
        layers: 2,
        vocab: VOCAB_WORDS + 2 + 6, // padded past the tokenizer, as Qwen's are
        dtype: Dt::F32,
        tied: false,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        windows: vec![None, None],
        theta: 10000.0,
        llama3: None,
        shards: false,
        config: json!({}),
    }
}

fn qwen2() -> Spec {
    let mut s = base("qwen2");
    s.qkv_bias = true;
    s.tied = true;
    s.theta = 1_000_000.0;
    s
}

fn qwen3() -> Spec {
    let mut s = base("qwen3");
    s.qk_norm = true;
    s.head_dim = 12; // not hidden / heads
    s.dtype = Dt::Bf16;
    s.config = json!({"head_dim": 12, "attention_bias": false});
    s
}

fn mistral() -> Spec {
    let mut s = base("mistral");
    s.windows = vec![Some(3), Some(3)];
    s.dtype = Dt::F16;
    s.config = json!({"sliding_window": 3});
    s
}

fn llama3() -> Spec {
    let mut s = base("llama");
    s.head_dim = 16;
    s.heads = 2;
    s.kv_heads = 1;
    s.qkv_bias = true;
    s.o_bias = true;
    s.theta = 10000.0;
    // wavelengths 6.3 (kept), 19.9 and 62.8 (interpolated), >= 199 (divided)
    s.llama3 = Some((8.0, 1.0, 4.0, 64.0));
    s.shards = true;
    s.config = json!({
        "head_dim": 16,
        "attention_bias": true,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    });
    s
}

fn round(x: f32, dt: Dt) -> f32 {
    match dt {
        Dt::F32 => x,
        Dt::F16 => half::f16::from_f32(x).to_f32(),
        Dt::Bf16 => half::bf16::from_f32(x).to_f32(),
    }
}

/// Tensors of the checkpoint: name -> (shape, values as stored).
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn make_tensors(s: &Spec) -> Tensors {
    let mut t = Tensors::new();
    let mut seed = 1u64;
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        seed += 1;
        let v = weights(n, seed, scale)
            .into_iter()
            .map(|x| round(x + offset, s.dtype))
            .collect();
        t.insert(name, (shape, v));
    };
    let (d, hd, f, v) = (s.hidden, s.head_dim, s.ffn, s.vocab);
    add("model.embed_tokens.weight".into(), vec![v, d], 1.0, 0.0);
    add("model.norm.weight".into(), vec![d], 0.2, 1.0);
    if !s.tied {
        add("lm_head.weight".into(), vec![v, d], 0.3, 0.0);
    }
    for l in 0..s.layers {
        let p = |x: &str| format!("model.layers.{l}.{x}");
        add(p("input_layernorm.weight"), vec![d], 0.2, 1.0);
        add(p("post_attention_layernorm.weight"), vec![d], 0.2, 1.0);
        add(
            p("self_attn.q_proj.weight"),
            vec![s.heads * hd, d],
            0.3,
            0.0,
        );
        add(
            p("self_attn.k_proj.weight"),
            vec![s.kv_heads * hd, d],
            0.3,
            0.0,
        );
        add(
            p("self_attn.v_proj.weight"),
            vec![s.kv_heads * hd, d],
            0.3,
            0.0,
        );
        add(
            p("self_attn.o_proj.weight"),
            vec![d, s.heads * hd],
            0.3,
            0.0,
        );
        if s.qkv_bias {
            add(p("self_attn.q_proj.bias"), vec![s.heads * hd], 0.5, 0.0);
            add(p("self_attn.k_proj.bias"), vec![s.kv_heads * hd], 0.5, 0.0);
            add(p("self_attn.v_proj.bias"), vec![s.kv_heads * hd], 0.5, 0.0);
        }
        if s.o_bias {
            add(p("self_attn.o_proj.bias"), vec![d], 0.5, 0.0);
        }
        if s.qk_norm {
            add(p("self_attn.q_norm.weight"), vec![hd], 0.3, 1.0);
            add(p("self_attn.k_norm.weight"), vec![hd], 0.3, 1.0);
        }
        add(p("mlp.gate_proj.weight"), vec![f, d], 0.3, 0.0);
        add(p("mlp.up_proj.weight"), vec![f, d], 0.3, 0.0);
        add(p("mlp.down_proj.weight"), vec![d, f], 0.3, 0.0);
    }
    t
}

fn bytes_of(v: &[f32], dt: Dt) -> (safetensors::Dtype, Vec<u8>) {
    match dt {
        Dt::F32 => (
            safetensors::Dtype::F32,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        Dt::F16 => (
            safetensors::Dtype::F16,
            v.iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
        ),
        Dt::Bf16 => (
            safetensors::Dtype::BF16,
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        ),
    }
}

/// (name, (shape, values)) pairs of [`Tensors`].
type Named<'a> = (&'a String, &'a (Vec<usize>, Vec<f32>));

fn write_safetensors(path: &Path, tensors: &[Named<'_>], dt: Dt) {
    let data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (shape, v))| {
            let (d, b) = bytes_of(v, dt);
            (n.to_string(), d, shape.clone(), b)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A WordLevel tokenizer: `<s>` (BOS, added by the post-processor), `<unk>`,
/// then words w0 .. w29, split on whitespace.
fn tokenizer_json() -> Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<s>".into(), json!(0));
    vocab.insert("<unk>".into(), json!(1));
    for i in 0..VOCAB_WORDS {
        vocab.insert(format!("w{i}"), json!(i + 2));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
}

fn write_checkpoint(dir: &Path, s: &Spec) -> Tensors {
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = json!({
        "architectures": ["X"],
        "model_type": s.model_type,
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "vocab_size": s.vocab,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": s.theta,
        "hidden_act": "silu",
        "tie_word_embeddings": s.tied,
        "torch_dtype": "float32",
    });
    for (k, v) in s.config.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<s>", "eos_token": "<unk>",
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}w1"})
        .to_string(),
    )
    .unwrap();
    let t = make_tensors(s);
    let all: Vec<_> = t.iter().collect();
    if s.shards {
        let (a, b) = all.split_at(all.len() / 2);
        let names = [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ];
        write_safetensors(&dir.join(names[0]), a, s.dtype);
        write_safetensors(&dir.join(names[1]), b, s.dtype);
        let mut wm = serde_json::Map::new();
        for (n, _) in a {
            wm.insert(n.to_string(), json!(names[0]));
        }
        for (n, _) in b {
            wm.insert(n.to_string(), json!(names[1]));
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            json!({"metadata": {"total_size": 0}, "weight_map": wm}).to_string(),
        )
        .unwrap();
    } else {
        write_safetensors(&dir.join("model.safetensors"), &all, s.dtype);
    }
    t
}

// ---- the f64 reference, from HF's modeling_{llama,mistral,qwen2,qwen3}.py ----

struct RefOut {
    /// per layer: q (heads, t, hd) post-RoPE, k, v (kv_heads, t, hd), o (heads, t, hd)
    layers: Vec<[Vec<f64>; 4]>,
    logits_last: Vec<f64>,
}

fn matvec(w: &[f32], x: &[f64], out_n: usize) -> Vec<f64> {
    let n = x.len();
    (0..out_n)
        .map(|r| (0..n).map(|c| w[r * n + c] as f64 * x[c]).sum())
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * *w as f64).collect()
}

/// transformers' `_compute_default_rope_parameters` + `_compute_llama3_parameters`.
fn inv_freqs(s: &Spec) -> Vec<f64> {
    let dim = s.head_dim;
    let base: Vec<f64> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / s.theta.powf(i as f64 / dim as f64))
        .collect();
    let Some((factor, low, high, old)) = s.llama3 else {
        return base;
    };
    let low_freq_wavelen = old / low;
    let high_freq_wavelen = old / high;
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let mut inv = if wavelen > low_freq_wavelen {
                f / factor
            } else {
                f
            };
            let smooth = (old / wavelen - low) / (high - low);
            let smoothed = (1.0 - smooth) * inv / factor + smooth * inv;
            // `~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)`
            let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
            if is_medium {
                inv = smoothed;
            }
            inv
        })
        .collect()
}

fn reference(s: &Spec, t: &Tensors, ids: &[u32]) -> RefOut {
    let w = |n: &str| &t[n].1;
    let (d, hd, nh, nkv) = (s.hidden, s.head_dim, s.heads, s.kv_heads);
    let n = ids.len();
    let eps = 1e-6;
    let inv = inv_freqs(s);
    let half = hd / 2;
    let rope = |x: &mut [f64], pos: usize| {
        for i in 0..half {
            let a = pos as f64 * inv[i];
            let (c, sn) = (a.cos(), a.sin());
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * c - x2 * sn;
            x[i + half] = x2 * c + x1 * sn;
        }
    };
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| {
            w("model.embed_tokens.weight")[id as usize * d..(id as usize + 1) * d]
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    let mut layers = Vec::new();
    for l in 0..s.layers {
        let p = |x: &str| format!("model.layers.{l}.{x}");
        let mut q = vec![0f64; nh * n * hd];
        let mut k = vec![0f64; nkv * n * hd];
        let mut v = vec![0f64; nkv * n * hd];
        for (pos, x) in xs.iter().enumerate() {
            let h = rmsnorm(x, w(&p("input_layernorm.weight")), eps);
            let mut qp = matvec(w(&p("self_attn.q_proj.weight")), &h, nh * hd);
            let mut kp = matvec(w(&p("self_attn.k_proj.weight")), &h, nkv * hd);
            let mut vp = matvec(w(&p("self_attn.v_proj.weight")), &h, nkv * hd);
            if s.qkv_bias {
                for (y, b) in [(&mut qp, "q"), (&mut kp, "k"), (&mut vp, "v")] {
                    let bias = w(&p(&format!("self_attn.{b}_proj.bias")));
                    y.iter_mut().zip(bias).for_each(|(a, b)| *a += *b as f64);
                }
            }
            for hh in 0..nh {
                let mut qh = qp[hh * hd..(hh + 1) * hd].to_vec();
                if s.qk_norm {
                    qh = rmsnorm(&qh, w(&p("self_attn.q_norm.weight")), eps);
                }
                rope(&mut qh, pos);
                q[(hh * n + pos) * hd..(hh * n + pos + 1) * hd].copy_from_slice(&qh);
            }
            for g in 0..nkv {
                let mut kh = kp[g * hd..(g + 1) * hd].to_vec();
                if s.qk_norm {
                    kh = rmsnorm(&kh, w(&p("self_attn.k_norm.weight")), eps);
                }
                rope(&mut kh, pos);
                k[(g * n + pos) * hd..(g * n + pos + 1) * hd].copy_from_slice(&kh);
                v[(g * n + pos) * hd..(g * n + pos + 1) * hd]
                    .copy_from_slice(&vp[g * hd..(g + 1) * hd]);
            }
        }
        let mut o = vec![0f64; nh * n * hd];
        let scale = 1.0 / (hd as f64).sqrt();
        for hh in 0..nh {
            let g = hh / (nh / nkv);
            for t in 0..n {
                let qv = &q[(hh * n + t) * hd..(hh * n + t + 1) * hd];
                // HF sliding mask: kv_idx > q_idx - W
                let keys: Vec<usize> = (0..=t)
                    .filter(|&j| s.windows[l].is_none_or(|w| j as i64 > t as i64 - w as i64))
                    .collect();
                let sc: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let kv = &k[(g * n + j) * hd..(g * n + j + 1) * hd];
                        qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (&j, ej) in keys.iter().zip(&e) {
                    for i in 0..hd {
                        o[(hh * n + t) * hd + i] += ej / z * v[(g * n + j) * hd + i];
                    }
                }
            }
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let oc: Vec<f64> = (0..nh)
                .flat_map(|hh| o[(hh * n + pos) * hd..(hh * n + pos + 1) * hd].to_vec())
                .collect();
            let mut a = matvec(w(&p("self_attn.o_proj.weight")), &oc, d);
            if s.o_bias {
                a.iter_mut()
                    .zip(w(&p("self_attn.o_proj.bias")))
                    .for_each(|(a, b)| *a += *b as f64);
            }
            x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
            let h = rmsnorm(x, w(&p("post_attention_layernorm.weight")), eps);
            let gate = matvec(w(&p("mlp.gate_proj.weight")), &h, s.ffn);
            let up = matvec(w(&p("mlp.up_proj.weight")), &h, s.ffn);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matvec(w(&p("mlp.down_proj.weight")), &act, d);
            x.iter_mut().zip(&down).for_each(|(x, a)| *x += a);
        }
        layers.push([q, k, v, o]);
    }
    let last = rmsnorm(&xs[n - 1], w("model.norm.weight"), eps);
    let head = if s.tied {
        w("model.embed_tokens.weight")
    } else {
        w("lm_head.weight")
    };
    RefOut {
        layers,
        logits_last: matvec(head, &last, s.vocab),
    }
}

fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Relative L2 tolerance of the f32 forward pass against the f64 reference.
const TOL: f64 = 1e-5;

fn check_family(s: Spec) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(s.model_type);
    let t = write_checkpoint(&dir, &s);
    let m = Model::load(&dir).unwrap();
    assert_eq!(m.architecture, s.model_type);
    let text = "w3 w7 w1 w12 w29 w0 w5 w5 w8 w2";
    let ids = m.tokenizer.encode(text).unwrap();
    // BOS from the post-processor, then the words (id = word + 2)
    assert_eq!(ids, vec![0, 5, 9, 3, 14, 31, 2, 7, 7, 10, 4]);
    let want = reference(&s, &t, &ids);
    let mut cache = KvCache::new(&m.llama.cfg, ids.len());
    let mut worst = 0f64;
    let mut seen = 0;
    let logits = m
        .llama
        .forward(
            &ids,
            0,
            &mut cache,
            ForwardOptions {
                colsum: None,
                probs: false,
                attention: None,
            },
            &mut |tap| {
                let r = &want.layers[tap.layer];
                for (name, got, want) in [
                    ("q", tap.q, &r[0]),
                    ("k", tap.k, &r[1]),
                    ("v", tap.v, &r[2]),
                    ("o", tap.o, &r[3]),
                ] {
                    let e = rel_l2(got, want);
                    assert!(
                        e < TOL,
                        "{}: layer {} {name}: relative L2 {e:.2e}",
                        s.model_type,
                        tap.layer
                    );
                    worst = worst.max(e);
                }
                seen += 1;
            },
        )
        .unwrap();
    assert_eq!(seen, s.layers);
    let e = rel_l2(&logits, &want.logits_last);
    assert!(e < TOL, "{}: logits relative L2 {e:.2e}", s.model_type);
    eprintln!(
        "{}: q/k/v/o worst relative L2 {worst:.2e}, logits {e:.2e} (tolerance {TOL:.0e})",
        s.model_type
    );
    // capture end to end: the manifest records the family, windows, RoPE
    let out = tmp.path().join("trace");
    let mut o = CaptureOptions::new(text, &out);
    o.n_decode = 3;
    o.dtype = kvreplay_traces::Dtype::F32;
    o.prefill_chunk = 4;
    capture(&m, &o, &mut |_| {}).unwrap();
    let tr = kvreplay_traces::Trace::open(&out).unwrap();
    let mm = &tr.manifest.model;
    assert_eq!(mm.architecture, s.model_type);
    assert_eq!(mm.rope.style, kvreplay_traces::RopeStyle::Neox);
    assert_eq!(tr.manifest.tokens.ids[..ids.len()], ids[..]);
    if s.windows.iter().any(|w| w.is_some()) {
        assert_eq!(
            mm.layers.iter().map(|l| l.window).collect::<Vec<_>>(),
            s.windows
        );
    }
    if let Some((factor, ..)) = s.llama3 {
        assert!(
            matches!(mm.rope.scaling, kvreplay_traces::RopeScaling::Llama3 { factor: f, .. } if f == factor),
            "{:?}",
            mm.rope.scaling
        );
    }
}

#[test]
fn qwen2_with_qkv_bias_and_tied_embeddings_matches_the_reference() {
    check_family(qwen2());
}

#[test]
fn qwen3_with_qk_norm_and_bf16_weights_matches_the_reference() {
    check_family(qwen3());
}

#[test]
fn mistral_with_a_window_shorter_than_the_prompt_matches_the_reference() {
    check_family(mistral());
}

#[test]
fn llama_with_llama3_rope_scaling_o_bias_and_shards_matches_the_reference() {
    check_family(llama3());
}

#[test]
fn qwen2_sliding_layers_follow_use_sliding_window_and_max_window_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = qwen2();
    s.layers = 3;
    s.config = json!({"use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1});
    write_checkpoint(tmp.path(), &s);
    let m = Model::load(tmp.path()).unwrap();
    let w: Vec<_> = m
        .llama
        .cfg
        .layer_attention
        .iter()
        .map(|l| l.window)
        .collect();
    assert_eq!(w, vec![None, Some(4), Some(4)]);
    // layer_types wins
    s.config = json!({"sliding_window": 2, "layer_types":
        ["sliding_attention", "full_attention", "sliding_attention"]});
    let d2 = tmp.path().join("lt");
    write_checkpoint(&d2, &s);
    let m = Model::load(&d2).unwrap();
    let w: Vec<_> = m
        .llama
        .cfg
        .layer_attention
        .iter()
        .map(|l| l.window)
        .collect();
    assert_eq!(w, vec![Some(2), None, Some(2)]);
    // without use_sliding_window, no window
    s.config = json!({"use_sliding_window": false, "sliding_window": 4});
    let d3 = tmp.path().join("off");
    write_checkpoint(&d3, &s);
    let m = Model::load(&d3).unwrap();
    assert!(m
        .llama
        .cfg
        .layer_attention
        .iter()
        .all(|l| l.window.is_none()));
}

#[test]
fn chat_template_renders_and_is_encoded_without_a_second_bos() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(tmp.path(), &qwen2());
    let m = Model::load(tmp.path()).unwrap();
    let r = m.tokenizer.apply_chat_template("w4").unwrap();
    assert_eq!(r, "<s>w4 w1");
    assert_eq!(m.tokenizer.encode_chat(&r).unwrap().0, vec![0, 6, 3]);
    assert_eq!(m.tokenizer.bos, Some(0));
}

#[test]
fn llama_tokenizer_classes_follow_add_bos_token_and_add_eos_token() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(tmp.path(), &qwen2());
    let tc = tmp.path().join("tokenizer_config.json");
    let enc = |cfg: Value| {
        std::fs::write(&tc, cfg.to_string()).unwrap();
        Model::load(tmp.path())
            .unwrap()
            .tokenizer
            .encode("w4 w5")
            .unwrap()
    };
    // no flags: tokenizer.json's post-processor (BOS)
    assert_eq!(
        enc(json!({"bos_token": "<s>", "eos_token": "<unk>"})),
        vec![0, 6, 7]
    );
    // a Llama class rebuilds it from the flags
    assert_eq!(
        enc(
            json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "<unk>",
                   "add_bos_token": false, "add_eos_token": true})
        ),
        vec![6, 7, 1]
    );
    // other classes keep tokenizer.json's post-processor
    assert_eq!(
        enc(
            json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "add_bos_token": false})
        ),
        vec![0, 6, 7]
    );
}

fn err_of(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) -> PathBuf {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
    p
}

#[test]
fn bad_checkpoints_are_refused_naming_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |name: &str, s: Spec| {
        let d = tmp.path().join(name);
        write_checkpoint(&d, &s);
        d
    };
    let d = fresh("missing", qwen2());
    edit_config(&d, |v| {
        v.as_object_mut().unwrap().remove("hidden_size");
    });
    let e = err_of(&d);
    assert!(
        e.contains("config.json") && e.contains("`hidden_size`") && e.contains("missing"),
        "{e}"
    );

    let d = fresh("unknown", qwen2());
    edit_config(&d, |v| v["model_type"] = json!("falcon"));
    let e = err_of(&d);
    assert!(
        e.contains("config.json") && e.contains("`model_type`") && e.contains("falcon"),
        "{e}"
    );

    let d = fresh("gemma", qwen2());
    edit_config(&d, |v| v["model_type"] = json!("gemma3"));
    let e = err_of(&d);
    assert!(e.contains("`gemma3`") && e.contains("gemma3_text"), "{e}");

    let d = fresh("yarn", qwen2());
    edit_config(&d, |v| {
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0})
    });
    let e = err_of(&d);
    assert!(
        e.contains("rope_scaling.rope_type") && e.contains("yarn"),
        "{e}"
    );

    let d = fresh("gelu", qwen2());
    edit_config(&d, |v| v["hidden_act"] = json!("gelu"));
    let e = err_of(&d);
    assert!(e.contains("`hidden_act`") && e.contains("gelu"), "{e}");

    let d = fresh("mlpbias", llama3());
    edit_config(&d, |v| v["mlp_bias"] = json!(true));
    assert!(err_of(&d).contains("`mlp_bias`"));

    let d = fresh("shard", llama3());
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    let e = err_of(&d);
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00002-of-00002.safetensors")
            && e.contains("missing"),
        "{e}"
    );

    let d = fresh("shape", qwen2());
    edit_config(&d, |v| v["intermediate_size"] = json!(40));
    let e = err_of(&d);
    assert!(
        e.contains("model.safetensors")
            && e.contains("mlp.gate_proj.weight")
            && e.contains("[48, 32]")
            && e.contains("[40, 32]"),
        "{e}"
    );

    // wrong dtype: an I32 tensor
    let d = tmp.path().join("dtype");
    let t = write_checkpoint(&d, &qwen2());
    let mut views_data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = t
        .iter()
        .map(|(n, (s, v))| {
            let (dt, b) = bytes_of(v, Dt::F32);
            (n.clone(), dt, s.clone(), b)
        })
        .collect();
    views_data
        .iter_mut()
        .find(|x| x.0 == "model.norm.weight")
        .unwrap()
        .1 = safetensors::Dtype::I32;
    let views: Vec<_> = views_data
        .iter()
        .map(|(n, dt, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &d.join("model.safetensors")).unwrap();
    let e = err_of(&d);
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");

    // missing tensor, untied without lm_head
    let d = fresh("nohead", qwen2());
    edit_config(&d, |v| v["tie_word_embeddings"] = json!(false));
    let e = err_of(&d);
    assert!(
        e.contains("lm_head.weight") && e.contains("tie_word_embeddings"),
        "{e}"
    );

    // no config.json
    let d = fresh("noconfig", qwen2());
    std::fs::remove_file(d.join("config.json")).unwrap();
    let e = err_of(&d);
    assert!(e.contains("config.json"), "{e}");
}

/// Gemma 3 from HF: the tiny gemma3 GGUF's weights written as a
/// `gemma3_text` checkpoint (norms stored as HF's `w` of `(1 + w)`, i.e. the
/// GGUF's value minus 1) must load to the same architecture and compute the
/// same q/k/v/o as the GGUF path (itself checked against
/// scripts/reference_gemma3.py on the real Gemma 3 270M).
#[test]
fn gemma3_text_checkpoint_matches_the_gemma3_gguf() {
    use kvreplay_capture::testing::{tiny_gemma3_gguf, GEMMA3_WINDOW};
    let tmp = tempfile::tempdir().unwrap();
    let g = Model::load(&tiny_gemma3_gguf(tmp.path())).unwrap();
    let c = &g.llama.cfg;
    let mut t = Tensors::new();
    let mut put = |name: String, shape: Vec<usize>, w: &[f32], minus_one: bool| {
        let v = w
            .iter()
            .map(|x| if minus_one { x - 1.0 } else { *x })
            .collect();
        t.insert(name, (shape, v));
    };
    let (d, hd, f, v) = (c.d_model, c.head_dim, c.ffn_dim, c.vocab_size);
    let (h, kv) = (c.n_heads, c.n_kv_heads);
    let m = &g.llama;
    put(
        "model.embed_tokens.weight".into(),
        vec![v, d],
        &m.embed,
        false,
    );
    put("model.norm.weight".into(), vec![d], &m.out_norm, true);
    if let Some(head) = &m.lm_head {
        put("lm_head.weight".into(), vec![v, d], head, false);
    }
    for (l, w) in m.layers.iter().enumerate() {
        let p = |x: &str| format!("model.layers.{l}.{x}");
        put(p("input_layernorm.weight"), vec![d], &w.attn_norm, true);
        put(
            p("post_attention_layernorm.weight"),
            vec![d],
            w.post_attn_norm.as_ref().unwrap(),
            true,
        );
        put(
            p("pre_feedforward_layernorm.weight"),
            vec![d],
            &w.ffn_norm,
            true,
        );
        put(
            p("post_feedforward_layernorm.weight"),
            vec![d],
            w.post_ffn_norm.as_ref().unwrap(),
            true,
        );
        put(
            p("self_attn.q_norm.weight"),
            vec![hd],
            w.q_norm.as_ref().unwrap(),
            true,
        );
        put(
            p("self_attn.k_norm.weight"),
            vec![hd],
            w.k_norm.as_ref().unwrap(),
            true,
        );
        put(p("self_attn.q_proj.weight"), vec![h * hd, d], &w.wq, false);
        put(p("self_attn.k_proj.weight"), vec![kv * hd, d], &w.wk, false);
        put(p("self_attn.v_proj.weight"), vec![kv * hd, d], &w.wv, false);
        put(p("self_attn.o_proj.weight"), vec![d, h * hd], &w.wo, false);
        put(p("mlp.gate_proj.weight"), vec![f, d], &w.w_gate, false);
        put(p("mlp.up_proj.weight"), vec![f, d], &w.w_up, false);
        put(p("mlp.down_proj.weight"), vec![d, f], &w.w_down, false);
    }
    let dir = tmp.path().join("gemma3-hf");
    std::fs::create_dir_all(&dir).unwrap();
    let all: Vec<_> = t.iter().collect();
    write_safetensors(&dir.join("model.safetensors"), &all, Dt::F32);
    let cfg = json!({
        "model_type": "gemma3_text",
        "hidden_size": d, "intermediate_size": f, "num_hidden_layers": c.n_layers,
        "num_attention_heads": h, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": v, "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope.theta, "rope_local_base_freq": 10000.0,
        "rope_scaling": null, "sliding_window": GEMMA3_WINDOW, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": hd, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": null, "final_logit_softcapping": null,
        "tie_word_embeddings": m.lm_head.is_none(), "attention_bias": false,
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    let hm = Model::load(&dir).unwrap();
    assert_eq!(hm.architecture, "gemma3_text");
    let hc = &hm.llama.cfg;
    assert_eq!(hc.layer_attention, c.layer_attention);
    assert_eq!(hc.rope, c.rope);
    assert!((hc.attn_scale - c.attn_scale).abs() <= 1e-7 * c.attn_scale);
    assert_eq!(
        (
            hc.qk_norm,
            hc.post_norms,
            hc.activation,
            hc.embed_scale,
            hc.permuted_qk
        ),
        (
            c.qk_norm,
            c.post_norms,
            c.activation,
            c.embed_scale,
            c.permuted_qk
        )
    );
    // more positions than the window, so sliding layers cut keys off
    let ids: Vec<u32> = (0..11).map(|i| (i * 7 + 3) % v as u32).collect();
    let run = |mm: &Model| {
        let mut cache = KvCache::new(&mm.llama.cfg, ids.len());
        let mut taps = Vec::new();
        let logits = mm
            .llama
            .forward(
                &ids,
                0,
                &mut cache,
                ForwardOptions {
                    colsum: None,
                    probs: false,
                    attention: None,
                },
                &mut |tap| {
                    taps.push([
                        tap.q.to_vec(),
                        tap.k.to_vec(),
                        tap.v.to_vec(),
                        tap.o.to_vec(),
                    ])
                },
            )
            .unwrap();
        (taps, logits)
    };
    let ((ta, la), (tb, lb)) = (run(&g), run(&hm));
    let f64s = |x: &[f32]| x.iter().map(|v| *v as f64).collect::<Vec<_>>();
    let mut worst = 0f64;
    for (a, b) in ta.iter().zip(&tb) {
        for (x, y) in a.iter().zip(b) {
            worst = worst.max(rel_l2(y, &f64s(x)));
        }
    }
    let el = rel_l2(&lb, &f64s(&la));
    eprintln!("gemma3_text vs gemma3 GGUF: q/k/v/o worst relative L2 {worst:.2e}, logits {el:.2e}");
    assert!(worst < TOL && el < TOL, "{worst:.2e} {el:.2e}");
}
