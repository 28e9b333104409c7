//! Replay: apply a compression policy to a trace without rerunning the model.
//!
//! For every layer and KV head the policy builds the compressed cache at the
//! end of prefill (and may act again at each decode step); the engine replays
//! the captured decode queries over it and measures output error, retention
//! and memory against the full cache. Semantics: `replay/SEMANTICS.md`.
//!
//! Invariant: replay never loads a model; everything comes from the trace.

pub mod allocation;
pub mod cache;
pub mod engine;
mod error;
pub mod external;
pub mod info;
pub mod memo;
pub mod memory;
pub mod output;
pub mod params;
pub mod policies;
pub mod policy;
pub mod scorer;
pub mod select;
pub mod session;
pub mod spec;

pub use cache::HeadCache;
pub use engine::{
    check_reads, check_reads_of, replay, replay_layer, replay_on, Budget, HeadMetrics,
    ReplayResult, Retained, TraceReplay,
};
pub use error::ReplayError;
pub use policies::{PolicyInfo, REGISTRY};
pub use policy::{LayerData, Policy, PrefillCtx, StepCtx};
pub use scorer::{Scorer, StepScorer, TopK, Unit};
pub use session::Session;
pub use spec::PolicySpec;
