//! Closed-loop validation: does replay error predict what the model really
//! does with a compressed cache?
//!
//! For each trace and (policy, budget) point, [`closed_loop`] reruns the
//! model on the trace's prompt with the policy inside the forward pass, in
//! two modes: teacher-forced on the trace's continuation (KL of the
//! next-token distribution against the uncompressed model, top-1 agreement,
//! perplexity of the continuation) and free-running (the generated text and,
//! for needle tasks, whether it still contains the needle). The same point is
//! replayed, and [`report`] measures how well each replay statistic ranks the
//! points like the end-to-end KL (Spearman), on all points and on held-out
//! traces. Closed-loop runs cost a model run each: meant for a calibration
//! subset.

pub mod closed_loop;
pub mod report;
pub mod sensitivity;

use std::path::Path;

use kvreplay_capture::Model;
use kvreplay_replay::{Budget, PolicySpec, ReplayResult};
use kvreplay_traces::Trace;
use serde::{Deserialize, Serialize};

use closed_loop::{decode_compressed, prefill, Feed};

#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    #[error(transparent)]
    Replay(kvreplay_replay::ReplayError),
    #[error(transparent)]
    Capture(#[from] kvreplay_capture::CaptureError),
    #[error("compute: {0}")]
    Kernel(kvreplay_kernels::KernelError),
    #[error(transparent)]
    Trace(#[from] kvreplay_traces::TraceError),
    #[error("{path}: {msg}")]
    Input { path: String, msg: String },
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
}

/// One validated (trace, policy, budget) point.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub trace: String,
    pub policy: String,
    /// The policy family (`kvreplay policies`) of the spec's base policy.
    pub family: String,
    pub budget: usize,
    // end to end, teacher-forced on the trace's continuation
    pub e2e_kl: f64,
    pub e2e_top1: f64,
    pub e2e_ppl: f64,
    pub full_ppl: f64,
    // end to end, free-running
    pub needle_kept: Option<bool>,
    pub text: String,
    // replay statistics (predictors)
    pub replay_rel_l2: f64,
    pub replay_attn_loss: f64,
    pub replay_kl: f64,
    pub replay_worst_layer_rel_l2: f64,
    pub replay_p95_rel_l2: f64,
    pub replay_depth_weighted_rel_l2: f64,
    /// Σ_l s_l · mean_h rel_l2² with the trace's depth-sensitivity profile:
    /// the predicted end-to-end KL.
    pub replay_predicted_kl: f64,
    // the closed loop's own statistics (not available to replay): how far
    // teacher forcing is from the compressed model's real queries
    /// Mean over layers, heads and steps of the attention-output error
    /// measured inside the compressed run, with its own queries.
    pub loop_rel_l2: f64,
    /// The sensitivity-weighted prediction from those in-loop errors.
    pub loop_predicted_kl: f64,
    /// Mean relative L2 distance of the compressed run's queries from the
    /// uncompressed run's (query drift).
    pub query_drift: f64,
    // cost
    pub closed_loop_seconds: f64,
    pub replay_seconds: f64,
}

/// A replay statistic of a row.
pub type Predictor = fn(&Row) -> f64;

/// The replay statistics tried as predictors of the end-to-end KL, by name.
pub const PREDICTORS: &[(&str, Predictor)] = &[
    ("rel_l2 (mean)", |r| r.replay_rel_l2),
    ("1 - attn_mass (mean)", |r| r.replay_attn_loss),
    ("kl (mean)", |r| r.replay_kl),
    ("rel_l2 worst layer", |r| r.replay_worst_layer_rel_l2),
    ("rel_l2 p95 over heads", |r| r.replay_p95_rel_l2),
    ("rel_l2 depth-weighted", |r| r.replay_depth_weighted_rel_l2),
    ("sensitivity-weighted rel_l2² (predicted KL)", |r| {
        r.replay_predicted_kl
    }),
];

/// The closed loop's own statistics, measured inside the compressed run:
/// not predictors (replay cannot compute them), but how well they rank the
/// points bounds what teacher-forced replay statistics of the same form can
/// reach; the gap is the cost of teacher forcing (query drift).
pub const IN_LOOP: &[(&str, Predictor)] = &[
    ("in-loop rel_l2 (mean)", |r| r.loop_rel_l2),
    ("in-loop sensitivity-weighted rel_l2²", |r| {
        r.loop_predicted_kl
    }),
];

/// The statistics of one replay that are tried as predictors.
fn predictors(r: &ReplayResult, row: &mut Row) {
    let all: Vec<f64> = r.metrics().map(|m| m.rel_l2).collect();
    row.replay_rel_l2 = r.mean(|m| m.rel_l2);
    row.replay_attn_loss = 1.0 - r.mean(|m| m.attn_mass);
    row.replay_kl = r.mean(|m| m.kl);
    let per_layer: Vec<f64> = r
        .layers
        .iter()
        .map(|l| l.metrics.iter().map(|m| m.rel_l2).sum::<f64>() / l.metrics.len() as f64)
        .collect();
    row.replay_worst_layer_rel_l2 = per_layer.iter().cloned().fold(0.0, f64::max);
    let mut s = all.clone();
    s.sort_by(|a, b| kvreplay_replay::select::cmp_f64(*a, *b));
    row.replay_p95_rel_l2 = s[((0.95 * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
    let wsum: f64 = (1..=per_layer.len()).map(|w| w as f64).sum();
    row.replay_depth_weighted_rel_l2 = per_layer
        .iter()
        .enumerate()
        .map(|(l, x)| (l + 1) as f64 * x)
        .sum::<f64>()
        / wsum;
}

/// Families held out of the predictor's choice in the by-family split:
/// merging within and across layers.
pub const HELD_OUT_FAMILIES: &[&str] = &["merging", "cross-layer"];

/// log Σ exp(x), max-shifted, in f64.
fn log_sum_exp(x: &[f32]) -> f64 {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
    m + x.iter().map(|v| (*v as f64 - m).exp()).sum::<f64>().ln()
}

/// KL(p || q) of two logit vectors' softmax distributions, in f64.
pub fn kl_logits(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p), log_sum_exp(q));
    p.iter()
        .zip(q)
        .map(|(a, b)| {
            let la = *a as f64 - lp;
            la.exp() * (la - (*b as f64 - lq))
        })
        .sum::<f64>()
        .max(0.0)
}

/// -log softmax(logits)[target].
fn nll(logits: &[f32], target: u32) -> f64 {
    log_sum_exp(logits) - logits[target as usize] as f64
}

/// The digits of the trace's `needle` span, if it has one with digits.
fn needle_digits(trace: &Trace, model: &Model) -> Option<String> {
    let m = &trace.manifest;
    let s = m.spans.iter().find(|s| s.name == "needle")?;
    let text = model.tokenizer.decode(&m.tokens.ids[s.start..s.end]);
    // the first run of at least 3 digits (the pass key)
    text.split(|c: char| !c.is_ascii_digit())
        .find(|run| run.len() >= 3)
        .map(String::from)
}

/// The trace must have been captured from `model`.
fn check_model(trace: &Trace, trace_dir: &Path, model: &Model) -> Result<(), ValidateError> {
    let m = &trace.manifest;
    if m.model.source.sha256 != model.source.sha256 {
        return Err(ValidateError::Input {
            path: trace_dir.display().to_string(),
            msg: format!(
                "was captured from {} (sha256 {}), not from the model given ({}); pass the model the trace was captured with",
                m.model.source.file_name, m.model.source.sha256, model.source.file_name
            ),
        });
    }
    Ok(())
}

/// The closed loop compares continuations: at least 2 decode tokens.
fn check_decode(trace_dir: &Path, n: usize) -> Result<(), ValidateError> {
    if n < 2 {
        return Err(ValidateError::Input {
            path: trace_dir.display().to_string(),
            msg: "needs at least 2 decode tokens to compare continuations; capture it with --decode 16".into(),
        });
    }
    Ok(())
}

/// Validate `specs` x `budgets` on `trace`, calling `progress(done, total, label)`.
pub fn validate_trace(
    model: &Model,
    trace_dir: &Path,
    specs: &[PolicySpec],
    budgets: &[usize],
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<Row>, ValidateError> {
    let trace = Trace::open(trace_dir)?;
    let m = &trace.manifest;
    let name = trace_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    check_model(&trace, trace_dir, model)?;
    let (p, n) = (m.prompt_len(), m.generation.n_decode);
    check_decode(trace_dir, n)?;
    let total = specs.len() * budgets.len();
    let ids = &m.tokens.ids;
    let cont = &ids[p..p + n];
    let pre = prefill(model, &ids[..p], p + n)?;
    // the uncompressed run, through the closed loop's hook: its logits are
    // `decode_full`'s bit for bit (tests/closed_loop.rs), and its queries
    // are the reference of the compressed runs' query drift
    let full = closed_loop::decode_with(
        model,
        &pre,
        &kvreplay_replay::policies::full::Full,
        p,
        cont,
        n,
        Feed::Teacher,
        None,
        None,
    )?;
    let reference = &full.in_loop.queries;
    let full_ppl = (cont[1..]
        .iter()
        .zip(&full.logits)
        .map(|(t, l)| nll(l, *t))
        .sum::<f64>()
        / (n - 1) as f64)
        .exp();
    let needle = needle_digits(&trace, model);
    // the trace's depth-sensitivity profile: stored with it, measured once
    let profile = match kvreplay_traces::Sensitivity::of(&trace)? {
        Some(s) => s,
        None => {
            let s = sensitivity::measure(model, &pre, &full, cont, Default::default(), &mut |l| {
                progress(0, total, &format!("{name} sensitivity of layer {l}"))
            })?;
            sensitivity::store(&s, trace_dir)?
        }
    };
    let mut rows = Vec::new();
    // one replay of the trace for every point: its layers and reference are kept
    let replay = kvreplay_replay::TraceReplay::new(&trace, &Default::default())?;
    for spec in specs {
        let policy = spec.build()?;
        for &b in budgets {
            progress(rows.len(), total, &format!("{name} {} B={b}", spec.short()));
            let t0 = std::time::Instant::now();
            let tf = closed_loop::decode_with(
                model,
                &pre,
                policy.as_ref(),
                b,
                cont,
                n,
                Feed::Teacher,
                None,
                Some(reference),
            )?;
            let il = &tf.in_loop;
            let fr = decode_compressed(model, &pre, policy.as_ref(), b, cont, n, Feed::Greedy)?;
            let closed_loop_seconds = t0.elapsed().as_secs_f64();
            let kl = sensitivity::mean_kl(&full, &tf);
            let argmax = |x: &[f32]| kvreplay_kernels::cpu::argmax(x);
            let top1 = tf
                .logits
                .iter()
                .zip(&full.logits)
                .filter(|(c, f)| argmax(c) == argmax(f))
                .count() as f64
                / n as f64;
            let ppl = (cont[1..]
                .iter()
                .zip(&tf.logits)
                .map(|(t, l)| nll(l, *t))
                .sum::<f64>()
                / (n - 1) as f64)
                .exp();
            let text = model.tokenizer.decode(&fr.tokens);
            let t1 = std::time::Instant::now();
            let r = replay.replay(policy.as_ref(), Budget::Entries(b))?;
            let mut row = Row {
                trace: name.clone(),
                policy: spec.short(),
                family: kvreplay_replay::policies::family_of(&spec.short()).to_string(),
                budget: b,
                e2e_kl: kl,
                e2e_top1: top1,
                e2e_ppl: ppl,
                full_ppl,
                needle_kept: needle.as_ref().map(|d| text.contains(d.as_str())),
                text,
                replay_rel_l2: 0.0,
                replay_attn_loss: 0.0,
                replay_kl: 0.0,
                replay_worst_layer_rel_l2: 0.0,
                replay_p95_rel_l2: 0.0,
                replay_depth_weighted_rel_l2: 0.0,
                replay_predicted_kl: profile.predict_raw(&r.layer_sq_rel_l2()),
                loop_rel_l2: closed_loop::InLoop::mean(&il.rel_l2, il.steps),
                loop_predicted_kl: profile
                    .predict_raw(&closed_loop::InLoop::layer_sq(&il.rel_l2, il.steps)),
                query_drift: closed_loop::InLoop::mean(&il.drift, il.steps),
                closed_loop_seconds,
                replay_seconds: t1.elapsed().as_secs_f64(),
            };
            predictors(&r, &mut row);
            rows.push(row);
        }
    }
    progress(total, total, &name);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_of_logits_by_hand() {
        // p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
        let p = [0.0f32, 0.0];
        let q = [0.0f32, 3f32.ln()];
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_logits(&p, &q) - want).abs() < 1e-7);
        assert_eq!(kl_logits(&p, &p), 0.0);
    }

    #[test]
    fn nll_by_hand() {
        let l = [0.0f32, 3f32.ln()];
        assert!((nll(&l, 1) - (4.0f64 / 3.0).ln()).abs() < 1e-7);
    }
}
