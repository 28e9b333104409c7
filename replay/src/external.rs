//! Policies defined outside this crate, named in a spec by a registered
//! prefix: `PREFIX:BODY[+wrapper...]` (the Python binding registers `py`, so
//! `py:path/file.py:Class:w=16` is a Python scorer). Replay depends on no
//! language runtime: an embedder registers a resolver that turns the body
//! into a policy, and the spec machinery (canonical form, provenance,
//! wrappers after `+`, sweeps) treats the result like a built-in.

use std::sync::{Arc, RwLock};

use crate::policy::Policy;
use crate::ReplayError;

/// A policy built from the body of an external spec.
#[derive(Clone)]
pub struct External {
    /// Short name for tables (e.g. `py:MyScorer`).
    pub short: String,
    /// The whole element with everything that identifies the policy (its
    /// parameters, its source's hash): what provenance records. Parsing it
    /// again must give the same policy (sweeps re-parse their plan's specs).
    pub canonical: String,
    pub policy: Arc<dyn Policy>,
}

impl std::fmt::Debug for External {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("External")
            .field("canonical", &self.canonical)
            .finish()
    }
}

impl PartialEq for External {
    fn eq(&self, other: &Self) -> bool {
        self.canonical == other.canonical
    }
}

/// Turns the body of `PREFIX:BODY` into a policy.
pub trait Resolver: Send + Sync {
    fn resolve(&self, body: &str) -> Result<External, ReplayError>;
}

type Resolvers = Vec<(String, Arc<dyn Resolver>)>;
static RESOLVERS: RwLock<Resolvers> = RwLock::new(Vec::new());

/// Register `resolver` for specs starting with `PREFIX:` (replacing any
/// resolver of that prefix). A prefix must not be a registered policy name.
pub fn register(prefix: &str, resolver: Arc<dyn Resolver>) -> Result<(), ReplayError> {
    if crate::policies::find(prefix).is_some() || prefix.is_empty() || prefix.contains([':', '+']) {
        return Err(ReplayError::BadSpec {
            spec: prefix.into(),
            msg: "an external prefix must be a new word (not a policy name, no `:` or `+`)".into(),
        });
    }
    let mut r = RESOLVERS.write().unwrap_or_else(|e| e.into_inner());
    r.retain(|(p, _)| p != prefix);
    r.push((prefix.to_string(), resolver));
    Ok(())
}

/// The resolver and body of `element` when it starts with a registered prefix.
pub(crate) fn lookup(element: &str) -> Option<(Arc<dyn Resolver>, String)> {
    let (prefix, body) = element.trim().split_once(':')?;
    let r = RESOLVERS.read().unwrap_or_else(|e| e.into_inner());
    r.iter()
        .find(|(p, _)| p == prefix.trim())
        .map(|(_, res)| (res.clone(), body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PolicySpec;

    struct Named;
    impl Resolver for Named {
        fn resolve(&self, body: &str) -> Result<External, ReplayError> {
            Ok(External {
                short: format!("ext:{body}"),
                canonical: format!("ext:{body}"),
                policy: PolicySpec::parse("snapkv")?.build()?,
            })
        }
    }

    #[test]
    fn a_registered_prefix_builds_an_external_policy_with_wrappers() {
        assert!(PolicySpec::parse("ext:a").is_err());
        register("ext", Arc::new(Named)).unwrap();
        let s = PolicySpec::parse("ext:a:b=1+quant:bits=4").unwrap();
        assert_eq!(s.short(), "ext:a:b=1+quant");
        assert_eq!(s.canonical(), "ext:a:b=1+quant:bits=4,group=32,residual=32");
        assert!(s.build().is_ok());
        assert!(register("snapkv", Arc::new(Named)).is_err());
    }
}
