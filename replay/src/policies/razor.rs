//! RazorAttention (docs/methods/razor.md; Tang et al., arXiv 2407.15891,
//! ICLR 2025): retrieval heads keep the full cache; every other head keeps
//! its first `n_sink` positions, a recent buffer, and one compensation token
//! for the positions it drops: k̂ = mean of the dropped keys, v̂ = mean of
//! the dropped values (the paper's Eq. 4), attended as if it were the
//! N_d dropped positions with that key (Eq. 5): its logit carries
//! + ln N_d. Prefill only.
//!
//! Retrieval heads are the paper's two kinds: *induction* heads (attend to
//! the token after an earlier occurrence of the current token, i.e. to the
//! token about to be produced: the copy criterion of the retrieval score,
//! `retrieval_head`) and *echo* heads (attend to an earlier occurrence of the
//! current token itself). The top `frac` of query heads by copy score and
//! the top `echo_frac` by echo score, positive scores only, ranked over the
//! whole model, are retrieval heads; both scores are probed on the replayed
//! trace itself (ORACLE; the paper probes a repeated random-token sequence).
//!
//! Budget: a non-retrieval KV head keeps exactly B prompt entries, s =
//! min(n_sink, B − 1) sinks, the compensation token and the B − 1 − s most
//! recent positions (the paper's buffer max(S0, N/C), written as B here so a
//! budget sweep moves it); a retrieval KV head keeps all P. GQA: a KV head is
//! kept whole when any query head of its group is a retrieval head.

use std::sync::Arc;

use crate::info::{Build, Caps, Family, Memory, PolicyInfo};
use crate::params::{Kind, ParamInfo};
use crate::policies::retrieval_head::HeadSplit;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "razor",
    summary: "full cache on retrieval (induction + echo) heads; the others keep sinks, a recent window and one compensation token merging what they drop; prefill only",
    paper: "RazorAttention: Efficient KV Cache Compression Through Retrieval Heads (Tang et al., ICLR 2025, arXiv 2407.15891); no official code",
    params: &[
        ParamInfo { name: "frac", default: "0.14", kind: Kind::Float, help: "share of query heads kept whole as induction heads: the top by copy (retrieval) score, positive only" },
        ParamInfo { name: "echo_frac", default: "0.01", kind: Kind::Float, help: "share of query heads kept whole as echo heads: the top by echo score, positive only" },
        ParamInfo { name: "n_sink", default: "4", kind: Kind::Int, help: "first prompt positions kept by the other heads (inside B)" },
        ParamInfo { name: "compensate", default: "true", kind: Kind::Bool, help: "merge the dropped positions into one compensation entry (false: drop them)" },
        ParamInfo { name: "scope", default: "model", kind: Kind::Choice(&["model", "layer"]), help: "rank heads over the whole model (one layer group) or within each layer" },
        ParamInfo { name: "span", default: "auto", kind: Kind::Choice(&["auto", "prompt"]), help: "where a copy or echo must point: auto = the trace's `needle` span when it has one, else the prompt" },
    ],
    caps: Caps {
        family: Family::Merging,
        merges: true,
        memory: Memory::Beyond("the retrieval heads keep their whole cache; only the other heads keep B entries"),
        approximation: Some("ORACLE probe: induction (copy) and echo scores are measured on the replayed trace's own decode steps (the paper probes a repeated random-token sequence); the buffer is B − 1 − sinks entries instead of max(S0, N/C); prefill only"),
        ..Caps::EVICT_PREFILL
    },
    test: "razor_keeps_retrieval_heads_whole_and_merges_the_dropped_middle",
    build: Build::Policy(|p| Ok(Arc::new(HeadSplit::from_params(p, true)?))),
};
