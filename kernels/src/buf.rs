//! [`Buf`], an f32 buffer where the backend computes; [`AttnShape`]; and the
//! per-thread count of host-device [`transfers`]. A leaf module: the
//! operations on buffers are in `resident.rs`.

use std::cell::Cell;

/// An f32 buffer on the backend's device.
pub enum Buf {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Dev(cudarc::driver::CudaSlice<f32>, usize),
}

impl Buf {
    pub fn len(&self) -> usize {
        match self {
            Buf::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Buf::Dev(_, n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn host(&self) -> &[f32] {
        match self {
            Buf::Host(v) => v,
            #[cfg(feature = "cuda")]
            Buf::Dev(..) => unreachable!("a device buffer reached the CPU backend"),
        }
    }

    pub(crate) fn host_mut(&mut self) -> &mut [f32] {
        match self {
            Buf::Host(v) => v,
            #[cfg(feature = "cuda")]
            Buf::Dev(..) => unreachable!("a device buffer reached the CPU backend"),
        }
    }
}

impl Clone for Buf {
    /// A copy on the same device (device-to-device for CUDA; panics only if
    /// the device runs out of memory, as cudarc's clone does).
    fn clone(&self) -> Buf {
        match self {
            Buf::Host(v) => Buf::Host(v.clone()),
            #[cfg(feature = "cuda")]
            Buf::Dev(s, n) => Buf::Dev(s.clone(), *n),
        }
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Buf::Host(v) => write!(f, "Buf::Host({} f32)", v.len()),
            #[cfg(feature = "cuda")]
            Buf::Dev(_, n) => write!(f, "Buf::Dev({n} f32)"),
        }
    }
}

/// Host-device transfers made by this thread through the resident API.
pub mod transfers {
    use super::Cell;

    thread_local! {
        static COUNTS: Cell<Transfers> = const { Cell::new(Transfers { to_device: 0, to_host: 0 }) };
    }

    /// Counts of transfers (calls, not bytes).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Transfers {
        pub to_device: u64,
        pub to_host: u64,
    }

    impl std::ops::Sub for Transfers {
        type Output = Transfers;
        fn sub(self, o: Transfers) -> Transfers {
            Transfers {
                to_device: self.to_device - o.to_device,
                to_host: self.to_host - o.to_host,
            }
        }
    }

    /// This thread's counts so far.
    pub fn now() -> Transfers {
        COUNTS.with(|c| c.get())
    }

    pub(crate) fn to_device() {
        COUNTS.with(|c| {
            let mut t = c.get();
            t.to_device += 1;
            c.set(t)
        });
    }

    pub(crate) fn to_host() {
        COUNTS.with(|c| {
            let mut t = c.get();
            t.to_host += 1;
            c.set(t)
        });
    }
}

/// The shape of one layer's attention in [`Backend::attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// New positions (queries) in this call.
    pub c: usize,
    /// Position of the first query; keys 0 .. pos0 + c are attended.
    pub pos0: usize,
    /// Positions the cache holds per KV head (its second dimension).
    pub cap: usize,
    pub head_dim: usize,
    pub scale: f32,
}
