//! Budget-independent results, computed once per (trace, layer) and reused by
//! every budget and policy that asks for them: window votes, attention rows,
//! the full-cache reference of the metrics. Only the most recent trace is
//! kept, since sweeps run trace by trace. Values come from deterministic
//! functions of the trace, so reusing them changes no result.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

type Entry = Arc<dyn Any + Send + Sync>;

struct Memo {
    trace: String,
    map: HashMap<(usize, String), Entry>,
}

fn memo() -> &'static Mutex<Memo> {
    static MEMO: OnceLock<Mutex<Memo>> = OnceLock::new();
    MEMO.get_or_init(|| {
        Mutex::new(Memo {
            trace: String::new(),
            map: HashMap::new(),
        })
    })
}

/// The value of `key` for `layer` of trace `trace`, computed by `f` on first use.
pub fn get_or<T: Any + Send + Sync>(
    trace: &str,
    layer: usize,
    key: &str,
    f: impl FnOnce() -> T,
) -> Arc<T> {
    match try_get_or(trace, layer, key, || Ok::<T, std::convert::Infallible>(f())) {
        Ok(v) => v,
        Err(e) => match e {},
    }
}

/// As [`get_or`] for a computation that can fail; failures are not kept.
pub fn try_get_or<T: Any + Send + Sync, E>(
    trace: &str,
    layer: usize,
    key: &str,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<Arc<T>, E> {
    {
        let m = memo().lock().expect("memo lock");
        if m.trace == trace {
            if let Some(v) = m.map.get(&(layer, key.to_string())) {
                if let Ok(v) = v.clone().downcast::<T>() {
                    return Ok(v);
                }
            }
        }
    }
    let v = Arc::new(f()?);
    let mut m = memo().lock().expect("memo lock");
    if m.trace != trace {
        m.trace = trace.to_string();
        m.map.clear();
    }
    m.map.insert((layer, key.to_string()), v.clone());
    Ok(v)
}

/// Forget every kept result (benchmarks use it to time cold runs).
pub fn clear() {
    let mut m = memo().lock().expect("memo lock");
    m.trace.clear();
    m.map.clear();
}
