import json
import subprocess

import numpy as np
import pytest

import kvreplay


def test_a_trace_rewritten_through_the_writer_verifies_and_replays_the_same(smol_trace, kvreplay_bin, tmp_path):
    t = kvreplay.Trace(smol_trace)
    out = tmp_path / "copy.kvtrace"
    w = kvreplay.TraceWriter(out, t.manifest)
    for l in range(t.n_layers):
        L = t.layer(l)
        w.write(l, q=L.q, k=L.k, v=L.v, o=L.o, colsum=L.colsum)
    assert not out.exists()  # only OUT.partial until finish
    w.finish()
    subprocess.run([str(kvreplay_bin), "verify", str(out)], check=True, capture_output=True)
    c = kvreplay.Trace(out)
    for name in ("q", "k", "v", "o", "attn_colsum"):
        assert np.array_equal(c.layer(5).tensor(name), t.layer(5).tensor(name)), name
    for l in range(t.n_layers):
        assert (out / f"layer-{l:03d}.safetensors").read_bytes() == (smol_trace / f"layer-{l:03d}.safetensors").read_bytes()
    a = kvreplay.replay(c, "snapkv", budget=64)
    b = kvreplay.replay(t, "snapkv", budget=64)
    assert np.array_equal(a.metrics["rel_l2"], b.metrics["rel_l2"])
    with pytest.raises(RuntimeError, match="already finished"):
        w.finish()


def test_the_writer_checks_shapes(smol_trace, tmp_path):
    t = kvreplay.Trace(smol_trace)
    w = kvreplay.TraceWriter(tmp_path / "x.kvtrace", t.manifest)
    with pytest.raises(ValueError, match="the manifest implies"):
        w.write(0, k=np.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="out of range"):
        w.write(t.n_layers, colsum=t.layer(0).colsum)
