//! The SmolLM2 GGUF converted into an HF checkpoint directory by
//! scripts/gguf_to_hf.py (weights dequantised to f32 by the `gguf` package,
//! Q/K rows un-permuted to the HF layout, tokenizer.json built from the GGUF
//! vocabulary and merges): capture from the directory equals capture from
//! the GGUF. Skips with a printed reason without the model or the reference
//! Python environment; fails then under KVREPLAY_REQUIRE_MODEL=1.

use std::path::Path;

mod common;

use common::{kvreplay, model, python, text, ROOT};
use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_traces::{Dtype, Trace};

const PROMPT: &str = "Read this carefully. The passkey is 71432, remember it: the quick brown fox jumps over the lazy dog; naïve café — 3.14159! What is the passkey?";

/// Relative L2 tolerance per (layer, head) of q/k/v/o between the two
/// captures. The weights are the same f32 numbers; the two paths differ only
/// in where Q/K rows are un-permuted (numpy vs Rust, exact), so the
/// difference is f32 rounding order at most (measured: see the test output).
const TOL: f64 = 1e-5;

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn hf_checkpoint_converted_from_the_gguf_captures_the_same() {
    let (Some(gguf), Some(python)) = (model(), python()) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2-hf");
    let o = common::python_cmd(&python)
        .arg(Path::new(ROOT).join("scripts/gguf_to_hf.py"))
        .arg(&gguf)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "gguf_to_hf.py failed:\n{}", text(&o));
    println!("{}", text(&o));

    let mg = Model::load(&gguf).unwrap();
    let mh = Model::load(&dir).unwrap();
    assert_eq!(mh.architecture, "llama");
    // the same architecture description, but for the Q/K layout of the files
    let mut hc = mh.llama.cfg.clone();
    assert!(!hc.permuted_qk && mg.llama.cfg.permuted_qk);
    hc.permuted_qk = true;
    assert_eq!(mg.llama.cfg, hc);
    for chat in [false, true] {
        let (a, b) = (
            tmp.path().join(format!("g{chat}")),
            tmp.path().join(format!("h{chat}")),
        );
        for (m, out) in [(&mg, &a), (&mh, &b)] {
            let mut opts = CaptureOptions::new(PROMPT, out);
            opts.chat = chat;
            opts.n_decode = 8;
            opts.dtype = Dtype::F32;
            capture(m, &opts, &mut |_| {}).unwrap();
        }
        let (ta, tb) = (Trace::open(&a).unwrap(), Trace::open(&b).unwrap());
        // same prompt ids and the same greedy tokens
        assert_eq!(
            ta.manifest.tokens.ids, tb.manifest.tokens.ids,
            "chat={chat}"
        );
        assert_eq!(ta.manifest.tokens.prompt_len, tb.manifest.tokens.prompt_len);
        assert_eq!(ta.manifest.model.rope, tb.manifest.model.rope);
        let c = &mg.llama.cfg;
        let mut worst = [0f64; 4];
        for l in 0..c.n_layers {
            let (la, lb) = (ta.layer(l), tb.layer(l));
            for h in 0..c.n_heads {
                worst[0] = worst[0].max(rel_l2(&lb.q(h).to_f32(), &la.q(h).to_f32()));
                worst[3] = worst[3].max(rel_l2(&lb.o(h).to_f32(), &la.o(h).to_f32()));
            }
            for g in 0..c.n_kv_heads {
                worst[1] = worst[1].max(rel_l2(&lb.k(g).to_f32(), &la.k(g).to_f32()));
                worst[2] = worst[2].max(rel_l2(&lb.v(g).to_f32(), &la.v(g).to_f32()));
            }
        }
        println!(
            "chat={chat}: {} prompt + 8 greedy tokens identical; worst relative L2 per (layer, head): q {:.2e}, k {:.2e}, v {:.2e}, o {:.2e} (tolerance {TOL:.0e})",
            ta.manifest.tokens.prompt_len, worst[0], worst[1], worst[2], worst[3]
        );
        for (name, w) in ["q", "k", "v", "o"].iter().zip(worst) {
            assert!(w <= TOL, "chat={chat}: {name} differs by {w:.2e}");
        }
    }

    // the CLI takes the directory as --model
    let out = tmp.path().join("cli.kvtrace");
    let o = kvreplay(&[
        "capture",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--decode",
        "4",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "capture --model DIR failed:\n{}",
        text(&o)
    );
    let t = Trace::open(&out).unwrap();
    assert_eq!(t.manifest.model.source.file_name, "smollm2-hf");
    // validate reruns the model from the directory (its fingerprint matches)
    let vout = tmp.path().join("validate");
    let o = kvreplay(&[
        "validate",
        "--model",
        dir.to_str().unwrap(),
        "--trace",
        out.to_str().unwrap(),
        "--policy",
        "streaming_llm",
        "--budget",
        "4",
        "--out",
        vout.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "validate --model DIR failed:\n{}",
        text(&o)
    );
    assert!(vout.join("summary.json").exists(), "{}", text(&o));
}
