//! `capture --suite` resumes only traces of the very request (once it kept an
//! existing trace whatever its decode length, dtype or content).

use kvreplay_capture::resume::{differences, Request};
use kvreplay_capture::testing::*;
use kvreplay_capture::{capture, CaptureOptions, Model};
use kvreplay_traces::{Dtype, Span, Trace};

#[test]
fn a_finished_trace_is_kept_only_for_the_request_that_made_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = Model::load(&tiny_gguf(tmp.path(), &PLAIN)).unwrap();
    let out = tmp.path().join("t.kvtrace");
    let mut o = CaptureOptions::new("the cat saw the dogs", &out);
    o.n_decode = 3;
    o.dtype = Dtype::F16;
    o.spans = vec![Span {
        name: "needle".into(),
        start: 1,
        end: 2,
    }];
    capture(&model, &o, &mut |_| {}).unwrap();
    let t = Trace::open(&out).unwrap();
    let ids = model.tokenizer.encode(&o.prompt).unwrap();
    let same = Request {
        model: &model.source,
        prompt_ids: &ids,
        spans: &o.spans,
        n_decode: 3,
        dtype: Dtype::F16,
        device: "cpu",
        keep_queries: None,
    };
    assert!(differences(&t.manifest, &same).is_empty());
    let d = differences(
        &t.manifest,
        &Request {
            n_decode: 16,
            dtype: Dtype::F32,
            ..same
        },
    );
    assert_eq!(d, ["--decode 3 (not 16)", "--dtype f16 (not f32)"]);
    // A suite captured on the CPU is not resumed on CUDA (nor the reverse).
    let d = differences(
        &t.manifest,
        &Request {
            device: "cuda",
            ..same
        },
    );
    assert_eq!(d, ["--device cpu (not cuda)"]);
    // A full trace does not stand for a lean one (nor the reverse).
    let d = differences(
        &t.manifest,
        &Request {
            keep_queries: Some(64),
            ..same
        },
    );
    assert_eq!(d, ["--keep full (not --keep lean --keep-queries 64)"]);
    // A CUDA capture records the GPU's line; the kind is what is compared.
    let mut on_gpu = t.manifest.clone();
    on_gpu.capture.device = "cuda: NVIDIA H100 80GB HBM3 (sm_90), cuBLAS".into();
    let cuda = Request {
        device: "cuda",
        ..same
    };
    assert!(differences(&on_gpu, &cuda).is_empty());
    assert_eq!(differences(&on_gpu, &same), ["--device cuda (not cpu)"]);
    let other: Vec<u32> = ids.iter().rev().copied().collect();
    let d = differences(
        &t.manifest,
        &Request {
            prompt_ids: &other,
            ..same
        },
    );
    assert_eq!(d, ["another prompt"]);
    let d = differences(&t.manifest, &Request { spans: &[], ..same });
    assert_eq!(d, ["another prompt"]);
    let mut src = model.source.clone();
    src.sha256 = "0".repeat(64);
    src.file_name = "other.gguf".into();
    let d = differences(
        &t.manifest,
        &Request {
            model: &src,
            ..same
        },
    );
    assert_eq!(d.len(), 1);
    assert!(d[0].starts_with("model "), "{d:?}");
}
