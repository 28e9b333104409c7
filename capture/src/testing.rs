//! Tiny llama models written as GGUF files, for tests of this crate and the
//! crates that run a model (not part of the public API).
#![allow(missing_docs)]

use crate::gguf::write::{gguf_bytes, RawTensor};
use crate::gguf::{MetaArray, MetaValue};
use std::path::{Path, PathBuf};

pub const D_MODEL: u64 = 32;
pub const HEADS: u64 = 4;
pub const KV_HEADS: u64 = 2;
pub const HEAD_DIM: u64 = 8;
pub const FFN: u64 = 64;
pub const LAYERS: usize = 2;
pub const CONTROL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const MERGES: [&str; 5] = ["Ġ t", "h e", "Ġt he", "1 2", "12 3"];

/// GPT-2's printable stand-in for every byte.
pub fn byte_chars() -> Vec<char> {
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

pub fn vocab() -> (Vec<String>, Vec<u64>) {
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

pub fn weights(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i.wrapping_add(seed * 7919)).wrapping_mul(0x9E3779B97F4A7C15) >> 40;
            ((h % 2001) as f32 / 1000.0 - 1.0) * scale
        })
        .collect()
}

pub fn f32_tensor(name: &str, dims: &[u64], seed: u64, scale: f32) -> RawTensor {
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
pub fn q8_0_tensor(name: &str, dims: &[u64], seed: u64, scale: f32) -> RawTensor {
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

/// Q4_1 blocks as ggml's reference quantiser makes them: m = min, d = (max
/// − min) / 15, q = round((x − m) / d).
pub fn q4_1_bytes(w: &[f32]) -> Vec<u8> {
    let mut data = Vec::new();
    for block in w.chunks(32) {
        let mn = block.iter().fold(f32::INFINITY, |a, x| a.min(*x));
        let mx = block.iter().fold(f32::NEG_INFINITY, |a, x| a.max(*x));
        let d = (mx - mn) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        data.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        data.extend_from_slice(&half::f16::from_f32(mn).to_le_bytes());
        let q: Vec<u8> = block
            .iter()
            .map(|x| (((x - mn) * id + 0.5) as u8).min(15))
            .collect();
        data.extend((0..16).map(|i| q[i] | (q[i + 16] << 4)));
    }
    data
}

/// Re-type every f32 layer matrix (`blk.N.*` with two dimensions) of a tiny
/// model as `ggml_type` (3 = Q4_1, or 0 = f32 holding the Q4_1 values
/// dequantised: the quantised model's f32 twin).
pub fn retype_layer_matrices(t: &mut [RawTensor], ggml_type: u32) {
    use kvreplay_kernels::cpu::{dequantize, BlockType};
    for x in t.iter_mut() {
        if !(x.name.starts_with("blk.") && x.dims.len() == 2 && x.ggml_type == 0) {
            continue;
        }
        let w: Vec<f32> = x
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let q = q4_1_bytes(&w);
        x.data = match ggml_type {
            3 => q,
            0 => {
                let mut f = vec![0f32; w.len()];
                dequantize(BlockType::Q4_1, &q, &mut f).unwrap();
                f.iter().flat_map(|v| v.to_le_bytes()).collect()
            }
            other => panic!("retype_layer_matrices: type {other}"),
        };
        x.ggml_type = ggml_type;
    }
}

pub struct Tweak {
    pub arch: &'static str,
    /// ggml type written for blk.0.ffn_up (0 = F32).
    pub ffn_up_type: u32,
    pub context: u64,
    pub pre: &'static str,
    /// Write an explicit output.weight (equal to the dequantised embedding).
    pub untied: bool,
    /// `tokenizer.chat_template`.
    pub chat_template: &'static str,
}

/// The ChatML template the tiny models carry unless a test asks for another.
pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

pub const PLAIN: Tweak = Tweak {
    arch: "llama",
    ffn_up_type: 0,
    context: 64,
    pre: "smollm",
    untied: false,
    chat_template: CHATML,
};

pub fn tiny_gguf(dir: &Path, tweak: &Tweak) -> PathBuf {
    let path = dir.join(format!(
        "tiny-{}-{}-{}-{}.gguf",
        tweak.arch, tweak.ffn_up_type, tweak.pre, tweak.untied
    ));
    std::fs::write(&path, tiny_gguf_bytes(tweak, |_, _| {})).unwrap();
    path
}

/// The bytes of a tiny model, after `edit` changed its metadata and tensors.
pub fn tiny_gguf_bytes(
    tweak: &Tweak,
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<RawTensor>),
) -> Vec<u8> {
    let (tokens, types) = vocab();
    let v = tokens.len() as u64;
    let a = tweak.arch;
    let mut meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.name".into(), MetaValue::Str("tiny".into())),
        (format!("{a}.block_count"), MetaValue::Uint(LAYERS as u64)),
        (
            format!("{a}.context_length"),
            MetaValue::Uint(tweak.context),
        ),
        (format!("{a}.embedding_length"), MetaValue::Uint(D_MODEL)),
        (format!("{a}.feed_forward_length"), MetaValue::Uint(FFN)),
        (format!("{a}.attention.head_count"), MetaValue::Uint(HEADS)),
        (
            format!("{a}.attention.head_count_kv"),
            MetaValue::Uint(KV_HEADS),
        ),
        (format!("{a}.rope.freq_base"), MetaValue::Float(10000.0)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::Float(1e-5),
        ),
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            MetaValue::Str(tweak.pre.into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(MetaArray::Str(tokens.iter().collect())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(MetaArray::I32(types.iter().map(|&t| t as i32).collect())),
        ),
        (
            "tokenizer.ggml.merges".into(),
            MetaValue::Array(MetaArray::Str(MERGES.iter().collect())),
        ),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::Uint(2)),
        (
            "tokenizer.chat_template".into(),
            MetaValue::Str(tweak.chat_template.into()),
        ),
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
    edit(&mut meta, &mut t);
    let meta_refs: Vec<(&str, MetaValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    gguf_bytes(&meta_refs, &t)
}

/// A size-limited tmpfs mounted on an (empty) folder for as long as the
/// guard lives (unmounted on drop, also when the test fails), so tests can
/// fill a disk. Mounting needs root; `mount` returns `Err(why)` where it
/// cannot, and the caller says why its test did not run. Declare the guard
/// after the folder's owner so that it drops (unmounts) first.
pub struct TmpfsMount {
    dir: PathBuf,
}

impl TmpfsMount {
    pub fn mount(dir: &Path, size: &str) -> Result<TmpfsMount, String> {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed (root is needed): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(TmpfsMount { dir: dir.into() })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let umount = |lazy: bool| {
            let mut c = std::process::Command::new("umount");
            if lazy {
                c.arg("-l");
            }
            c.arg(&self.dir)
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        };
        if !umount(false) && !umount(true) {
            eprintln!("could not unmount {}", self.dir.display());
        }
    }
}

/// The tiny Gemma 3's sliding window (keys per query, counting itself).
pub const GEMMA3_WINDOW: u64 = 4;
/// Its layers: layer 5 is the full-attention one (`l % 6 == 5`).
pub const GEMMA3_LAYERS: usize = 6;

/// A SentencePiece vocabulary: control pieces, the 256 byte pieces, then
/// scored pieces (the merge order follows the scores: `th` before `he`).
pub fn spm_vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut pieces: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"]
        .map(String::from)
        .to_vec();
    let mut scores = vec![0f32; 4];
    let mut types = vec![3i32; 4];
    for b in 0..256 {
        pieces.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for (p, s) in [
        ("▁", -1.0),
        ("t", -2.0),
        ("h", -3.0),
        ("e", -4.0),
        ("a", -5.0),
        ("c", -6.0),
        ("th", -7.0),
        ("he", -8.0),
        ("the", -9.0),
        ("▁the", -10.0),
        ("▁c", -11.0),
        ("at", -12.0),
        ("▁cat", -13.0),
    ] {
        pieces.push(p.into());
        scores.push(s);
        types.push(1);
    }
    pieces.push("\n".into()); // user-defined, matched whole
    scores.push(0.0);
    types.push(4);
    (pieces, scores, types)
}

/// A tiny `gemma3` GGUF: 6 layers (5 sliding with a window of
/// [`GEMMA3_WINDOW`], layer 5 full), MQA, head_dim 8 from
/// `attention.key_length`, q/k norms, post norms, and a SentencePiece
/// vocabulary ([`spm_vocab`]).
pub fn tiny_gemma3_gguf(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-gemma3.gguf");
    std::fs::write(&path, tiny_gemma3_gguf_bytes(|_, _| {})).unwrap();
    path
}

pub fn tiny_gemma3_gguf_bytes(
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<RawTensor>),
) -> Vec<u8> {
    let (pieces, scores, types) = spm_vocab();
    let v = pieces.len() as u64;
    let a = "gemma3";
    let (heads, hd) = (2u64, HEAD_DIM);
    let mut meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.name".into(), MetaValue::Str("tiny gemma3".into())),
        (
            format!("{a}.block_count"),
            MetaValue::Uint(GEMMA3_LAYERS as u64),
        ),
        (format!("{a}.context_length"), MetaValue::Uint(64)),
        (format!("{a}.embedding_length"), MetaValue::Uint(D_MODEL)),
        (format!("{a}.feed_forward_length"), MetaValue::Uint(FFN)),
        (format!("{a}.attention.head_count"), MetaValue::Uint(heads)),
        (format!("{a}.attention.head_count_kv"), MetaValue::Uint(1)),
        (format!("{a}.attention.key_length"), MetaValue::Uint(hd)),
        (format!("{a}.attention.value_length"), MetaValue::Uint(hd)),
        (
            format!("{a}.attention.sliding_window"),
            MetaValue::Uint(GEMMA3_WINDOW),
        ),
        (format!("{a}.rope.freq_base"), MetaValue::Float(1_000_000.0)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::Float(1e-6),
        ),
        (
            "tokenizer.ggml.model".into(),
            MetaValue::Str("llama".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            MetaValue::Str("default".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(MetaArray::Str(pieces.iter().collect())),
        ),
        (
            "tokenizer.ggml.scores".into(),
            MetaValue::Array(MetaArray::F32(scores)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(MetaArray::I32(types)),
        ),
        ("tokenizer.ggml.bos_token_id".into(), MetaValue::Uint(2)),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::Uint(1)),
        ("tokenizer.ggml.unknown_token_id".into(), MetaValue::Uint(3)),
        ("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true)),
        (
            "tokenizer.ggml.add_space_prefix".into(),
            MetaValue::Bool(false),
        ),
    ];
    let (d, q, kv, f) = (D_MODEL, heads * hd, hd, FFN);
    let mut t = vec![
        f32_tensor("output_norm.weight", &[d], 2, 1.0),
        q8_0_tensor("token_embd.weight", &[d, v], 1, 1.0),
    ];
    for l in 0..GEMMA3_LAYERS as u64 {
        let s = 100 * (l + 1);
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        t.push(f32_tensor(&n("attn_norm"), &[d], s + 1, 1.0));
        t.push(f32_tensor(&n("attn_q"), &[d, q], s + 2, 0.5));
        t.push(f32_tensor(&n("attn_k"), &[d, kv], s + 3, 0.5));
        t.push(f32_tensor(&n("attn_v"), &[d, kv], s + 4, 0.5));
        t.push(f32_tensor(&n("attn_q_norm"), &[hd], s + 10, 1.0));
        t.push(f32_tensor(&n("attn_k_norm"), &[hd], s + 11, 1.0));
        t.push(f32_tensor(&n("attn_output"), &[q, d], s + 5, 0.3));
        t.push(f32_tensor(&n("post_attention_norm"), &[d], s + 12, 1.0));
        t.push(f32_tensor(&n("ffn_norm"), &[d], s + 6, 1.0));
        t.push(f32_tensor(&n("ffn_gate"), &[d, f], s + 7, 0.3));
        t.push(f32_tensor(&n("ffn_up"), &[d, f], s + 8, 0.3));
        t.push(f32_tensor(&n("ffn_down"), &[f, d], s + 9, 0.3));
        t.push(f32_tensor(&n("post_ffw_norm"), &[d], s + 13, 1.0));
    }
    edit(&mut meta, &mut t);
    let meta_refs: Vec<(&str, MetaValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    gguf_bytes(&meta_refs, &t)
}
