"""kvreplay.hf.capture against the Rust capture (needs torch, transformers
and gguf: scripts/test-python-hf.sh installs them into .venv-hf/; skipped
without them)."""
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test-python-hf.sh)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("gguf", reason="gguf is not installed (transformers needs it to read the GGUF)")
pytest.importorskip("accelerate", reason="accelerate is not installed (transformers needs it to load a GGUF)")

import kvreplay  # noqa: E402
import kvreplay.hf  # noqa: E402
from conftest import MODEL  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    """SmolLM2 in transformers, float32, on $KVREPLAY_HF_DEVICE (default cpu;
    `cuda` runs the HF capture on a GPU)."""
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(MODEL.parent), gguf_file=MODEL.name, dtype=torch.float32
    )
    return m.to(os.environ.get("KVREPLAY_HF_DEVICE", "cpu")).eval()


def rel(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_hf_capture_matches_the_rust_capture(smol_trace, kvreplay_bin, hf_model, tmp_path):
    rs = kvreplay.Trace(smol_trace)
    ids = rs.token_ids.tolist()
    p = rs.prompt_len
    out = kvreplay.hf.capture(
        hf_model, ids[:p], continuation=ids[p:], out=tmp_path / "hf.kvtrace",
        source_file=str(MODEL), spans=rs.spans,
    )
    subprocess.run([str(kvreplay_bin), "verify", str(out)], check=True, capture_output=True)
    hf = kvreplay.Trace(out)
    assert hf.manifest["model"]["rope"]["style"] == "neox"
    assert hf.token_ids.tolist() == ids and hf.prompt_len == p
    worst = {}
    for l in range(rs.n_layers):
        for name in ("q", "k", "v", "o", "attn_colsum"):
            e = rel(hf.layer(l).tensor(name).astype(np.float32), rs.layer(l).tensor(name).astype(np.float32))
            worst[name] = max(worst.get(name, 0.0), e)
    print("worst relative L2 difference per tensor over the layers:", worst)
    for name, e in worst.items():
        assert e < 1e-3, (name, e)  # measured: at most 4.1e-5 (o)
    # every classic baseline (their default settings) keeps the same positions;
    # adakv's global top-k across heads compares scores of different heads,
    # where a 4e-5 relative difference in q/k can flip a near-tie: there the
    # shares must round to 1 at 3 decimals
    shares = {}
    for spec in ("random", "streaming_llm", "h2o", "snapkv", "pyramidkv", "adakv", "tova",
                 "knorm", "scissorhands", "cam"):
        a = kvreplay.replay(hf, spec, budget=128)
        b = kvreplay.replay(rs, spec, budget=128)
        shares[spec] = np.mean([
            len(np.intersect1d(a.kept(l, h), b.kept(l, h))) / max(len(b.kept(l, h)), 1)
            for l in range(rs.n_layers) for h in range(rs.n_kv_heads)
        ])
        print(f"{spec}: share of the Rust capture's kept positions the HF capture keeps: {shares[spec]:.6f}")
    for spec, same in shares.items():
        assert same == 1.0 or (spec == "adakv" and same >= 0.999), (spec, same)
