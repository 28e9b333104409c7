//! Budget-independent results of one layer (window votes, attention rows, the
//! full-cache reference), computed once and reused by every budget and
//! policy replayed through the same [`TraceReplay`](crate::TraceReplay).
//!
//! The cache is owned: a `TraceReplay` makes one per layer and hands it to
//! the layer's data, so nothing outlives the trace, two traces never share
//! entries, and a benchmark's cold start is a new `TraceReplay`. Keys are
//! typed: each kind of result has a key struct naming everything the value
//! depends on besides the layer, and the key's type fixes the value's type.
//! Values come from deterministic functions of the trace, so reusing them
//! changes no result.

use std::any::Any;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

/// A key of the memo: equal keys stand for equal values of type `Value`.
pub trait MemoKey: PartialEq + Debug + Send + Sync + 'static {
    type Value: Send + Sync + 'static;
}

/// Type-erased key, compared by value within its own type.
trait AnyKey: Send + Sync {
    fn same(&self, other: &dyn Any) -> bool;
    fn as_any(&self) -> &dyn Any;
}

impl<K: MemoKey> AnyKey for K {
    fn same(&self, other: &dyn Any) -> bool {
        other.downcast_ref::<K>() == Some(self)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

type Entry = (Box<dyn AnyKey>, Arc<dyn Any + Send + Sync>);

/// The memo of one layer.
#[derive(Default)]
pub struct Memo {
    entries: Mutex<Vec<Entry>>,
}

impl Memo {
    /// The value of `key`, computed by `f` on first use.
    pub fn get_or<K: MemoKey>(&self, key: K, f: impl FnOnce() -> K::Value) -> Arc<K::Value> {
        match self.try_get_or(key, || Ok::<_, std::convert::Infallible>(f())) {
            Ok(v) => v,
            Err(e) => match e {},
        }
    }

    /// As [`get_or`](Self::get_or) for a computation that can fail; failures are not kept.
    pub fn try_get_or<K: MemoKey, E>(
        &self,
        key: K,
        f: impl FnOnce() -> Result<K::Value, E>,
    ) -> Result<Arc<K::Value>, E> {
        if let Some(v) = self.find(&key) {
            return Ok(v);
        }
        // Computed outside the lock: other keys of the layer stay available.
        let v = Arc::new(f()?);
        let mut m = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        m.push((Box::new(key), v.clone()));
        Ok(v)
    }

    fn find<K: MemoKey>(&self, key: &K) -> Option<Arc<K::Value>> {
        let m = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .find(|(k, _)| k.as_any().downcast_ref::<K>().is_some() && k.same(key))
            .and_then(|(_, v)| v.clone().downcast::<K::Value>().ok())
    }

    /// Number of kept results (for tests).
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(PartialEq, Debug)]
    struct Votes {
        w: usize,
    }
    impl MemoKey for Votes {
        type Value = Vec<f32>;
    }
    #[derive(PartialEq, Debug)]
    struct Rows;
    impl MemoKey for Rows {
        type Value = usize;
    }

    #[test]
    fn equal_keys_reuse_and_other_keys_compute() {
        let m = Memo::default();
        let mut calls = 0;
        let a = m.get_or(Votes { w: 4 }, || {
            calls += 1;
            vec![1.0]
        });
        let b = m.get_or(Votes { w: 4 }, || {
            calls += 1;
            vec![2.0]
        });
        assert_eq!(
            (a.as_slice(), b.as_slice(), calls),
            (&[1.0f32][..], &[1.0f32][..], 1)
        );
        assert_eq!(m.get_or(Votes { w: 8 }, || vec![3.0]).as_slice(), &[3.0]);
        assert_eq!(*m.get_or(Rows, || 7), 7);
        assert_eq!(m.len(), 3);
        let failed: Result<_, &str> = m.try_get_or(Votes { w: 9 }, || Err("no"));
        assert!(failed.is_err() && m.len() == 3, "failures are not kept");
    }
}
