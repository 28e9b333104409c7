//! Hand-built layers and traces for replay tests.
#![allow(dead_code, clippy::needless_range_loop)]

use kvreplay_replay::engine::attend;
use kvreplay_replay::policy::LayerData;
use kvreplay_replay::{HeadCache, PolicySpec, Session};
use kvreplay_traces::*;
use std::path::{Path, PathBuf};

/// A layer whose attention is easy to reason about: head_dim 2, scale 1,
/// every query (1, 0), key i = (s[g][i], 0) in KV head g, so the logit of key i
/// is s[g][i] for every query, and value i = (i, 1). Column sums are computed
/// exactly (causal softmax over the prompt). `group` query heads per KV head.
pub fn simple_layer(
    s: &[Vec<f32>],
    group: usize,
    prompt_len: usize,
    layer: usize,
    n_layers: usize,
) -> LayerData {
    let nkv = s.len();
    let t = s[0].len();
    let d = 2;
    let nh = nkv * group;
    let mut q = Vec::new();
    for _ in 0..nh * t {
        q.extend_from_slice(&[1.0, 0.0]);
    }
    let mut k = Vec::new();
    let mut v = Vec::new();
    for sg in s {
        for (i, x) in sg.iter().enumerate() {
            k.extend_from_slice(&[*x, 0.0]);
            v.extend_from_slice(&[i as f32, 1.0]);
        }
    }
    let mut colsum = vec![0f32; nh * prompt_len];
    for h in 0..nh {
        let sg = &s[h / group];
        for j in 0..prompt_len {
            let z: f64 = (0..=j).map(|i| (sg[i] as f64).exp()).sum();
            for i in 0..=j {
                colsum[h * prompt_len + i] += ((sg[i] as f64).exp() / z) as f32;
            }
        }
    }
    LayerData {
        layer,
        n_layers,
        n_heads: nh,
        n_kv_heads: nkv,
        d,
        scale: 1.0,
        prompt_len,
        total_len: t,
        q_start: 0,
        window: None,
        q,
        k,
        v,
        colsum,
        all_colsum: None,
        rope: None,
        memo: None,
        backend: Default::default(),
        tokens: None,
    }
}

/// A pseudo-random layer (heads, KV heads, d) with attention sinks at
/// position 0 and a few heavy hitters, for invariant tests.
pub fn random_layer(seed: u64, nh: usize, nkv: usize, d: usize, p: usize, t: usize) -> LayerData {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
    };
    let q: Vec<f32> = (0..nh * t * d).map(|_| rnd()).collect();
    let mut k: Vec<f32> = (0..nkv * t * d).map(|_| rnd()).collect();
    let v: Vec<f32> = (0..nkv * t * d).map(|_| rnd()).collect();
    for g in 0..nkv {
        for i in [0usize, p / 3, p / 2] {
            for c in 0..d {
                k[(g * t + i) * d + c] *= 4.0; // heavier keys
            }
        }
    }
    let scale = 1.0 / (d as f32).sqrt();
    let group = nh / nkv;
    let colsum = exact_colsums(nh, group, p, scale, |h, g, j, i| {
        (0..d)
            .map(|c| q[(h * t + j) * d + c] as f64 * k[(g * t + i) * d + c] as f64)
            .sum::<f64>()
    });
    LayerData {
        layer: 0,
        n_layers: 1,
        n_heads: nh,
        n_kv_heads: nkv,
        d,
        scale,
        prompt_len: p,
        total_len: t,
        q_start: 0,
        window: None,
        q,
        k,
        v,
        colsum,
        all_colsum: None,
        rope: None,
        memo: None,
        backend: Default::default(),
        tokens: None,
    }
}

/// Write `layers` as an f32 trace (o recomputed exactly) so the whole
/// replay path, files included, can be tested.
pub fn write_trace(dir: &Path, layers: &[LayerData]) -> PathBuf {
    let l0 = &layers[0];
    let layout = TraceLayout {
        n_layers: layers.len(),
        n_heads: l0.n_heads,
        n_kv_heads: l0.n_kv_heads,
        head_dim: l0.d,
        total_len: l0.total_len,
        prompt_len: l0.prompt_len,
        dtype: Dtype::F32,
        attn_probs: false,
        query_start: 0,
    };
    let out = dir.join("hand.kvtrace");
    let mut w = TraceWriter::create(&out, layout, true).unwrap();
    let (t, d) = (l0.total_len, l0.d);
    for (l, data) in layers.iter().enumerate() {
        let lw = w.layer(l);
        for g in 0..data.n_kv_heads {
            lw.write_rows(TensorKind::K, g, 0, &data.k[g * t * d..(g + 1) * t * d]);
            lw.write_rows(TensorKind::V, g, 0, &data.v[g * t * d..(g + 1) * t * d]);
        }
        for h in 0..data.n_heads {
            lw.write_rows(TensorKind::Q, h, 0, &data.q[h * t * d..(h + 1) * t * d]);
            let g = h / data.group();
            for pos in 0..t {
                let qr = data.q_row(h, pos);
                let l: Vec<f64> = (0..=pos)
                    .map(|i| {
                        data.k_row(g, i)
                            .iter()
                            .zip(qr)
                            .map(|(a, b)| (*a * *b) as f64)
                            .sum::<f64>()
                            * data.scale as f64
                    })
                    .collect();
                let mx = l.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = l.iter().map(|x| (x - mx).exp()).sum();
                let mut o = vec![0f32; d];
                for i in 0..=pos {
                    for c in 0..d {
                        o[c] += ((l[i] - mx).exp() / z) as f32 * data.v_row(g, i)[c];
                    }
                }
                lw.write_rows(TensorKind::O, h, pos, &o);
            }
            lw.write_colsum(
                h,
                &data.colsum[h * data.prompt_len..(h + 1) * data.prompt_len],
            );
        }
    }
    let m = Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        model: ModelInfo {
            architecture: "llama".into(),
            name: None,
            n_layers: layers.len(),
            n_heads: l0.n_heads,
            n_kv_heads: l0.n_kv_heads,
            head_dim: d,
            d_model: l0.n_heads * d,
            ffn_dim: 0,
            vocab_size: 0,
            context_length: t,
            norm_eps: 1e-5,
            attn_scale: l0.scale as f64,
            rope: Rope {
                theta: 10000.0,
                style: RopeStyle::Neox,
                rotated_dims: d,
                scaling: RopeScaling::None,
            },
            source: SourceFile {
                file_name: "hand".into(),
                sha256: String::new(),
                size: 0,
            },
            layers: Vec::new(),
        },
        tokens: Tokens {
            ids: vec![0; t],
            prompt_len: l0.prompt_len,
            text: vec![String::new(); t],
        },
        generation: Generation {
            method: "greedy".into(),
            n_decode: t - l0.prompt_len,
        },
        spans: vec![],
        capture: CaptureInfo {
            device: "cpu".into(),
            dtype: Dtype::F32,
            compute_dtype: "f32".into(),
            prefill_chunk: 1,
            threads: 1,
            attn_probs: false,
            chat_template: false,
            prompt_source: "test".into(),
            kvreplay_version: "test".into(),
            created: "2026-01-01T00:00:00Z".into(),
            keep_queries: None,
        },
        files: vec![],
    };
    w.finish(m).unwrap()
}

/// A layer from explicit rows: `q[h][t]` per query head, `k[g][t]` and
/// `v[g][t]` per KV head (every row of the same length d, every head of the
/// same length T), logit scale `scale`. Column sums are computed exactly (f64)
/// from the causal softmax over the first `prompt_len` positions; tests may
/// overwrite them.
pub fn explicit_layer(
    q: &[Vec<Vec<f32>>],
    k: &[Vec<Vec<f32>>],
    v: &[Vec<Vec<f32>>],
    prompt_len: usize,
    scale: f32,
) -> LayerData {
    let (nh, nkv) = (q.len(), k.len());
    let t = k[0].len();
    let d = k[0][0].len();
    let group = nh / nkv;
    let flat = |x: &[Vec<Vec<f32>>]| -> Vec<f32> {
        x.iter()
            .flat_map(|head| {
                assert_eq!(head.len(), t, "every head has T rows");
                head.iter().flat_map(|row| {
                    assert_eq!(row.len(), d, "every row has d values");
                    row.iter().copied()
                })
            })
            .collect()
    };
    let colsum = exact_colsums(nh, group, prompt_len, scale, |h, g, j, i| {
        q[h][j]
            .iter()
            .zip(&k[g][i])
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
    });
    LayerData {
        layer: 0,
        n_layers: 1,
        n_heads: nh,
        n_kv_heads: nkv,
        d,
        scale,
        prompt_len,
        total_len: t,
        q_start: 0,
        window: None,
        q: flat(q),
        k: flat(k),
        v: flat(v),
        colsum,
        all_colsum: None,
        rope: None,
        memo: None,
        backend: Default::default(),
        tokens: None,
    }
}

/// Run prefill and every decode step of `spec` on layers replayed together
/// (one layer, or a cross-layer policy's group) through the engine's loop (a
/// `Session`), attending over each cache as the engine does; returns every
/// layer's caches after prefill and after each decode step.
pub fn run_group_steps(spec: &str, datas: &[LayerData], budget: usize) -> Vec<Vec<Vec<HeadCache>>> {
    let policy = PolicySpec::parse(spec).unwrap().build().unwrap();
    let refs: Vec<&LayerData> = datas.iter().collect();
    let mut s = Session::prefill(policy.as_ref(), &refs, budget).unwrap();
    let snapshot = |s: &Session| {
        (0..datas.len())
            .map(|i| s.caches(i).to_vec())
            .collect::<Vec<_>>()
    };
    let mut out = vec![snapshot(&s)];
    let (p, t) = (datas[0].prompt_len, datas[0].total_len);
    for pos in p..t {
        let mut probs = Vec::new();
        for (i, data) in datas.iter().enumerate() {
            s.append(i, pos, |g| (data.k_row(g, pos), data.v_row(g, pos)));
            probs.push(
                (0..data.n_heads)
                    .map(|h| {
                        let cache = &s.caches(i)[s.cache_of(i, h)];
                        let (_, w, z) =
                            attend(data.q_row(h, pos), cache, data.scale, &data.backend).unwrap();
                        w.iter().map(|x| (x / z) as f32).collect::<Vec<f32>>()
                    })
                    .collect::<Vec<_>>(),
            );
        }
        let queries: Vec<Vec<&[f32]>> = datas
            .iter()
            .map(|d| (0..d.n_heads).map(|h| d.q_row(h, pos)).collect())
            .collect();
        s.step(pos, &probs, &queries);
        out.push(snapshot(&s));
    }
    out
}

/// [`run_group_steps`] for one layer: its caches after prefill and after each step.
pub fn run_steps(spec: &str, data: &LayerData, budget: usize) -> Vec<Vec<HeadCache>> {
    run_group_steps(spec, std::slice::from_ref(data), budget)
        .into_iter()
        .map(|mut layers| layers.remove(0))
        .collect()
}

/// Exact causal column sums over a prompt of `p`: per query head h (reading
/// KV head h / group), the f64 softmax of `scale · dot(h, g, j, i)` over keys
/// i <= j, summed over the rows j; (n_heads, P) as f32.
pub fn exact_colsums(
    nh: usize,
    group: usize,
    p: usize,
    scale: f32,
    dot: impl Fn(usize, usize, usize, usize) -> f64,
) -> Vec<f32> {
    let mut colsum = vec![0f32; nh * p];
    for h in 0..nh {
        let g = h / group;
        for j in 0..p {
            let l: Vec<f64> = (0..=j).map(|i| dot(h, g, j, i) * scale as f64).collect();
            let mx = l.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = l.iter().map(|x| (x - mx).exp()).sum();
            for i in 0..=j {
                colsum[h * p + i] += ((l[i] - mx).exp() / z) as f32;
            }
        }
    }
    colsum
}
