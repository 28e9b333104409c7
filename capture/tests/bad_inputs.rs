//! Inputs that once crashed or hung a capture (issue 13, "Reliability"): a
//! full disk, decode lengths that wrap, non-regular model files, task
//! lengths and chat templates without bound. Each must be a clear, typed
//! error that leaves nothing behind, and a previous trace must survive.

use kvreplay_capture::testing::*;
use kvreplay_capture::{capture, CaptureError, CaptureOptions, Model};
use kvreplay_traces::{verify, Dtype, Trace, TraceError, VerifyOptions};
use std::path::{Path, PathBuf};

fn load(dir: &Path, context: u64) -> Model {
    Model::load(&tiny_gguf(dir, &Tweak { context, ..PLAIN })).unwrap()
}

fn err_of(r: Result<impl Sized, CaptureError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn small(out: &Path) -> CaptureOptions {
    let mut o = CaptureOptions::new("the cat saw the 42 dogs", out);
    o.n_decode = 3;
    o.dtype = Dtype::F32;
    o
}

/// A trace of about 11.7 MB on the tiny model: 604 positions with the
/// (n_heads, T, T) f32 attention probabilities of both layers.
fn big(out: &Path) -> CaptureOptions {
    let mut o = CaptureOptions::new("word ".repeat(120), out);
    o.n_decode = 4;
    o.dtype = Dtype::F32;
    o.attn_probs = true;
    o.force = true;
    o
}

/// Names in a folder, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Every file of a trace folder with its bytes.
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    listing(dir)
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect()
}

/// A 5 MiB tmpfs on `tmp/disk`, or None (with the reason printed) where
/// this machine cannot mount one.
fn small_disk(tmp: &Path) -> Option<(PathBuf, TmpfsMount)> {
    let disk = tmp.join("disk");
    std::fs::create_dir(&disk).unwrap();
    match TmpfsMount::mount(&disk, "5M") {
        Ok(m) => Some((disk, m)),
        Err(why) => {
            eprintln!("NOT RUN: cannot fill a disk here: {why}");
            None
        }
    }
}

#[test]
fn capture_into_a_full_disk_is_a_typed_error_naming_bytes_needed_and_free() {
    // Was: SIGBUS (exit 135, no message) from a write through the map of a
    // sparse layer file, leaving OUT.partial behind.
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 2048);
    // The same capture on a roomy disk gives the bytes a full trace takes.
    let roomy = tmp.path().join("roomy.kvtrace");
    capture(&m, &big(&roomy), &mut |_| {}).unwrap();
    let layer_bytes: u64 = Trace::open(&roomy)
        .unwrap()
        .manifest
        .files
        .iter()
        .map(|f| f.size)
        .sum();
    assert!(layer_bytes > 5 << 20, "{layer_bytes}");

    let Some((disk, _mount)) = small_disk(tmp.path()) else {
        return;
    };
    let out = disk.join("big.kvtrace");
    let r = capture(&m, &big(&out), &mut |_| {});
    match &r {
        Err(CaptureError::Trace(TraceError::NoSpace { needed, free, .. })) => {
            assert_eq!(*needed, layer_bytes);
            assert_eq!(*free, 5 << 20, "the empty 5 MiB tmpfs is all free");
        }
        Err(e) => panic!("expected TraceError::NoSpace, got {e}"),
        Ok(_) => panic!("a trace larger than the disk was written"),
    }
    let e = err_of(r);
    assert!(
        e.contains(&format!("needs {layer_bytes} bytes"))
            && e.contains(&format!("{} bytes free", 5 << 20))
            && e.contains(&disk.join("big.kvtrace.partial").display().to_string())
            && e.contains("choose another --out"),
        "{e}"
    );
    assert!(listing(&disk).is_empty(), "left {:?}", listing(&disk));
}

#[test]
fn a_full_disk_keeps_the_previous_trace_under_force() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 2048);
    let Some((disk, _mount)) = small_disk(tmp.path()) else {
        return;
    };
    let out = disk.join("t.kvtrace");
    capture(&m, &small(&out), &mut |_| {}).unwrap();
    let before = contents(&out);
    let e = err_of(capture(&m, &big(&out), &mut |_| {}));
    assert!(e.contains("bytes free"), "{e}");
    assert_eq!(contents(&out), before, "the old trace changed");
    let r = verify(&out, &VerifyOptions::default()).unwrap();
    assert!(r.files_checked == LAYERS && r.max_rel_err < 1e-5, "{r:?}");
    assert_eq!(listing(&disk), ["t.kvtrace"]);
}

#[test]
fn force_replaces_a_trace_whole_and_leaves_no_side_folders() {
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 64);
    let out = tmp.path().join("t.kvtrace");
    capture(&m, &small(&out), &mut |_| {}).unwrap();
    let mut o = small(&out);
    o.prompt = "the 123 dogs".into();
    o.force = true;
    capture(&m, &o, &mut |_| {}).unwrap();
    let t = Trace::open(&out).unwrap();
    assert_eq!(
        t.manifest.tokens.ids[..t.manifest.tokens.prompt_len],
        m.tokenizer.encode("the 123 dogs").unwrap()[..]
    );
    let r = verify(&out, &VerifyOptions::default()).unwrap();
    assert!(r.files_checked == LAYERS && r.max_rel_err < 1e-5, "{r:?}");
    let names: Vec<String> = listing(tmp.path())
        .into_iter()
        .filter(|n| n.contains("kvtrace"))
        .collect();
    assert_eq!(names, ["t.kvtrace"]);
}

#[test]
fn decode_lengths_past_the_context_are_refused_without_wrapping() {
    // --decode 18446744073709551613 wrapped prompt + decode to a few tokens
    // and panicked in the forward pass.
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 64);
    let out = tmp.path().join("x.kvtrace");
    for n in [18446744073709551613usize, usize::MAX, 64] {
        for beyond_context in [false, true] {
            if beyond_context && n == 64 {
                continue; // past the context on purpose (benchmarks): allowed
            }
            let mut o = small(&out);
            o.n_decode = n;
            o.beyond_context = beyond_context;
            let e = err_of(capture(&m, &o, &mut |_| {}));
            assert!(
                e.contains(&format!("{n} more are to be generated"))
                    && e.contains("context is 64 tokens")
                    && e.contains("lower --decode"),
                "{n}: {e}"
            );
        }
    }
    assert!(!out.exists() && !tmp.path().join("x.kvtrace.partial").exists());
}

#[test]
fn forward_past_the_cache_is_an_error_not_a_panic() {
    use kvreplay_capture::llama::{ForwardOptions, KvCache};
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 64);
    let mut cache = KvCache::new(&m.llama.cfg, 4);
    let fo = ForwardOptions {
        colsum: None,
        probs: false,
        attention: None,
    };
    let r = m.llama.forward(&[5, 6], 3, &mut cache, fo, &mut |_| {});
    let e = r
        .expect_err("positions 3..5 do not fit a cache of 4")
        .to_string();
    assert!(
        e.contains("positions 3..5") && e.contains("capacity 4"),
        "{e}"
    );
}

#[test]
fn a_model_that_is_not_a_regular_file_is_refused_before_it_is_opened() {
    // A FIFO as --model blocked forever in open().
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("model.gguf");
    let st = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(st.success());
    // Hold the FIFO open read-write (which never blocks on Linux), so that a
    // capture that does open it fails at once instead of hanging this test.
    let _held = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fifo)
        .unwrap();
    let e = err_of(Model::load(&fifo));
    assert!(
        e.contains("model.gguf") && e.contains("a FIFO (named pipe), not a regular file"),
        "{e}"
    );
    let e = err_of(Model::load(Path::new("/dev/null")));
    assert!(
        e.contains("/dev/null") && e.contains("a character device, not a regular file"),
        "{e}"
    );
}

#[test]
fn task_lengths_past_the_context_are_refused() {
    // passkey:length=100000000000 tokenized filler without end.
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 64);
    let err = |spec: &str| match kvreplay_capture::tasks::build(spec, &m) {
        Ok(_) => panic!("{spec} was accepted"),
        Err(e) => e.to_string(),
    };
    for spec in ["passkey:length=1000", "multifact:length=65,facts=2"] {
        let e = err(spec);
        assert!(
            e.contains(&format!("--task {spec}"))
                && e.contains("the model's context of 64 tokens")
                && e.contains("use length=64 or less"),
            "{spec}: {e}"
        );
    }
    // past any context: refused by the parser before a model is consulted
    let spec = "passkey:length=100000000000,depth=0.5";
    let e = err(spec);
    assert!(
        e.contains(&format!("--task {spec}")) && e.contains("up to 16777216"),
        "{e}"
    );
}

#[test]
fn chat_templates_that_do_not_finish_run_out_of_fuel() {
    // Nested 100,000-step loops in tokenizer.chat_template ran for hours.
    let tmp = tempfile::tempdir().unwrap();
    for chat_template in [
        "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    ] {
        let path = tiny_gguf(
            tmp.path(),
            &Tweak {
                chat_template,
                ..PLAIN
            },
        );
        let m = Model::load(&path).unwrap();
        let e = err_of(m.tokenizer.apply_chat_template("hi"));
        assert!(
            e.contains(&path.display().to_string())
                && e.contains("tokenizer.chat_template")
                && e.contains("steps")
                && e.contains("without --chat"),
            "{e}"
        );
    }
    // An ordinary template still renders.
    let m = Model::load(&tiny_gguf(tmp.path(), &PLAIN)).unwrap();
    assert_eq!(
        m.tokenizer.apply_chat_template("hi").unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn prompt_text_files_that_are_not_regular_files_are_refused() {
    // file:PATH read a FIFO (blocking) or a device (never ending) as text.
    let tmp = tempfile::tempdir().unwrap();
    let m = load(tmp.path(), 64);
    let e = err_of(kvreplay_capture::tasks::build("file:/dev/null", &m));
    assert!(
        e.contains("/dev/null")
            && e.contains("the prompt file is a character device, not a regular file"),
        "{e}"
    );
    let e = err_of(kvreplay_capture::read_text_file(tmp.path(), "prompt file"));
    assert!(
        e.contains("the prompt file is a directory, not a regular file"),
        "{e}"
    );
    std::fs::write(tmp.path().join("p.txt"), "the cat").unwrap();
    assert_eq!(
        kvreplay_capture::read_text_file(&tmp.path().join("p.txt"), "prompt file").unwrap(),
        "the cat"
    );
}
