//! The policy registry: one module per policy, one entry per policy here.
//!
//! Adding a policy: write `policies/NAME.rs` (or `policies/NAME/mod.rs` with
//! its parts beside it) with its `INFO` (name, paper, parameters,
//! capabilities, the name of its known-answer test, how to build it) and add
//! `&NAME::INFO` to [`REGISTRY`]. `kvreplay policies`, the spec parser, the
//! sweep, the golden test and the checks of README/SEMANTICS read the
//! registry; a test fails when the known-answer test it names is missing.

use std::sync::Arc;

use crate::policy::Policy;
use crate::scorer::Scorer;
use crate::spec::{ParamInfo, Params};
use crate::ReplayError;

/// An enum for a `Choice` parameter: one variant per accepted word, and the
/// `FromStr` through which [`Params::choice`] reads it. The words are the
/// ones the parameter's [`ParamInfo`] lists.
macro_rules! choice_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $word:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl std::str::FromStr for $name {
            type Err = ();
            fn from_str(s: &str) -> Result<$name, ()> {
                match s {
                    $($word => Ok($name::$variant),)+
                    _ => Err(()),
                }
            }
        }
    };
}

pub mod adakv;
pub mod ahakv;
pub mod cam;
pub mod d2o;
pub mod ems;
pub mod full;
pub mod h2o;
pub mod knorm;
pub mod kvmerger;
pub mod minicache;
pub mod pyramidkv;
pub mod quant;
pub mod random;
pub mod scissorhands;
pub mod snapkv;
pub mod streaming_llm;
pub mod tova;

/// How a registered name becomes a policy.
#[derive(Clone, Copy)]
pub enum Build {
    /// A policy in its own right.
    Policy(fn(&Params) -> Result<Arc<dyn Policy>, ReplayError>),
    /// A scorer: a policy through the shared selection, and usable inside
    /// every scorer wrapper (`adakv:scorer=NAME`).
    Scorer(fn(&Params) -> Result<Arc<dyn Scorer>, ReplayError>),
    /// Wraps any registered scorer, chosen by its `scorer` parameter; the
    /// scorer's parameters are accepted beside the wrapper's own (written
    /// `SCORER.NAME` where the wrapper has a parameter of the same name), with
    /// the defaults listed here overriding the scorer's.
    ScorerWrapper {
        default_scorer: &'static str,
        scorer_defaults: &'static [(&'static str, &'static str)],
        build: fn(&Params, Arc<dyn Scorer>) -> Result<Arc<dyn Policy>, ReplayError>,
    },
    /// Composes onto any policy with `+` (alone: onto `full`).
    Wrapper(fn(&Params, Arc<dyn Policy>) -> Result<Arc<dyn Policy>, ReplayError>),
}

/// Method family, for listings and the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Reference,
    Eviction,
    Merging,
    Quantisation,
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
    /// The cache equals the uncompressed one when the budget covers the
    /// trace (false: entries are re-expressed whatever the budget).
    pub exact_when_covering: bool,
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
        exact_when_covering: true,
    };
    /// A decode-time eviction policy (`decode_evict=false`: prefill only).
    pub const EVICT_DECODE: Caps = Caps {
        phase: Phase::DecodeByDefault,
        ..Caps::EVICT_PREFILL
    };

    /// Whether the policy acts during decode under its defaults.
    pub fn decodes_by_default(&self) -> bool {
        matches!(self.phase, Phase::Decode | Phase::DecodeByDefault)
    }
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

/// Every policy, in the order `kvreplay policies` lists them.
pub static REGISTRY: &[&PolicyInfo] = &[
    &full::INFO,
    &random::INFO,
    &streaming_llm::INFO,
    &h2o::INFO,
    &snapkv::INFO,
    &pyramidkv::INFO,
    &adakv::INFO,
    &tova::INFO,
    &knorm::INFO,
    &scissorhands::INFO,
    &cam::INFO,
    &ahakv::INFO,
    &kvmerger::INFO,
    &d2o::INFO,
    &minicache::INFO,
    &ems::INFO,
    &quant::INFO,
];

pub fn find(name: &str) -> Option<&'static PolicyInfo> {
    REGISTRY.iter().copied().find(|p| p.name == name)
}

/// The names of every registered scorer.
pub fn scorer_names() -> Vec<&'static str> {
    REGISTRY
        .iter()
        .filter(|p| p.is_scorer())
        .map(|p| p.name)
        .collect()
}

/// What `kvreplay policies` prints: each policy with its family, when it
/// acts, its capabilities, parameters and paper.
pub fn listing() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for p in REGISTRY {
        let how = match p.build {
            Build::Wrapper(_) => format!("  (wrapper: compose as POLICY+{})", p.name),
            Build::Scorer(_) => "  (scorer: also usable as scorer=NAME in pyramidkv, adakv, cam)".into(),
            Build::ScorerWrapper { default_scorer, .. } => {
                format!("  (wraps any scorer: scorer=NAME, default {default_scorer}; the scorer's parameters are accepted too)")
            }
            Build::Policy(_) => String::new(),
        };
        let c = &p.caps;
        let phase = match c.phase {
            Phase::Prefill => "prefill only",
            Phase::Decode => "acts at every decode step",
            Phase::DecodeByDefault => "acts at every decode step (decode_evict=false: prefill only)",
            Phase::PrefillByDefault => "prefill only (decode_evict=true: also at every decode step)",
        };
        let mut flags = vec![c.family.name(), phase];
        for (on, what) in [
            (c.merges, "merges entries"),
            (c.quantises, "quantises"),
            (c.cross_layer, "shares across layers"),
            (c.per_query_head, "one cache per query head"),
        ] {
            if on {
                flags.push(what);
            }
        }
        let _ = writeln!(out, "{}{how}", p.name);
        let _ = writeln!(out, "    {}", p.summary);
        let _ = writeln!(out, "    {}", flags.join("; "));
        let _ = writeln!(out, "    paper: {}", p.paper);
        for a in p.params {
            let _ = writeln!(out, "    {:<15} default {:<9} {}", a.name, a.default, a.help);
        }
        out.push('\n');
    }
    out.push_str("Spec syntax: NAME, NAME:key=value,key=value, WRAPPER:scorer=SCORER (e.g. adakv:scorer=tova), or BASE+WRAPPER (e.g. snapkv:w=16+quant:bits=2).\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Kind, PolicySpec};

    /// Every word a `Choice` parameter lists is one its policy reads (a typed
    /// choice whose `FromStr` missed a word would refuse it here).
    #[test]
    fn every_listed_choice_builds() {
        for info in REGISTRY {
            for p in info.params {
                if let Kind::Choice(words) = p.kind {
                    for w in words {
                        let spec = format!("{}:{}={w}", info.name, p.name);
                        let built = PolicySpec::parse(&spec).and_then(|s| s.build());
                        assert!(built.is_ok(), "{spec}: {:?}", built.err());
                    }
                }
            }
        }
    }
}
