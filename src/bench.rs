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

pub struct ReplayBench {
    pub trace: Option<PathBuf>,
    pub model: Option<PathBuf>,
    pub reps: usize,
}

/// Budgets of the sweep benchmark.
pub const SWEEP_BUDGETS: [usize; 6] = [32, 64, 128, 256, 512, 1024];

pub fn bench_replay(b: &ReplayBench) -> Result<()> {
    use kvreplay_replay::{Budget, PolicySpec, REGISTRY};
    let tmp = std::env::temp_dir().join(format!("kvreplay-bench-replay-{}", std::process::id()));
    let trace_dir = match &b.trace {
        Some(t) if t.exists() => t.clone(),
        other => {
            let out = other.clone().unwrap_or_else(|| tmp.join("bench.kvtrace"));
            let model_path = crate::cli::resolve_model(b.model.clone())?;
            let model = Model::load(&model_path)?;
            let mut ids = model.tokenizer.encode(&filler_text(2048))?;
            ids.truncate(2048);
            let mut o = CaptureOptions::new("(benchmark filler)", out);
            o.prompt_ids = Some(ids);
            o.n_decode = 64;
            println!(
                "capturing a 2048 + 64 token trace of {} into {} ...",
                model_path.display(),
                o.out.display()
            );
            capture(&model, &o, &mut |_| {})?.out
        }
    };
    let trace = kvreplay_traces::Trace::open(&trace_dir)?;
    let m = &trace.manifest;
    println!(
        "replay benchmark on {}: {} prompt + {} decode tokens, {} layers x {} KV heads, {} threads",
        trace_dir.display(),
        m.prompt_len(),
        m.generation.n_decode,
        m.model.n_layers,
        m.model.n_kv_heads,
        rayon::current_num_threads()
    );
    let one = PolicySpec::parse("snapkv")?.build()?;
    let mut times = Vec::new();
    for _ in 0..b.reps {
        let t0 = std::time::Instant::now();
        kvreplay_replay::replay(&trace, one.as_ref(), Budget::Entries(256))?;
        times.push(t0.elapsed().as_secs_f64());
    }
    println!(
        "one replay (snapkv, budget 256): median {:.3} s over {} reps {:?}",
        median(&mut times.clone()),
        b.reps,
        times.iter().map(|t| format!("{t:.3}")).collect::<Vec<_>>()
    );
    let policies: Vec<_> = REGISTRY.iter().map(|p| p.name).collect();
    let t0 = std::time::Instant::now();
    let mut per_policy = Vec::new();
    for name in &policies {
        let p = PolicySpec::parse(name)?.build()?;
        let tp = std::time::Instant::now();
        for &budget in &SWEEP_BUDGETS {
            kvreplay_replay::replay(&trace, p.as_ref(), Budget::Entries(budget))?;
        }
        per_policy.push((name, tp.elapsed().as_secs_f64()));
    }
    let total = t0.elapsed().as_secs_f64();
    println!(
        "sweep: {} policies x {} budgets {:?} = {} replays in {total:.2} s ({:.3} s per replay)",
        policies.len(),
        SWEEP_BUDGETS.len(),
        SWEEP_BUDGETS,
        policies.len() * SWEEP_BUDGETS.len(),
        total / (policies.len() * SWEEP_BUDGETS.len()) as f64
    );
    for (name, t) in per_policy {
        println!("  {name:>14}: {t:.2} s for 6 budgets");
    }
    std::fs::remove_dir_all(&tmp).ok();
    Ok(())
}
