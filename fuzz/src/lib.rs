//! The fuzz targets' bodies: each feeds arbitrary bytes to a public parser
//! of files or arguments that come from outside, and uses what it accepts.
//! A target must never panic, hang or allocate far beyond its input.
//!
//! Shared by the cargo-fuzz binaries (`fuzz_targets/`) and the bounded,
//! seeded run in CI (`tests/fuzz_parsers.rs` in the root package, which
//! includes this file by path). Each returns whether the parser accepted
//! the input, so CI can check that its seeds are valid inputs.

use std::path::Path;

use kvreplay_capture::gguf::GgufFile;
use kvreplay_capture::llama::LlamaConfig;
use kvreplay_capture::tasks::TaskSpec;
use kvreplay_replay::spec::PolicySpec;
use kvreplay_traces::{parse_layer_header, Dtype, Manifest, TraceLayout};

/// A target: its input's bytes in, whether the parser accepted them out.
pub type Target = fn(&[u8]) -> bool;

/// The targets by name, as `fuzz/corpus/<name>/` holds their seeds.
pub const TARGETS: &[(&str, Target)] = &[
    ("manifest", manifest),
    ("layer_header", layer_header),
    ("gguf", gguf),
    ("policy_spec", policy_spec),
    ("task_spec", task_spec),
];

/// `manifest.json` text (`Manifest::parse`), then the shapes it implies.
pub fn manifest(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(m) = Manifest::parse(Path::new("fuzz/manifest.json"), text) else {
        return false;
    };
    let layout = m.layout();
    assert_eq!(layout.total_len, m.tokens.ids.len());
    assert!(layout.prompt_len >= 1 && layout.prompt_len <= layout.total_len);
    for h in 0..m.model.n_heads.min(1024) {
        assert!(m.kv_head_of(h) < m.model.n_kv_heads);
    }
    true
}

/// The layout a layer file is checked against, from the input's first 4
/// bytes: KV heads 1-4, query heads per KV head 1-4, dtype, attention
/// probabilities or not (byte 0), head_dim 1-32 (byte 1), T 1-64 (byte 2),
/// prompt length 1-T (byte 3).
pub fn layout_of(cfg: [u8; 4]) -> TraceLayout {
    let n_kv_heads = 1 + (cfg[0] & 3) as usize;
    let total_len = 1 + (cfg[2] % 64) as usize;
    TraceLayout {
        n_layers: 1,
        n_heads: n_kv_heads * (1 + ((cfg[0] >> 2) & 3) as usize),
        n_kv_heads,
        head_dim: 1 + (cfg[1] % 32) as usize,
        total_len,
        prompt_len: 1 + cfg[3] as usize % total_len,
        dtype: [Dtype::F16, Dtype::Bf16, Dtype::F32, Dtype::F32][((cfg[0] >> 4) & 3) as usize],
        attn_probs: cfg[0] & 0x80 != 0,
        query_start: 0,
    }
}

/// A layer file (`parse_layer_header`): 4 layout bytes (see [`layout_of`]),
/// then the file's bytes.
pub fn layer_header(data: &[u8]) -> bool {
    let Some((cfg, file)) = data.split_first_chunk::<4>() else {
        return false;
    };
    let Ok(index) = parse_layer_header(
        Path::new("fuzz/layer-000.safetensors"),
        file,
        &layout_of(*cfg),
    ) else {
        return false;
    };
    for (name, (dtype, shape, range)) in &index {
        assert!(
            range.end <= file.len(),
            "{name}: {range:?} past {}",
            file.len()
        );
        assert_eq!(
            range.len(),
            shape.iter().product::<usize>() * dtype.size(),
            "{name}"
        );
    }
    true
}

/// A GGUF file (`GgufFile::parse`), then the llama configuration its
/// metadata implies and every tensor it holds, dequantised.
pub fn gguf(data: &[u8]) -> bool {
    let Ok(g) = GgufFile::parse("fuzz.gguf", data.to_vec()) else {
        return false;
    };
    let _ = LlamaConfig::from_gguf(&g);
    for t in g.tensors.iter().take(64) {
        if let Ok(v) = g.tensor_f32(&t.name, &t.dims) {
            assert_eq!(Some(v.len() as u64), t.n_elements(), "{}", t.name);
        }
    }
    let _ = g.get_strings("tokenizer.ggml.tokens");
    true
}

/// A `--policy` spec (`PolicySpec::parse`), then its canonical form (which
/// must parse to the same spec) and the policy it builds.
pub fn policy_spec(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(spec) = PolicySpec::parse(text) else {
        return false;
    };
    let canonical = spec.canonical();
    let again = PolicySpec::parse(&canonical)
        .unwrap_or_else(|e| panic!("canonical form `{canonical}` of `{text}` is refused: {e}"));
    assert_eq!(again, spec, "`{text}` -> `{canonical}`");
    let _ = spec.short();
    let _ = spec.build();
    true
}

/// A `--task` spec (`TaskSpec::parse`).
pub fn task_spec(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    TaskSpec::parse(text).is_ok()
}
