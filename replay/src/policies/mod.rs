//! The policy registry: one module per policy, one entry per policy here.
//!
//! Adding a policy: write `policies/NAME.rs` (or `policies/NAME/mod.rs` with
//! its parts beside it) with its `INFO` (name, paper, parameters,
//! capabilities, the name of its known-answer test, how to build it) and add
//! `&NAME::INFO` to [`REGISTRY`]. `kvreplay policies`, the spec parser, the
//! sweep, the golden test and the checks of README/SEMANTICS read the
//! registry; a test fails when the known-answer test it names is missing.

pub use crate::info::{Build, Caps, Family, Memory, Phase, PolicyInfo};

pub mod a2sf;
pub mod adakv;
pub mod ahakv;
pub mod block;
pub mod cam;
pub mod chunk;
pub mod chunkkv;
pub mod compactor;
pub mod compresskv;
pub mod criticaladakv;
pub mod criticalkv;
pub mod cur;
pub mod d2o;
pub mod decoding;
pub mod ems;
pub mod expected_attention;
pub mod finch;
pub mod full;
pub mod gear;
pub mod h2o;
pub mod keydiff;
pub mod keyrerotation;
pub mod knorm;
pub mod kvcrush;
pub mod kvmerger;
pub mod kvquant;
pub mod lagkv;
pub mod lazyeviction;
pub mod leverage;
pub mod mikv;
pub mod minicache;
pub mod mustafar;
pub mod observed_attention;
pub mod prefilldecoding;
pub mod pyramidkv;
pub mod quant;
pub mod random;
pub mod razor;
pub mod retrieval_head;
pub mod scissorhands;
pub mod simlayerkv;
pub mod sliding;
pub mod snapkv;
pub mod streaming_llm;
pub mod think;
pub mod tova;
pub mod triforce;
pub mod windowkv;
pub mod xkv;
pub mod zipcache;

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
    &sliding::INFO,
    &observed_attention::INFO,
    &keydiff::INFO,
    &lagkv::INFO,
    &a2sf::INFO,
    &leverage::INFO,
    &cur::INFO,
    &mikv::INFO,
    &mustafar::INFO,
    &zipcache::INFO,
    &gear::INFO,
    &kvquant::INFO,
    &retrieval_head::INFO,
    &razor::INFO,
    &windowkv::INFO,
    &compresskv::INFO,
    &chunkkv::INFO,
    &chunk::INFO,
    &block::INFO,
    &criticalkv::INFO,
    &criticaladakv::INFO,
    &keyrerotation::INFO,
    &decoding::INFO,
    &prefilldecoding::INFO,
    &expected_attention::INFO,
    &think::INFO,
    &simlayerkv::INFO,
    &compactor::INFO,
    &finch::INFO,
    &kvcrush::INFO,
    &lazyeviction::INFO,
    &xkv::INFO,
    &triforce::INFO,
];

/// The family name (`Family::name`) of a spec's base policy, the name
/// before any `:` or `+`; `external` for a policy not in the registry
/// (a Python policy).
pub fn family_of(spec: &str) -> &'static str {
    let base = spec.split([':', '+']).next().unwrap_or(spec);
    find(base).map_or("external", |i| i.caps.family.name())
}

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
    // grouped by family, registry order within a family; wrappers that
    // compose onto any policy (`+quant`, `+sliding`) last
    let group = |p: &PolicyInfo| match p.build {
        Build::Wrapper(_) => "wrappers (compose onto any policy with +)",
        _ => match p.caps.family {
            Family::Reference => "reference",
            Family::Eviction => "eviction",
            Family::Merging => "merging",
            Family::Quantisation => "quantisation",
            Family::LowRank => "low-rank",
            Family::CrossLayer => "cross-layer",
            Family::Allocation => "budget allocation (wrappers over a scorer)",
        },
    };
    let mut groups: Vec<&str> = Vec::new();
    for p in REGISTRY {
        if !groups.contains(&group(p)) {
            groups.push(group(p));
        }
    }
    groups.sort_by_key(|g| {
        [
            "reference",
            "eviction",
            "merging",
            "quantisation",
            "low-rank",
            "cross-layer",
            "budget allocation (wrappers over a scorer)",
            "wrappers (compose onto any policy with +)",
        ]
        .iter()
        .position(|x| x == g)
    });
    let ordered: Vec<(&str, &PolicyInfo)> = groups
        .iter()
        .flat_map(|g| {
            REGISTRY
                .iter()
                .filter(move |p| group(p) == *g)
                .map(move |p| (*g, *p))
        })
        .collect();
    let mut heading = "";
    for (g, p) in ordered {
        if g != heading {
            if !heading.is_empty() {
                out.push('\n');
            }
            let _ = writeln!(out, "== {g} ==");
            heading = g;
        }
        let how = match p.build {
            Build::Wrapper(_) => format!("  (wrapper: compose as POLICY+{})", p.name),
            Build::Scorer(_) => {
                "  (scorer: also usable as scorer=NAME in pyramidkv, adakv, cam)".into()
            }
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
            Phase::AsScorer => "acts when its scorer does (prefill, or also at every decode step for a decode-time scorer)",
        };
        let fidelity = match c.approximation {
            None => "exact".to_string(),
            Some(how) => format!("approximated: {how}"),
        };
        let mut flags = vec![c.family.name(), phase];
        for (on, what) in [
            (c.merges, "merges entries"),
            (c.quantises, "quantises"),
            (c.cross_layer, "shares across layers"),
            (
                c.per_query_head,
                "one cache per query head (⌊B/G⌋ entries each)",
            ),
        ] {
            if on {
                flags.push(what);
            }
        }
        let _ = writeln!(out, "{}{how}", p.name);
        let _ = writeln!(out, "    {}", p.summary);
        let _ = writeln!(out, "    {}; {fidelity}", flags.join("; "));
        match c.memory {
            Memory::Budget => {}
            Memory::Metadata { what, .. } => {
                let _ = writeln!(out, "    memory: B entries' bytes per KV head, plus {what}");
            }
            Memory::Beyond(why) => {
                let _ = writeln!(out, "    memory: not set by B: {why}");
            }
        }
        let _ = writeln!(out, "    paper: {}", p.paper);
        for a in p.params {
            let _ = writeln!(
                out,
                "    {:<15} default {:<9} {}",
                a.name, a.default, a.help
            );
            if let crate::params::Kind::Preset(list) = a.kind {
                let wrapper = matches!(p.build, Build::ScorerWrapper { .. });
                for preset in list.iter().filter(|x| !x.sets.is_empty()) {
                    let sets: Vec<String> = preset
                        .sets
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    let _ = writeln!(
                        out,
                        "    {:<15} {}={} sets {}{}",
                        "",
                        a.name,
                        preset.name,
                        sets.join(","),
                        if wrapper {
                            format!(" and the scorer's preset={} where it has one", preset.name)
                        } else {
                            String::new()
                        }
                    );
                }
            }
        }
        out.push('\n');
    }
    out.push_str("Spec syntax: NAME, NAME:key=value,key=value, WRAPPER:scorer=SCORER (e.g. adakv:scorer=h2o), or BASE+WRAPPER (e.g. snapkv:w=16+quant:bits=2).\n");
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
