//! Resuming a batch of captures (`capture --suite`): a finished trace is kept
//! only when it is the trace this request would write.

use kvreplay_traces::{Dtype, Manifest, SourceFile, Span};

/// What a capture is asked to produce.
pub struct Request<'a> {
    pub model: &'a SourceFile,
    pub prompt_ids: &'a [u32],
    pub spans: &'a [Span],
    pub n_decode: usize,
    pub dtype: Dtype,
    /// The device the capture runs on ("cpu" or "cuda"): traces of one
    /// suite come from one device (CUDA's differ from the CPU's in the last
    /// bits, see BENCHMARKS.md, GPU).
    pub device: &'a str,
    /// `Some(N)`: a lean trace keeping the last N prompt queries.
    pub keep_queries: Option<usize>,
}

/// How the trace described by `m` differs from what `req` would capture
/// (model file, prompt and its spans, decode length, dtype, device); empty
/// when it is that trace.
pub fn differences(m: &Manifest, req: &Request) -> Vec<String> {
    let mut v = Vec::new();
    if m.model.source.sha256 != req.model.sha256 {
        v.push(format!(
            "model {} (not {})",
            m.model.source.file_name, req.model.file_name
        ));
    }
    if m.tokens.ids[..m.prompt_len()] != *req.prompt_ids || m.spans != req.spans {
        v.push("another prompt".into());
    }
    if m.generation.n_decode != req.n_decode {
        v.push(format!(
            "--decode {} (not {})",
            m.generation.n_decode, req.n_decode
        ));
    }
    if m.capture.dtype != req.dtype {
        v.push(format!(
            "--dtype {} (not {})",
            m.capture.dtype.name(),
            req.dtype.name()
        ));
    }
    if m.capture.keep_queries != req.keep_queries {
        let keep = |k: Option<usize>| match k {
            None => "--keep full".to_string(),
            Some(n) => format!("--keep lean --keep-queries {n}"),
        };
        v.push(format!(
            "{} (not {})",
            keep(m.capture.keep_queries),
            keep(req.keep_queries)
        ));
    }
    // The manifest records the backend's line ("cuda: NVIDIA H100 ... ");
    // the kind of device is what must match.
    let was = m.capture.device.split(':').next().unwrap_or("").trim();
    if was != req.device {
        v.push(format!("--device {was} (not {})", req.device));
    }
    v
}
