//! What the registry knows of a policy: how to build it, its parameters,
//! capabilities and known-answer test. A leaf module, so policy files declare
//! themselves without importing the registry that lists them.

use std::sync::Arc;

use crate::params::{ParamInfo, Params};
use crate::policy::Policy;
use crate::scorer::Scorer;
use crate::ReplayError;

/// Builds a policy from its parameters.
pub type BuildPolicy = fn(&Params) -> Result<Arc<dyn Policy>, ReplayError>;
/// Builds a scorer from its parameters.
pub type BuildScorer = fn(&Params) -> Result<Arc<dyn Scorer>, ReplayError>;
/// Builds a policy around the scorer it wraps.
pub type BuildAround = fn(&Params, Arc<dyn Scorer>) -> Result<Arc<dyn Policy>, ReplayError>;
/// Builds a policy around the policy it composes onto.
pub type BuildOnto = fn(&Params, Arc<dyn Policy>) -> Result<Arc<dyn Policy>, ReplayError>;

/// How a registered name becomes a policy.
#[derive(Clone, Copy)]
pub enum Build {
    /// A policy in its own right.
    Policy(BuildPolicy),
    /// A scorer: a policy through the shared selection, and usable inside
    /// every scorer wrapper (`adakv:scorer=NAME`).
    Scorer(BuildScorer),
    /// Wraps any registered scorer, chosen by its `scorer` parameter; the
    /// scorer's parameters are accepted beside the wrapper's own (written
    /// `SCORER.NAME` where the wrapper has a parameter of the same name), with
    /// the defaults listed here overriding the scorer's.
    ScorerWrapper {
        default_scorer: &'static str,
        scorer_defaults: &'static [(&'static str, &'static str)],
        build: BuildAround,
    },
    /// Composes onto any policy with `+` (alone: onto `full`).
    Wrapper(BuildOnto),
}

/// Method family, for listings and the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Reference,
    Eviction,
    Merging,
    Quantisation,
    /// Low-rank or sparse approximations of the keys and values (every
    /// position kept, each stored approximately).
    LowRank,
    CrossLayer,
    Allocation,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Reference => "reference",
            Family::Eviction => "eviction",
            Family::Merging => "merging",
            Family::Quantisation => "quantisation",
            Family::LowRank => "low-rank",
            Family::CrossLayer => "cross-layer",
            Family::Allocation => "budget allocation",
        }
    }
}

/// When a policy acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// At the end of prefill only; decode entries are appended.
    Prefill,
    /// Also at every decode step (holds its capacity).
    Decode,
    /// Decode-time by default, prefill-only with `decode_evict=false`.
    DecodeByDefault,
    /// Prefill-only by default, decode-time with `decode_evict=true`.
    PrefillByDefault,
    /// A scorer wrapper: acts when its scorer does (the default scorer's
    /// phase is what `holds_capacity` describes).
    AsScorer,
}

/// How much a policy holds at `--budget B`, under its defaults: the bound
/// is B f16 entries' bytes (B·2·d·16 bits) per KV head and layer, summed
/// over layers and heads (a policy that moves budget between layers or
/// heads meets it in total), with the decode entries a cache appends on top
/// (once per cache: G times per KV head with one cache per query head).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Memory {
    /// Within the bound.
    Budget,
    /// Within the bound plus metadata stored beside the entries, at most
    /// `share` of the bound (e.g. EMS's per-slot norms and indices): what it is.
    Metadata { share: f64, what: &'static str },
    /// Not set by B, and why (a fixed precision, layers or heads left whole,
    /// positions kept at low precision instead of dropped).
    Beyond(&'static str),
}

/// What a policy does, as `kvreplay policies`, the tests and SEMANTICS.md
/// need to know it.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    pub family: Family,
    pub phase: Phase,
    /// Writes entries that stand for several positions.
    pub merges: bool,
    /// Stores entries below f16 precision.
    pub quantises: bool,
    /// Replays groups of layers together (shared storage).
    pub cross_layer: bool,
    /// Keeps one cache per query head by default (G× the entries of a per-KV-head cache).
    pub per_query_head: bool,
    /// Holds a fixed capacity during decode under its defaults: each step's
    /// query sees capacity + 1 entries, then the policy evicts back.
    pub holds_capacity: bool,
    /// The cache equals the uncompressed one when the budget covers the
    /// trace (false: entries are re-expressed whatever the budget).
    pub exact_when_covering: bool,
    /// How the policy's bytes relate to `--budget B` (a registry test checks it).
    pub memory: Memory,
    /// `None`: the published rule as its paper or reference code states it.
    /// `Some(how)`: what kvreplay approximates, and why (the method's page
    /// says more).
    pub approximation: Option<&'static str>,
}

impl Caps {
    /// A prefill-only eviction policy that keeps exact entries.
    pub const EVICT_PREFILL: Caps = Caps {
        family: Family::Eviction,
        phase: Phase::Prefill,
        merges: false,
        quantises: false,
        cross_layer: false,
        per_query_head: false,
        holds_capacity: false,
        exact_when_covering: true,
        memory: Memory::Budget,
        approximation: None,
    };
    /// A decode-time eviction policy (`decode_evict=false`: prefill only).
    pub const EVICT_DECODE: Caps = Caps {
        phase: Phase::DecodeByDefault,
        holds_capacity: true,
        ..Caps::EVICT_PREFILL
    };
}

/// A registered policy: what `kvreplay policies` lists and specs resolve to.
pub struct PolicyInfo {
    /// Registry key, file name and CSV value.
    pub name: &'static str,
    pub summary: &'static str,
    /// Source paper (title, venue/arXiv) and reference code.
    pub paper: &'static str,
    pub params: &'static [ParamInfo],
    pub caps: Caps,
    /// The known-answer test (a `#[test] fn` under `replay/tests/`) that
    /// checks the policy's rule on hand-built layers.
    pub test: &'static str,
    pub build: Build,
}

impl PolicyInfo {
    /// Composes onto another policy with `+` (e.g. `snapkv+quant`).
    pub fn is_wrapper(&self) -> bool {
        matches!(self.build, Build::Wrapper(_))
    }
    /// Usable as `scorer=NAME` inside the scorer wrappers.
    pub fn is_scorer(&self) -> bool {
        matches!(self.build, Build::Scorer(_))
    }
}
