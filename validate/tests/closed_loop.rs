//! The closed loop on tiny generated llama and gemma3 models: equal to the
//! uncompressed run when nothing is compressed (sliding windows included),
//! equal to an independent masked forward pass for StreamingLLM, and the
//! report end to end.

use kvreplay_capture::llama::Llama;
use kvreplay_capture::testing::{tiny_gemma3_gguf, tiny_gguf, GEMMA3_WINDOW, PLAIN};
use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_kernels::cpu;
use kvreplay_replay::{PolicySpec, REGISTRY};
use kvreplay_validate::closed_loop::{decode_compressed, decode_full, prefill, Feed};

fn model(dir: &std::path::Path) -> Model {
    Model::load(&tiny_gguf(dir, &PLAIN)).unwrap()
}

/// A prompt of 24 tokens and 6 continuation tokens of the tiny vocabulary.
fn tokens() -> (Vec<u32>, Vec<u32>) {
    let ids: Vec<u32> = (0..30u32).map(|i| 3 + (i * 37 + 11) % 250).collect();
    (ids[..24].to_vec(), ids[24..].to_vec())
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|l| l.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn full_policy_reproduces_the_uncompressed_run_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let (prompt, cont) = tokens();
    let pre = prefill(&m, &prompt, 30).unwrap();
    let full = PolicySpec::parse("full").unwrap().build().unwrap();
    for feed in [Feed::Teacher, Feed::Greedy] {
        let a = decode_full(&m, &pre, &cont, 6, feed).unwrap();
        let b = decode_compressed(&m, &pre, full.as_ref(), 4, &cont, 6, feed).unwrap();
        assert_eq!(a.tokens, b.tokens, "{feed:?}");
        assert_eq!(bits(&a.logits), bits(&b.logits), "{feed:?}");
    }
}

/// With a budget covering every position (B >= T), no policy evicts or
/// merges, so the closed loop is the uncompressed run. The policies whose
/// capabilities say they re-express entries whatever the budget
/// (`exact_when_covering = false`: quant and the mixed-precision, sparse and
/// low-rank stores, d2o and ems, think) are left out, as in replay's own
/// test of B >= T.
#[test]
fn every_policy_with_a_budget_covering_the_run_reproduces_it() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let (prompt, cont) = tokens();
    let pre = prefill(&m, &prompt, 30).unwrap();
    let want = decode_full(&m, &pre, &cont, 6, Feed::Teacher).unwrap();
    let mut checked = 0;
    for info in REGISTRY.iter().filter(|i| i.caps.exact_when_covering) {
        let p = PolicySpec::parse(info.name).unwrap().build().unwrap();
        let got = decode_compressed(&m, &pre, p.as_ref(), 64, &cont, 6, Feed::Teacher)
            .unwrap_or_else(|e| panic!("{}: {e}", info.name));
        assert_eq!(bits(&got.logits), bits(&want.logits), "{}", info.name);
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} policies checked");
}

/// An independent forward pass without a KV cache: every position's hidden
/// state recomputed from scratch, with query i allowed to see key j when
/// `allowed(i, j)`; softmax in f64. Returns the logits of the last position.
fn masked_forward(m: &Llama, ids: &[u32], allowed: &dyn Fn(usize, usize) -> bool) -> Vec<f32> {
    let c = &m.cfg;
    let (t, dm, hd, nh, nkv) = (ids.len(), c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
    let mut x = vec![0f32; t * dm];
    cpu::embedding(&m.embed, dm, ids, &mut x);
    for w in &m.layers {
        let mut h = x.clone();
        cpu::rms_norm(&mut h, &w.attn_norm, c.norm_eps);
        let (mut q, mut k, mut v) = (
            vec![0f32; t * nh * hd],
            vec![0f32; t * nkv * hd],
            vec![0f32; t * nkv * hd],
        );
        cpu::linear(&h, &w.wq, &mut q, t, dm, nh * hd);
        cpu::linear(&h, &w.wk, &mut k, t, dm, nkv * hd);
        cpu::linear(&h, &w.wv, &mut v, t, dm, nkv * hd);
        cpu::apply_rope(&mut q, nh, hd, 0, &c.rope);
        cpu::apply_rope(&mut k, nkv, hd, 0, &c.rope);
        let mut o = vec![0f32; t * nh * hd];
        for i in 0..t {
            for hh in 0..nh {
                let g = hh / (nh / nkv);
                let qi = &q[(i * nh + hh) * hd..(i * nh + hh + 1) * hd];
                let js: Vec<usize> = (0..=i).filter(|&j| allowed(i, j)).collect();
                let l: Vec<f64> = js
                    .iter()
                    .map(|&j| {
                        let kj = &k[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                        qi.iter()
                            .zip(kj)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * c.attn_scale as f64
                    })
                    .collect();
                let mx = l.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = l.iter().map(|a| (a - mx).exp()).sum();
                for (jj, &j) in js.iter().enumerate() {
                    let p = (l[jj] - mx).exp() / z;
                    for e in 0..hd {
                        o[(i * nh + hh) * hd + e] += (p * v[(j * nkv + g) * hd + e] as f64) as f32;
                    }
                }
            }
        }
        let mut a = vec![0f32; t * dm];
        cpu::linear(&o, &w.wo, &mut a, t, nh * hd, dm);
        x.iter_mut().zip(&a).for_each(|(p, q)| *p += q);
        let mut h = x.clone();
        cpu::rms_norm(&mut h, &w.ffn_norm, c.norm_eps);
        let (mut gate, mut up) = (vec![0f32; t * c.ffn_dim], vec![0f32; t * c.ffn_dim]);
        cpu::linear(&h, &w.w_gate, &mut gate, t, dm, c.ffn_dim);
        cpu::linear(&h, &w.w_up, &mut up, t, dm, c.ffn_dim);
        cpu::silu_mul(&mut gate, &up);
        let mut down = vec![0f32; t * dm];
        cpu::linear(&gate, &w.w_down, &mut down, t, c.ffn_dim, dm);
        x.iter_mut().zip(&down).for_each(|(p, q)| *p += q);
    }
    let mut last = x[(t - 1) * dm..].to_vec();
    cpu::rms_norm(&mut last, &m.out_norm, c.norm_eps);
    let head = m.lm_head.as_ref().unwrap_or(&m.embed);
    let mut logits = vec![0f32; c.vocab_size];
    cpu::linear(&last, head, &mut logits, 1, dm, c.vocab_size);
    logits
}

/// StreamingLLM at budget B: a decode query at position i sees the 4 sinks
/// and positions i - (B - 4) ..= i (its own entry appended, the oldest
/// non-sink evicted after each step); prompt queries see everything before
/// them (prefill is uncompressed).
#[test]
fn streaming_llm_equals_an_independent_masked_forward_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let (prompt, cont) = tokens();
    let (p, b) = (prompt.len(), 10usize);
    let pre = prefill(&m, &prompt, 30).unwrap();
    let pol = PolicySpec::parse("streaming_llm").unwrap().build().unwrap();
    let got = decode_compressed(&m, &pre, pol.as_ref(), b, &cont, 6, Feed::Teacher).unwrap();
    let allowed = |i: usize, j: usize| i < p || j < 4 || j + (b - 4) >= i;
    let mut ids = prompt.clone();
    let mut differs_from_full = false;
    for (step, logits) in got.logits.iter().enumerate() {
        ids.push(cont[step]);
        let want = masked_forward(&m.llama, &ids, &allowed);
        let full = masked_forward(&m.llama, &ids, &|_, _| true);
        let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        for (g, w) in logits.iter().zip(&want) {
            // f32 attention in the model against f64 here, through 2 layers
            assert!((g - w).abs() <= 1e-4 * scale, "step {step}: {g} vs {w}");
        }
        differs_from_full |= want
            .iter()
            .zip(&full)
            .any(|(a, c)| (a - c).abs() > 1e-3 * scale);
    }
    assert!(
        differs_from_full,
        "the mask never mattered: the test would not see a wrong eviction"
    );
}

#[test]
fn validate_writes_rows_correlations_and_a_report() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let trace = tmp.path().join("t.kvtrace");
    let (prompt, _) = tokens();
    let mut o = CaptureOptions::new("(tokens)", &trace);
    o.prompt_ids = Some(prompt);
    o.n_decode = 6;
    capture(&m, &o, &mut |_| {}).unwrap();
    let specs: Vec<PolicySpec> = ["full", "streaming_llm", "h2o"]
        .iter()
        .map(|s| PolicySpec::parse(s).unwrap())
        .collect();
    let rows =
        kvreplay_validate::validate_trace(&m, &trace, &specs, &[6, 12], &mut |_, _, _| {}).unwrap();
    assert_eq!(rows.len(), 6);
    for r in rows.iter().filter(|r| r.policy == "full") {
        assert_eq!(
            (r.e2e_kl, r.e2e_top1, r.replay_rel_l2),
            (0.0, 1.0, 0.0),
            "{r:?}"
        );
        assert_eq!(r.e2e_ppl, r.full_ppl);
    }
    assert!(
        rows.iter().any(|r| r.e2e_kl > 0.0),
        "nothing was compressed"
    );
    let out = tmp.path().join("val");
    let s = kvreplay_validate::report::write(&out, &rows, "test").unwrap();
    assert_eq!(s.points, 6);
    assert_eq!(s.correlations.len(), kvreplay_validate::PREDICTORS.len());
    for f in ["validation.csv", "summary.json", "scatter.svg", "report.md"] {
        assert!(out.join(f).metadata().unwrap().len() > 100, "{f}");
    }
    let csv = std::fs::read_to_string(out.join("validation.csv")).unwrap();
    assert_eq!(csv.lines().count(), 7, "header + 6 rows");
}

#[test]
fn a_trace_from_another_model_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let trace = tmp.path().join("t.kvtrace");
    let mut o = CaptureOptions::new("(tokens)", &trace);
    o.prompt_ids = Some(tokens().0);
    o.n_decode = 3;
    capture(&m, &o, &mut |_| {}).unwrap();
    let mut tw = PLAIN;
    tw.untied = true;
    let other = Model::load(&tiny_gguf(tmp.path(), &tw)).unwrap();
    let specs = [PolicySpec::parse("full").unwrap()];
    let e = kvreplay_validate::validate_trace(&other, &trace, &specs, &[4], &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("was captured from") && e.contains("pass the model"),
        "{e}"
    );
}

/// Tiny Gemma 3 (five sliding layers with a window of 4, one full layer) on
/// a 24-token prompt: the windows cut keys off at every step. With nothing
/// compressed, the closed loop is the uncompressed run bit for bit, whether
/// the sliding layers keep their window (the default) or go through the
/// policy (`+sliding`, where the cache holds every position and the window
/// is applied at attention time).
#[test]
fn gemma3_closed_loop_with_nothing_compressed_is_the_uncompressed_run() {
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny_gemma3_gguf(tmp.path())).unwrap();
    assert!(prefill_len() > GEMMA3_WINDOW as usize);
    let (prompt, cont) = tokens();
    let pre = prefill(&m, &prompt, 30).unwrap();
    assert_eq!(pre.layers.iter().filter(|l| l.window.is_some()).count(), 5);
    let mut checked = 0;
    for feed in [Feed::Teacher, Feed::Greedy] {
        let want = decode_full(&m, &pre, &cont, 6, feed).unwrap();
        for info in REGISTRY
            .iter()
            .filter(|i| i.caps.exact_when_covering && i.name != "sliding")
        {
            for spec in [info.name.to_string(), format!("{}+sliding", info.name)] {
                let p = PolicySpec::parse(&spec).unwrap().build().unwrap();
                let got = decode_compressed(&m, &pre, p.as_ref(), 64, &cont, 6, feed)
                    .unwrap_or_else(|e| panic!("{spec}: {e}"));
                assert_eq!(got.tokens, want.tokens, "{spec} {feed:?}");
                assert_eq!(bits(&got.logits), bits(&want.logits), "{spec} {feed:?}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 2 * 2 * 12, "only {checked} runs checked");
}

fn prefill_len() -> usize {
    tokens().0.len()
}

/// validate on a tiny Gemma 3 trace: `full` is exact; StreamingLLM at budget
/// 6 compresses the full-attention layer only (the sliding layers keep their
/// window of 4), and with `+sliding` its sliding layers too, which keeps 4
/// sinks + 2 recent entries there instead of the last 4 positions: a
/// different end-to-end result.
#[test]
fn validate_runs_on_a_sliding_window_model() {
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny_gemma3_gguf(tmp.path())).unwrap();
    let trace = tmp.path().join("g.kvtrace");
    let mut o = CaptureOptions::new("(tokens)", &trace);
    o.prompt_ids = Some(tokens().0);
    o.n_decode = 6;
    capture(&m, &o, &mut |_| {}).unwrap();
    let specs: Vec<PolicySpec> = ["full", "streaming_llm", "streaming_llm+sliding"]
        .iter()
        .map(|s| PolicySpec::parse(s).unwrap())
        .collect();
    let rows =
        kvreplay_validate::validate_trace(&m, &trace, &specs, &[6], &mut |_, _, _| {}).unwrap();
    assert_eq!(rows.len(), 3);
    let kl = |p: &str| rows.iter().find(|r| r.policy == p).unwrap().e2e_kl;
    let full = rows.iter().find(|r| r.policy == "full").unwrap();
    assert_eq!((full.e2e_kl, full.replay_rel_l2), (0.0, 0.0), "{full:?}");
    assert!(kl("streaming_llm") > 0.0, "{rows:?}");
    assert!(kl("streaming_llm+sliding") > 0.0, "{rows:?}");
    assert_ne!(kl("streaming_llm"), kl("streaming_llm+sliding"), "{rows:?}");
}

/// The depth-sensitivity profile on the tiny model: a zero perturbation is
/// the uncompressed run bit for bit; every layer's sensitivity is finite and
/// non-negative, some positive; the KL is second order in ε (halving ε
/// quarters it, so KL/ε² agrees at ε = 0.02 and 0.04 within 10%); and the
/// profile is stored with the trace, reused, and gives validate's
/// `replay_predicted_kl` (0 for `full`, positive where replay has error).
#[test]
fn sensitivity_is_second_order_stored_with_the_trace_and_predicts() {
    use kvreplay_validate::closed_loop::{decode_with, Perturb};
    use kvreplay_validate::sensitivity::{for_trace, mean_kl, measure, Options};
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let (prompt, cont) = tokens();
    let pre = prefill(&m, &prompt, 30).unwrap();
    let full = decode_full(&m, &pre, &cont, 6, Feed::Teacher).unwrap();
    let policy = PolicySpec::parse("full").unwrap().build().unwrap();
    // the uncompressed closed loop with `layer`'s outputs perturbed by ε
    let perturbed = |layer: usize, eps: f64, seed: u64| {
        let pt = Perturb {
            layer,
            head: None,
            eps,
            seed,
        };
        decode_with(
            &m,
            &pre,
            policy.as_ref(),
            24,
            &cont,
            6,
            Feed::Teacher,
            Some(pt),
            None,
        )
        .unwrap()
    };
    let same = perturbed(1, 0.0, 7);
    assert_eq!(bits(&same.logits), bits(&full.logits));
    let at = |eps: f64| {
        measure(
            &m,
            &pre,
            &full,
            &cont,
            Options {
                eps,
                draws: 2,
                seed: 3,
                per_head: false,
            },
            &mut |_| {},
        )
        .unwrap()
    };
    let (a, b) = (at(0.02), at(0.04));
    assert_eq!(a.per_layer.len(), m.llama.cfg.n_layers);
    assert!(
        a.per_layer.iter().all(|s| s.is_finite() && *s >= 0.0),
        "{:?}",
        a.per_layer
    );
    assert!(a.per_layer.iter().any(|s| *s > 0.0), "{:?}", a.per_layer);
    for (x, y) in a.per_layer.iter().zip(&b.per_layer) {
        assert!(
            (x - y).abs() <= 0.1 * x.max(*y),
            "KL/ε² at ε = 0.02: {x}, at 0.04: {y}"
        );
    }
    // per head: one head perturbed at a time, (layers, heads), of the layer's order of size
    let ph = measure(
        &m,
        &pre,
        &full,
        &cont,
        Options {
            eps: 0.02,
            draws: 2,
            seed: 3,
            per_head: true,
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(
        ph.per_layer, a.per_layer,
        "the per-layer figures do not depend on --per-head"
    );
    let heads = ph.per_head.unwrap();
    assert_eq!(
        (heads.len(), heads[0].len()),
        (m.llama.cfg.n_layers, m.llama.cfg.n_heads)
    );
    for (l, hs) in heads.iter().enumerate() {
        assert!(hs.iter().all(|s| s.is_finite() && *s >= 0.0), "{hs:?}");
        // each head alone moves the model less than all of them together
        assert!(
            hs.iter().all(|s| *s <= a.per_layer[l] * 1.5),
            "{hs:?} vs {}",
            a.per_layer[l]
        );
    }
    // one layer's KL is the profile's prediction for an error of ε on that layer alone
    let run = perturbed(0, 0.02, 3);
    let alone = mean_kl(&full, &run) / (0.02 * 0.02);
    assert!(
        alone > 0.0 && (alone / a.per_layer[0]).ln().abs() < 1.0,
        "{alone} vs {}",
        a.per_layer[0]
    );

    let trace = tmp.path().join("t.kvtrace");
    let mut o = CaptureOptions::new("(tokens)", &trace);
    o.prompt_ids = Some(prompt);
    o.n_decode = 6;
    capture(&m, &o, &mut |_| {}).unwrap();
    let (s, measured) = for_trace(&m, &trace, Options::default(), false, &mut |_| {}).unwrap();
    assert!(measured && trace.join("sensitivity.json").exists());
    let (again, measured) = for_trace(&m, &trace, Options::default(), false, &mut |_| {}).unwrap();
    assert!(!measured);
    assert_eq!(again, s);
    let specs: Vec<PolicySpec> = ["full", "streaming_llm"]
        .iter()
        .map(|x| PolicySpec::parse(x).unwrap())
        .collect();
    let rows =
        kvreplay_validate::validate_trace(&m, &trace, &specs, &[8], &mut |_, _, _| {}).unwrap();
    assert_eq!(rows[0].replay_predicted_kl, 0.0, "full");
    // the uncompressed closed loop: no in-loop error, no query drift
    assert_eq!(
        (
            rows[0].loop_rel_l2,
            rows[0].query_drift,
            rows[0].loop_predicted_kl
        ),
        (0.0, 0.0, 0.0)
    );
    assert!(
        rows[1].loop_rel_l2 > 0.0 && rows[1].loop_predicted_kl > 0.0,
        "{:?}",
        rows[1]
    );
    assert!(
        rows[1].replay_predicted_kl > 0.0 && rows[1].e2e_kl > 0.0,
        "{:?}",
        rows[1]
    );
    // the trace itself is still intact (the profile is beside the manifest's files)
    kvreplay_traces::Trace::open(&trace).unwrap();
}
