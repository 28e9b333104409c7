//! Compute kernels for kvreplay.
//!
//! `cpu` holds the reference implementation of every operation capture and
//! replay need. `cuda` (feature `cuda`) holds NVRTC-compiled twins of them,
//! each checked by a parity test (`kernels/tests/parity.rs`). Callers open a
//! [`Backend`] from a [`DeviceRequest`] (`--device cpu|cuda|auto`) and run
//! every operation through it.
//!
//! Invariant: kernels know nothing of models, traces or policies; they take
//! slices with shapes written in their doc comments.
//!
//! Determinism: every kernel gives bit-identical results for any number of
//! rayon threads (work is split into fixed-size blocks, never by thread count).

mod backend;
mod buf;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod launch;
mod resident;
mod weight;

pub use backend::{Backend, DeviceRequest, Opened};
pub use buf::{transfers, AttnShape, Buf};
pub use weight::Weight;

/// Threads per block of every CUDA kernel that reduces across a block
/// (`block_max`/`block_sum` in `cuda/prelude.cuh`). Defined here only: NVRTC
/// gets it as `-DBLOCK=...`, and the launchers use this constant, so the two
/// cannot differ. A power of two (the tree reductions halve it).
pub const BLOCK: u32 = 256;
const _: () = assert!(BLOCK.is_power_of_two());

/// Queries per block of the attention's column sums: each block's rows are
/// added (in order, from zero) into a part that is then added to the column
/// sum, blocks in order, on the CPU (`cpu::attention`, which also splits its
/// work into blocks of this many queries) and in the CUDA `column_sums`.
/// Passed to NVRTC as `-DATTN_ROWS=...`.
pub const ATTN_ROWS: u32 = 32;

/// Keys per split of the CUDA attention's product with v (`probs_times_v`):
/// partial sums over fixed runs of keys, added in order by `sum_splits`.
/// Passed to NVRTC as `-DKEY_SPLIT=...`.
pub const KEY_SPLIT: u32 = 64;

/// Where kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// The requested device cannot be used here (no driver, GPU or NVRTC).
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("unsupported tensor type {0}")]
    UnsupportedType(String),
}
