//! `kvreplay verify`: check a trace's sizes and checksums and recompute `o`.

use anyhow::{Context, Result};
use std::path::Path;

use kvreplay_traces::VerifyOptions;

pub(super) fn cmd_verify(dir: &Path, positions: usize) -> Result<()> {
    let opts = VerifyOptions {
        positions_per_layer: positions,
        tolerance: None,
    };
    let r = kvreplay_traces::verify(dir, &opts)
        .with_context(|| format!("verifying trace {}", dir.display()))?;
    println!(
        "ok: {} layer files ({:.1} MB) match their sizes and sha256; o recomputed from q/k/v at {} (layer, head, position) points, max relative L2 error {:.2e} (tolerance {:.0e})",
        r.files_checked,
        r.bytes_checked as f64 / 1e6,
        r.positions_checked,
        r.max_rel_err,
        r.tolerance
    );
    Ok(())
}
