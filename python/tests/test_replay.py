import csv
import json

import numpy as np
import pytest

import kvreplay
from conftest import run_cli


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("spec,budget", [("snapkv:w=16", 128), ("h2o", 64), ("knorm", 100)])
def test_replay_equals_the_cli_bit_for_bit(smol_trace, kvreplay_bin, tmp_path, spec, budget):
    out = tmp_path / "cli"
    run_cli(kvreplay_bin, "replay", "--trace", str(smol_trace), "--policy", spec,
            "--budget", str(budget), "--out", str(out))
    r = kvreplay.replay(kvreplay.Trace(smol_trace), spec, budget=budget)
    cli_summary = json.loads((out / "summary.json").read_text())
    for k in ("policy", "policy_spec", "budget", "rel_l2_mean", "cosine_mean", "attn_mass_mean",
              "kl_mean", "bytes", "full_bytes", "memory_ratio"):
        assert r.summary[k] == cli_summary[k], k
    rows = read_csv(out / "metrics.csv")
    assert len(rows) == len(r.metrics["layer"])
    for col in ("rel_l2", "cosine", "attn_mass", "kl"):
        # the CSV holds Rust's shortest round-trip text: equal floats parse equal
        assert [float(x[col]) for x in rows] == r.metrics[col].tolist(), col
    for col in ("layer", "head", "bytes"):
        assert [int(x[col]) for x in rows] == r.metrics[col].tolist(), col
    ret = read_csv(out / "retention.csv")
    for col in ("layer", "head", "position", "entry"):
        assert [int(x[col]) for x in ret] == r.retention[col].tolist(), col


def test_replay_to_writes_what_the_cli_writes(smol_trace, kvreplay_bin, tmp_path):
    run_cli(kvreplay_bin, "replay", "--trace", str(smol_trace), "--policy", "snapkv",
            "--budget", "64", "--out", str(tmp_path / "cli"))
    kvreplay.replay_to(smol_trace, "snapkv", tmp_path / "py", budget=64)
    for f in ("metrics.csv", "retention.csv"):
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "py" / f).read_bytes()


def test_pandas_and_errors(smol_trace):
    pd = pytest.importorskip("pandas")
    r = kvreplay.replay(smol_trace, "snapkv", ratio=0.25)
    m, ret = r.to_pandas()
    assert isinstance(m, pd.DataFrame) and set(m.columns) >= {"policy", "layer", "head", "rel_l2"}
    assert len(ret) == len(r.retention["position"])
    assert r.summary["budget"] == int(0.25 * kvreplay.Trace(smol_trace).prompt_len)
    assert len(r.kept(0, 0)) == r.summary["budget"]
    with pytest.raises(kvreplay.KvReplayError, match="unknown policy"):
        kvreplay.replay(smol_trace, "nope", budget=8)
    with pytest.raises(ValueError, match="exactly one"):
        kvreplay.replay(smol_trace, "h2o")


def test_sweep_equals_the_cli_and_resumes(smol_trace, kvreplay_bin, tmp_path):
    pols, budgets = ["snapkv:w=16", "h2o"], [64, 128]
    args = ["sweep", "--traces", str(smol_trace), "--out", str(tmp_path / "cli"),
            "--budget", ",".join(map(str, budgets))]
    for p in pols:
        args += ["--policy", p]
    run_cli(kvreplay_bin, *args)
    r = kvreplay.sweep([smol_trace], pols, budgets, tmp_path / "py")
    assert (r.points, r.ran, r.reused, r.complete, r.failed) == (4, 4, 0, True, [])
    for f in ("results.csv", "summary.csv"):
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "py" / f).read_bytes(), f
    again = kvreplay.sweep([smol_trace], pols, budgets, tmp_path / "py")
    assert (again.ran, again.reused) == (0, 4)
