//! Depth sensitivity, measured with the model: for each layer l, the
//! teacher-forced decode of a trace's continuation with the uncompressed
//! cache and layer l's attention outputs perturbed (each head's o gets
//! ε·‖o‖·u, u a random unit vector per step and head), and the mean KL of
//! the next-token distribution against the unperturbed run. Divided by ε²,
//! that is the KL a relative error r on layer l's heads causes, to second
//! order (KL ≈ s_l·r²); summed over layers it predicts a compressed replay's
//! end-to-end KL from its per-layer errors alone
//! ([`kvreplay_traces::Sensitivity::predict`]).

use kvreplay_capture::Model;
use kvreplay_replay::policies::full::Full;
use kvreplay_traces::{Sensitivity, SENSITIVITY_FORMAT};

use crate::closed_loop::{decode_with, Decoded, Feed, Perturb, Prefilled};
use crate::{kl_logits, ValidateError};

/// How the profile is measured.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Relative perturbation size ε.
    pub eps: f64,
    /// Random directions per layer (averaged).
    pub draws: usize,
    /// Seed of the directions.
    pub seed: u64,
    /// Also measure every query head on its own (n_heads times the runs).
    pub per_head: bool,
}

impl Default for Options {
    /// ε = 0.2 (inside the range of the compressed replays' errors, small
    /// enough for the second-order term to dominate), 2 draws.
    fn default() -> Self {
        Options {
            eps: 0.2,
            draws: 2,
            seed: 0x5E45,
            per_head: false,
        }
    }
}

/// Mean KL(full ‖ run) of the next-token distributions over the steps.
pub fn mean_kl(full: &Decoded, run: &Decoded) -> f64 {
    let n = full.logits.len();
    full.logits
        .iter()
        .zip(&run.logits)
        .map(|(f, c)| kl_logits(f, c))
        .sum::<f64>()
        / n.max(1) as f64
}

/// The depth-sensitivity profile of a prefilled prompt: `full` is the
/// unperturbed teacher-forced decode of `cont` (n steps); `progress(l)` is
/// called before each layer.
pub fn measure(
    model: &Model,
    pre: &Prefilled,
    full: &Decoded,
    cont: &[u32],
    opts: Options,
    progress: &mut dyn FnMut(usize),
) -> Result<Sensitivity, ValidateError> {
    let n = full.logits.len();
    let nl = model.llama.cfg.n_layers;
    let mut per_layer = Vec::with_capacity(nl);
    // KL/ε² of perturbing `head` (None: every head) of `layer`, over the draws
    let sens = |layer: usize, head: Option<usize>| -> Result<f64, ValidateError> {
        let mut kl = 0.0;
        for draw in 0..opts.draws.max(1) {
            let perturb = Perturb {
                layer,
                head,
                eps: opts.eps,
                seed: opts.seed.wrapping_add(draw as u64),
            };
            let run = decode_with(
                model,
                pre,
                &Full,
                pre.prompt_len,
                cont,
                n,
                Feed::Teacher,
                Some(perturb),
                None,
            )?;
            kl += mean_kl(full, &run);
        }
        Ok(kl / opts.draws.max(1) as f64 / (opts.eps * opts.eps))
    };
    for layer in 0..nl {
        progress(layer);
        per_layer.push(sens(layer, None)?);
    }
    let nh = model.llama.cfg.n_heads;
    let per_head = opts
        .per_head
        .then(|| {
            (0..nl)
                .map(|layer| {
                    progress(layer);
                    (0..nh)
                        .map(|h| sens(layer, Some(h)))
                        .collect::<Result<Vec<f64>, _>>()
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    Ok(Sensitivity {
        format: SENSITIVITY_FORMAT.into(),
        model_sha256: model.source.sha256.clone(),
        eps: opts.eps,
        draws: opts.draws.max(1),
        decode_steps: n,
        per_layer,
        per_head,
        scale: 1.0,
        family_scale: Default::default(),
        kvreplay_version: env!("CARGO_PKG_VERSION").into(),
    })
}

/// The profile of the trace at `trace_dir` for `model`: the stored one when
/// it was measured with this model (unless `force`), else measured now and
/// written into the trace. Returns it and whether it was measured now.
pub fn for_trace(
    model: &Model,
    trace_dir: &std::path::Path,
    opts: Options,
    force: bool,
    progress: &mut dyn FnMut(usize),
) -> Result<(Sensitivity, bool), ValidateError> {
    let trace = kvreplay_traces::Trace::open(trace_dir)?;
    let m = &trace.manifest;
    crate::check_model(&trace, trace_dir, model)?;
    if !force {
        if let Some(s) = Sensitivity::of(&trace)? {
            return Ok((s, false));
        }
    }
    let (p, n) = (m.prompt_len(), m.generation.n_decode);
    crate::check_decode(trace_dir, n)?;
    let ids = &m.tokens.ids;
    let cont = &ids[p..p + n];
    let pre = crate::closed_loop::prefill(model, &ids[..p], p + n)?;
    let full = crate::closed_loop::decode_full(model, &pre, cont, n, Feed::Teacher)?;
    let s = measure(model, &pre, &full, cont, opts, progress)?;
    Ok((store(&s, trace_dir)?, true))
}

/// Write `s` into the trace and return it as stored: what every later read
/// (a sweep's `predicted_kl`) sees, to the last bit (JSON's decimal
/// round trip may move a value by an ulp).
pub fn store(s: &Sensitivity, trace_dir: &std::path::Path) -> Result<Sensitivity, ValidateError> {
    s.write(trace_dir)?;
    Ok(Sensitivity::read(trace_dir)?.expect("the profile was just written"))
}
