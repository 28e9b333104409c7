//! Launch configurations of the CUDA kernels, as plain numbers.
//!
//! Always compiled (no `cuda` feature needed): the CUDA backend
//! (`cuda/mod.rs`) turns these into cudarc `LaunchConfig`s, and the emulated
//! kernel tests (`kernels/tests/emulated.rs`) launch the same kernels on the
//! CPU with the very same configurations.

use crate::{BLOCK, KEY_SPLIT};

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

/// One block of `threads` per (row, head): grid (rows, heads).
pub fn rows_heads(r: usize, heads: usize, threads: u32) -> Launch {
    Launch {
        grid: (r.max(1) as u32, heads.max(1) as u32, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
    }
}

/// `probs_times_v` for (heads, c) rows over n keys of head_dim d: one block
/// per (row, head, run of `KEY_SPLIT` keys), threads over d (a power of two
/// in 32 ..= BLOCK).
pub fn probs_times_v(c: usize, heads: usize, n: usize, d: usize) -> Launch {
    let mut l = rows_heads(c, heads, (d.next_power_of_two() as u32).clamp(32, BLOCK));
    l.grid.2 = n.div_ceil(KEY_SPLIT as usize).max(1) as u32;
    l
}

/// `column_sums` of `m` tracked columns for each of `heads` heads.
pub fn column_sums(m: usize, heads: usize) -> Launch {
    let mut l = grid_1d(m);
    l.grid.1 = heads.max(1) as u32;
    l
}
