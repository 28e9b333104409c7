//! Policy parameters: what a policy accepts (`ParamInfo`) and the validated
//! values of one spec element (`Params`). A leaf module: policies read their
//! parameters here without depending on the spec parser or the registry.

use std::collections::BTreeMap;

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
    /// The name of a registered scorer (`kvreplay policies` marks them).
    Scorer,
    /// One of the listed presets: each sets other parameters of the policy
    /// (those not given explicitly in the spec). Conventionally named
    /// `preset`, with `paper` (setting nothing) as its default.
    Preset(&'static [Preset]),
}

/// A named set of parameter values (e.g. `preset=kvpress`): the values of
/// other parameters it sets, unless the spec gives them. Keys are the
/// policy's own parameter names; a scorer wrapper's preset also selects the
/// preset of the same name of its scorer, when the scorer has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    pub sets: &'static [(&'static str, &'static str)],
}

impl Preset {
    /// Every preset parameter's default: the paper's rule, setting nothing.
    pub const PAPER: Preset = Preset {
        name: "paper",
        sets: &[],
    };

    /// The words a `Preset` parameter accepts.
    pub fn names(list: &[Preset]) -> Vec<&'static str> {
        list.iter().map(|p| p.name).collect()
    }
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
    pub values: BTreeMap<String, String>,
}

impl Params {
    pub(crate) fn bad(&self, key: &str, msg: String) -> ReplayError {
        ReplayError::BadParam {
            policy: self.policy.into(),
            key: key.into(),
            value: self.values.get(key).cloned().unwrap_or_default(),
            msg,
        }
    }
    pub(crate) fn raw(&self, key: &str) -> &str {
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
    /// A number in [lo, hi].
    pub fn float_in(&self, key: &str, lo: f64, hi: f64) -> Result<f64, ReplayError> {
        let x = self.float(key)?;
        if !(lo..=hi).contains(&x) {
            return Err(self.bad(key, format!("must lie in [{lo}, {hi}]")));
        }
        Ok(x)
    }
    /// An integer of at least 1; `msg` says why 0 is refused (e.g. "a chunk
    /// holds at least one position").
    pub fn int_positive(&self, key: &str, msg: &str) -> Result<usize, ReplayError> {
        let n = self.int(key)?;
        if n == 0 {
            return Err(self.bad(key, msg.into()));
        }
        Ok(n)
    }
    /// A number above 0.
    pub fn float_positive(&self, key: &str) -> Result<f64, ReplayError> {
        let x = self.float(key)?;
        if x.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(self.bad(key, "must be above 0".into()));
        }
        Ok(x)
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
    /// A `Choice` parameter as its typed value.
    pub fn choice<T: std::str::FromStr>(&self, key: &str) -> Result<T, ReplayError> {
        self.raw(key)
            .parse()
            .map_err(|_| self.bad(key, "not a valid choice".into()))
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
pub(crate) use choice_enum;
