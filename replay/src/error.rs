/// Errors of the replay stage; each says what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("unknown policy `{name}`; run `kvreplay policies` to list them (known: {known})")]
    UnknownPolicy { name: String, known: String },
    #[error("policy `{policy}`: unknown parameter `{key}` (valid: {valid})")]
    UnknownParam {
        policy: String,
        key: String,
        valid: String,
    },
    #[error("policy `{policy}`: parameter `{key}` = `{value}`: {msg}")]
    BadParam {
        policy: String,
        key: String,
        value: String,
        msg: String,
    },
    #[error("policy spec `{spec}`: {msg}")]
    BadSpec { spec: String, msg: String },
    #[error("budget: {0}")]
    BadBudget(String),
    #[error("trace {path}: {msg}")]
    TraceLacks { path: String, msg: String },
    #[error("compute: {0}")]
    Kernel(#[from] kvreplay_kernels::KernelError),
    #[error(transparent)]
    Trace(#[from] kvreplay_traces::TraceError),
    #[error("{path}: {err}")]
    Io {
        path: std::path::PathBuf,
        err: std::io::Error,
    },
    #[error("policy `{policy}` broke the replay contract: {msg} (a bug in the policy; please report it)")]
    Contract { policy: String, msg: String },
    /// A policy defined outside this crate (`py:...`) failed.
    #[error("policy `{policy}`, layer {layer}: {msg}")]
    External {
        policy: String,
        layer: usize,
        msg: String,
    },
    #[error("{path}: {msg}")]
    Output {
        path: std::path::PathBuf,
        msg: String,
    },
    #[error("{path}: writing CSV: {err}")]
    Csv {
        path: std::path::PathBuf,
        err: csv::Error,
    },
}
