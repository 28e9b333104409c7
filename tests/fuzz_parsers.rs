//! The cargo-fuzz targets (fuzz/src/lib.rs), bounded for CI: each target
//! runs on its seed corpus (`fuzz/corpus/<target>/`, regressions included)
//! and on a fixed number of mutations of it drawn from a seeded generator
//! (byte flips, random bytes, boundary integers, insertions, deletions,
//! truncations, splices), so every run tries the same inputs. A panic
//! fails the test and names the target and the input (written under
//! `target/fuzz-failures/`). Running the targets for real: fuzz/README.md.

#[allow(dead_code)]
#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::path::{Path, PathBuf};

/// Mutated inputs per target.
const MUTATIONS: usize = 20_000;

/// xorshift64*: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Integers that sit on the edges parsers get wrong.
const BOUNDARY: &[u64] = &[
    0,
    1,
    2,
    7,
    8,
    31,
    32,
    255,
    256,
    65535,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1 << 60,
    u64::MAX - 1000,
    u64::MAX - 1023,
    u64::MAX,
];

/// Text fragments for the text parsers.
const TOKENS: &[&str] = &[
    "+",
    ":",
    ",",
    "=",
    ";",
    " ",
    "\"",
    "{",
    "}",
    "[",
    "]",
    "-1",
    "0",
    "1e308",
    "NaN",
    "null",
    "18446744073709551615",
    "99999999999999999999",
    "none",
    "scorer",
    "quant",
    "h2o",
    "length",
    "facts",
    "depth",
];

fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = v.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = rng.next() as u8;
            }
            2 => {
                // a boundary integer, little-endian, 4 or 8 bytes wide
                let x = BOUNDARY[rng.below(BOUNDARY.len())].to_le_bytes();
                let w = if rng.below(2) == 0 { 4 } else { 8 };
                let at = rng.below(len.saturating_sub(w) + 1);
                for (j, b) in x[..w].iter().enumerate() {
                    if at + j < v.len() {
                        v[at + j] = *b;
                    }
                }
            }
            3 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, bytes);
            }
            4 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(64)).min(len);
                v.drain(a..b);
            }
            5 => v.truncate(rng.below(len + 1)),
            6 => {
                // splice: our head, another seed's tail
                let other = &corpus[rng.below(corpus.len())];
                let a = rng.below(len + 1);
                let b = rng.below(other.len() + 1);
                v.truncate(a);
                v.extend_from_slice(&other[b..]);
            }
            7 => {
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                let at = rng.below(len + 1);
                v.splice(at..at, t.iter().copied());
            }
            _ if len > 0 => {
                // duplicate a chunk
                let a = rng.below(len);
                let b = (a + 1 + rng.below(32)).min(len);
                let chunk = v[a..b].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, chunk);
            }
            _ => v.push(rng.next() as u8),
        }
    }
    v
}

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn read_corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// Run `f` on `input`; on a panic save the input and fail naming it.
fn run(target: &str, what: &str, f: fn(&[u8]) -> bool, input: &[u8]) -> bool {
    match std::panic::catch_unwind(|| f(input)) {
        Ok(accepted) => accepted,
        Err(_) => {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{target}-{what}"));
            std::fs::write(&path, input).unwrap();
            panic!(
                "fuzz target `{target}` panicked on {what}; the input is in {} (replay it with `cargo +nightly fuzz run {target} {}`)",
                path.display(),
                path.display()
            );
        }
    }
}

#[test]
fn fuzz_targets_survive_their_corpus_and_seeded_mutations() {
    for (i, (target, f)) in targets::TARGETS.iter().enumerate() {
        let corpus = read_corpus(target);
        let seeds: Vec<Vec<u8>> = corpus.iter().map(|(_, b)| b.clone()).collect();
        let mut accepted = 0;
        for (name, bytes) in &corpus {
            accepted += run(target, name, *f, bytes) as usize;
        }
        assert!(
            accepted > 0,
            "no seed of `{target}` is a valid input; regenerate fuzz/corpus/{target}/ (fuzz/README.md)"
        );
        let mut rng = Rng(0x6b76_7265_706c_6179 ^ (i as u64 + 1));
        for m in 0..MUTATIONS {
            let base = &seeds[rng.below(seeds.len())];
            let input = mutate(&mut rng, base, &seeds);
            run(target, &format!("mutation-{m}"), *f, &input);
        }
    }
}

/// Write the seed corpus (`seed-*` files; regression inputs are kept):
/// `cargo test --release --test fuzz_parsers -- --ignored write_seed_corpus`.
#[test]
#[ignore = "writes fuzz/corpus/; run by hand when the formats change"]
fn write_seed_corpus() {
    use kvreplay_capture::gguf::write::{gguf_bytes, RawTensor};
    use kvreplay_capture::gguf::{MetaArray, MetaValue};
    use kvreplay_capture::testing::{tiny_gguf_bytes, PLAIN};

    let put = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let golden = root.join("replay/tests/golden/tiny.kvtrace");

    // manifest: the golden trace's, and a variant with every optional part
    let text = std::fs::read_to_string(golden.join("manifest.json")).unwrap();
    put("manifest", "golden.json", text.as_bytes());
    let mut m: kvreplay_traces::Manifest = serde_json::from_str(&text).unwrap();
    m.capture.attn_probs = true;
    m.capture.dtype = kvreplay_traces::Dtype::Bf16;
    m.model.rope.scaling = kvreplay_traces::RopeScaling::Linear { factor: 2.0 };
    m.spans = vec![kvreplay_traces::Span {
        name: "needle".into(),
        start: 1,
        end: 3,
    }];
    put(
        "manifest",
        "variant.json",
        serde_json::to_string_pretty(&m).unwrap().as_bytes(),
    );

    // layer_header: the golden layer file (layout bytes first), and a
    // two-position file with attention probabilities
    let mut layer = vec![0b0000_0101u8 | 0x20, 7, 23, 19]; // 2 KV heads x 2, f32, d 8, T 24, P 20
    assert_eq!(
        targets::layout_of([layer[0], layer[1], layer[2], layer[3]]),
        kvreplay_traces::TraceLayout {
            n_layers: 1,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            total_len: 24,
            prompt_len: 20,
            dtype: kvreplay_traces::Dtype::F32,
            attn_probs: false,
            query_start: 0,
        }
    );
    layer.extend(std::fs::read(golden.join("layer-000.safetensors")).unwrap());
    put("layer_header", "golden.bin", &layer);
    // 1 KV head, 1 query head, f16, probs; head_dim 2, T 2, P 1
    let cfg = [0x80u8, 1, 1, 0];
    let l = targets::layout_of(cfg);
    assert_eq!(
        (l.n_heads, l.head_dim, l.total_len, l.prompt_len, l.dtype),
        (1, 2, 2, 1, kvreplay_traces::Dtype::F16)
    );
    let tensors = [
        ("attn_colsum", "F32", vec![1, 1], 4),
        ("attn_probs", "F32", vec![1, 2, 2], 4),
        ("q", "F16", vec![1, 2, 2], 2),
        ("k", "F16", vec![1, 2, 2], 2),
        ("v", "F16", vec![1, 2, 2], 2),
        ("o", "F16", vec![1, 2, 2], 2),
    ];
    let mut off = 0;
    let mut entries = Vec::new();
    for (name, dt, shape, size) in &tensors {
        let n = shape.iter().product::<usize>() * size;
        entries.push(format!(
            "\"{name}\":{{\"dtype\":\"{dt}\",\"shape\":{shape:?},\"data_offsets\":[{off},{}]}}",
            off + n
        ));
        off += n;
    }
    let mut json = format!("{{{}}}", entries.join(",")).into_bytes();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut small = cfg.to_vec();
    small.extend((json.len() as u64).to_le_bytes());
    small.extend(json);
    small.extend((0..off).map(|i| i as u8 % 7));
    put("layer_header", "small.bin", &small);

    // gguf: the tiny model's metadata alone, and one small tensor of every supported type
    put(
        "gguf",
        "tiny-metadata.gguf",
        &tiny_gguf_bytes(&PLAIN, |_, t| t.clear()),
    );
    let tensor = |name: &str, dims: &[u64], ggml_type: u32, bytes: usize| RawTensor {
        name: name.into(),
        dims: dims.to_vec(),
        ggml_type,
        data: (0..bytes).map(|i| (i * 37 % 251) as u8).collect(),
    };
    let meta = [
        ("general.architecture", MetaValue::Str("llama".into())),
        ("general.alignment", MetaValue::Uint(32)),
        ("llama.rope.freq_base", MetaValue::Float(10000.0)),
        ("a.i32", MetaValue::Array(MetaArray::I32(vec![1, -2, 3]))),
        (
            "a.str",
            MetaValue::Array(MetaArray::Str(["a b", "c"].iter().collect())),
        ),
    ];
    put(
        "gguf",
        "every-type.gguf",
        &gguf_bytes(
            &meta,
            &[
                tensor("f32", &[4, 2], 0, 32),
                tensor("f16", &[4], 1, 8),
                tensor("bf16", &[4], 30, 8),
                tensor("q8_0", &[32], 8, 34),
                tensor("q4_0", &[32], 2, 18),
                tensor("q4_1", &[32], 3, 20),
                tensor("q4_k", &[256], 12, 144),
                tensor("q5_k", &[256], 13, 176),
                tensor("q6_k", &[256], 14, 210),
            ],
        ),
    );

    // policy_spec: every registered policy alone, and composed forms
    for info in kvreplay_replay::REGISTRY {
        put("policy_spec", info.name, info.name.as_bytes());
    }
    for (i, s) in [
        "snapkv:w=16+quant:bits=2",
        "adakv:scorer=h2o,recent=8,alpha=0.2",
        "pyramidkv:scorer=knorm",
        "cam:scorer=snapkv,snapkv.w=4",
        "minicache:gamma=1,rho=0",
        "kvmerger:sigma=fixed,sigma0=1",
    ]
    .iter()
    .enumerate()
    {
        put("policy_spec", &format!("composed-{i}"), s.as_bytes());
    }

    // task_spec
    for (i, s) in [
        "passkey:length=512,depth=0.1",
        "multifact:length=4000,facts=3",
        "passkey",
        "file:essay.txt",
    ]
    .iter()
    .enumerate()
    {
        put("task_spec", &i.to_string(), s.as_bytes());
    }
}
