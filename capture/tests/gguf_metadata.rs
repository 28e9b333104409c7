//! Malformed GGUF metadata and tensor tables are refused when the model is
//! loaded, naming the file and the key or tensor; before these checks such a
//! file captured a garbage trace (a NaN epsilon became `null` in the
//! manifest, which no command could open) and exited 0.

use kvreplay_capture::gguf::write::RawTensor;
use kvreplay_capture::gguf::MetaValue;
use kvreplay_capture::testing::{tiny_gguf_bytes, PLAIN};
use kvreplay_capture::Model;

/// Load the tiny model with metadata `key` replaced by `value` (removed when
/// None) and its tensors edited by `tensors`; the error text.
fn load_err(
    key: &str,
    value: Option<MetaValue>,
    tensors: impl FnOnce(&mut Vec<RawTensor>),
) -> String {
    let bytes = tiny_gguf_bytes(&PLAIN, |meta, t| {
        meta.retain(|(k, _)| k != key);
        if let Some(v) = value {
            meta.push((key.to_string(), v));
        }
        tensors(t);
    });
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("edited.gguf");
    std::fs::write(&path, bytes).unwrap();
    match Model::load(&path) {
        Ok(_) => panic!("the model with `{key}` edited was accepted"),
        Err(e) => e.to_string(),
    }
}

fn meta_err(key: &str, value: MetaValue) -> String {
    let shown = format!("{value:?}");
    let e = load_err(key, Some(value), |_| {});
    assert!(
        e.contains("edited.gguf") && e.contains(&format!("`{key}`")),
        "{key} = {shown}: {e}"
    );
    e
}

#[test]
fn rope_freq_base_that_is_zero_negative_or_nan_is_refused() {
    for v in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = meta_err("llama.rope.freq_base", MetaValue::Float(v));
        assert!(e.contains("finite number greater than 0"), "{v}: {e}");
    }
}

#[test]
fn rms_epsilon_that_is_negative_nan_or_zero_is_refused() {
    for v in [-1.0, f64::NAN, 0.0] {
        let e = meta_err(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::Float(v),
        );
        assert!(e.contains("finite number greater than 0"), "{v}: {e}");
    }
}

#[test]
fn linear_rope_scaling_needs_a_positive_factor() {
    let bytes = |factor: f64| {
        tiny_gguf_bytes(&PLAIN, |meta, _| {
            meta.push((
                "llama.rope.scaling.type".into(),
                MetaValue::Str("linear".into()),
            ));
            meta.push(("llama.rope.scaling.factor".into(), MetaValue::Float(factor)));
        })
    };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("scaled.gguf");
    for f in [0.0, -2.0, f64::NAN] {
        std::fs::write(&path, bytes(f)).unwrap();
        let e = Model::load(&path).err().expect("accepted").to_string();
        assert!(
            e.contains("`llama.rope.scaling.factor`") && e.contains("greater than 0"),
            "{f}: {e}"
        );
    }
    std::fs::write(&path, bytes(2.0)).unwrap();
    let m = Model::load(&path).unwrap();
    assert_eq!(m.llama.cfg.rope.linear_factor, 2.0);
}

#[test]
fn zero_counts_are_refused() {
    for key in [
        "llama.block_count",
        "llama.context_length",
        "llama.feed_forward_length",
        "llama.embedding_length",
        "llama.attention.head_count",
        "llama.attention.key_length",
        "llama.rope.dimension_count",
    ] {
        let e = meta_err(key, MetaValue::Uint(0));
        assert!(
            e.contains("at least 1") || e.contains("inconsistent"),
            "{key}: {e}"
        );
    }
}

#[test]
fn optional_metadata_of_the_wrong_type_is_refused_not_defaulted() {
    // these once fell back to a default (10000, "none") or to 0 silently
    for (key, value) in [
        ("llama.rope.freq_base", MetaValue::Str("10000".into())),
        ("llama.rope.scaling.type", MetaValue::Uint(1)),
        ("llama.attention.key_length", MetaValue::Str("8".into())),
        ("llama.rope.dimension_count", MetaValue::Float(8.0)),
        ("llama.vocab_size", MetaValue::Int(-5)),
    ] {
        let e = meta_err(key, value);
        assert!(e.contains("not a") || e.contains("not an"), "{key}: {e}");
    }
    let e = load_err(
        "llama.attention.value_length",
        Some(MetaValue::Uint(4)),
        |_| {},
    );
    assert!(e.contains("equal key and value head sizes"), "{e}");
}

#[test]
fn a_tensor_whose_type_does_not_match_its_bytes_fails_loading_naming_it() {
    // blk.0.ffn_gate holds f32 data; declared F16 it would read half of it
    let e = load_err("general.name", None, |t| {
        let g = t
            .iter_mut()
            .find(|t| t.name == "blk.0.ffn_gate.weight")
            .unwrap();
        g.ggml_type = 1;
    });
    assert!(
        e.contains("edited.gguf")
            && e.contains("tensor `blk.0.ffn_gate.weight`")
            && e.contains("does not match"),
        "{e}"
    );
}
