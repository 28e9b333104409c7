//! `kvreplay bench`: throughput benchmarks on the real model (not timed tests).

use anyhow::{Context, Result};
use std::path::PathBuf;

use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_traces::Dtype;

/// Deterministic English-like filler for synthetic prompts of any length.
pub fn filler_text(words: usize) -> String {
    const W: &[&str] = &[
        "the", "river", "runs", "past", "old", "mill", "where", "children", "once", "played", "in",
        "summer", "evenings", "and", "their", "voices", "carried", "over", "fields", "of",
        "barley", "towards", "distant", "hills", "that", "glowed", "under", "a", "setting", "sun.",
    ];
    let mut s = String::new();
    let mut x: u64 = 0x2545F4914F6CDD1D;
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            s.push(' ');
        }
        s.push_str(W[(x % W.len() as u64) as usize]);
    }
    s
}

pub struct CaptureBench {
    pub model: PathBuf,
    pub prompt_tokens: usize,
    pub decode: usize,
    pub reps: usize,
    pub dtype: Dtype,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn bench_capture(b: &CaptureBench) -> Result<()> {
    let model =
        Model::load(&b.model).with_context(|| format!("loading model {}", b.model.display()))?;
    let mut ids = model.tokenizer.encode(&filler_text(b.prompt_tokens))?;
    anyhow::ensure!(ids.len() >= b.prompt_tokens, "filler text too short");
    ids.truncate(b.prompt_tokens);
    let dir = std::env::temp_dir().join(format!("kvreplay-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!(
        "capture benchmark: {} prompt tokens + {} decode tokens, dtype {}, {} threads, {} reps",
        b.prompt_tokens,
        b.decode,
        b.dtype.name(),
        rayon::current_num_threads(),
        b.reps
    );
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for rep in 0..b.reps {
        let mut o = CaptureOptions::new("(benchmark filler)", dir.join(format!("b{rep}.kvtrace")));
        o.prompt_ids = Some(ids.clone());
        o.n_decode = b.decode;
        o.dtype = b.dtype;
        let s = capture(&model, &o, &mut |_| {})?;
        let (p, d) = (
            b.prompt_tokens as f64 / s.prefill_secs,
            b.decode as f64 / s.decode_secs,
        );
        println!(
            "  rep {rep}: prefill {p:8.1} tok/s ({:.2} s)   decode {d:6.1} tok/s ({:.2} s)",
            s.prefill_secs, s.decode_secs
        );
        pre.push(p);
        dec.push(d);
        std::fs::remove_dir_all(&s.out)?;
    }
    std::fs::remove_dir_all(&dir).ok();
    println!(
        "median: prefill {:.1} tok/s, decode {:.1} tok/s",
        median(&mut pre),
        median(&mut dec)
    );
    Ok(())
}
