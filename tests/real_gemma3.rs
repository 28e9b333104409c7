//! Gemma 3 270M (GGUF Q4_K_M) through the `kvreplay` binary: the capture
//! matches an independent f32 implementation (scripts/reference_gemma3.py,
//! with the `sentencepiece` package as the tokenizer). Skips with a printed
//! reason when the model is absent; fails instead under
//! KVREPLAY_REQUIRE_MODEL=1 (scripts/test.sh fetches it).

use std::path::Path;

mod common;

use common::{gemma3_model, kvreplay, python, text, ROOT};

/// A prompt longer than Gemma 3's 512-token window, so that the sliding
/// layers' mask cuts keys off: numbered sentences (no two alike), with a pass
/// key early on, asked for at the end.
fn long_prompt() -> String {
    let subjects = [
        "The river",
        "A small bird",
        "The old clock",
        "Every lantern",
        "The baker's cat",
    ];
    let verbs = ["watched", "followed", "remembered", "counted", "ignored"];
    let objects = [
        "the northern hills",
        "seven red boats",
        "a quiet market",
        "the winter stars",
        "an open window",
    ];
    let mut s = String::from("Remember this: the pass key is 40213. ");
    for i in 0..32 {
        s.push_str(&format!(
            "Sentence {i}: {} {} {} near house {}. ",
            subjects[i % 5],
            verbs[(i / 5) % 5],
            objects[(i * 3) % 5],
            100 + 7 * i
        ));
    }
    s.push_str("What is the pass key? The pass key is");
    s
}

#[test]
fn gemma3_capture_matches_independent_reference() {
    let (Some(model), Some(python)) = (gemma3_model(), python()) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let prompt = tmp.path().join("prompt.txt");
    std::fs::write(&prompt, long_prompt()).unwrap();
    let out = tmp.path().join("g.kvtrace");
    let m = model.to_str().unwrap();
    let o = kvreplay(&[
        "capture",
        "--model",
        m,
        "--device",
        "cpu",
        "--prompt-file",
        prompt.to_str().unwrap(),
        "--decode",
        "8",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "capture failed:\n{}", text(&o));
    println!("{}", text(&o));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let p = manifest["tokens"]["prompt_len"].as_u64().unwrap();
    assert!(
        p > 512,
        "the prompt is {p} tokens, not longer than the window"
    );
    let layers = manifest["model"]["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 18);
    for (l, la) in layers.iter().enumerate() {
        if l % 6 == 5 {
            assert!(la["window"].is_null(), "layer {l}: {la}");
            assert_eq!(la["rope_theta"], 1e6, "layer {l}");
        } else {
            assert_eq!(la["window"], 512, "layer {l}");
            assert_eq!(la["rope_theta"], 1e4, "layer {l}");
        }
    }
    // verify recomputes o with each layer's window
    let o = kvreplay(&["verify", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify failed:\n{}", text(&o));
    println!("{}", text(&o));
    // replay refuses sliding-window layers rather than computing them wrong
    let r = tmp.path().join("r");
    let o = kvreplay(&[
        "replay",
        "--trace",
        out.to_str().unwrap(),
        "--policy",
        "snapkv",
        "--budget",
        "64",
        "--out",
        r.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // sliding layers keep their 512-entry window (zero error, 512 entries of
    // 2 x 256 f16 per KV head); the full-attention layers (l % 6 == 5) are compressed
    let csv = std::fs::read_to_string(r.join("metrics.csv")).unwrap();
    let mut seen = 0;
    for line in csv.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let (layer, rel_l2, bytes): (usize, f64, u64) = (
            f[2].parse().unwrap(),
            f[4].parse().unwrap(),
            f[8].parse().unwrap(),
        );
        if layer % 6 == 5 {
            assert!(
                rel_l2 > 0.0 && bytes == 64 * 2 * 256 * 2 + 8 * 2 * 256 * 2,
                "{line}"
            );
        } else {
            assert!(rel_l2 == 0.0 && bytes == 512 * 2 * 256 * 2, "{line}");
        }
        seen += 1;
    }
    assert_eq!(
        seen,
        18 * 4,
        "every (layer, head) of the 18 layers and 4 heads"
    );
    let o = common::python_cmd(&python)
        .arg(Path::new(ROOT).join("scripts/reference_gemma3.py"))
        .args([
            "--model",
            m,
            "--trace",
            out.to_str().unwrap(),
            "--prompt-file",
            prompt.to_str().unwrap(),
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
fn gemma3_tokenizer_known_answer() {
    let Some(model) = gemma3_model() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("t.kvtrace");
    let o = kvreplay(&[
        "capture",
        "--model",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--prompt",
        "The capital of France is",
        "--decode",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let ids: Vec<u64> = manifest["tokens"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(&ids[..6], &[2, 818, 5279, 529, 7001, 563]);
}

/// The default suite's prompts (plain text: the base model has no chat
/// template) and strings with control pieces and whitespace runs give the
/// same ids as the `sentencepiece` package (with added-token splitting) in
/// scripts/reference_gemma3.py.
#[test]
fn gemma3_suite_prompts_tokenize_like_sentencepiece() {
    let (Some(model_path), Some(python)) = (gemma3_model(), python()) else {
        return;
    };
    let model = kvreplay_capture::Model::load(&model_path).unwrap();
    assert!(
        !model.tokenizer.has_chat_template(),
        "the base Gemma 3 270M GGUF was expected to carry no chat template"
    );
    let mut items = Vec::new();
    for (name, spec) in kvreplay_capture::tasks::default_suite() {
        let text = kvreplay_capture::tasks::build(&spec, &model).unwrap().text;
        let (ids, _, _) = kvreplay_capture::tasks::prepare(&spec, &model, false).unwrap();
        assert_eq!(ids, model.tokenizer.encode(&text).unwrap());
        items.push(serde_json::json!({ "name": name, "text": text, "ids": ids }));
    }
    for (i, text) in [
        "The capital of France is",
        "two  spaces,   three, and a tab\there\n\n\nthree newlines",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        "<table><tr><td>cell</td></tr></table> and ünïcödé ✓ 🚀",
    ]
    .iter()
    .enumerate()
    {
        let ids = model.tokenizer.encode(text).unwrap();
        items.push(serde_json::json!({ "name": format!("text {i}"), "text": text, "ids": ids }));
    }
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("ids.json");
    std::fs::write(&file, serde_json::to_string(&items).unwrap()).unwrap();
    let o = common::python_cmd(&python)
        .arg(Path::new(ROOT).join("scripts/reference_gemma3.py"))
        .args(["--model", model_path.to_str().unwrap(), "--check-ids"])
        .arg(&file)
        .output()
        .unwrap();
    println!("{}", text(&o));
    assert!(
        o.status.success(),
        "ids differ from sentencepiece:\n{}",
        text(&o)
    );
    assert_eq!(text(&o).matches("ids identical").count(), items.len());
}
