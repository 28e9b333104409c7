//! `import kvreplay`: the Rust side of the Python package (the module
//! `kvreplay._kvreplay`; the public API is `python/python/kvreplay/`).
//!
//! - traces: zero-copy read-only NumPy views over the memory maps;
//! - replay and sweeps: the engine and the analysis crate's sweep, with the
//!   GIL released while Rust works;
//! - Python scorers: a `py:` resolver registered in replay's external-policy
//!   hook, so `py:file.py:Class:k=v` works wherever a spec does.

use std::path::PathBuf;
use std::sync::Arc;

use numpy::ndarray::{ArrayView, IxDyn};
use numpy::{IntoPyArray, PyArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use kvreplay_kernels::Backend;
use kvreplay_replay::{Budget, PolicySpec, ReplayError};
use kvreplay_traces::{Dtype, Reads, Trace};

mod scorer;
pub use scorer::{register_py_resolver, PyScorerPolicy};

pyo3::create_exception!(
    _kvreplay,
    KvReplayError,
    pyo3::exceptions::PyRuntimeError,
    "An error of kvreplay's Rust engine (the message says what and where)."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    KvReplayError::new_err(e.to_string())
}

/// An open trace (the Python `kvreplay.Trace` wraps it).
#[pyclass(module = "kvreplay._kvreplay", frozen)]
pub struct RawTrace {
    pub(crate) inner: Arc<Trace>,
}

#[pymethods]
impl RawTrace {
    #[new]
    #[pyo3(signature = (path, verify = true))]
    fn new(py: Python<'_>, path: PathBuf, verify: bool) -> PyResult<Self> {
        let reads = if verify {
            Reads::Verified
        } else {
            Reads::Unverified
        };
        let t = py.detach(|| Trace::open_with(&path, reads)).map_err(err)?;
        Ok(RawTrace { inner: Arc::new(t) })
    }

    /// The manifest as JSON text.
    fn manifest_json(&self) -> String {
        serde_json::to_string(&self.inner.manifest).expect("a manifest serialises")
    }

    fn content_id(&self) -> String {
        self.inner.content_id().to_string()
    }

    fn n_layers(&self) -> usize {
        self.inner.n_layers()
    }

    fn path(&self) -> PathBuf {
        self.inner.dir().to_path_buf()
    }

    /// Tensor `name` of layer `layer` as a read-only NumPy array over the
    /// memory map (no copy); the array's base keeps the trace open.
    /// f16 -> float16, f32 -> float32, bf16 -> uint16 (the raw bits).
    fn tensor<'py>(
        slf: &Bound<'py, Self>,
        layer: usize,
        name: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let this = slf.get();
        if layer >= this.inner.n_layers() {
            return Err(PyValueError::new_err(format!(
                "layer {layer} out of range: the trace has {} layers",
                this.inner.n_layers()
            )));
        }
        let view = this.inner.layer(layer);
        let (dtype, shape, bytes) = view.tensor_bytes(name).ok_or_else(|| {
            PyValueError::new_err(format!("layer {layer} has no tensor `{name}`"))
        })?;
        let shape = IxDyn(shape);
        let container = slf.clone().into_any();
        // SAFETY: `bytes` lies in a read-only memory map owned by the trace,
        // which `container` (the array's base) keeps alive; the reader
        // checked that the tensor is aligned to its dtype and fully inside
        // the file; the array is made read-only below.
        let arr: Bound<'py, PyAny> = unsafe {
            match dtype {
                Dtype::F32 => {
                    let s: &[f32] = cast(bytes);
                    let v = ArrayView::from_shape(shape, s).map_err(err)?;
                    PyArray::borrow_from_array(&v, container).into_any()
                }
                Dtype::F16 => {
                    let s: &[half::f16] = cast(bytes);
                    let v = ArrayView::from_shape(shape, s).map_err(err)?;
                    PyArray::borrow_from_array(&v, container).into_any()
                }
                Dtype::Bf16 => {
                    let s: &[u16] = cast(bytes);
                    let v = ArrayView::from_shape(shape, s).map_err(err)?;
                    PyArray::borrow_from_array(&v, container).into_any()
                }
            }
        };
        let kw = PyDict::new(slf.py());
        kw.set_item("write", false)?;
        arr.call_method("setflags", (), Some(&kw))?;
        Ok(arr)
    }
}

/// `bytes` reinterpreted as `T`s.
///
/// # Safety
/// `bytes` must be aligned to `T` and a whole number of `T`s, and every bit
/// pattern must be a valid `T` (true of f32, f16 and u16).
unsafe fn cast<T>(bytes: &[u8]) -> &[T] {
    let n = std::mem::size_of::<T>();
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
            && bytes.len().is_multiple_of(n)
    );
    std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / n)
}

/// A trace being written (the Python `kvreplay.TraceWriter` wraps it): the
/// Rust writer, so the files, checksums and manifest are the CLI capture's.
#[pyclass(module = "kvreplay._kvreplay", frozen)]
pub struct RawTraceWriter {
    inner: std::sync::Mutex<Option<kvreplay_traces::TraceWriter>>,
    manifest: kvreplay_traces::Manifest,
}

#[pymethods]
impl RawTraceWriter {
    /// `manifest_json`: the whole manifest but `files` (filled in by finish).
    #[new]
    #[pyo3(signature = (out, manifest_json, force = false))]
    fn new(out: PathBuf, manifest_json: &str, force: bool) -> PyResult<Self> {
        let manifest: kvreplay_traces::Manifest = serde_json::from_str(manifest_json)
            .map_err(|e| PyValueError::new_err(format!("manifest: {e}")))?;
        let w =
            kvreplay_traces::TraceWriter::create(&out, manifest.layout(), force).map_err(err)?;
        Ok(RawTraceWriter {
            inner: std::sync::Mutex::new(Some(w)),
            manifest,
        })
    }

    /// Write tensor `name` (q, k, v, o: (heads, T, d); attn_colsum: (n_heads, P))
    /// of layer `layer` from a C-contiguous float32 array, converted to the
    /// trace's dtype.
    fn write(
        &self,
        py: Python<'_>,
        layer: usize,
        name: &str,
        data: numpy::PyReadonlyArrayDyn<'_, f32>,
    ) -> PyResult<()> {
        use kvreplay_traces::TensorKind;
        let layout = self.manifest.layout();
        let (heads, rows, kind) = match name {
            "q" => (layout.n_heads, layout.total_len, Some(TensorKind::Q)),
            "o" => (layout.n_heads, layout.total_len, Some(TensorKind::O)),
            "k" => (layout.n_kv_heads, layout.total_len, Some(TensorKind::K)),
            "v" => (layout.n_kv_heads, layout.total_len, Some(TensorKind::V)),
            "attn_colsum" => (layout.n_heads, layout.prompt_len, None),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "no tensor `{name}` to write"
                )))
            }
        };
        let want: Vec<usize> = match kind {
            Some(_) => vec![heads, rows, layout.head_dim],
            None => vec![heads, rows],
        };
        if data.shape() != want.as_slice() {
            return Err(PyValueError::new_err(format!(
                "{name}: shape {:?}, the manifest implies {want:?}",
                data.shape()
            )));
        }
        if layer >= layout.n_layers {
            return Err(PyValueError::new_err(format!(
                "layer {layer} out of range ({} layers)",
                layout.n_layers
            )));
        }
        let values = data
            .as_slice()
            .map_err(|_| PyValueError::new_err(format!("{name}: not C-contiguous")))?;
        let per_head = values.len() / heads;
        py.detach(|| -> PyResult<()> {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let w = g
                .as_mut()
                .ok_or_else(|| PyRuntimeError::new_err("the trace is already finished"))?;
            let lw = w.layer(layer);
            for (h, chunk) in values.chunks_exact(per_head).enumerate() {
                match kind {
                    Some(k) => lw.write_rows(k, h, 0, chunk),
                    None => lw.write_colsum(h, chunk),
                }
            }
            Ok(())
        })
    }

    /// Flush, checksum, write the manifest and move the trace into place.
    fn finish(&self, py: Python<'_>) -> PyResult<PathBuf> {
        let w = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("the trace is already finished"))?;
        let m = self.manifest.clone();
        py.detach(|| w.finish(m)).map_err(err)
    }
}

fn budget_of(budget: Option<usize>, ratio: Option<f64>) -> PyResult<Budget> {
    let b = match (budget, ratio) {
        (Some(b), None) => Budget::Entries(b),
        (None, Some(r)) => Budget::Ratio(r),
        _ => {
            return Err(PyValueError::new_err(
                "give exactly one of budget= (entries per KV head) or ratio= (of the prompt)",
            ))
        }
    };
    b.validate()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(b)
}

fn backend_of(device: &str) -> PyResult<Backend> {
    match device {
        "cpu" => Ok(Backend::Cpu),
        _ => Err(PyValueError::new_err(format!(
            "device `{device}`: the Python binding replays on the CPU only (device=\"cpu\")"
        ))),
    }
}

/// A policy given as a spec string or as a Python scorer object.
fn spec_of(policy: &Bound<'_, PyAny>) -> PyResult<PolicySpec> {
    if let Ok(s) = policy.extract::<String>() {
        return PolicySpec::parse(&s).map_err(err);
    }
    let ext = scorer::external_of_object(policy)?;
    Ok(PolicySpec {
        external: Some(ext),
        parts: Vec::new(),
    })
}

/// Replay `policy` on `trace`: (summary JSON, metrics columns, retention columns).
#[pyfunction]
#[pyo3(signature = (trace, policy, budget = None, ratio = None, device = "cpu"))]
fn replay<'py>(
    py: Python<'py>,
    trace: &Bound<'py, RawTrace>,
    policy: &Bound<'py, PyAny>,
    budget: Option<usize>,
    ratio: Option<f64>,
    device: &str,
) -> PyResult<(String, Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let budget = budget_of(budget, ratio)?;
    let backend = backend_of(device)?;
    let spec = spec_of(policy)?;
    let built = spec.build().map_err(err)?;
    let t = trace.get().inner.clone();
    let r = py
        .detach(|| kvreplay_replay::replay_on(&t, built.as_ref(), budget, &backend))
        .map_err(err)?;
    let s = kvreplay_replay::output::summary(&t, &spec, budget, &r, &backend);
    let summary = serde_json::to_string(&s).expect("a summary serialises");
    let m = PyDict::new(py);
    let ms: Vec<&kvreplay_replay::HeadMetrics> = r.metrics().collect();
    let col_u = |f: &dyn Fn(&kvreplay_replay::HeadMetrics) -> u64| -> Vec<u64> {
        ms.iter().map(|x| f(x)).collect()
    };
    let col_f = |f: &dyn Fn(&kvreplay_replay::HeadMetrics) -> f64| -> Vec<f64> {
        ms.iter().map(|x| f(x)).collect()
    };
    m.set_item("layer", col_u(&|x| x.layer as u64).into_pyarray(py))?;
    m.set_item("head", col_u(&|x| x.head as u64).into_pyarray(py))?;
    m.set_item("rel_l2", col_f(&|x| x.rel_l2).into_pyarray(py))?;
    m.set_item("cosine", col_f(&|x| x.cosine).into_pyarray(py))?;
    m.set_item("attn_mass", col_f(&|x| x.attn_mass).into_pyarray(py))?;
    m.set_item("kl", col_f(&|x| x.kl).into_pyarray(py))?;
    m.set_item("bytes", col_u(&|x| x.bytes).into_pyarray(py))?;
    let ret: Vec<&kvreplay_replay::Retained> =
        r.layers.iter().flat_map(|l| l.retained.iter()).collect();
    let rc = |f: &dyn Fn(&kvreplay_replay::Retained) -> usize| -> Vec<u64> {
        ret.iter().map(|x| f(x) as u64).collect()
    };
    let rd = PyDict::new(py);
    rd.set_item("layer", rc(&|x| x.layer).into_pyarray(py))?;
    rd.set_item("head", rc(&|x| x.head).into_pyarray(py))?;
    rd.set_item("position", rc(&|x| x.position).into_pyarray(py))?;
    rd.set_item("entry", rc(&|x| x.entry).into_pyarray(py))?;
    Ok((summary, m, rd))
}

/// Write a replay's outputs as the CLI does (metrics.csv, retention.csv,
/// summary.json into OUT, replaced whole only with `force`).
#[pyfunction]
#[pyo3(signature = (trace, policy, out, budget = None, ratio = None, force = false))]
fn replay_to<'py>(
    py: Python<'py>,
    trace: &Bound<'py, RawTrace>,
    policy: &Bound<'py, PyAny>,
    out: PathBuf,
    budget: Option<usize>,
    ratio: Option<f64>,
    force: bool,
) -> PyResult<String> {
    let budget = budget_of(budget, ratio)?;
    let spec = spec_of(policy)?;
    let built = spec.build().map_err(err)?;
    let t = trace.get().inner.clone();
    py.detach(|| -> Result<String, ReplayError> {
        kvreplay_replay::output::check_out(&out, force)?;
        let r = kvreplay_replay::replay_on(&t, built.as_ref(), budget, &Backend::Cpu)?;
        let s = kvreplay_replay::output::summary(&t, &spec, budget, &r, &Backend::Cpu);
        kvreplay_replay::output::write(&out, &s, &r, force)?;
        Ok(serde_json::to_string(&s).expect("a summary serialises"))
    })
    .map_err(err)
}

/// The CLI's sweep (resumable: points already in OUT are reused); returns
/// (points, ran, reused, complete, failed as (trace, spec, budget, reason)).
#[pyfunction]
#[pyo3(signature = (traces, policies, budgets, out, report = true))]
#[allow(clippy::type_complexity)]
fn sweep(
    py: Python<'_>,
    traces: Vec<PathBuf>,
    policies: Vec<String>,
    budgets: Vec<usize>,
    out: PathBuf,
    report: bool,
) -> PyResult<(
    usize,
    usize,
    usize,
    bool,
    Vec<(String, String, usize, String)>,
)> {
    use kvreplay_analysis::sweep;
    py.detach(|| -> Result<_, String> {
        let plan = sweep::Plan::new(&traces, &policies, &budgets)
            .map_err(|e| format!("checking the sweep before any work: {e}"))?;
        let backend = Backend::Cpu;
        let plan = plan.on_device(backend.device());
        let opts = sweep::RunOptions::new(&backend);
        let r = sweep::run_opts(&plan, &out, &opts, &mut |_, _, _| {})
            .map_err(|e| format!("sweeping into {}: {e}", out.display()))?;
        if report && r.complete && r.failed.len() < plan.points().len() {
            kvreplay_analysis::report::write(&out, &plan)
                .map_err(|e| format!("writing the report: {e}"))?;
        }
        let failed = r
            .failed
            .iter()
            .map(|f| {
                (
                    f.trace.clone(),
                    f.policy_spec.clone(),
                    f.budget,
                    f.reason.clone(),
                )
            })
            .collect();
        Ok((r.points, r.ran, r.reused, r.complete, failed))
    })
    .map_err(KvReplayError::new_err)
}

/// Every registered policy: (name, summary, is_scorer).
#[pyfunction]
fn policies(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let items: Vec<(String, String, bool)> = kvreplay_replay::REGISTRY
        .iter()
        .map(|p| (p.name.to_string(), p.summary.to_string(), p.is_scorer()))
        .collect();
    PyList::new(py, items)
}

/// The canonical form of a spec (every default filled in, `py:` specs with
/// their source's sha256).
#[pyfunction]
fn canonical(spec: &str) -> PyResult<String> {
    Ok(PolicySpec::parse(spec).map_err(err)?.canonical())
}

/// For a Rust program that embeds Python (the CLI built with
/// `--features python`): start the interpreter, add the active virtual
/// environment's packages (`$VIRTUAL_ENV`, where `pip install ./python` put
/// `kvreplay`), and register the `py:` resolver.
pub fn embed() -> Result<(), String> {
    Python::initialize();
    Python::attach(|py| -> PyResult<()> {
        if let Ok(venv) = std::env::var("VIRTUAL_ENV") {
            let site = py.import("site")?;
            let v = py.version_info();
            let dir = format!("{venv}/lib/python{}.{}/site-packages", v.major, v.minor);
            site.call_method1("addsitedir", (dir,))?;
        }
        Ok(())
    })
    .map_err(|e| format!("starting Python: {e}"))?;
    register_py_resolver().map_err(|e| e.to_string())
}

#[pymodule]
fn _kvreplay(m: &Bound<'_, PyModule>) -> PyResult<()> {
    register_py_resolver().map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    m.add("KvReplayError", m.py().get_type::<KvReplayError>())?;
    m.add_class::<RawTrace>()?;
    m.add_class::<RawTraceWriter>()?;
    m.add_class::<scorer::ScoreCtx>()?;
    m.add_function(wrap_pyfunction!(replay, m)?)?;
    m.add_function(wrap_pyfunction!(replay_to, m)?)?;
    m.add_function(wrap_pyfunction!(sweep, m)?)?;
    m.add_function(wrap_pyfunction!(policies, m)?)?;
    m.add_function(wrap_pyfunction!(canonical, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
