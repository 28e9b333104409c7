use std::path::PathBuf;

/// Errors of the capture stage. Each names the file or input involved and
/// what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: not a GGUF model file ({why}); pass a .gguf file such as SmolLM2-135M-Instruct.Q4_1.gguf")]
    NotGguf { path: PathBuf, why: String },
    #[error("{path}: GGUF version {version} is not supported (versions 2 and 3 are); re-convert the model with a current llama.cpp")]
    GgufVersion { path: PathBuf, version: u32 },
    #[error("{path}: corrupt GGUF file: {msg}; re-download or re-convert the model")]
    GgufCorrupt { path: PathBuf, msg: String },
    #[error("{path}: metadata key `{key}` is {problem}")]
    Metadata {
        path: PathBuf,
        key: String,
        problem: String,
    },
    #[error("{path}: architecture `{arch}` is not supported (supported: {supported}); capture a llama-family model")]
    UnsupportedArchitecture {
        path: PathBuf,
        arch: String,
        supported: String,
    },
    #[error("{path}: tensor `{tensor}` has type {type_name}, which kvreplay cannot dequantise (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K); use a file quantised with one of those")]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        type_name: String,
    },
    #[error("{path}: the {what} is {kind}, not a regular file; pass a text file")]
    NotAFile {
        path: PathBuf,
        what: &'static str,
        kind: &'static str,
    },
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error("{path}: field `{field}` is {problem}")]
    Config {
        path: PathBuf,
        field: String,
        problem: String,
    },
    #[error("{path}: unsupported model feature: {msg}")]
    Unsupported { path: PathBuf, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("the prompt is empty; pass some text with --prompt or --prompt-file")]
    EmptyPrompt,
    #[error("the prompt is {prompt} tokens and {decode} more are to be generated, but the model's context is {context} tokens; shorten the prompt or lower --decode")]
    PromptTooLong {
        prompt: usize,
        decode: usize,
        context: usize,
    },
    #[error("{0}")]
    InvalidOption(String),
    #[error("compute: {0}")]
    Kernel(#[from] kvreplay_kernels::KernelError),
    #[error(transparent)]
    Trace(#[from] kvreplay_traces::TraceError),
}

impl CaptureError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CaptureError::Io {
            path: path.into(),
            err: source,
        }
    }
}
