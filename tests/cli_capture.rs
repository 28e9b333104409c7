//! `kvreplay capture` and global options on bad inputs, through the binary,
//! on a tiny generated model (no real model needed): each must end with a
//! clear message and exit status 1, never a panic, a signal or a hang.

mod common;

use common::{kvreplay, text};
use kvreplay_capture::testing::{tiny_gguf, PLAIN};
use std::path::Path;

/// `kvreplay capture --model MODEL ARGS... --out OUT`, which must fail with
/// exit status 1 and write nothing at OUT; returns what it printed.
fn capture_fails(model: &Path, args: &[&str], out: &Path) -> String {
    let mut a = vec!["capture", "--model", model.to_str().unwrap()];
    a.extend_from_slice(args);
    a.extend(["--out", out.to_str().unwrap()]);
    let o = kvreplay(&a);
    let s = text(&o);
    assert_eq!(o.status.code(), Some(1), "{s}");
    assert!(!out.exists(), "{s}");
    s
}

#[test]
fn threads_beyond_the_cap_are_capped_with_a_warning() {
    // --threads 100000 built a pool of 100,000 threads (over a minute).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cap = cpus.max(256);
    let o = kvreplay(&["--threads", "100000", "policies"]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    assert!(
        s.contains(&format!(
            "--threads 100000 is more than kvreplay can use; using {cap}"
        )),
        "{s}"
    );
    let o = kvreplay(&["--threads", "2", "policies"]);
    assert!(o.status.success() && !text(&o).contains("--threads"));
}

#[test]
fn capture_with_a_decode_length_that_would_wrap_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_gguf(tmp.path(), &PLAIN);
    let out = tmp.path().join("x.kvtrace");
    let s = capture_fails(
        &model,
        &[
            "--prompt",
            "the cat",
            "--decode",
            "18446744073709551613",
            "--device",
            "cpu",
        ],
        &out,
    );
    assert!(
        s.contains("18446744073709551613 more are to be generated")
            && s.contains("context is 64 tokens")
            && !s.contains("panicked"),
        "{s}"
    );
}

#[test]
fn capture_refuses_a_fifo_as_model() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("pipe.gguf");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    // Held open read-write (never blocks on Linux), so a kvreplay that opens
    // the FIFO fails rather than hangs.
    let _held = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fifo)
        .unwrap();
    let out = tmp.path().join("x.kvtrace");
    let s = capture_fails(&fifo, &["--prompt", "the cat"], &out);
    assert!(
        s.contains("pipe.gguf") && s.contains("a FIFO (named pipe), not a regular file"),
        "{s}"
    );
}

#[test]
fn capture_refuses_a_prompt_file_that_is_not_a_regular_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_gguf(tmp.path(), &PLAIN);
    let out = tmp.path().join("x.kvtrace");
    let s = capture_fails(&model, &["--prompt-file", "/dev/null"], &out);
    assert!(
        s.contains("/dev/null: the prompt file is a character device, not a regular file"),
        "{s}"
    );
}
