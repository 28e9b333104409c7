//! Compute kernels for kvreplay.
//!
//! `cpu` holds the reference implementation of every operation capture and
//! replay need. A CUDA backend (its own issue) will add a `cuda` module whose
//! every function has its twin here and a parity test against it; callers
//! select a backend through [`Device`].
//!
//! Invariant: kernels know nothing of models, traces or policies; they take
//! slices with shapes written in their doc comments.
//!
//! Determinism: every kernel gives bit-identical results for any number of
//! rayon threads (work is split into fixed-size blocks, never by thread count).

pub mod cpu;

/// Where kernels run. Only the CPU exists in this build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("unsupported tensor type {0}")]
    UnsupportedType(String),
}
