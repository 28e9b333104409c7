//! `kvreplay claims`: the seed papers' trace-checkable claims, measured.
//!
//! Each spec's section 6 lists claims a recorded trace can check. Every claim
//! here is measured on the given trace and printed next to what the paper
//! states, with a verdict. A disagreement is a finding about this model and
//! trace, not a failure of the tool.
//!
//! The claims, by id, and the file that measures them (each paper's claims
//! appear in `measure`'s output in this order):
//!
//! | ids      | method    | paper                     | file            |
//! |----------|-----------|---------------------------|-----------------|
//! | E1-E10   | ems       | EMS (Li et al.)           | `ems.rs`        |
//! | D1-D10   | d2o       | D2O (Wan et al.)          | `d2o.rs`        |
//! | K1-K10   | kvmerger  | KVMerger (Wang et al.)    | `kvmerger.rs`   |
//! | A1-A10   | ahakv     | AhaKV (Gu et al.)         | `ahakv.rs`      |
//! | M1-M5    | minicache | MiniCache (Liu et al.)    | `minicache.rs`  |
//!
//! `ctx.rs` holds what they share (`Verdict`, `Claim`, the measurement
//! context `Ctx`, small helpers); this file runs them all (`measure`).

use std::collections::HashMap;

use kvreplay_replay::ReplayError;
use kvreplay_traces::Trace;

mod ahakv;
mod ctx;
mod d2o;
mod ems;
mod kvmerger;
mod minicache;

use ahakv::ahakv;
use d2o::d2o;
use ems::ems;
use kvmerger::kvmerger;
use minicache::minicache;

use ctx::Ctx;
pub use ctx::{Claim, Verdict};

/// The shortest prompt the claims measure (windows of 32, budgets of P/4).
pub const MIN_PROMPT: usize = 64;

/// Every claim, measured on `trace`. Replays run at budgets derived from the
/// prompt length P (B = P/4 unless a claim names another).
pub fn measure(trace: &Trace) -> Result<Vec<Claim>, ReplayError> {
    let p = trace.manifest.prompt_len();
    if p < MIN_PROMPT {
        return Err(ReplayError::TraceLacks {
            path: trace.dir().display().to_string(),
            msg: format!(
                "has a {p}-token prompt; the claims need at least {MIN_PROMPT} (their windows are 32 tokens and their budgets P/4): capture a longer prompt, e.g. --task passkey:length=1024"
            ),
        });
    }
    // one f32 copy of each layer, shared by the direct measurements and the replays
    let tr = kvreplay_replay::TraceReplay::new(trace, &Default::default())?;
    let layers = (0..trace.n_layers()).map(|l| tr.layer(l)).collect();
    let mut c = Ctx {
        trace,
        tr,
        layers,
        p,
        errors: HashMap::new(),
    };
    let mut out = Vec::new();
    ems(&mut c, &mut out)?;
    d2o(&mut c, &mut out)?;
    kvmerger(&mut c, &mut out)?;
    ahakv(&mut c, &mut out)?;
    minicache(&mut c, &mut out)?;
    Ok(out)
}
