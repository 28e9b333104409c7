import json
from pathlib import Path

import numpy as np
import pytest

import kvreplay

PORTS = Path(__file__).parent / "ports"


def same(a, b):
    assert a.summary["budget"] == b.summary["budget"]
    for col in ("layer", "head", "position", "entry"):
        assert np.array_equal(a.retention[col], b.retention[col]), col
    for col in ("rel_l2", "cosine", "attn_mass", "kl", "bytes"):
        assert np.array_equal(a.metrics[col], b.metrics[col]), col


@pytest.mark.parametrize("params,budget", [("w=16", 128), ("w=32", 64), ("w=8,pool=avg,k=5", 100)])
def test_python_snapkv_keeps_what_snapkv_keeps(smol_trace, params, budget):
    t = kvreplay.Trace(smol_trace)
    py = kvreplay.replay(t, f"py:{PORTS}/snapkv.py:SnapKV:{params}", budget=budget)
    rs = kvreplay.replay(t, f"snapkv:{params}", budget=budget)
    same(py, rs)
    assert py.summary["policy"] == "py:SnapKV"
    sha = __import__("hashlib").sha256((PORTS / "snapkv.py").read_bytes()).hexdigest()
    assert py.summary["policy_spec"].endswith(f"sha256={sha}")


@pytest.mark.parametrize("params,budget", [("", 128), ("skip_layers=none", 64)])
def test_python_knorm_keeps_what_knorm_keeps(smol_trace, params, budget):
    t = kvreplay.Trace(smol_trace)
    py = kvreplay.replay(t, f"py:{PORTS}/knorm.py:KNorm:{params}".rstrip(":"), budget=budget)
    rs = kvreplay.replay(t, f"knorm:{params}".rstrip(":"), budget=budget)
    same(py, rs)


def test_a_scorer_object_and_wrappers(smol_trace):
    import sys

    sys.path.insert(0, str(PORTS))
    from snapkv import SnapKV

    t = kvreplay.Trace(smol_trace)
    same(kvreplay.replay(t, SnapKV(w=16), budget=96), kvreplay.replay(t, "snapkv:w=16", budget=96))
    # a `+` wrapper composes onto a Python scorer as onto a built-in
    a = kvreplay.replay(t, f"py:{PORTS}/snapkv.py:SnapKV:w=16+quant:bits=4", budget=96)
    b = kvreplay.replay(t, "snapkv:w=16+quant:bits=4", budget=96)
    same(a, b)


def test_python_scorer_in_a_sweep_resumes_and_records_the_hash(smol_trace, tmp_path):
    spec = f"py:{PORTS}/knorm.py:KNorm"
    r = kvreplay.sweep([smol_trace], [spec, "knorm"], [64], tmp_path / "s")
    assert r.complete and not r.failed, r.failed
    plan = (tmp_path / "s" / "plan.json").read_text()
    assert "sha256=" in plan
    again = kvreplay.sweep([smol_trace], [spec, "knorm"], [64], tmp_path / "s")
    assert again.ran == 0


@pytest.mark.parametrize(
    "cls,what",
    [
        ("WrongShape", r"returned shape \[10, "),
        ("NaNs", "NaN for KV head 0, position 3"),
        ("Raises", "boom in layer"),
    ],
)
def test_bad_scorers_fail_clearly(smol_trace, tmp_path, cls, what):
    spec = f"py:{PORTS}/bad.py:{cls}"
    with pytest.raises(kvreplay.KvReplayError, match=what) as e:
        kvreplay.replay(smol_trace, spec, budget=64)
    msg = str(e.value)
    assert f"policy `py:{cls}`, layer " in msg
    if cls == "Raises":
        assert "Traceback" in msg and "in helper" in msg and "ValueError" in msg
    # nothing half-written
    with pytest.raises(kvreplay.KvReplayError):
        kvreplay.replay_to(smol_trace, spec, tmp_path / "out", budget=64)
    assert not any(tmp_path.iterdir())


def test_the_context_is_only_valid_inside_score(smol_trace):
    kvreplay.replay(smol_trace, f"py:{PORTS}/bad.py:Stash", budget=64)
    import sys

    stash = [m for n, m in sys.modules.items() if n.startswith("kvreplay_user_bad")][0].Stash
    assert stash.ctx.keys.shape[0] == stash.ctx.n_kv_heads
    with pytest.raises(RuntimeError, match="only valid inside score"):
        stash.ctx.window_attention(4)


def test_spec_errors(tmp_path):
    with pytest.raises(kvreplay.KvReplayError, match="no such file|No such file"):
        kvreplay.canonical("py:/nonexistent.py:X")
    with pytest.raises(kvreplay.KvReplayError, match="defines no `Nope`"):
        kvreplay.canonical(f"py:{PORTS}/snapkv.py:Nope")
    with pytest.raises(kvreplay.KvReplayError, match="has changed"):
        kvreplay.canonical(f"py:{PORTS}/snapkv.py:SnapKV:sha256=00")


def test_the_cli_runs_a_python_scorer_when_built_with_the_feature(smol_trace, kvreplay_bin, tmp_path):
    import subprocess

    spec = f"py:{PORTS}/snapkv.py:SnapKV:w=16"
    p = subprocess.run([str(kvreplay_bin), "replay", "--trace", str(smol_trace), "--policy", spec,
                        "--budget", "128", "--out", str(tmp_path / "py")], capture_output=True, text=True)
    if "unknown policy `py" in p.stderr:
        pytest.skip("the CLI was built without `--features python`")
    assert p.returncode == 0, p.stderr
    subprocess.run([str(kvreplay_bin), "replay", "--trace", str(smol_trace), "--policy", "snapkv:w=16",
                    "--budget", "128", "--out", str(tmp_path / "rs")], check=True, capture_output=True)
    assert (tmp_path / "py" / "retention.csv").read_bytes() == (tmp_path / "rs" / "retention.csv").read_bytes()
    s = json.loads((tmp_path / "py" / "summary.json").read_text())
    assert s["policy"] == "py:SnapKV" and "sha256=" in s["policy_spec"]


def test_a_python_policy_keeps_what_it_returns(smol_trace):
    t = kvreplay.Trace(smol_trace)
    a = kvreplay.replay(t, f"py:{PORTS}/bad.py:Recent", budget=64)
    b = kvreplay.replay(t, "streaming_llm:n_sink=0,decode_evict=false", budget=64)
    same(a, b)


@pytest.mark.parametrize(
    "cls,what",
    [
        ("OutOfRange", r"KV head 0: position \d+ is outside the prompt"),
        ("OverBudget", "KV head 0: keeps 65 positions, over the budget of 64"),
        ("TooFewHeads", r"returned 1 lists of positions; expected one per KV head \(3\)"),
    ],
)
def test_bad_python_policies_fail_clearly(smol_trace, cls, what):
    with pytest.raises(kvreplay.KvReplayError, match=what) as e:
        kvreplay.replay(smol_trace, f"py:{PORTS}/bad.py:{cls}", budget=64)
    assert f"policy `py:{cls}`, layer " in str(e.value)


@pytest.mark.parametrize(
    "alloc,builtin",
    [("pyramidkv", "pyramidkv:w=8"), ("pyramidkv:beta=5", "pyramidkv:beta=5,w=8"), ("adakv", "adakv:w=8")],
)
def test_allocation_wrappers_around_a_python_scorer(smol_trace, alloc, builtin):
    t = kvreplay.Trace(smol_trace)
    a = kvreplay.replay(t, f"py:{PORTS}/snapkv.py:SnapKV:w=8,allocation={alloc}", budget=96)
    b = kvreplay.replay(t, builtin, budget=96)
    same(a, b)
