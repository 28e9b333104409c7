"""kvreplay: record an LLM's attention inputs once; replay any KV-cache
compression policy on them in seconds. The engine is Rust; this package is
its Python face (docs/python.md).

    import kvreplay
    t = kvreplay.Trace("passkey.kvtrace")
    k = t.layer(3).k                      # (n_kv_heads, T, d) float16, no copy
    r = kvreplay.replay(t, "snapkv:w=16", budget=128)
    r.summary["rel_l2_mean"], r.to_pandas()
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _kvreplay
from ._kvreplay import KvReplayError, ScoreContext

__version__ = _kvreplay.__version__

__all__ = [
    "Trace",
    "TraceWriter",
    "Layer",
    "replay",
    "replay_to",
    "sweep",
    "Scorer",
    "Policy",
    "ScoreContext",
    "ReplayResult",
    "SweepResult",
    "KvReplayError",
    "policies",
    "canonical",
    "bf16_to_float32",
]


def bf16_to_float32(a: np.ndarray) -> np.ndarray:
    """bf16 tensors are exposed as their raw uint16 bits (NumPy has no
    bfloat16); this widens them to float32 (a copy). With `ml_dtypes`
    installed, `a.view(ml_dtypes.bfloat16)` is a zero-copy alternative."""
    a = np.asarray(a)
    if a.dtype != np.uint16:
        raise TypeError(f"expected the uint16 bits of a bf16 tensor, got {a.dtype}")
    return (a.astype(np.uint32) << 16).view(np.float32)


class Layer:
    """One layer of a trace; every tensor is a read-only NumPy view of the
    memory map, as stored (float16, float32, or uint16 bits for bf16)."""

    def __init__(self, raw: "_kvreplay.RawTrace", index: int):
        self._raw = raw
        self.index = index

    def tensor(self, name: str) -> np.ndarray:
        return self._raw.tensor(self.index, name)

    @property
    def q(self) -> np.ndarray:
        """(n_heads, T, head_dim) post-RoPE queries."""
        return self.tensor("q")

    @property
    def k(self) -> np.ndarray:
        """(n_kv_heads, T, head_dim) post-RoPE keys."""
        return self.tensor("k")

    @property
    def v(self) -> np.ndarray:
        """(n_kv_heads, T, head_dim) values."""
        return self.tensor("v")

    @property
    def o(self) -> np.ndarray:
        """(n_heads, T, head_dim) per-head attention outputs."""
        return self.tensor("o")

    @property
    def colsum(self) -> np.ndarray:
        """(n_heads, prompt_len) float32: attention each prompt key received
        from all prompt queries."""
        return self.tensor("attn_colsum")

    @property
    def attn_probs(self) -> Optional[np.ndarray]:
        """(n_heads, T, T) when captured with --attn-probs, else None."""
        try:
            return self.tensor("attn_probs")
        except ValueError:
            return None


class Trace:
    """A kvreplay trace directory, memory-mapped. `verify=True` (the
    default) checks every layer file's sha256 and finiteness on open."""

    def __init__(self, path: Union[str, os.PathLike], verify: bool = True):
        self._raw = _kvreplay.RawTrace(os.fspath(path), verify)
        self.manifest: Dict[str, Any] = json.loads(self._raw.manifest_json())
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        m = self.manifest["model"]
        return (
            f"Trace({self.path!r}: {m['architecture']} {m['n_layers']} layers, "
            f"P={self.prompt_len}, T={len(self.token_ids)})"
        )

    @property
    def content_id(self) -> str:
        return self._raw.content_id()

    @property
    def token_ids(self) -> np.ndarray:
        return np.asarray(self.manifest["tokens"]["ids"], dtype=np.uint32)

    @property
    def tokens(self) -> List[str]:
        return list(self.manifest["tokens"]["text"])

    @property
    def prompt_len(self) -> int:
        return int(self.manifest["tokens"]["prompt_len"])

    @property
    def n_decode(self) -> int:
        return int(self.manifest["generation"]["n_decode"])

    @property
    def spans(self) -> Dict[str, Tuple[int, int]]:
        """Named prompt ranges, name -> (start, end)."""
        return {s["name"]: (s["start"], s["end"]) for s in self.manifest.get("spans", [])}

    @property
    def n_layers(self) -> int:
        return self._raw.n_layers()

    @property
    def n_heads(self) -> int:
        return self.manifest["model"]["n_heads"]

    @property
    def n_kv_heads(self) -> int:
        return self.manifest["model"]["n_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.manifest["model"]["head_dim"]

    @property
    def dtype(self) -> str:
        return self.manifest["capture"]["dtype"]

    def layer(self, l: int) -> Layer:
        if not -self.n_layers <= l < self.n_layers:
            raise IndexError(f"layer {l}: the trace has {self.n_layers} layers")
        return Layer(self._raw, l % self.n_layers)

    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, l: int) -> Layer:
        return self.layer(l)

    def __iter__(self):
        return (self.layer(l) for l in range(self.n_layers))


class TraceWriter:
    """Write a trace through the Rust writer (the CLI capture's files,
    checksums and manifest checks; `kvreplay verify` accepts the result).

        w = kvreplay.TraceWriter("out.kvtrace", manifest)  # manifest: dict, `files` filled in here
        for l in range(n_layers):
            w.write(l, q=q, k=k, v=v, o=o, colsum=colsum)    # float arrays, (heads, T, d) / (n_heads, P)
        w.finish()

    Until `finish()` the trace is in `OUT.partial/` (replaced by the next
    writer of OUT): an interrupted writer leaves no OUT that looks complete.
    """

    def __init__(self, out: Union[str, os.PathLike], manifest: Dict[str, Any], force: bool = False):
        m = dict(manifest)
        m["files"] = []
        self._raw = _kvreplay.RawTraceWriter(os.fspath(out), json.dumps(m), force)

    def write(self, layer: int, **tensors: np.ndarray) -> None:
        for name, a in tensors.items():
            name = "attn_colsum" if name == "colsum" else name
            self._raw.write(layer, name, np.ascontiguousarray(a, dtype=np.float32))

    def finish(self) -> str:
        return self._raw.finish()


def _raw_trace(trace: Union[Trace, str, os.PathLike]) -> "_kvreplay.RawTrace":
    if isinstance(trace, Trace):
        return trace._raw
    return Trace(trace)._raw


@dataclass
class ReplayResult:
    """A replay: `summary` (the CLI's summary.json), `metrics` (one row per
    (layer, query head): layer, head, rel_l2, cosine, attn_mass, kl, bytes)
    and `retention` (one row per retained prompt position per cache: layer,
    head, position, entry), both as dicts of NumPy columns."""

    summary: Dict[str, Any]
    metrics: Dict[str, np.ndarray]
    retention: Dict[str, np.ndarray]

    def kept(self, layer: int, head: int) -> np.ndarray:
        """Prompt positions cache `head` of `layer` still represents, ascending."""
        r = self.retention
        sel = (r["layer"] == layer) & (r["head"] == head)
        return np.sort(r["position"][sel])

    def to_pandas(self):
        """(metrics, retention) as pandas DataFrames (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover
            raise ImportError("to_pandas() needs pandas: pip install pandas") from e
        m = pd.DataFrame(self.metrics)
        m.insert(0, "budget", self.summary["budget"])
        m.insert(0, "policy", self.summary["policy"])
        return m, pd.DataFrame(self.retention)


def replay(
    trace: Union[Trace, str, os.PathLike],
    policy: Union[str, "Scorer"],
    budget: Optional[int] = None,
    ratio: Optional[float] = None,
    device: str = "cpu",
) -> ReplayResult:
    """Replay `policy` (a spec such as "snapkv:w=16", "py:file.py:Class:k=v",
    or a Scorer object) on `trace` at `budget` entries per KV head (or
    `ratio` of the prompt). The GIL is released while the engine runs
    (a Python scorer takes it back once per layer)."""
    s, m, r = _kvreplay.replay(_raw_trace(trace), policy, budget, ratio, device)
    return ReplayResult(json.loads(s), dict(m), dict(r))


def replay_to(
    trace: Union[Trace, str, os.PathLike],
    policy: Union[str, "Scorer"],
    out: Union[str, os.PathLike],
    budget: Optional[int] = None,
    ratio: Optional[float] = None,
    force: bool = False,
) -> Dict[str, Any]:
    """Replay and write metrics.csv, retention.csv and summary.json into
    `out`, exactly as `kvreplay replay --out` does; returns the summary."""
    s = _kvreplay.replay_to(_raw_trace(trace), policy, os.fspath(out), budget, ratio, force)
    return json.loads(s)


@dataclass
class SweepResult:
    points: int
    ran: int
    reused: int
    complete: bool
    failed: List[Tuple[str, str, int, str]] = field(default_factory=list)
    out: str = ""

    def results(self):
        """results.csv as a pandas DataFrame (needs pandas)."""
        import pandas as pd

        return pd.read_csv(os.path.join(self.out, "results.csv"))


def sweep(
    traces: Sequence[Union[str, os.PathLike]],
    policies: Sequence[str],
    budgets: Sequence[int],
    out: Union[str, os.PathLike],
    report: bool = True,
) -> SweepResult:
    """`kvreplay sweep`: every (trace, policy, budget) point into `out`
    (results.csv, summary.csv, report); resumable (points already in `out`
    are reused). Policies are spec strings (`py:` specs included)."""
    traces = [os.fspath(t.path if isinstance(t, Trace) else t) for t in traces]
    p, ran, reused, complete, failed = _kvreplay.sweep(
        traces, list(policies), [int(b) for b in budgets], os.fspath(out), report
    )
    return SweepResult(p, ran, reused, complete, list(failed), os.fspath(out))


def policies() -> List[Tuple[str, str, bool]]:
    """Built-in policies: (name, summary, is_scorer)."""
    return _kvreplay.policies()


def canonical(spec: str) -> str:
    """The spec with every default filled in (`py:` specs with their file's sha256)."""
    return _kvreplay.canonical(spec)


class Scorer:
    """Base class of Python scorers (the kvpress `score()` contract).

    Subclasses implement `score(self, ctx)` returning a float array of shape
    (ctx.n_kv_heads, ctx.prompt_len) (or (n_kv_heads, prompt_len - window)):
    one score per KV head and prompt position, higher is kept. It is called
    once per layer, for all KV heads; a Python scorer keeps one cache per KV
    head. kvreplay's shared selection does the rest; these attributes steer it:

    - `sinks`: the first positions, always kept (inside the budget);
    - `window`: the last prompt positions, always kept (inside the budget);
    - `skip_layers`: layers left uncompressed;
    - `tie`: which of two equal scores survives, "later" (default) or "earlier";
    - `allocation`: how the budget is spread: None/"uniform" (B per KV head),
      or a scorer wrapper's spec, "pyramidkv[:beta=20]" or "adakv[:alpha=0.2]"
      (in a `py:` spec: `allocation=adakv`, a reserved key).

    Keyword arguments of the constructor (the `k=v` of a `py:` spec) become
    attributes, converted to int, float or bool when they look like one.
    """

    sinks: int = 0
    window: int = 0
    skip_layers: Sequence[int] = ()
    tie: str = "later"
    allocation: Optional[str] = None

    def __init__(self, **params: Any):
        self.params = dict(params)
        for k, v in params.items():
            setattr(self, k, v)

    def score(self, ctx: ScoreContext) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError("a Scorer must implement score(self, ctx)")


class Policy:
    """Base class of Python policies that choose their caches themselves.

    Subclasses implement `keep(self, ctx)` returning, per KV head, the
    prompt positions to keep (a list of n_kv_heads integer sequences, or an
    (n_kv_heads, n) integer array), given the same `ctx` as `Scorer.score`.
    Called once per layer. The engine checks the answer (one sequence per KV
    head, positions inside the prompt, each once, at most `ctx.budget` when
    the prompt is longer) and keeps those exact entries; decode appends.
    Keyword arguments of the constructor become attributes, as for Scorer.
    """

    def __init__(self, **params: Any):
        self.params = dict(params)
        for k, v in params.items():
            setattr(self, k, v)

    def keep(self, ctx: ScoreContext):  # pragma: no cover
        raise NotImplementedError("a Policy must implement keep(self, ctx)")


def _convert(v: str) -> Any:
    low = v.lower()
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return v


def _load_scorer(path: str, class_name: str, params: Dict[str, str]):
    """`py:PATH:CLASS:k=v`: load CLASS from PATH and build it with the params."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]
    name = f"kvreplay_user_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path}: not a Python module")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    cls = getattr(mod, class_name, None)
    if cls is None:
        raise AttributeError(f"{path} defines no `{class_name}`")
    params = dict(params)
    allocation = params.pop("allocation", None)  # reserved: the selection's, not the class's
    obj = cls(**{k: _convert(v) for k, v in params.items()})
    if allocation is not None:
        obj.allocation = allocation
    return obj


def _describe_scorer(obj) -> Tuple[str, str]:
    """(short name, canonical spec) of a scorer object given directly."""
    cls = type(obj)
    short = f"py:{cls.__name__}"
    try:
        src = inspect.getsourcefile(cls)
    except TypeError:
        src = None
    params = getattr(obj, "params", {}) or {}
    kv = "".join(f"{k}={params[k]}," for k in sorted(params))
    if src and os.path.isfile(src):
        sha = hashlib.sha256(open(src, "rb").read()).hexdigest()
        return short, f"py:{src}:{cls.__name__}:{kv}sha256={sha}"
    return short, f"py:<{cls.__module__}>:{cls.__name__}:{kv}".rstrip(",:")
