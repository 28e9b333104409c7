//! Launch configurations of the CUDA kernels, as plain numbers.
//!
//! Always compiled (no `cuda` feature needed): the CUDA backend
//! (`cuda/mod.rs`) turns these into cudarc `LaunchConfig`s, and the emulated
//! kernel tests (`kernels/tests/emulated.rs`) launch the same kernels on the
//! CPU with the very same configurations.

use crate::BLOCK;

/// Threads per block of `probs_times_v` (it loops over `d` with `blockDim.x`).
pub const PV_THREADS: u32 = 128;

/// Side of `linear_tiled`'s square output tiles (`TILE` in `layer.cu`).
pub const TILE: u32 = 16;

/// Grid, block and dynamic shared memory of one kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// One thread per element of `n`, `BLOCK` threads per block (at least one
/// block, so an empty launch is still valid).
pub fn grid_1d(n: usize) -> Launch {
    Launch {
        grid: (n.div_ceil(BLOCK as usize).max(1) as u32, 1, 1),
        block: (BLOCK, 1, 1),
        shared_bytes: 0,
    }
}

/// One block of `threads` per row of `r` (at least one block).
pub fn rows(r: usize, threads: u32) -> Launch {
    Launch {
        grid: (r.max(1) as u32, 1, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
    }
}

/// `linear_tiled` for an (m, n) output: one `TILE`×`TILE` block per tile.
pub fn tiles(m: usize, n: usize) -> Launch {
    Launch {
        grid: (
            n.div_ceil(TILE as usize) as u32,
            m.div_ceil(TILE as usize) as u32,
            1,
        ),
        block: (TILE, TILE, 1),
        shared_bytes: 0,
    }
}
