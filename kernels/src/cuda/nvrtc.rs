//! Run-time compilation of the CUDA C sources with NVRTC (no GPU needed).
//!
//! cudarc loads `libnvrtc` with the system's dlopen search. To use a library
//! that is not on that path (e.g. unpacked from the `nvidia-cuda-nvrtc-cu12`
//! wheel), set `KVREPLAY_NVRTC_LIB` to the absolute path of `libnvrtc.so.12`:
//! it is opened first, and cudarc's later dlopen of the same soname reuses it.

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use crate::KernelError;

const PRELUDE: &str = include_str!("prelude.cuh");

/// Every kernel source: (file name, CUDA C, the kernels it defines).
pub const SOURCES: &[(&str, &str, &[&str])] = &[
    (
        "layer.cu",
        include_str!("layer.cu"),
        &[
            "embedding",
            "rms_norm",
            "silu_mul",
            "gelu_tanh_mul",
            "scale_inplace",
            "rope",
            "add_inplace",
            "transpose_heads",
            "linear_tiled",
        ],
    ),
    (
        "attention.cu",
        include_str!("attention.cu"),
        &[
            "causal_softmax",
            "probs_times_v",
            "sum_splits",
            "column_sums",
            "attend_biased",
            "attention_rows",
        ],
    ),
];

/// What a compile produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// PTX text for a virtual architecture, e.g. "compute_80".
    Ptx(&'static str),
    /// Device code (SASS in an ELF) for a real architecture, e.g. "sm_90".
    Cubin(&'static str),
}

/// Whether libnvrtc can be loaded: Ok, or why not (and what to do).
pub fn nvrtc_available() -> Result<(), String> {
    static PRELOAD: OnceLock<Result<(), String>> = OnceLock::new();
    PRELOAD
        .get_or_init(|| {
            if let Ok(p) = std::env::var("KVREPLAY_NVRTC_LIB") {
                use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
                // SAFETY: loading a shared library runs its initialisers;
                // libnvrtc's are benign. The handle is kept for the process.
                let lib = unsafe { Library::open(Some(&p), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
                    format!("KVREPLAY_NVRTC_LIB={p} could not be loaded ({e}); point it at libnvrtc.so.12")
                })?;
                std::mem::forget(lib);
            }
            Ok(())
        })
        .clone()?;
    // SAFETY: only probes whether the library can be dlopen'ed.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err("libnvrtc (libnvrtc.so.13 or .so.12) was not found: install the CUDA runtime compiler (e.g. `pip install nvidia-cuda-nvrtc-cu12`, or `scripts/fetch-nvrtc.sh`) and set KVREPLAY_NVRTC_LIB to its libnvrtc.so.*, or add its folder to LD_LIBRARY_PATH".into())
    }
}

/// Compile one source (the prelude is prepended) for `target`, with
/// `--fmad=false` so products and sums round as on the CPU.
pub fn compile(name: &str, src: &str, target: Target) -> Result<Vec<u8>, KernelError> {
    nvrtc_available().map_err(KernelError::Unavailable)?;
    let full = format!("{PRELUDE}\n#line 1 \"{name}\"\n{src}");
    let err = |what: &str, e: String| KernelError::Cuda(format!("NVRTC {what} of {name}: {e}"));
    let c_src = CString::new(full).map_err(|e| err("source", e.to_string()))?;
    let c_name = CString::new(name).map_err(|e| err("name", e.to_string()))?;
    let prog = result::create_program(&c_src, Some(&c_name))
        .map_err(|e| err("create", format!("{e:?}")))?;
    let arch = match target {
        Target::Ptx(a) | Target::Cubin(a) => a,
    };
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_string(),
        "--std=c++14".to_string(),
        format!("-DBLOCK={}", crate::BLOCK),
        format!("-DKEY_SPLIT={}", crate::KEY_SPLIT),
        format!("-DATTN_ROWS={}", crate::ATTN_ROWS),
    ];
    // SAFETY: `prog` was created above and is destroyed exactly once below.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let res = match compiled {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> =
                            l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(err("compile", format!("{e:?} (options {opts:?})\n{log}")))
            }
            Ok(()) => match target {
                Target::Ptx(_) => result::get_ptx(prog)
                    .map(|p| p.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect())
                    .map_err(|e| err("get_ptx", format!("{e:?}"))),
                Target::Cubin(_) => {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .map_err(|e| err("cubin size", format!("{e:?}")))
                        .and_then(|()| {
                            let mut buf = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                                .result()
                                .map(|()| buf)
                                .map_err(|e| err("get cubin", format!("{e:?}")))
                        })
                }
            },
        };
        let _ = result::destroy_program(prog);
        res
    }?;
    if out.is_empty() {
        return Err(err("output", format!("empty output for {target:?}")));
    }
    Ok(out)
}
