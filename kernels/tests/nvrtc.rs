//! Every CUDA kernel source compiles with NVRTC: to PTX for sm_80 and to a
//! CUBIN (real device code) for sm_90. Needs libnvrtc (no GPU): CI fetches
//! it with `scripts/fetch-nvrtc.sh` and sets KVREPLAY_NVRTC_LIB and
//! KVREPLAY_REQUIRE_NVRTC=1, so there a missing library fails the test.
#![cfg(feature = "cuda")] // always on in tests: see the dev-dependency in Cargo.toml

use kvreplay_kernels::cuda::nvrtc::{compile, nvrtc_available, Target, SOURCES};

fn nvrtc_here(test: &str) -> bool {
    match nvrtc_available() {
        Ok(()) => true,
        Err(why) if std::env::var("KVREPLAY_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("{test}: KVREPLAY_REQUIRE_NVRTC=1 but {why}")
        }
        Err(why) => {
            eprintln!("{test}: not run: {why}");
            false
        }
    }
}

fn source(file: &str) -> (&'static str, &'static [&'static str]) {
    let s = SOURCES.iter().find(|s| s.0 == file).expect("source listed");
    (s.1, s.2)
}

fn check_ptx(test: &str, file: &str) {
    if !nvrtc_here(test) {
        return;
    }
    let (src, kernels) = source(file);
    let ptx = String::from_utf8(compile(file, src, Target::Ptx("compute_80")).unwrap()).unwrap();
    assert!(
        ptx.contains(".target sm_80"),
        "{file}: PTX does not target sm_80"
    );
    for k in kernels {
        assert!(
            ptx.contains(&format!(".entry {k}(")),
            "{file}: PTX has no entry {k}"
        );
    }
}

fn check_cubin(test: &str, file: &str) {
    if !nvrtc_here(test) {
        return;
    }
    let (src, kernels) = source(file);
    let bin = compile(file, src, Target::Cubin("sm_90")).unwrap();
    assert_eq!(&bin[..4], b"\x7fELF", "{file}: CUBIN is not an ELF image");
    for k in kernels {
        let sym = format!(".text.{k}");
        assert!(
            bin.windows(sym.len()).any(|w| w == sym.as_bytes()),
            "{file}: CUBIN has no code section for {k}"
        );
    }
}

#[test]
fn nvrtc_layer_ptx_sm80() {
    check_ptx("nvrtc_layer_ptx_sm80", "layer.cu");
}
#[test]
fn nvrtc_layer_cubin_sm90() {
    check_cubin("nvrtc_layer_cubin_sm90", "layer.cu");
}
#[test]
fn nvrtc_attention_ptx_sm80() {
    check_ptx("nvrtc_attention_ptx_sm80", "attention.cu");
}
#[test]
fn nvrtc_attention_cubin_sm90() {
    check_cubin("nvrtc_attention_cubin_sm90", "attention.cu");
}

#[test]
fn nvrtc_compile_error_carries_the_log() {
    if !nvrtc_here("nvrtc_compile_error_carries_the_log") {
        return;
    }
    let e = compile(
        "broken.cu",
        "extern \"C\" __global__ void k() { undefined_thing(); }",
        Target::Ptx("compute_80"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("broken.cu") && e.contains("undefined_thing"),
        "{e}"
    );
}
