//! A weight matrix that a device backend may mirror in device memory.

use std::borrow::Cow;
use std::ops::Deref;
use std::sync::OnceLock;

use crate::cpu::QuantMatrix;

/// A weight in host memory: f32, or GGUF-quantised blocks ([`QuantMatrix`])
/// that the CPU kernels multiply by without an f32 copy. With the `cuda`
/// feature, a device copy (f32) is made on first use by the CUDA backend and
/// freed with the weight.
///
/// Derefs to an f32 slice; for a quantised weight that dequantises the whole
/// matrix once and keeps it (for callers that need f32, such as tests). The
/// CPU forward pass never does: it uses [`Weight::quant`], [`Weight::len`]
/// and [`Weight::to_f32`], and a test checks that no f32 copy was made.
pub struct Weight {
    repr: Repr,
    #[cfg(feature = "cuda")]
    pub(crate) dev: OnceLock<cudarc::driver::CudaSlice<f32>>,
}

enum Repr {
    F32(Vec<f32>),
    Quant {
        q: QuantMatrix,
        f32: OnceLock<Vec<f32>>,
    },
}

impl Weight {
    pub fn new(data: Vec<f32>) -> Weight {
        Weight::with(Repr::F32(data))
    }

    /// A quantised (rows, cols) weight, kept as blocks.
    pub fn quantized(q: QuantMatrix) -> Weight {
        Weight::with(Repr::Quant {
            q,
            f32: OnceLock::new(),
        })
    }

    fn with(repr: Repr) -> Weight {
        Weight {
            repr,
            #[cfg(feature = "cuda")]
            dev: OnceLock::new(),
        }
    }

    /// The blocks of a quantised weight (None for f32).
    pub fn quant(&self) -> Option<&QuantMatrix> {
        match &self.repr {
            Repr::F32(_) => None,
            Repr::Quant { q, .. } => Some(q),
        }
    }

    /// Elements (without dequantising).
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::F32(v) => v.len(),
            Repr::Quant { q, .. } => q.rows() * q.cols(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The weight as f32: borrowed when it is f32, else dequantised into a
    /// new vector that is not kept (unlike `Deref`).
    pub fn to_f32(&self) -> Cow<'_, [f32]> {
        match &self.repr {
            Repr::F32(v) => Cow::Borrowed(v),
            Repr::Quant { q, f32 } => match f32.get() {
                Some(v) => Cow::Borrowed(v),
                None => Cow::Owned(q.to_f32()),
            },
        }
    }

    /// Whether a quantised weight has been dequantised and kept through
    /// `Deref` (always false for f32 weights).
    pub fn has_f32_copy(&self) -> bool {
        matches!(&self.repr, Repr::Quant { f32, .. } if f32.get().is_some())
    }

    /// Host bytes this weight holds (its blocks or its f32 values, plus a
    /// kept f32 copy).
    pub fn host_bytes(&self) -> usize {
        match &self.repr {
            Repr::F32(v) => 4 * v.len(),
            Repr::Quant { q, f32 } => q.data().len() + f32.get().map_or(0, |v| 4 * v.len()),
        }
    }
}

impl From<Vec<f32>> for Weight {
    fn from(v: Vec<f32>) -> Weight {
        Weight::new(v)
    }
}

impl From<QuantMatrix> for Weight {
    fn from(q: QuantMatrix) -> Weight {
        Weight::quantized(q)
    }
}

impl Deref for Weight {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.repr {
            Repr::F32(v) => v,
            Repr::Quant { q, f32 } => f32.get_or_init(|| q.to_f32()),
        }
    }
}

impl Clone for Weight {
    /// Clones the host data; the copy makes its own device mirror when used.
    fn clone(&self) -> Weight {
        match &self.repr {
            Repr::F32(v) => Weight::new(v.clone()),
            Repr::Quant { q, .. } => Weight::quantized(q.clone()),
        }
    }
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.repr {
            Repr::F32(v) => write!(f, "Weight({} f32)", v.len()),
            Repr::Quant { q, .. } => write!(f, "Weight({q:?})"),
        }
    }
}
