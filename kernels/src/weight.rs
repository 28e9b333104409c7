//! A weight matrix that a device backend may mirror in device memory.

use std::ops::Deref;

/// f32 weights in host memory, plus (with the `cuda` feature) a device copy
/// made on first use by the CUDA backend and freed with the weight. Derefs to
/// the host slice, so CPU code reads it as `&[f32]`.
pub struct Weight {
    data: Vec<f32>,
    #[cfg(feature = "cuda")]
    pub(crate) dev: std::sync::OnceLock<cudarc::driver::CudaSlice<f32>>,
}

impl Weight {
    pub fn new(data: Vec<f32>) -> Weight {
        Weight {
            data,
            #[cfg(feature = "cuda")]
            dev: std::sync::OnceLock::new(),
        }
    }
}

impl From<Vec<f32>> for Weight {
    fn from(v: Vec<f32>) -> Weight {
        Weight::new(v)
    }
}

impl Deref for Weight {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.data
    }
}

impl Clone for Weight {
    /// Clones the host data; the copy makes its own device mirror when used.
    fn clone(&self) -> Weight {
        Weight::new(self.data.clone())
    }
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weight({} f32)", self.data.len())
    }
}
