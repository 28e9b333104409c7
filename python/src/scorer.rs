//! Python scorers inside the shared selection.
//!
//! A Python scorer's `score(ctx)` is called once per layer with every KV
//! head: it returns (n_kv_heads, P) scores (or (n_kv_heads, P - window):
//! the protected window is never read). The policy hands those rows to
//! replay's [`TopK`] (the selection every built-in scorer goes through:
//! sinks, the recent window, ties, budgets), so a Python port of a built-in
//! scorer keeps exactly what the built-in keeps when its scores are equal.
//! A Python scorer keeps one cache per KV head (never per query head).

use std::sync::{Arc, RwLock};

use numpy::ndarray::Array3;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvreplay_replay::cache::HeadCache;
use kvreplay_replay::external::{register, External, Resolver};
use kvreplay_replay::info::{Build, BuildAround};
use kvreplay_replay::params::Params;
use kvreplay_replay::policies::find;
use kvreplay_replay::policy::DecodeState;
use kvreplay_replay::select::{Protect, Tie};
use kvreplay_replay::{Policy, PrefillCtx, ReplayError, Scorer, TopK, Unit};

/// A Python scorer object as a replay policy.
pub struct PyScorerPolicy {
    obj: Py<PyAny>,
    /// For messages and tables, e.g. `py:SnapKV` (leaked once per build: the
    /// selection names its policy with a `&'static str`).
    name: &'static str,
    sinks: usize,
    window: usize,
    skip_layers: Vec<usize>,
    tie: Tie,
    /// A scorer wrapper that spreads the budget (`allocation = "adakv"`,
    /// `"pyramidkv:beta=20"`): its builder and parameters.
    allocation: Option<(BuildAround, Params)>,
}

impl PyScorerPolicy {
    /// Read the scorer's selection attributes (`sinks`, `window`,
    /// `skip_layers`, `tie`) from `obj`.
    pub fn from_object(obj: &Bound<'_, PyAny>, name: String) -> Result<Self, String> {
        let int = |attr: &str| -> Result<usize, String> {
            match obj.getattr(attr) {
                Ok(v) if v.is_none() => Ok(0),
                Ok(v) => v
                    .extract::<usize>()
                    .map_err(|_| format!("`{attr}` must be a non-negative integer")),
                Err(_) => Ok(0),
            }
        };
        if !obj.hasattr("score").unwrap_or(false) {
            return Err("the object has no `score(self, ctx)` method".into());
        }
        let skip_layers = match obj.getattr("skip_layers") {
            Ok(v) if !v.is_none() => v
                .extract::<Vec<usize>>()
                .map_err(|_| "`skip_layers` must be a sequence of layer indices".to_string())?,
            _ => Vec::new(),
        };
        let tie = match obj.getattr("tie").and_then(|t| t.extract::<String>()) {
            Ok(t) if t == "later" => Tie::KeepLater,
            Ok(t) if t == "earlier" => Tie::KeepEarlier,
            Ok(t) => return Err(format!("`tie` = {t:?}: expected \"later\" or \"earlier\"")),
            Err(_) => Tie::KeepLater,
        };
        let allocation = match obj.getattr("allocation") {
            Ok(v) if !v.is_none() => {
                let spec: String = v.extract().map_err(|_| {
                    "`allocation` must be a string such as \"adakv:alpha=0.2\"".to_string()
                })?;
                if spec == "uniform" {
                    None
                } else {
                    let p = kvreplay_replay::spec::parse_one(&spec).map_err(|e| e.to_string())?;
                    match find(p.policy).map(|i| i.build) {
                        Some(Build::ScorerWrapper { build, .. }) => Some((build, p)),
                        _ => {
                            return Err(format!(
                                "`allocation` = {spec:?}: expected uniform or a scorer wrapper (adakv, pyramidkv)"
                            ))
                        }
                    }
                }
            }
            _ => None,
        };
        Ok(PyScorerPolicy {
            allocation,
            obj: obj.clone().unbind(),
            name: Box::leak(name.into_boxed_str()),
            sinks: int("sinks")?,
            window: int("window")?,
            skip_layers,
            tie,
        })
    }

    fn fail(&self, layer: usize, msg: impl Into<String>) -> ReplayError {
        ReplayError::External {
            policy: self.name.to_string(),
            layer,
            msg: msg.into(),
        }
    }

    /// `score(ctx)` of every KV head of the layer, checked.
    fn scores(&self, ctx: &PrefillCtx, prot: Protect) -> Result<Vec<Vec<f32>>, ReplayError> {
        let (l, p, nkv) = (ctx.layer(), ctx.prompt_len(), ctx.n_kv_heads());
        let need = p - prot.recent;
        Python::attach(|py| -> Result<Vec<Vec<f32>>, ReplayError> {
            let c = ScoreCtx::new(py, ctx, self.window).map_err(|e| self.fail(l, e.to_string()))?;
            let alive = c.ptr.clone();
            let c = Bound::new(py, c).map_err(|e| self.fail(l, e.to_string()))?;
            let out = self.obj.bind(py).call_method1("score", (c,));
            // a thread of the scorer may still read the context: wait for it
            // without the GIL (it may need it to finish)
            py.detach(|| *alive.write().unwrap_or_else(|e| e.into_inner()) = None);
            let out = out.map_err(|e| self.fail(l, python_error(py, &e)))?;
            let np = py
                .import("numpy")
                .map_err(|e| self.fail(l, e.to_string()))?;
            let arr = np
                .call_method1("asarray", (out, "float32"))
                .map_err(|e| self.fail(l, format!("score() did not return an array: {e}")))?;
            let arr = arr.cast_into::<PyArray2<f32>>().map_err(|_| {
                self.fail(
                    l,
                    format!("score() must return a 2-D array (n_kv_heads={nkv}, P={p})"),
                )
            })?;
            let shape = arr.shape().to_vec();
            if shape[0] != nkv || shape[1] < need || shape[1] > p {
                return Err(self.fail(
                    l,
                    format!(
                        "score() returned shape {shape:?}; expected ({nkv}, {p}) (or ({nkv}, {need}) without the protected recent window)"
                    ),
                ));
            }
            let ro = arr.readonly();
            let a = ro.as_array();
            let mut rows = Vec::with_capacity(nkv);
            for (g, row) in a.outer_iter().enumerate() {
                let v: Vec<f32> = row.iter().copied().collect();
                if let Some(i) = (prot.sinks..need).find(|&i| v[i].is_nan()) {
                    return Err(self.fail(
                        l,
                        format!("score() returned NaN for KV head {g}, position {i}"),
                    ));
                }
                rows.push(v);
            }
            Ok(rows)
        })
    }
}

/// The exception's traceback and message, as Python prints them.
fn python_error(py: Python<'_>, e: &PyErr) -> String {
    let text = (|| -> PyResult<String> {
        let tb = py.import("traceback")?;
        let lines = tb.call_method1(
            "format_exception",
            (e.get_type(py), e.value(py), e.traceback(py)),
        )?;
        let s: Vec<String> = lines.extract()?;
        Ok(s.concat())
    })();
    format!(
        "score() raised {}\n{}",
        e,
        text.unwrap_or_else(|_| String::new()).trim_end()
    )
}

/// Scores computed by Python for one layer, handed out per unit.
struct Rows {
    rows: Vec<Vec<f32>>,
    prot: Protect,
    tie: Tie,
}

impl Scorer for Rows {
    fn score(&self, _: &PrefillCtx, u: &Unit) -> Vec<f32> {
        self.rows.get(u.kv_head).cloned().unwrap_or_default()
    }
    fn protect(&self, _b: usize) -> Result<Protect, ReplayError> {
        Ok(self.prot)
    }
    fn tie(&self) -> Tie {
        self.tie
    }
}

impl Policy for PyScorerPolicy {
    fn name(&self) -> String {
        self.name.to_string()
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let prot = Protect::new(self.sinks, self.window, b);
        let skip = self.skip_layers.contains(&ctx.layer());
        // the selection reads scores only when it selects (as for built-ins)
        let rows = if !skip && p > b && b > prot.total() {
            self.scores(ctx, prot)?
        } else {
            Vec::new()
        };
        if skip {
            let caches = (0..ctx.n_kv_heads()).map(|g| ctx.full_cache(g)).collect();
            return Ok((caches, Box::new(kvreplay_replay::policy::AppendOnly)));
        }
        let rows: Arc<dyn Scorer> = Arc::new(Rows {
            rows,
            prot,
            tie: self.tie,
        });
        match &self.allocation {
            Some((build, params)) => build(params, rows)?.prefill(ctx),
            None => TopK::new(self.name, rows).prefill(ctx),
        }
    }
}

/// A Python `kvreplay.Policy`: `keep(ctx)` returns each KV head's kept
/// prompt positions; the engine checks them (one list per KV head, integer
/// positions inside the prompt, no more than the budget when the prompt
/// exceeds it) and builds exact caches of them (append-only during decode).
pub struct PyKeepPolicy {
    obj: Py<PyAny>,
    name: String,
}

impl Policy for PyKeepPolicy {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (l, p, b, nkv) = (ctx.layer(), ctx.prompt_len(), ctx.budget, ctx.n_kv_heads());
        let fail = |msg: String| ReplayError::External {
            policy: self.name.clone(),
            layer: l,
            msg,
        };
        let kept = Python::attach(|py| -> Result<Vec<Vec<usize>>, ReplayError> {
            let c = ScoreCtx::new(py, ctx, 0).map_err(|e| fail(e.to_string()))?;
            let alive = c.ptr.clone();
            let c = Bound::new(py, c).map_err(|e| fail(e.to_string()))?;
            let out = self.obj.bind(py).call_method1("keep", (c,));
            py.detach(|| *alive.write().unwrap_or_else(|e| e.into_inner()) = None);
            let out = out.map_err(|e| {
                fail(python_error(py, &e).replacen("score() raised", "keep() raised", 1))
            })?;
            let np = py.import("numpy").map_err(|e| fail(e.to_string()))?;
            let heads: Vec<Bound<'_, PyAny>> = out
                .try_iter()
                .and_then(|it| it.collect::<PyResult<Vec<_>>>())
                .map_err(|_| {
                    fail("keep() must return one sequence of positions per KV head".into())
                })?;
            if heads.len() != nkv {
                return Err(fail(format!(
                    "keep() returned {} lists of positions; expected one per KV head ({nkv})",
                    heads.len()
                )));
            }
            let mut kept = Vec::with_capacity(nkv);
            for (g, h) in heads.into_iter().enumerate() {
                let a = np
                    .call_method1("asarray", (h,))
                    .and_then(|a| a.call_method1("ravel", ()))
                    .map_err(|e| fail(format!("KV head {g}: {e}")))?;
                let kind: String = a
                    .getattr("dtype")
                    .and_then(|d| d.getattr("kind"))
                    .and_then(|k| k.extract())
                    .unwrap_or_default();
                if !(kind == "i" || kind == "u" || (kind == "f" && a.len().unwrap_or(1) == 0)) {
                    return Err(fail(format!(
                        "KV head {g}: positions must be integers (got dtype kind `{kind}`)"
                    )));
                }
                let v: Vec<i64> = a
                    .call_method1("astype", ("int64",))
                    .and_then(|a| a.call_method0("tolist"))
                    .and_then(|l| l.extract())
                    .map_err(|e| fail(format!("KV head {g}: {e}")))?;
                if let Some(x) = v.iter().find(|&&x| x < 0 || x as usize >= p) {
                    return Err(fail(format!(
                        "KV head {g}: position {x} is outside the prompt (0..{p})"
                    )));
                }
                let mut v: Vec<usize> = v.into_iter().map(|x| x as usize).collect();
                v.sort_unstable();
                let n = v.len();
                v.dedup();
                if v.len() != n {
                    return Err(fail(format!("KV head {g}: a position is kept twice")));
                }
                if p > b && v.len() > b {
                    return Err(fail(format!(
                        "KV head {g}: keeps {} positions, over the budget of {b}",
                        v.len()
                    )));
                }
                kept.push(v);
            }
            Ok(kept)
        })?;
        let caches = kept
            .iter()
            .enumerate()
            .map(|(g, k)| ctx.exact_cache(g, k))
            .collect();
        Ok((caches, Box::new(kvreplay_replay::policy::AppendOnly)))
    }
}

/// A Python scorer or policy object as a replay policy.
pub(crate) fn policy_of_object(
    obj: &Bound<'_, PyAny>,
    name: String,
) -> Result<Arc<dyn Policy>, String> {
    if obj.hasattr("keep").unwrap_or(false) && !obj.hasattr("score").unwrap_or(false) {
        return Ok(Arc::new(PyKeepPolicy {
            obj: obj.clone().unbind(),
            name,
        }));
    }
    Ok(Arc::new(PyScorerPolicy::from_object(obj, name)?))
}

/// What `score(ctx)` sees: one layer's prompt (copies of its keys, values
/// and column sums) and, while the call lasts, its queries and attention.
#[pyclass(module = "kvreplay._kvreplay", frozen, name = "ScoreContext")]
pub struct ScoreCtx {
    /// The address of the engine's context; None once `score` returned.
    ptr: Arc<RwLock<Option<usize>>>,
    #[pyo3(get)]
    layer: usize,
    #[pyo3(get)]
    n_layers: usize,
    #[pyo3(get)]
    budget: usize,
    #[pyo3(get)]
    n_heads: usize,
    #[pyo3(get)]
    n_kv_heads: usize,
    #[pyo3(get)]
    head_dim: usize,
    #[pyo3(get)]
    scale: f32,
    #[pyo3(get)]
    prompt_len: usize,
    /// The scorer's protected recent window (its `window` attribute).
    #[pyo3(get)]
    window: usize,
    /// (n_kv_heads, P, d) post-RoPE keys, float32.
    #[pyo3(get)]
    keys: Py<PyAny>,
    /// (n_kv_heads, P, d) values, float32.
    #[pyo3(get)]
    values: Py<PyAny>,
    /// (n_heads, P) attention each prompt key received from all prompt queries.
    #[pyo3(get)]
    colsum: Py<PyAny>,
}

impl ScoreCtx {
    fn new(py: Python<'_>, ctx: &PrefillCtx, window: usize) -> PyResult<Self> {
        let (p, d, nkv, nh) = (
            ctx.prompt_len(),
            ctx.head_dim(),
            ctx.n_kv_heads(),
            ctx.n_heads(),
        );
        let keys = gather(py, (nkv, p, d), |g, i| ctx.key(g, i));
        let values = gather(py, (nkv, p, d), |g, i| ctx.value(g, i));
        let mut cs = Vec::with_capacity(nh * p);
        for h in 0..nh {
            cs.extend_from_slice(ctx.colsum(h));
        }
        let colsum = numpy::ndarray::Array2::from_shape_vec((nh, p), cs)
            .expect("shape")
            .into_pyarray(py)
            .into_any()
            .unbind();
        Ok(ScoreCtx {
            ptr: Arc::new(RwLock::new(Some(ctx as *const PrefillCtx as usize))),
            layer: ctx.layer(),
            n_layers: ctx.n_layers(),
            budget: ctx.budget,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            scale: ctx.scale(),
            prompt_len: p,
            window,
            keys,
            values,
            colsum,
        })
    }

    /// Run `f` on the engine's context, which stays valid while `f` runs
    /// (`score` has not returned: the clearing waits for the read lock).
    fn with_ctx<R>(&self, f: impl FnOnce(&PrefillCtx) -> R) -> PyResult<R> {
        let guard = self.ptr.read().unwrap_or_else(|e| e.into_inner());
        match *guard {
            // SAFETY: the address is set while `score` runs, during which the
            // engine's PrefillCtx is alive (and Sync); it is cleared under
            // the write lock when `score` returns, so it never dangles here.
            Some(p) => Ok(f(unsafe { &*(p as *const PrefillCtx) })),
            None => Err(PyRuntimeError::new_err(
                "this context is only valid inside score(): read what you need there",
            )),
        }
    }
}

/// A (a, b, d) float32 array whose row (i, j) is `f(i, j)`.
fn gather<'a>(
    py: Python<'_>,
    shape: (usize, usize, usize),
    f: impl Fn(usize, usize) -> &'a [f32],
) -> Py<PyAny> {
    let mut a = Array3::<f32>::zeros(shape);
    for i in 0..shape.0 {
        for j in 0..shape.1 {
            a.slice_mut(numpy::ndarray::s![i, j, ..])
                .as_slice_mut()
                .expect("contiguous")
                .copy_from_slice(f(i, j));
        }
    }
    a.into_pyarray(py).into_any().unbind()
}

#[pymethods]
impl ScoreCtx {
    /// Query heads per KV head.
    #[getter]
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// The last `w` prompt queries of every query head: (n_heads, w, d) float32.
    fn queries<'py>(&self, py: Python<'py>, w: usize) -> PyResult<Bound<'py, PyAny>> {
        let (p, d) = (self.prompt_len, self.head_dim);
        let w = w.min(p);
        let a = self.with_ctx(|c| {
            let mut a = Array3::<f32>::zeros((self.n_heads, w, d));
            for h in 0..self.n_heads {
                for (j, i) in (p - w..p).enumerate() {
                    a.slice_mut(numpy::ndarray::s![h, j, ..])
                        .as_slice_mut()
                        .expect("contiguous")
                        .copy_from_slice(c.query(h, i));
                }
            }
            a
        })?;
        Ok(a.into_pyarray(py).into_any())
    }

    /// Causal softmax attention of the last `w` prompt queries over the
    /// prompt keys, computed by the engine as its built-ins do:
    /// (n_heads, w, P) float32, zero above the diagonal.
    fn window_attention<'py>(&self, py: Python<'py>, w: usize) -> PyResult<Bound<'py, PyAny>> {
        let p = self.prompt_len;
        let w = w.min(p);
        let nh = self.n_heads;
        let rows: Vec<f32> = py.detach(|| {
            self.with_ctx(|c| {
                let mut out = Vec::with_capacity(nh * w * p);
                for h in 0..nh {
                    out.extend(c.attn_rows(h, p - w..p));
                }
                out
            })
        })?;
        let a = Array3::from_shape_vec((nh, w, p), rows).expect("shape");
        Ok(a.into_pyarray(py).into_any())
    }
}

/// `key=value` parameters of a `py:` spec, sorted by key.
type KeyValues = Vec<(String, String)>;

/// Parse `path.py:Class[:k=v,...]`.
fn parse_body(body: &str) -> Result<(String, String, KeyValues), ReplayError> {
    let bad = |msg: &str| ReplayError::BadSpec {
        spec: format!("py:{body}"),
        msg: msg.into(),
    };
    let i = body
        .find(".py:")
        .ok_or_else(|| bad("expected py:PATH.py:CLASS[:key=value,...]"))?;
    let path = body[..i + 3].to_string();
    let rest = &body[i + 4..];
    let (class, params) = match rest.split_once(':') {
        Some((c, p)) => (c.trim(), p),
        None => (rest.trim(), ""),
    };
    if class.is_empty() {
        return Err(bad("no class named after the file (py:PATH.py:CLASS)"));
    }
    let mut kv: Vec<(String, String)> = Vec::new();
    for item in params.split(',').filter(|s| !s.trim().is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| bad(&format!("`{item}` is not key=value")))?;
        let k = k.trim().to_string();
        if kv.iter().any(|(g, _)| *g == k) {
            return Err(bad(&format!("`{k}` is given twice")));
        }
        kv.push((k, v.trim().to_string()));
    }
    kv.sort();
    Ok((path, class.to_string(), kv))
}

/// `py:PATH.py:CLASS[:k=v,...]`: the class is loaded from the file and
/// built with the parameters as keyword arguments (numbers and booleans
/// converted); the canonical form records the file's sha256 (a canonical
/// spec whose file has changed since is refused).
struct PyResolver;

impl Resolver for PyResolver {
    fn resolve(&self, body: &str) -> Result<External, ReplayError> {
        let (path, class, mut kv) = parse_body(body)?;
        let sha = kvreplay_traces::sha256_file(std::path::Path::new(&path)).map_err(|e| {
            ReplayError::Io {
                path: path.clone().into(),
                err: e,
            }
        })?;
        if let Some(j) = kv.iter().position(|(k, _)| k == "sha256") {
            let (_, want) = kv.remove(j);
            if want != sha {
                return Err(ReplayError::BadSpec {
                    spec: format!("py:{body}"),
                    msg: format!(
                        "{path} has changed since this spec was recorded (sha256 {sha}, the spec says {want})"
                    ),
                });
            }
        }
        let short = format!("py:{class}");
        let params: String = kv
            .iter()
            .map(|(k, v)| format!("{k}={v},"))
            .collect::<String>();
        let canonical = format!("py:{path}:{class}:{params}sha256={sha}");
        let policy = Python::attach(|py| -> Result<Arc<dyn Policy>, String> {
            let m = py.import("kvreplay").map_err(|e| e.to_string())?;
            let d = PyDict::new(py);
            for (k, v) in &kv {
                d.set_item(k, v).map_err(|e| e.to_string())?;
            }
            let obj = m
                .getattr("_load_scorer")
                .and_then(|f| f.call1((&path, &class, d)))
                .map_err(|e| {
                    python_error(py, &e).replacen("score() raised", "loading raised", 1)
                })?;
            policy_of_object(&obj, short.clone())
        })
        .map_err(|msg| ReplayError::BadSpec {
            spec: format!("py:{body}"),
            msg,
        })?;
        Ok(External {
            short,
            canonical,
            policy,
        })
    }
}

/// Register the `py:` prefix in replay's external-policy hook.
pub fn register_py_resolver() -> Result<(), ReplayError> {
    register("py", Arc::new(PyResolver))
}

/// A Python scorer object given directly (not by a spec string).
pub(crate) fn external_of_object(obj: &Bound<'_, PyAny>) -> PyResult<External> {
    let py = obj.py();
    let desc: (String, String) = py
        .import("kvreplay")?
        .getattr("_describe_scorer")?
        .call1((obj,))?
        .extract()?;
    let (short, canonical) = desc;
    let policy = policy_of_object(obj, short.clone())
        .map_err(|e| pyo3::exceptions::PyTypeError::new_err(format!("{short}: {e}")))?;
    Ok(External {
        short,
        canonical,
        policy,
    })
}
