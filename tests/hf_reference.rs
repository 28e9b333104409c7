//! Tiny random-weight HF checkpoints of every supported family, written by
//! `scripts/reference_hf.py make-tiny` (qwen2 q/k/v biases and tied
//! embeddings; qwen3 q/k norms, head_dim 12, f16; mistral window 3 on an
//! 11-token prompt, f16; llama with Llama 3 RoPE scaling, q/k/v/o biases and
//! two shards; gemma3_text with (1 + w) norms, a window of 3 and a local RoPE
//! base), captured with `kvreplay capture --model DIR` and checked by
//! `reference_hf.py check`: an independent NumPy float64 forward pass from the
//! checkpoint files (greedy tokens recomputed without a KV cache, q/k/v/o per
//! layer and head within 1e-4 relative L2). Skips with a printed reason
//! without the reference Python environment; fails then under
//! KVREPLAY_REQUIRE_MODEL=1.

use std::path::Path;

mod common;

use common::{kvreplay, python, text, ROOT};

#[test]
fn tiny_hf_checkpoints_match_the_numpy_reference() {
    let Some(python) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(ROOT).join("scripts/reference_hf.py");
    let o = common::python_cmd(&python)
        .arg(&script)
        .arg("make-tiny")
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "make-tiny failed:\n{}", text(&o));
    for fam in ["qwen2", "qwen3", "mistral", "llama3", "gemma3_text"] {
        let dir = tmp.path().join(fam);
        let out = tmp.path().join(format!("{fam}.kvtrace"));
        let o = kvreplay(&[
            "capture",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "w3 w7 w1 w12 w29 w0 w5 w5 w8 w2",
            "--decode",
            "4",
            "--dtype",
            "f32",
            "--prefill-chunk",
            "4",
            "--device",
            "cpu",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{fam}: capture failed:\n{}", text(&o));
        let o = common::python_cmd(&python)
            .arg(&script)
            .args(["check", "--checkpoint"])
            .arg(&dir)
            .arg("--trace")
            .arg(&out)
            .args(["--tol", "1e-4"])
            .output()
            .unwrap();
        println!("{fam}: {}", text(&o));
        assert!(
            o.status.success() && text(&o).contains("trace matches"),
            "{fam}: the trace does not match the reference:\n{}",
            text(&o)
        );
    }
}
