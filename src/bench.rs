//! `kvreplay bench`: throughput benchmarks on the real model (not timed tests).

use anyhow::{Context, Result};
use std::path::PathBuf;

use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_traces::Dtype;

use crate::cli::common::resolve_model;

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

/// Exactly `n` token ids of filler text (one word is at least one token).
fn filler_ids(model: &Model, n: usize) -> Result<Vec<u32>> {
    let mut ids = model.tokenizer.encode(&filler_text(n))?;
    anyhow::ensure!(ids.len() >= n, "filler text too short");
    ids.truncate(n);
    Ok(ids)
}

pub struct CaptureBench {
    pub model: PathBuf,
    pub prompt_tokens: usize,
    pub decode: usize,
    pub reps: usize,
    pub dtype: Dtype,
    pub device: kvreplay_kernels::DeviceRequest,
    pub prefill_chunk: usize,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn bench_capture(b: &CaptureBench) -> Result<()> {
    let mut model =
        Model::load(&b.model).with_context(|| format!("loading model {}", b.model.display()))?;
    model.llama.set_backend(crate::cli::common::open_device(
        b.device,
        crate::cli::common::Work::Capture,
    )?);
    let ids = filler_ids(&model, b.prompt_tokens)?;
    let dir = std::env::temp_dir().join(format!("kvreplay-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!(
        "capture benchmark: {} prompt tokens (chunks of {}) + {} decode tokens, dtype {}, {} threads, {} reps, device {}",
        b.prompt_tokens,
        b.prefill_chunk,
        b.decode,
        b.dtype.name(),
        rayon::current_num_threads(),
        b.reps,
        model.llama.backend.describe()
    );
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for rep in 0..b.reps {
        let mut o = CaptureOptions::new("(benchmark filler)", dir.join(format!("b{rep}.kvtrace")));
        o.prompt_ids = Some(ids.clone());
        o.n_decode = b.decode;
        o.dtype = b.dtype;
        o.prefill_chunk = b.prefill_chunk;
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
    let (p, d) = (median(&mut pre), median(&mut dec));
    println!("median: prefill {p:.1} tok/s, decode {d:.1} tok/s");
    println!("{}", target("capture prefill", p, ">=", 500.0, "tok/s"));
    println!("{}", target("capture decode", d, ">=", 60.0, "tok/s"));
    Ok(())
}

/// One line of a figure beside the performance issue's target for it:
/// `name: value unit (target op goal): met` or `: not met`.
fn target(name: &str, value: f64, op: &str, goal: f64, unit: &str) -> String {
    let met = match op {
        "<" => value < goal,
        _ => value >= goal,
    };
    format!(
        "target  {name}: {value:.2} {unit} (target {op} {goal} {unit}): {}",
        if met { "met" } else { "not met" }
    )
}

pub struct ReplayBench {
    pub trace: Option<PathBuf>,
    pub model: Option<PathBuf>,
    pub reps: usize,
    /// Python with numpy + safetensors for scripts/reference_replay.py; None skips it.
    pub python: Option<PathBuf>,
    /// Skip timing a model rerun (prefill + decode) even when the model is present.
    pub no_rerun: bool,
    /// `all`, `core` or a comma-separated list of policy specs to sweep.
    pub policies: String,
}

/// Budgets of the sweep benchmark.
pub const SWEEP_BUDGETS: [usize; 6] = [32, 64, 128, 256, 512, 1024];

/// The policies the NumPy reference implements.
const REFERENCE_POLICIES: [&str; 4] = ["full", "snapkv", "h2o", "streaming_llm"];

/// The 17 policies of the performance issue's sweep target (the registry
/// when it was filed: the classic baselines, the seed methods and `quant`).
const CORE_POLICIES: [&str; 17] = [
    "full",
    "random",
    "streaming_llm",
    "h2o",
    "snapkv",
    "pyramidkv",
    "adakv",
    "tova",
    "knorm",
    "scissorhands",
    "cam",
    "ahakv",
    "kvmerger",
    "d2o",
    "minicache",
    "ems",
    "quant",
];

/// The benchmark trace: `trace` if it exists, else a 2048 + 64 filler capture
/// (into `trace`, or a temporary folder).
fn bench_trace(
    trace: &Option<PathBuf>,
    model: &Option<PathBuf>,
    tmp: &std::path::Path,
) -> Result<PathBuf> {
    if let Some(t) = trace.as_ref().filter(|t| t.exists()) {
        return Ok(t.clone());
    }
    let out = trace.clone().unwrap_or_else(|| tmp.join("bench.kvtrace"));
    let model_path = resolve_model(model.clone())?;
    let model = Model::load(&model_path)?;
    let mut o = CaptureOptions::new("(benchmark filler)", out);
    o.prompt_ids = Some(filler_ids(&model, 2048)?);
    o.n_decode = 64;
    println!(
        "capturing a 2048 + 64 token trace of {} into {} ...",
        model_path.display(),
        o.out.display()
    );
    Ok(capture(&model, &o, &mut |_| {})?.out)
}

/// (total seconds, per policy (name, its seconds, seconds since the cold
/// start when it finished), per-point (policy, budget, summary)).
type SweepTiming = (
    f64,
    Vec<(String, f64, f64)>,
    Vec<(String, usize, kvreplay_replay::output::Summary)>,
);

/// Sweep `policies` x `budgets` from a cold start (no kept results); returns
/// (total seconds, per-policy seconds, per-point summaries).
fn timed_sweep(
    trace: &kvreplay_traces::Trace,
    policies: &[&str],
    budgets: &[usize],
) -> Result<SweepTiming> {
    use kvreplay_replay::{Budget, PolicySpec};
    let t0 = std::time::Instant::now();
    // cold start: a new replay of the trace keeps nothing from earlier runs
    let tr = kvreplay_replay::TraceReplay::new(trace, &Default::default())?;
    let (mut per_policy, mut points) = (Vec::new(), Vec::new());
    for name in policies {
        let spec = PolicySpec::parse(name)?;
        let p = spec.build()?;
        let tp = std::time::Instant::now();
        for &b in budgets {
            let r = tr.replay_spec(name, p.as_ref(), Budget::Entries(b))?;
            points.push((
                name.to_string(),
                b,
                kvreplay_replay::output::summary(
                    trace,
                    &spec,
                    Budget::Entries(b),
                    &r,
                    &kvreplay_kernels::Backend::Cpu,
                ),
            ));
        }
        per_policy.push((
            name.to_string(),
            tp.elapsed().as_secs_f64(),
            t0.elapsed().as_secs_f64(),
        ));
    }
    Ok((t0.elapsed().as_secs_f64(), per_policy, points))
}

pub fn bench_replay(b: &ReplayBench) -> Result<()> {
    use kvreplay_replay::{Budget, PolicySpec, REGISTRY};
    let tmp = std::env::temp_dir().join(format!("kvreplay-bench-replay-{}", std::process::id()));
    let trace_dir = bench_trace(&b.trace, &b.model, &tmp)?;
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

    // 1. One point, cold (first replay of the trace) and warm (reused
    //    budget-independent results, as inside a sweep).
    let one = PolicySpec::parse("snapkv")?.build()?;
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    for _ in 0..b.reps {
        let t0 = std::time::Instant::now();
        let tr = kvreplay_replay::TraceReplay::new(&trace, &Default::default())?;
        tr.replay(one.as_ref(), Budget::Entries(256))?;
        cold.push(t0.elapsed().as_secs_f64());
        let t0 = std::time::Instant::now();
        tr.replay(one.as_ref(), Budget::Entries(256))?;
        warm.push(t0.elapsed().as_secs_f64());
    }
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|t| format!("{t:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "one replay (snapkv, budget 256): cold median {:.3} s [{}]; warm median {:.3} s [{}]",
        median(&mut cold.clone()),
        fmt(&cold),
        median(&mut warm.clone()),
        fmt(&warm)
    );

    // 2. Against the NumPy reference: the same points, both from a cold start.
    let mut numpy_ratio = None;
    if let Some(py) = &b.python {
        let budgets = SWEEP_BUDGETS.map(|x| x.to_string()).join(",");
        let t0 = std::time::Instant::now();
        let out = std::process::Command::new(py)
            .arg("scripts/reference_replay.py")
            .arg(&trace_dir)
            .args([
                "--budgets",
                &budgets,
                "--policies",
                &REFERENCE_POLICIES.join(","),
            ])
            .output()
            .with_context(|| format!("running {} scripts/reference_replay.py", py.display()))?;
        let wall = t0.elapsed().as_secs_f64();
        anyhow::ensure!(
            out.status.success(),
            "reference_replay.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("reference_replay.py output")?;
        let (ours, _, points) = timed_sweep(&trace, &REFERENCE_POLICIES, &SWEEP_BUDGETS)?;
        let mut worst = [0f64; 4];
        for p in j["points"].as_array().context("points")? {
            let (pol, bud) = (
                p["policy"].as_str().unwrap_or(""),
                p["budget"].as_u64().unwrap_or(0) as usize,
            );
            let s = &points
                .iter()
                .find(|x| x.0 == pol && x.1 == bud)
                .context("point missing")?
                .2;
            for (w, (ours, key)) in worst.iter_mut().zip([
                (s.rel_l2_mean, "rel_l2"),
                (s.cosine_mean, "cosine"),
                (s.attn_mass_mean, "attn_mass"),
                (s.kl_mean, "kl"),
            ]) {
                *w = w.max((ours - p[key].as_f64().unwrap_or(f64::NAN)).abs());
            }
        }
        let theirs = j["seconds"].as_f64().unwrap_or(wall);
        numpy_ratio = Some(theirs / ours);
        println!(
            "vs NumPy reference ({} policies x {} budgets = {} points): kvreplay {ours:.2} s, NumPy {theirs:.2} s (process {wall:.2} s): {:.1}x faster",
            REFERENCE_POLICIES.len(),
            SWEEP_BUDGETS.len(),
            points.len(),
            theirs / ours
        );
        println!(
            "  largest metric difference over those points: rel_l2 {:.1e}, cosine {:.1e}, attn_mass {:.1e}, kl {:.1e}",
            worst[0], worst[1], worst[2], worst[3]
        );
    } else {
        println!("vs NumPy reference: not run (--no-numpy, or no Python with numpy and safetensors: run scripts/setup-reference.sh)");
    }

    // 3. The full sweep: every registered policy x 6 budgets, cold start,
    // the performance issue's 17 first, so the time at which they are done
    // is its sweep's time, cold start included. Every method; `sliding`
    // alone is `full` on a model without sliding layers.
    let policies: Vec<&str> = match b.policies.as_str() {
        "all" => CORE_POLICIES
            .into_iter()
            .chain(
                REGISTRY
                    .iter()
                    .map(|p| p.name)
                    .filter(|n| *n != "sliding" && !CORE_POLICIES.contains(n)),
            )
            .collect(),
        "core" => CORE_POLICIES.to_vec(),
        list => list
            .split(',')
            .map(str::trim)
            .filter(|x| !x.is_empty())
            .collect(),
    };
    // the 17-policy sweep is timed when the list starts with them
    let has_core =
        policies.len() >= CORE_POLICIES.len() && policies[..CORE_POLICIES.len()] == CORE_POLICIES;
    // each repetition from a cold start; the medians are reported
    let mut runs = Vec::new();
    for _ in 0..b.reps.max(1) {
        runs.push(timed_sweep(&trace, &policies, &SWEEP_BUDGETS)?);
    }
    let med = |f: &dyn Fn(&SweepTiming) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    let total = med(&|r| r.0);
    // (policy, its seconds, seconds since the sweep started), each a median
    let per_policy: Vec<(String, f64, f64)> = (0..policies.len())
        .map(|i| {
            (
                policies[i].to_string(),
                med(&|r| r.1[i].1),
                med(&|r| r.1[i].2),
            )
        })
        .collect();
    let points = runs[0].2.len();
    let per_point = total / points as f64;
    let core_points = CORE_POLICIES.len() * SWEEP_BUDGETS.len();
    // (seconds of the 17-policy sweep, cold start included; per point)
    let core = has_core.then(|| {
        let t = per_policy[CORE_POLICIES.len() - 1].2;
        (t, t / core_points as f64)
    });
    let each = |f: &dyn Fn(&SweepTiming) -> f64| {
        runs.iter()
            .map(|r| format!("{:.2}", f(r)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some((core_total, core_per_point)) = core {
        println!(
            "sweep of the performance issue's {} policies x {} budgets = {core_points} points in {core_total:.2} s ({core_per_point:.3} s per point; median of {} runs [{}] s)",
            CORE_POLICIES.len(),
            SWEEP_BUDGETS.len(),
            runs.len(),
            each(&|r| r.1[CORE_POLICIES.len() - 1].2),
        );
    }
    println!(
        "sweep: {} policies x {} budgets {:?} = {} points in {total:.2} s ({per_point:.3} s per point; median of {} runs [{}] s)",
        policies.len(),
        SWEEP_BUDGETS.len(),
        SWEEP_BUDGETS,
        points,
        runs.len(),
        each(&|r| r.0),
    );
    for (name, t, _) in &per_policy {
        println!(
            "  {name:>14}: {t:6.2} s for {} budgets",
            SWEEP_BUDGETS.len()
        );
    }

    let mut rerun_points = None;
    // 4. The alternative: rerunning the model on the same prompt (prefill in
    //    chunks of 256, then the decode tokens teacher-forced), no trace writes.
    if b.no_rerun {
        println!("model rerun: not timed (--no-rerun)");
    } else {
        match resolve_model(b.model.clone()) {
            Ok(path) => {
                let model = Model::load(&path)?;
                let mut times = Vec::new();
                for _ in 0..b.reps.max(1) {
                    times.push(time_rerun(&model, &m.tokens.ids, m.prompt_len())?);
                }
                let secs = median(&mut times);
                print!(
                    "model rerun (prefill {} + decode {} tokens, median of {}): {secs:.2} s = {:.0} sweep points per rerun-equivalent",
                    m.prompt_len(),
                    m.generation.n_decode,
                    times.len(),
                    secs / per_point,
                );
                match core {
                    Some((_, core_per_point)) => {
                        println!(
                            " ({:.0} over the issue's 17-policy sweep)",
                            secs / core_per_point
                        );
                        rerun_points = Some(secs / core_per_point);
                    }
                    None => println!(),
                }
            }
            Err(e) => println!("model rerun: not timed ({e})"),
        }
    }

    // 5. Each figure beside the performance issue's target (2 threads there).
    match core {
        Some((core_total, _)) => {
            println!("{}", target("17-policy sweep", core_total, "<", 20.0, "s"))
        }
        None => println!(
            "target  17-policy sweep: not measured (--policies does not start with the 17)"
        ),
    }
    let per_point_of = |name: &str| {
        per_policy
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, t, _)| t / SWEEP_BUDGETS.len() as f64)
    };
    for (name, goal) in [
        ("ems", 1.0),
        ("d2o", 0.5),
        ("minicache", 0.5),
        ("quant", 0.5),
    ] {
        if let Some(t) = per_point_of(name) {
            println!(
                "{}",
                target(&format!("{name} per point"), t, "<", goal, "s")
            );
        }
    }
    match rerun_points {
        Some(n) => println!(
            "{}",
            target("sweep points per model rerun", n, ">=", 100.0, "points")
        ),
        None => println!(
            "target  sweep points per model rerun: not measured (no rerun or no 17-policy sweep)"
        ),
    }
    match numpy_ratio {
        Some(r) => println!(
            "{}",
            target("speed-up over the NumPy reference", r, ">=", 10.0, "x")
        ),
        None => println!(
            "target  speed-up over the NumPy reference: not measured (no Python, or --no-numpy)"
        ),
    }
    std::fs::remove_dir_all(&tmp).ok();
    Ok(())
}

/// Seconds for one forward pass over `ids` as an evaluation rerun would do
/// it: prefill of the first `p` tokens in chunks of 256, then one step per
/// remaining token.
fn time_rerun(model: &Model, ids: &[u32], p: usize) -> Result<f64> {
    use kvreplay_capture::llama::{ForwardOptions, KvCache};
    let t0 = std::time::Instant::now();
    let mut cache = KvCache::new(&model.llama.cfg, ids.len());
    let mut sink = |_: kvreplay_capture::llama::LayerTaps<'_>| {};
    let mut pos = 0;
    while pos < ids.len() {
        let end = if pos < p { (pos + 256).min(p) } else { pos + 1 };
        let fo = ForwardOptions {
            colsum: None,
            probs: false,
            attention: None,
        };
        model
            .llama
            .forward(&ids[pos..end], pos, &mut cache, fo, &mut sink)?;
        pos = end;
    }
    Ok(t0.elapsed().as_secs_f64())
}

pub struct ScalingBench {
    pub model: Option<PathBuf>,
    pub dir: PathBuf,
    pub lengths: Vec<usize>,
    pub policy: String,
    pub budget: usize,
    pub reps: usize,
}

/// Replay time against prompt length: captures filler traces of each length
/// (64 decode tokens; kept in `dir` for reuse), times cold replays of one
/// (policy, budget) point and fits time = c · P^k by least squares in log-log.
pub fn bench_scaling(b: &ScalingBench) -> Result<()> {
    use kvreplay_replay::{Budget, PolicySpec};
    let spec = PolicySpec::parse(&b.policy)?;
    let policy = spec.build()?;
    std::fs::create_dir_all(&b.dir).with_context(|| format!("creating {}", b.dir.display()))?;
    let mut model: Option<Model> = None;
    let mut rows = Vec::new();
    for &len in &b.lengths {
        let dir = b.dir.join(format!("filler-{len:05}.kvtrace"));
        if !dir.join("manifest.json").exists() {
            if model.is_none() {
                model = Some(Model::load(&resolve_model(b.model.clone())?)?);
            }
            let model = model.as_ref().expect("loaded");
            let mut o = CaptureOptions::new("(benchmark filler)", &dir);
            o.prompt_ids = Some(filler_ids(model, len)?);
            o.n_decode = 64;
            o.force = true;
            o.beyond_context = true;
            let t0 = std::time::Instant::now();
            capture(model, &o, &mut |_| {})?;
            println!(
                "captured {} ({len} + 64 tokens) in {:.1} s",
                dir.display(),
                t0.elapsed().as_secs_f64()
            );
        }
        let trace = kvreplay_traces::Trace::open(&dir)?;
        let mut times = Vec::new();
        for _ in 0..b.reps {
            let t0 = std::time::Instant::now();
            kvreplay_replay::replay(&trace, policy.as_ref(), Budget::Entries(b.budget))?;
            times.push(t0.elapsed().as_secs_f64());
        }
        let t = median(&mut times.clone());
        println!(
            "P = {len:6}: {} at budget {}: median {t:.3} s (cold) over {} reps",
            spec.canonical(),
            b.budget,
            b.reps
        );
        rows.push((len as f64, t));
    }
    if rows.len() >= 2 {
        let n = rows.len() as f64;
        let (xs, ys): (Vec<f64>, Vec<f64>) = rows.iter().map(|(p, t)| (p.ln(), t.ln())).unzip();
        let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
        let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
        let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
        let k = sxy / sxx;
        let r2 = sxy * sxy / (sxx * ys.iter().map(|y| (y - my).powi(2)).sum::<f64>());
        println!(
            "replay time ~ P^{k:.2} (least squares in log-log over P = {}..{}, R^2 = {r2:.3})",
            rows[0].0,
            rows[rows.len() - 1].0
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::target;

    #[test]
    fn a_target_line_says_whether_the_figure_meets_it() {
        assert_eq!(
            target("17-policy sweep", 19.5, "<", 20.0, "s"),
            "target  17-policy sweep: 19.50 s (target < 20 s): met"
        );
        assert!(target("17-policy sweep", 20.0, "<", 20.0, "s").ends_with(": not met"));
        assert!(target("capture decode", 60.0, ">=", 60.0, "tok/s").ends_with(": met"));
        assert!(target("capture decode", 59.9, ">=", 60.0, "tok/s").ends_with(": not met"));
    }
}
