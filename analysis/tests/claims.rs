//! `kvreplay claims` on two synthetic traces built to pull the claims in
//! opposite directions: every claim must come out `agrees` on one and
//! `DISAGREES` on the other, or be listed in `ONE_SIDED` with the reason.
//! This is what keeps a claim from being true by construction.

mod common;
use common::synthetic_manifest;
use kvreplay_analysis::claims::{measure, Verdict};
use kvreplay_traces::*;
use std::path::{Path, PathBuf};

/// The structure a synthetic trace is built with.
struct Shape {
    seed: u64,
    /// AR(1) coefficient over positions of the keys' and values' noise
    /// (1 = every position alike, 0 = independent positions).
    key_locality: f32,
    value_locality: f32,
    /// A direction shared by every key (values) of a KV head: raises their
    /// pairwise cosine.
    key_bias: f32,
    value_bias: f32,
    /// Logit bonus of position 0 (an attention sink) and of late positions
    /// (a recency trend, per unit of relative position).
    sink: f32,
    recency: f32,
    /// Logit bonus of the first half of the prompt (an early block).
    early: f32,
    /// Value norms scale by 1 + ramp·(t/P − 1/2) along the positions.
    value_ramp: f32,
    /// Query scale (attention sharpness) of the first and last layer.
    temp: (f32, f32),
    /// Per-head spread of the query scale (multiplies by 1 ± spread).
    head_spread: f32,
    /// Share of layer l's keys and values carried over from layer l − 1, at
    /// the first and at the last layer.
    depth_carry: (f32, f32),
}

const NL: usize = 8;
const NH: usize = 4;
const NKV: usize = 2;
const D: usize = 16;
const P: usize = 256;
const T: usize = P + 16;

fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    move || {
        // sum of 4 uniforms: roughly normal, unit variance
        let mut s = 0.0;
        for _ in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s += ((x >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0;
        }
        s * 0.866
    }
}

/// An AR(1) noise series over the T positions (unit variance per component).
fn series(rnd: &mut impl FnMut() -> f32, rho: f32) -> Vec<Vec<f32>> {
    let mut prev: Vec<f32> = (0..D).map(|_| rnd()).collect();
    (0..T)
        .map(|_| {
            let fresh: Vec<f32> = (0..D).map(|_| rnd()).collect();
            prev = prev
                .iter()
                .zip(&fresh)
                .map(|(p, f)| rho * p + (1.0 - rho * rho).sqrt() * f)
                .collect();
            prev.clone()
        })
        .collect()
}

/// An f32 trace of `shape` with exact column sums and attention outputs.
fn write_trace(dir: &Path, name: &str, s: &Shape) -> PathBuf {
    let mut rnd = rng(s.seed);
    let unit = |v: &mut Vec<f32>| {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        v.iter_mut().for_each(|x| *x /= n);
    };
    // the direction every query leans to, per KV head (sinks and recency align with it)
    let qdir: Vec<Vec<f32>> = (0..NKV)
        .map(|_| {
            let mut v: Vec<f32> = (0..D).map(|_| rnd()).collect();
            unit(&mut v);
            v
        })
        .collect();
    let kdir: Vec<Vec<f32>> = (0..NKV)
        .map(|_| {
            let mut v: Vec<f32> = (0..D).map(|_| rnd()).collect();
            unit(&mut v);
            v
        })
        .collect();
    let vdir: Vec<Vec<f32>> = (0..NKV)
        .map(|_| {
            let mut v: Vec<f32> = (0..D).map(|_| rnd()).collect();
            unit(&mut v);
            v
        })
        .collect();
    let lerp = |(a, b): (f32, f32), l: usize| a + (b - a) * l as f32 / (NL - 1) as f32;
    let layout = TraceLayout {
        n_layers: NL,
        n_heads: NH,
        n_kv_heads: NKV,
        head_dim: D,
        total_len: T,
        prompt_len: P,
        dtype: Dtype::F32,
        attn_probs: false,
        query_start: 0,
    };
    let out = dir.join(name);
    let mut w = TraceWriter::create(&out, layout, false).unwrap();
    let scale = 1.0 / (D as f32).sqrt();
    // the noise series of the previous layer, per KV head
    type Rows = Vec<Vec<f32>>;
    let (mut prev_k, mut prev_v): (Vec<Rows>, Vec<Rows>) = (vec![], vec![]);
    for l in 0..NL {
        let carry = lerp(s.depth_carry, l);
        let temp = lerp(s.temp, l);
        let (mut ks, mut vs) = (vec![], vec![]);
        for g in 0..NKV {
            let kn = series(&mut rnd, s.key_locality);
            let vn = series(&mut rnd, s.value_locality);
            let mix = |prev: Option<&Vec<Vec<f32>>>, fresh: Vec<Vec<f32>>| -> Vec<Vec<f32>> {
                match prev {
                    None => fresh,
                    Some(p) => p
                        .iter()
                        .zip(fresh)
                        .map(|(a, b)| {
                            a.iter()
                                .zip(b)
                                .map(|(x, y)| carry * x + (1.0 - carry * carry).sqrt() * y)
                                .collect()
                        })
                        .collect(),
                }
            };
            let kn = mix(prev_k.get(g), kn);
            let vn = mix(prev_v.get(g), vn);
            let k: Vec<Vec<f32>> = (0..T)
                .map(|t| {
                    let sink = if t == 0 { s.sink } else { 0.0 };
                    let early = if t < P / 2 { s.early } else { 0.0 };
                    let lift = sink + early + s.recency * t as f32 / P as f32;
                    (0..D)
                        .map(|c| kn[t][c] + s.key_bias * 2.0 * kdir[g][c] + lift * 4.0 * qdir[g][c])
                        .collect()
                })
                .collect();
            let v: Vec<Vec<f32>> = (0..T)
                .map(|t| {
                    let ramp = 1.0 + s.value_ramp * (t.min(P) as f32 / P as f32 - 0.5);
                    (0..D)
                        .map(|c| ramp * (vn[t][c] + s.value_bias * 2.0 * vdir[g][c]))
                        .collect()
                })
                .collect();
            ks.push((kn, k));
            vs.push((vn, v));
        }
        let lw = w.layer(l);
        for g in 0..NKV {
            lw.write_rows(TensorKind::K, g, 0, &ks[g].1.concat());
            lw.write_rows(TensorKind::V, g, 0, &vs[g].1.concat());
        }
        for h in 0..NH {
            let g = h / (NH / NKV);
            let ht = temp * (1.0 + s.head_spread * (h as f32 / (NH - 1) as f32 * 2.0 - 1.0));
            let q: Vec<Vec<f32>> = (0..T)
                .map(|_| (0..D).map(|c| ht * (qdir[g][c] + 0.5 * rnd())).collect())
                .collect();
            lw.write_rows(TensorKind::Q, h, 0, &q.concat());
            let mut colsum = vec![0f32; P];
            let mut o = Vec::with_capacity(T * D);
            for (pos, qr) in q.iter().enumerate() {
                let lg: Vec<f64> = (0..=pos)
                    .map(|i| {
                        ks[g].1[i]
                            .iter()
                            .zip(qr)
                            .map(|(a, b)| (*a * *b) as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let mx = lg.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = lg.iter().map(|x| (x - mx).exp()).sum();
                let mut row = [0f64; D];
                for (i, x) in lg.iter().enumerate() {
                    let a = (x - mx).exp() / z;
                    if pos < P {
                        colsum[i] += a as f32;
                    }
                    for (r, v) in row.iter_mut().zip(&vs[g].1[i]) {
                        *r += a * *v as f64;
                    }
                }
                o.extend(row.iter().map(|x| *x as f32));
            }
            lw.write_rows(TensorKind::O, h, 0, &o);
            lw.write_colsum(h, &colsum);
        }
        prev_k = ks.into_iter().map(|x| x.0).collect();
        prev_v = vs.into_iter().map(|x| x.0).collect();
    }
    let m = synthetic_manifest((NL, NH, NKV, D), P, T, scale as f64, vec![]);
    w.finish(m).unwrap()
}

/// Like the papers' models: a sink, local and shared-direction keys, plain
/// values, attention sharpening with depth, heads that differ, deep layers
/// that resemble their neighbours.
fn paper_like() -> Shape {
    Shape {
        seed: 1,
        key_locality: 0.97,
        value_locality: 0.0,
        key_bias: 1.0,
        value_bias: 0.0,
        sink: 1.0,
        recency: 0.0,
        early: 1.0,
        value_ramp: 0.0,
        temp: (0.3, 2.5),
        head_spread: 0.6,
        depth_carry: (0.1, 0.95),
    }
}

/// The opposite on every axis the claims read: no sink but a recency trend,
/// independent keys, local and shared-direction values, attention blurring
/// with depth, identical heads, neighbours alike only at the bottom.
fn contrary() -> Shape {
    Shape {
        seed: 2,
        key_locality: 0.0,
        value_locality: 0.97,
        key_bias: 0.0,
        value_bias: 1.0,
        sink: 0.0,
        recency: 3.0,
        early: 0.0,
        value_ramp: -1.5,
        temp: (2.5, 0.3),
        head_spread: 0.0,
        depth_carry: (0.95, 0.1),
    }
}

/// Claims that do not come out `agrees` on one trace and `DISAGREES` on the
/// other, with the reason. Each one can still fail; these two traces just do
/// not pull it both ways. Replay rankings (which variant of a policy has the
/// lower error) follow the policies' behaviour on these traces more than the
/// traces' structure, and we found no structure that reverses them here.
const ONE_SIDED: &[(&str, &str)] = &[
    ("E1", "the global-local score mixes the two rankings, so it lands between them unless the early block pulls all three early (A) or local wins outright; both traces keep the order"),
    ("E5", "both traces have heads of different sharpness (A: per-head spread; B: sharpness changes with depth, which D1/D2 need); identical heads everywhere would disagree and lose D1/D2's flip"),
    ("E6", "replay ranking: τ = 0 (merge every evicted token) is best on both, the synthetic values reward merging"),
    ("E8", "replay ranking: partly on both (A: global-only not worst; B: local-only beats global-local)"),
    ("E9", "replay ranking: key-only similarity wins on both"),
    ("E10", "more budget never raised EMS's error on any trace we built"),
    ("D3", "replay ranking at equal memory: partly on A (inv-var softmax beats uniform, reciprocal does not beat uniform), disagrees on B"),
    ("D4", "replay ranking: partly on both (the EMA threshold hurts on A; D2O loses to H2O on B)"),
    ("K1", "B's independent keys share the recency direction, which lifts some adjacent pairs above 0.9 and keeps the curve from rising; keys with no shared direction would disagree and lose B's recency trend (A1, A3)"),
    ("K4", "soft-mode memory is 0.34 on A (very local keys merge a lot) and 1.0 on B; the 0.4-0.6 window needs ρ(0.75) ≈ 0.28, a key locality neither trace has"),
    ("K6", "replay ranking: σ = 5-6 beats smaller fixed σ on both"),
    ("K7", "replay ranking: partly on both (averaging loses to H2O, but so does Gaussian merging)"),
    ("K8", "replay ranking: the random pivot wins slightly on both"),
    ("K9", "replay ranking: H2O beats KVMerger on both"),
    ("A2", "needs window sums without positional trend; A's window rows attend to its early block (ρ ≈ −0.8), B's to recent keys (ρ ≈ 1.0), so it disagrees on both"),
    ("A4", "entropy grows like ln i whenever rows spread over what they see; only rows pinned to a fixed few keys would disagree, which neither trace has"),
    ("A5", "both traces have Gaussian-like logits, for which the step gain gives ≈ ln B by design (within 0.5 nats)"),
    ("A8", "replay ranking: removing VPE lowers the error on A (disagrees), mixed on B (partly)"),
    ("A9", "needs paragraph spans in the manifest; always not checkable"),
    ("M2", "partly on both: A's token 0 is no outlier, B's deep median is not near 0.6"),
    ("M3", "partly on A (SLERP ≈ mean merging), disagrees on B"),
    ("M4", "retention at γ = 0.05 is 0.9-1.0% on both; a heavy tail of dissimilar layer pairs would raise it"),
];

#[test]
fn every_claim_can_agree_and_disagree() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_trace(tmp.path(), "paper_like.kvtrace", &paper_like());
    let b = write_trace(tmp.path(), "contrary.kvtrace", &contrary());
    let ca = measure(&Trace::open(&a).unwrap()).unwrap();
    let cb = measure(&Trace::open(&b).unwrap()).unwrap();
    assert_eq!(ca.len(), cb.len());
    let mut report = String::new();
    let mut bad = vec![];
    for (x, y) in ca.iter().zip(&cb) {
        assert_eq!(x.id, y.id);
        assert!(
            x.verdict == Verdict::NotCheckable
                || x.measured.contains("no replay")
                || x.measured.contains("of the full cache"),
            "{} states no memory: {}",
            x.id,
            x.measured
        );
        let both = [x.verdict, y.verdict];
        let flips = both.contains(&Verdict::Agrees) && both.contains(&Verdict::Disagrees);
        let listed = ONE_SIDED.iter().any(|(id, _)| *id == x.id);
        report += &format!(
            "{:4} {:13} {:13} {}\n      A: {}\n      B: {}\n",
            x.id,
            x.verdict.label(),
            y.verdict.label(),
            if flips {
                ""
            } else if listed {
                "(listed)"
            } else {
                "<- ONE-SIDED"
            },
            x.measured,
            y.measured
        );
        if flips == listed {
            bad.push(x.id);
        }
    }
    eprintln!("{report}");
    assert!(
        bad.is_empty(),
        "claims that neither flip nor are listed in ONE_SIDED, or that are listed but flip: {bad:?}"
    );
    for id in ["E3", "D10", "K10", "A10", "M5"] {
        assert!(ca.iter().all(|c| c.id != id), "{id} was removed");
    }
}
