use std::path::PathBuf;

/// Everything that can go wrong reading, writing or verifying a trace.
/// Every variant names the file (and tensor) involved and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: not a trace directory (no manifest.json); a trace is the folder written by `kvreplay capture`")]
    NotATrace { path: PathBuf },
    #[error("{path}: invalid manifest: {msg}")]
    Manifest { path: PathBuf, msg: String },
    #[error("{path}: format version {found} was written by a newer kvreplay (this build reads up to version {supported}); upgrade kvreplay to read it")]
    NewerVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("{path}: missing layer file for layer {layer}; the trace is incomplete: recapture it with `kvreplay capture`")]
    MissingLayer { path: PathBuf, layer: usize },
    #[error("{path}: file is {actual} bytes, the manifest says {expected}; the file was truncated or replaced: recapture the trace")]
    Size {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path}: sha256 is {actual}, the manifest says {expected}; the file is corrupt (a changed byte): recapture the trace")]
    Checksum {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error("{path}: layer {layer}, head {head}, position {position}: stored `o` differs from attention recomputed from q/k/v (relative L2 error {rel_err:.3e} > {tol:.1e}); the trace is inconsistent: recapture it")]
    Recompute {
        path: PathBuf,
        layer: usize,
        head: usize,
        position: usize,
        rel_err: f64,
        tol: f64,
    },
    #[error("{path}: not a regular file (a FIFO, device or directory); layer files must be the plain files `kvreplay capture` writes")]
    NotAFile { path: PathBuf },
    #[error("{path}: tensor `{tensor}`, layer {layer}, head {head}, position {position} holds {value}; the capture produced a non-finite value (an overflow: recapture with --dtype f32 or bf16), replay cannot use it")]
    NonFinite {
        path: PathBuf,
        tensor: String,
        layer: usize,
        head: usize,
        position: usize,
        value: String,
    },
    #[error("{path}: {msg}")]
    Output { path: PathBuf, msg: String },
    /// The disk holding the output cannot take what is still to be written.
    #[error("{path}: not enough disk space: the trace needs {needed} bytes ({}) but its filesystem has {free} bytes free ({}); free some space or choose another --out on a larger disk", human_bytes(*needed), human_bytes(*free))]
    NoSpace {
        path: PathBuf,
        needed: u64,
        free: u64,
    },
}

/// `12.3 MB`-style size for messages (powers of 1000, one decimal).
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1000.0;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

impl TraceError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TraceError::Io {
            path: path.into(),
            err: source,
        }
    }
}
