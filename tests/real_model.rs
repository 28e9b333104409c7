//! Integration tests on the real model (SmolLM2-135M-Instruct, GGUF Q4_1)
//! through the `kvreplay` binary. `scripts/test.sh` fetches the model and the
//! Python reference and sets KVREPLAY_REQUIRE_MODEL=1, so there these tests
//! fail rather than skip when something is missing; a bare `cargo test`
//! without the model prints why each one did not run.

use std::path::Path;

mod common;

use common::{kvreplay, model, python, text, ROOT};

const PROMPT: &str = "Read this carefully. The passkey is 71432, remember it: the quick brown fox jumps over the lazy dog; naïve café — 3.14159! What is the passkey?";

/// The acceptance check: the trace matches an independent f32
/// implementation (scripts/reference_llama.py): identical prompt ids, the same
/// 16 greedy tokens, and attention logits, V and o within 1% relative L2 per head.
#[test]
fn capture_matches_independent_reference() {
    let (Some(model), Some(python)) = (model(), python()) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ref.kvtrace");
    let m = model.to_str().unwrap();
    let o = kvreplay(&[
        "capture",
        "--model",
        m,
        "--prompt",
        PROMPT,
        "--chat",
        "--decode",
        "16",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "capture failed:\n{}", text(&o));
    println!("{}", text(&o));
    let o = kvreplay(&["verify", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify failed:\n{}", text(&o));
    println!("{}", text(&o));
    let o = common::python_cmd(&python)
        .arg(Path::new(ROOT).join("scripts/reference_llama.py"))
        .args([
            "--model",
            m,
            "--trace",
            out.to_str().unwrap(),
            "--prompt",
            PROMPT,
            "--chat",
            "--tol",
            "0.01",
        ])
        .output()
        .unwrap();
    println!("{}", text(&o));
    assert!(
        o.status.success(),
        "the trace does not match the reference:\n{}",
        text(&o)
    );
    assert!(text(&o).contains("trace matches"));
}

#[test]
fn inspect_shows_the_real_shapes() {
    let Some(model) = model() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("i.kvtrace");
    let o = kvreplay(&[
        "capture",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--decode",
        "4",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = kvreplay(&["inspect", out.to_str().unwrap()]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    // 5 prompt tokens + 4 generated, 30 layers of 9 query / 3 KV heads of 64 dims
    assert!(
        s.contains("30 layers, 9 heads / 3 KV heads, head_dim 64"),
        "{s}"
    );
    assert!(s.contains("q [9, 9, 64]  k/v [3, 9, 64]"), "{s}");
    assert!(s.contains("Paris"), "{s}");
}

#[test]
fn bad_capture_requests_fail_clearly_and_leave_no_trace() {
    let Some(model) = model() else { return };
    let m = model.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.kvtrace");
    let o_s = out.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--prompt", "hi", "--decode", "9000"],
            "context is 8192 tokens",
        ),
        (&["--prompt", ""], "the prompt is empty"),
        (&["--prompt", "hi", "--dtype", "f8"], "unknown dtype `f8`"),
        (
            &["--prompt", "hi", "--decode", "2000", "--attn-probs"],
            "--attn-probs",
        ),
        (&["--prompt", "hi", "--span", "needle:3"], "NAME:START:END"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["capture", "--model", m, "--out", o_s];
        args.extend_from_slice(extra);
        let o = kvreplay(&args);
        assert!(
            !o.status.success() && text(&o).contains(want),
            "{extra:?}: {}",
            text(&o)
        );
        assert!(
            !out.exists() && !tmp.path().join("x.kvtrace.partial").exists(),
            "{extra:?} left files"
        );
    }
    let o = kvreplay(&[
        "capture",
        "--model",
        "/nonexistent/m.gguf",
        "--prompt",
        "hi",
        "--out",
        o_s,
    ]);
    assert!(
        text(&o).contains("/nonexistent/m.gguf") && text(&o).contains("fetch-model.sh"),
        "{}",
        text(&o)
    );
    std::fs::create_dir(&out).unwrap();
    let o = kvreplay(&["capture", "--model", m, "--prompt", "hi", "--out", o_s]);
    assert!(
        text(&o).contains("already exists") && text(&o).contains("--force"),
        "{}",
        text(&o)
    );
    let o = kvreplay(&[
        "capture", "--model", m, "--prompt", "hi", "--out", o_s, "--force",
    ]);
    assert!(
        text(&o).contains("is not a trace; refusing to overwrite"),
        "{}",
        text(&o)
    );
}
