//! Analyses of kvreplay traces and replays.
//!
//! `claims` measures, on one trace, every claim of the seed methods' papers
//! that a trace can check (each spec's section 6) and sets the figure beside
//! what the paper states. Sweeps, CSVs, plots and reports come with the
//! analysis issue.
//!
//! Invariant: analysis never loads a model; it reads traces and runs replays.

pub mod claims;
pub mod compare;
pub mod cost;
pub mod figure;
pub mod models;
pub mod rank;
pub mod report;
pub mod stats;
pub mod sweep;
