import json

import numpy as np
import pytest

import kvreplay


def test_manifest_tokens_and_shapes(smol_trace):
    t = kvreplay.Trace(smol_trace)
    m = json.loads((smol_trace / "manifest.json").read_text())
    assert t.manifest == m
    assert t.prompt_len == m["tokens"]["prompt_len"]
    assert list(t.token_ids) == m["tokens"]["ids"]
    assert t.n_layers == m["model"]["n_layers"] == len(t)
    assert "needle" in " ".join(t.spans) or t.spans == {s["name"]: (s["start"], s["end"]) for s in m["spans"]}
    T = len(t.token_ids)
    L = t.layer(2)
    assert L.q.shape == (t.n_heads, T, t.head_dim)
    assert L.k.shape == L.v.shape == (t.n_kv_heads, T, t.head_dim)
    assert L.o.shape == (t.n_heads, T, t.head_dim)
    assert L.colsum.shape == (t.n_heads, t.prompt_len) and L.colsum.dtype == np.float32
    assert L.k.dtype == {"f16": np.float16, "f32": np.float32, "bf16": np.uint16}[t.dtype]
    assert L.attn_probs is None
    with pytest.raises(IndexError):
        t.layer(t.n_layers)


def test_layers_are_zero_copy_read_only_views_of_the_map(smol_trace):
    t = kvreplay.Trace(smol_trace)
    a, b = t.layer(1).k, t.layer(1).k
    # the same bytes, twice: no copy
    assert np.shares_memory(a, b)
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert not a.flags.writeable and not a.flags.owndata
    with pytest.raises(ValueError):
        a[0, 0, 0] = 1
    # the memory is the layer file's bytes (the data offset of the header)
    raw = (smol_trace / "layer-001.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8 : 8 + n])
    s, e = hdr["k"]["data_offsets"]
    assert a.tobytes() == raw[8 + n + s : 8 + n + e]
    # the array keeps the map alive after the Trace object is gone
    q = t.layer(0).q
    del t, a, b
    import gc

    gc.collect()
    assert np.isfinite(q.astype(np.float32)).all()


def test_bf16_helper():
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    assert kvreplay.bf16_to_float32(bits).tolist() == [1.0, -2.0]
