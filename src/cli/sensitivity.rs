//! `kvreplay sensitivity`: measure a trace's depth-sensitivity profile with
//! its model and store it with the trace (`sensitivity.json`), so that
//! sweeps write `predicted_kl`.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

use kvreplay_capture::Model;

use super::common::{expand_traces, resolve_trace_model};

#[derive(Args)]
pub(super) struct SensitivityArgs {
    /// GGUF model file or HF checkpoint directory the traces were captured with [default: as for validate]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Traces: trace folders, or folders whose sub-folders are traces.
    #[arg(long, num_args = 1.., required = true)]
    trace: Vec<PathBuf>,
    /// Relative size ε of the perturbation of each head's attention output.
    #[arg(long, default_value_t = 0.2)]
    eps: f64,
    /// Random directions per layer, averaged.
    #[arg(long, default_value_t = 2)]
    draws: usize,
    /// Remeasure a trace that already has a profile for this model.
    #[arg(long)]
    force: bool,
    /// Also measure each query head on its own (n_heads times the model runs).
    #[arg(long)]
    per_head: bool,
}

pub(super) fn cmd_sensitivity(a: SensitivityArgs) -> Result<()> {
    if !(a.eps.is_finite() && a.eps > 0.0 && a.eps <= 1.0) {
        bail!("--eps {} must lie in (0, 1]", a.eps);
    }
    if a.draws == 0 {
        bail!("--draws must be at least 1");
    }
    let traces = expand_traces(&a.trace)?;
    let model_path = resolve_trace_model(a.model.clone(), &traces[0])?;
    let model = Model::load(&model_path)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let nl = model.llama.cfg.n_layers;
    let bar = ProgressBar::new((traces.len() * nl) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} layers ({elapsed}, eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let opts = kvreplay_validate::sensitivity::Options {
        eps: a.eps,
        draws: a.draws,
        per_head: a.per_head,
        ..Default::default()
    };
    for (i, t) in traces.iter().enumerate() {
        bar.set_message(t.display().to_string());
        let (s, measured) =
            kvreplay_validate::sensitivity::for_trace(&model, t, opts, a.force, &mut |l| {
                bar.set_position((i * nl + l) as u64)
            })
            .with_context(|| format!("measuring the sensitivity of {}", t.display()))?;
        bar.set_position(((i + 1) * nl) as u64);
        let top = s
            .per_layer
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |x| x.0);
        let line = format!(
            "{}: {} (most sensitive layer {top}: {:.3e} nats per unit squared relative error; total {:.3e})",
            t.display(),
            if measured { "measured, written to sensitivity.json" } else { "already has a profile for this model (--force remeasures)" },
            s.per_layer[top],
            s.per_layer.iter().sum::<f64>()
        );
        bar.suspend(|| println!("{line}"));
    }
    bar.finish_and_clear();
    Ok(())
}
