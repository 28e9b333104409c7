//! The policy registry: one file per policy, one entry per policy here.

use std::sync::Arc;

use crate::policy::Policy;
use crate::spec::{ParamInfo, Params};
use crate::ReplayError;

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

pub type Build = fn(&Params, Option<Arc<dyn Policy>>) -> Result<Arc<dyn Policy>, ReplayError>;

/// A registered policy: what `kvreplay policies` lists and specs resolve to.
pub struct PolicyInfo {
    /// Registry key, file name and CSV value.
    pub name: &'static str,
    pub summary: &'static str,
    /// Source paper (title, venue/arXiv) and reference code.
    pub paper: &'static str,
    pub params: &'static [ParamInfo],
    /// Composes onto another policy with `+` (e.g. `snapkv+quant`).
    pub wrapper: bool,
    /// Builds the policy; wrappers get the policy they wrap.
    pub build: Build,
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

/// Build helper for policies that are not wrappers.
pub(crate) fn base_only(p: &Params, inner: Option<Arc<dyn Policy>>) -> Result<(), ReplayError> {
    match inner {
        None => Ok(()),
        Some(_) => Err(ReplayError::BadSpec {
            spec: p.policy.into(),
            msg: "is not a wrapper and cannot follow `+`".into(),
        }),
    }
}
