//! Policy specifications: `name`, `name:key=value,...`, composed with `+`
//! (e.g. `snapkv:w=16+quant:bits=4`).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::policies::{find, PolicyInfo, REGISTRY};
use crate::policy::Policy;
use crate::ReplayError;

/// Kind of a parameter's value, for validation and help.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Int,
    Float,
    Bool,
    /// One of the listed words.
    Choice(&'static [&'static str]),
    /// Comma-free list of integers separated by `;` (e.g. `0;1`), or empty.
    IntList,
    /// A non-negative integer or the given word (e.g. `half`).
    IntOr(&'static str),
    /// A number or the given word (e.g. `budget`).
    FloatOr(&'static str),
}

/// A parameter a policy accepts.
#[derive(Clone, Copy, Debug)]
pub struct ParamInfo {
    pub name: &'static str,
    pub default: &'static str,
    pub kind: Kind,
    pub help: &'static str,
}

/// Validated parameters of one policy, every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub policy: &'static str,
    pub values: BTreeMap<&'static str, String>,
}

impl Params {
    fn bad(&self, key: &str, msg: String) -> ReplayError {
        ReplayError::BadParam {
            policy: self.policy.into(),
            key: key.into(),
            value: self.values.get(key).cloned().unwrap_or_default(),
            msg,
        }
    }
    fn raw(&self, key: &str) -> &str {
        self.values
            .get(key)
            .unwrap_or_else(|| panic!("policy {} reads undeclared parameter {key}", self.policy))
    }
    pub fn int(&self, key: &str) -> Result<usize, ReplayError> {
        self.raw(key)
            .parse()
            .map_err(|_| self.bad(key, "expected a non-negative integer".into()))
    }
    pub fn float(&self, key: &str) -> Result<f64, ReplayError> {
        self.raw(key)
            .parse()
            .map_err(|_| self.bad(key, "expected a number".into()))
    }
    pub fn bool(&self, key: &str) -> Result<bool, ReplayError> {
        match self.raw(key) {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(self.bad(key, "expected true or false".into())),
        }
    }
    pub fn word(&self, key: &str) -> &str {
        self.raw(key)
    }
    pub fn int_list(&self, key: &str) -> Result<Vec<usize>, ReplayError> {
        let s = self.raw(key);
        if s.is_empty() || s == "none" {
            return Ok(vec![]);
        }
        s.split(';')
            .map(|x| x.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|_| self.bad(key, "expected integers separated by `;` (e.g. 0;1)".into()))
    }
    /// `key=value` pairs, every default included, in name order.
    pub fn canonical(&self) -> String {
        let kv: Vec<String> = self
            .values
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if kv.is_empty() {
            self.policy.to_string()
        } else {
            format!("{}:{}", self.policy, kv.join(","))
        }
    }
}

fn check_value(info: &PolicyInfo, p: &ParamInfo, value: &str) -> Result<(), ReplayError> {
    let bad = |msg: String| ReplayError::BadParam {
        policy: info.name.into(),
        key: p.name.into(),
        value: value.into(),
        msg,
    };
    match p.kind {
        Kind::Int => value
            .parse::<usize>()
            .map(|_| ())
            .map_err(|_| bad("expected a non-negative integer".into())),
        Kind::Float => value
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .map(|_| ())
            .ok_or_else(|| bad("expected a finite number".into())),
        Kind::Bool => matches!(value, "true" | "false" | "1" | "0" | "yes" | "no")
            .then_some(())
            .ok_or_else(|| bad("expected true or false".into())),
        Kind::Choice(words) => words
            .contains(&value)
            .then_some(())
            .ok_or_else(|| bad(format!("expected one of: {}", words.join(", ")))),
        Kind::IntOr(word) => (value == word || value.parse::<usize>().is_ok())
            .then_some(())
            .ok_or_else(|| bad(format!("expected a non-negative integer or `{word}`"))),
        Kind::FloatOr(word) => (value == word
            || value.parse::<f64>().map(|x| x.is_finite()).unwrap_or(false))
        .then_some(())
        .ok_or_else(|| bad(format!("expected a number or `{word}`"))),
        Kind::IntList => {
            if value.is_empty()
                || value == "none"
                || value.split(';').all(|x| x.trim().parse::<usize>().is_ok())
            {
                Ok(())
            } else {
                Err(bad(
                    "expected integers separated by `;` (e.g. 0;1) or none".into()
                ))
            }
        }
    }
}

/// Parse one `name[:k=v,...]` element.
pub fn parse_one(s: &str) -> Result<Params, ReplayError> {
    let (name, rest) = match s.split_once(':') {
        Some((n, r)) => (n.trim(), Some(r)),
        None => (s.trim(), None),
    };
    let info = find(name).ok_or_else(|| ReplayError::UnknownPolicy {
        name: name.into(),
        known: REGISTRY
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let mut values: BTreeMap<&'static str, String> = info
        .params
        .iter()
        .map(|p| (p.name, p.default.to_string()))
        .collect();
    if let Some(rest) = rest.filter(|r| !r.trim().is_empty()) {
        for kv in rest.split(',') {
            let (k, v) = kv.split_once('=').ok_or_else(|| ReplayError::BadSpec {
                spec: s.into(),
                msg: format!("`{kv}` is not key=value"),
            })?;
            let (k, v) = (k.trim(), v.trim());
            let p = info.params.iter().find(|p| p.name == k).ok_or_else(|| {
                ReplayError::UnknownParam {
                    policy: info.name.into(),
                    key: k.into(),
                    valid: if info.params.is_empty() {
                        "none".into()
                    } else {
                        info.params
                            .iter()
                            .map(|p| p.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                }
            })?;
            check_value(info, p, v)?;
            values.insert(p.name, v.to_string());
        }
    }
    Ok(Params {
        policy: info.name,
        values,
    })
}

/// A parsed policy specification: a base policy and any wrappers.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicySpec {
    pub parts: Vec<Params>,
}

impl PolicySpec {
    pub fn parse(s: &str) -> Result<PolicySpec, ReplayError> {
        if s.trim().is_empty() {
            return Err(ReplayError::BadSpec {
                spec: s.into(),
                msg: "empty policy; run `kvreplay policies` to list them".into(),
            });
        }
        let parts = s.split('+').map(parse_one).collect::<Result<Vec<_>, _>>()?;
        for (i, p) in parts.iter().enumerate() {
            let wrapper = find(p.policy).map(|i| i.wrapper).unwrap_or(false);
            if i > 0 && !wrapper {
                return Err(ReplayError::BadSpec {
                    spec: s.into(),
                    msg: format!(
                        "`{}` cannot follow `+`: only wrappers ({}) compose onto a policy",
                        p.policy,
                        REGISTRY
                            .iter()
                            .filter(|i| i.wrapper)
                            .map(|i| i.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
        Ok(PolicySpec { parts })
    }

    /// The spec with every default filled in (for provenance).
    pub fn canonical(&self) -> String {
        self.parts
            .iter()
            .map(|p| p.canonical())
            .collect::<Vec<_>>()
            .join("+")
    }

    /// Short name for tables: the policy names joined by `+`.
    pub fn short(&self) -> String {
        self.parts
            .iter()
            .map(|p| p.policy)
            .collect::<Vec<_>>()
            .join("+")
    }

    /// Build the policy object.
    pub fn build(&self) -> Result<Arc<dyn Policy>, ReplayError> {
        let mut it = self.parts.iter();
        let first = it.next().expect("a spec has a base");
        let info = find(first.policy).expect("parsed names exist");
        let mut policy: Arc<dyn Policy> = (info.build)(first, None)?;
        for w in it {
            let info = find(w.policy).expect("parsed names exist");
            policy = (info.build)(w, Some(policy))?;
        }
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_filled_and_errors_name_the_problem() {
        let s = PolicySpec::parse("snapkv:w=16").unwrap();
        assert_eq!(s.canonical(), "snapkv:k=7,pool=max,w=16");
        let e = PolicySpec::parse("snapkv:window=16")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown parameter `window`") && e.contains("valid: w, k, pool"),
            "{e}"
        );
        let e = PolicySpec::parse("snapkv:pool=median")
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected one of: max, avg"), "{e}");
        let e = PolicySpec::parse("snap").unwrap_err().to_string();
        assert!(
            e.contains("unknown policy `snap`") && e.contains("snapkv"),
            "{e}"
        );
        let e = PolicySpec::parse("h2o+snapkv").unwrap_err().to_string();
        assert!(e.contains("only wrappers"), "{e}");
        assert_eq!(
            PolicySpec::parse("snapkv+quant:bits=2").unwrap().short(),
            "snapkv+quant"
        );
        let e = PolicySpec::parse("quant:bits=3").unwrap_err().to_string();
        assert!(e.contains("bits") && e.contains("2, 4, 8"), "{e}");
    }
}
