//! Policy specifications: `name`, `name:key=value,...`, composed with `+`
//! (e.g. `snapkv:w=16+quant:bits=4`).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::info::{Build, PolicyInfo};
pub use crate::params::{Kind, ParamInfo, Params, Preset};
use crate::policies::{find, scorer_names, REGISTRY};
use crate::policy::Policy;
use crate::scorer::TopK;
use crate::ReplayError;

impl Params {
    /// For a scorer wrapper: the chosen scorer and its parameters.
    pub fn scorer_params(&self) -> Result<Params, ReplayError> {
        let name = self.word("scorer");
        let info = find(name).filter(|i| i.is_scorer()).ok_or_else(|| {
            self.bad(
                "scorer",
                format!("expected a scorer: {}", scorer_names().join(", ")),
            )
        })?;
        let own = find(self.policy).map(|i| i.params).unwrap_or(&[]);
        let values = info
            .params
            .iter()
            .map(|p| {
                let key = scorer_key(own, info.name, p.name);
                (p.name.to_string(), self.raw(&key).to_string())
            })
            .collect();
        Ok(Params {
            policy: info.name,
            values,
        })
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
        Kind::Preset(list) => {
            let names = Preset::names(list);
            names
                .contains(&value)
                .then_some(())
                .ok_or_else(|| bad(format!("expected one of: {}", names.join(", "))))
        }
        Kind::Scorer => {
            let names = scorer_names();
            names
                .contains(&value)
                .then_some(())
                .ok_or_else(|| bad(format!("expected a scorer: {}", names.join(", "))))
        }
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

/// The name under which a scorer wrapper accepts its scorer's parameter
/// `name`: as is, or `SCORER.name` when the wrapper has a parameter of that name.
fn scorer_key(own: &[ParamInfo], scorer: &str, name: &str) -> String {
    if own.iter().any(|p| p.name == name) {
        format!("{scorer}.{name}")
    } else {
        name.to_string()
    }
}

/// Every parameter `info` accepts with its default, for a spec whose given
/// `key=value` pairs are `given` (a scorer wrapper's set depends on the scorer).
fn accepted(
    info: &'static PolicyInfo,
    given: &[(&str, &str)],
) -> Result<Vec<(String, ParamInfo, String)>, ReplayError> {
    let mut out: Vec<(String, ParamInfo, String)> = info
        .params
        .iter()
        .map(|p| (p.name.to_string(), *p, p.default.to_string()))
        .collect();
    if let Build::ScorerWrapper {
        default_scorer,
        scorer_defaults,
        ..
    } = info.build
    {
        let name = given
            .iter()
            .find(|(k, _)| *k == "scorer")
            .map(|(_, v)| *v)
            .unwrap_or(default_scorer);
        let sc = find(name)
            .filter(|i| i.is_scorer())
            .ok_or_else(|| ReplayError::BadParam {
                policy: info.name.into(),
                key: "scorer".into(),
                value: name.into(),
                msg: format!("expected a scorer: {}", scorer_names().join(", ")),
            })?;
        for p in sc.params {
            let default = scorer_defaults
                .iter()
                .find(|(k, _)| *k == p.name)
                .map_or(p.default, |(_, v)| *v);
            out.push((
                scorer_key(info.params, sc.name, p.name),
                *p,
                default.to_string(),
            ));
        }
    }
    Ok(out)
}

/// Fill in what the chosen presets set, for every parameter the spec does
/// not give: first the scorer's preset (a scorer wrapper's preset selects the
/// scorer's preset of the same name, when it has one), then the policy's own,
/// so the policy's own preset wins where both set a parameter.
fn apply_presets(
    info: &'static PolicyInfo,
    params: &[(String, ParamInfo, String)],
    given: &[(&str, &str)],
    values: &mut BTreeMap<String, String>,
) {
    let is_given = |key: &str| given.iter().any(|(k, _)| *k == key);
    // `accepted` lists the policy's own parameters first
    let (own, scorer_params) = params.split_at(info.params.len());
    let find_preset = |p: &ParamInfo, name: &str| match p.kind {
        Kind::Preset(list) => list.iter().find(|x| x.name == name).copied(),
        _ => None,
    };
    // the policy's own preset (a scorer wrapper's is named in info.params)
    let own_preset = own
        .iter()
        .find(|(_, p, _)| matches!(p.kind, Kind::Preset(_)))
        .and_then(|(key, p, _)| find_preset(p, &values[key]));
    if let Build::ScorerWrapper { .. } = info.build {
        // the scorer's preset parameter, if it has one
        if let Some((key, p, _)) = scorer_params
            .iter()
            .find(|(_, p, _)| matches!(p.kind, Kind::Preset(_)))
        {
            if !is_given(key) {
                if let Some(w) = own_preset.and_then(|o| find_preset(p, o.name)) {
                    values.insert(key.clone(), w.name.to_string());
                }
            }
            let scorer = find(values["scorer"].as_str()).expect("checked by `accepted`");
            if let Some(preset) = find_preset(p, &values[key]) {
                for (k, v) in preset.sets {
                    let key = scorer_key(info.params, scorer.name, k);
                    if !is_given(&key) {
                        values.insert(key, v.to_string());
                    }
                }
            }
        }
    }
    if let Some(preset) = own_preset {
        for (k, v) in preset.sets {
            if !is_given(k) {
                values.insert(k.to_string(), v.to_string());
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
    let mut given = Vec::new();
    if let Some(rest) = rest.filter(|r| !r.trim().is_empty()) {
        for kv in rest.split(',') {
            let (k, v) = kv.split_once('=').ok_or_else(|| ReplayError::BadSpec {
                spec: s.into(),
                msg: format!("`{kv}` is not key=value"),
            })?;
            let k = k.trim();
            if given.iter().any(|(g, _)| *g == k) {
                return Err(ReplayError::BadSpec {
                    spec: s.into(),
                    msg: format!("`{k}` is given twice; give each parameter once"),
                });
            }
            given.push((k, v.trim()));
        }
    }
    let params = accepted(info, &given)?;
    let mut values: BTreeMap<String, String> = params
        .iter()
        .map(|(k, _, d)| (k.clone(), d.clone()))
        .collect();
    for &(k, v) in &given {
        let (key, p, _) =
            params
                .iter()
                .find(|x| x.0 == k)
                .ok_or_else(|| ReplayError::UnknownParam {
                    policy: info.name.into(),
                    key: k.into(),
                    valid: if params.is_empty() {
                        "none".into()
                    } else {
                        params
                            .iter()
                            .map(|x| x.0.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                })?;
        check_value(info, p, v)?;
        values.insert(key.clone(), v.to_string());
    }
    apply_presets(info, &params, &given, &mut values);
    Ok(Params {
        policy: info.name,
        values,
    })
}

/// A parsed policy specification: a base policy and any wrappers.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicySpec {
    /// A base policy named by a registered external prefix (`py:...`);
    /// `parts` then holds only the wrappers composed onto it.
    pub external: Option<crate::external::External>,
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
        let mut elements: Vec<&str> = s.split('+').collect();
        let external = match crate::external::lookup(elements[0]) {
            Some((resolver, body)) => {
                elements.remove(0);
                Some(resolver.resolve(&body)?)
            }
            None => None,
        };
        let parts = elements
            .into_iter()
            .map(parse_one)
            .collect::<Result<Vec<_>, _>>()?;
        for (i, p) in parts.iter().enumerate() {
            let wrapper = find(p.policy).is_some_and(|i| i.is_wrapper());
            if (i > 0 || external.is_some()) && !wrapper {
                return Err(ReplayError::BadSpec {
                    spec: s.into(),
                    msg: format!(
                        "`{}` cannot follow `+`: only wrappers ({}) compose onto a policy",
                        p.policy,
                        REGISTRY
                            .iter()
                            .filter(|i| i.is_wrapper())
                            .map(|i| i.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
        for (i, p) in parts.iter().enumerate() {
            if parts[..i].iter().any(|q| q.policy == p.policy) {
                return Err(ReplayError::BadSpec {
                    spec: s.into(),
                    msg: format!("`{}` appears twice; compose each wrapper once", p.policy),
                });
            }
        }
        Ok(PolicySpec { external, parts })
    }

    /// The spec with every default filled in (for provenance).
    pub fn canonical(&self) -> String {
        self.external
            .iter()
            .map(|e| e.canonical.clone())
            .chain(self.parts.iter().map(|p| p.canonical()))
            .collect::<Vec<_>>()
            .join("+")
    }

    /// Short name for tables: the policy names joined by `+`.
    pub fn short(&self) -> String {
        self.external
            .iter()
            .map(|e| e.short.as_str())
            .chain(self.parts.iter().map(|p| p.policy))
            .collect::<Vec<_>>()
            .join("+")
    }

    /// Build the policy object.
    pub fn build(&self) -> Result<Arc<dyn Policy>, ReplayError> {
        let mut policy: Option<Arc<dyn Policy>> = self.external.as_ref().map(|e| e.policy.clone());
        for part in &self.parts {
            let info = find(part.policy).expect("parsed names exist");
            policy = Some(match (info.build, policy) {
                (Build::Policy(f), None) => f(part)?,
                (Build::Scorer(f), None) => Arc::new(TopK::new(info.name, f(part)?)),
                (Build::ScorerWrapper { build, .. }, None) => {
                    let sp = part.scorer_params()?;
                    let scorer = match find(sp.policy).map(|i| i.build) {
                        Some(Build::Scorer(f)) => f(&sp)?,
                        _ => unreachable!("scorer_params names a scorer"),
                    };
                    build(part, scorer)?
                }
                (Build::Wrapper(f), inner) => f(
                    part,
                    inner.unwrap_or_else(|| Arc::new(crate::policies::full::Full)),
                )?,
                (_, Some(_)) => unreachable!("parse admits only wrappers after `+`"),
            });
        }
        Ok(policy.expect("a spec has a base"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_filled_and_errors_name_the_problem() {
        let s = PolicySpec::parse("snapkv:w=16").unwrap();
        assert_eq!(
            s.canonical(),
            "snapkv:group_mean=before_pool,k=7,pool=max,preset=paper,w=16"
        );
        let e = PolicySpec::parse("snapkv:window=16")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown parameter `window`")
                && e.contains("valid: w, k, pool, group_mean, preset"),
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
        let e = PolicySpec::parse("adakv:scorer=h2o,scorer=snapkv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`scorer` is given twice"), "{e}");
        let e = PolicySpec::parse("quant:bits=3").unwrap_err().to_string();
        assert!(e.contains("bits") && e.contains("2, 4, 8"), "{e}");
    }

    #[test]
    fn a_wrapper_repeated_in_a_spec_is_refused() {
        // applied twice, quant re-quantised quantised entries and its byte
        // count wrapped below zero (4.6e18 bytes)
        let e = PolicySpec::parse("snapkv+quant+quant:bits=2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`quant` appears twice"), "{e}");
        assert!(PolicySpec::parse("snapkv+quant:bits=2").is_ok());
    }

    #[test]
    fn out_of_range_minicache_and_kvmerger_parameters_are_refused() {
        for (spec, key) in [
            ("minicache:gamma=1.5", "gamma"),
            ("minicache:rho=-0.1", "rho"),
            ("minicache:t=2", "t"),
            ("minicache:start=1.5", "start"),
            ("kvmerger:sigma=fixed,sigma0=0", "sigma0"),
            ("kvmerger:sigma0=-1", "sigma0"),
        ] {
            let e = match PolicySpec::parse(spec).and_then(|s| s.build()) {
                Ok(_) => panic!("{spec} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(&format!("`{key}`")), "{spec}: {e}");
        }
        assert!(PolicySpec::parse("minicache:gamma=1,rho=0")
            .unwrap()
            .build()
            .is_ok());
    }
}
