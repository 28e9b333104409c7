//! Replay outputs: metrics.csv, retention.csv and summary.json.

use serde::Serialize;
use std::path::Path;

use kvreplay_traces::Trace;

use crate::{Budget, PolicySpec, ReplayError, ReplayResult};

#[derive(Serialize)]
struct MetricsRow<'a> {
    policy: &'a str,
    budget: usize,
    layer: usize,
    head: usize,
    rel_l2: f64,
    cosine: f64,
    attn_mass: f64,
    kl: f64,
    bytes: u64,
}

/// Run-level figures, also printed by the CLI.
#[derive(Serialize, Clone, Debug)]
pub struct Summary {
    pub policy: String,
    /// The spec with every default filled in.
    pub policy_spec: String,
    pub budget: usize,
    pub budget_arg: Budget,
    pub rel_l2_mean: f64,
    pub cosine_mean: f64,
    pub attn_mass_mean: f64,
    pub kl_mean: f64,
    pub bytes: u64,
    pub full_bytes: u64,
    pub memory_ratio: f64,
    pub trace: TraceProvenance,
    /// Where the replay was computed: `cpu` or `cuda` (results of the two
    /// are close, not identical).
    pub device: String,
    /// The backend in one line, e.g. "cuda: NVIDIA H100 (sm_90), cuBLAS".
    pub device_detail: String,
    pub kvreplay_version: String,
}

#[derive(Serialize, Clone, Debug)]
pub struct TraceProvenance {
    pub path: String,
    pub model: String,
    pub model_sha256: String,
    pub prompt_len: usize,
    pub n_decode: usize,
    /// sha256 of every layer file, as the manifest records them.
    pub files_sha256: Vec<String>,
    /// sha256 of the trace's manifest.json: names the capture.
    pub content_id: String,
    /// Whether every layer file was checked against `files_sha256` (and for
    /// finite values) when read; false under `--no-verify`.
    pub verified: bool,
}

/// The summary of `r`, the replay of `trace` computed on `backend`.
pub fn summary(
    trace: &Trace,
    spec: &PolicySpec,
    budget: Budget,
    r: &ReplayResult,
    backend: &kvreplay_kernels::Backend,
) -> Summary {
    let m = &trace.manifest;
    Summary {
        policy: spec.short(),
        policy_spec: spec.canonical(),
        budget: r.budget,
        budget_arg: budget,
        rel_l2_mean: r.mean(|h| h.rel_l2),
        cosine_mean: r.mean(|h| h.cosine),
        attn_mass_mean: r.mean(|h| h.attn_mass),
        kl_mean: r.mean(|h| h.kl),
        bytes: r.bytes(),
        full_bytes: r.full_bytes(),
        memory_ratio: r.bytes() as f64 / r.full_bytes() as f64,
        trace: TraceProvenance {
            path: trace.dir().display().to_string(),
            model: m.model.source.file_name.clone(),
            model_sha256: m.model.source.sha256.clone(),
            prompt_len: m.prompt_len(),
            n_decode: m.generation.n_decode,
            files_sha256: m.files.iter().map(|f| f.sha256.clone()).collect(),
            content_id: trace.content_id().to_string(),
            verified: trace.verified(),
        },
        device: backend.device().name().into(),
        device_detail: backend.describe(),
        kvreplay_version: env!("CARGO_PKG_VERSION").into(),
    }
}

/// `OUT.partial`: where [`write`] puts the files before renaming the folder.
pub fn partial_of(out: &Path) -> std::path::PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

/// Refuse an existing `out` unless `force` (call before the work, so none is wasted).
pub fn check_out(out: &Path, force: bool) -> Result<(), ReplayError> {
    if !force && std::fs::symlink_metadata(out).is_ok() {
        return Err(ReplayError::Output {
            path: out.into(),
            msg: "already exists; pass --force to replace it, or choose another --out".into(),
        });
    }
    Ok(())
}

/// Write metrics.csv, retention.csv and summary.json into `OUT.partial/`,
/// then rename it to `out`: a failed or interrupted write leaves no `out`
/// that looks complete, and an existing `out` is replaced only with `force`
/// and only once the new one is whole.
pub fn write(
    out: &Path,
    summary: &Summary,
    r: &ReplayResult,
    force: bool,
) -> Result<(), ReplayError> {
    check_out(out, force)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |err| ReplayError::Io { path, err }
    };
    let partial = partial_of(out);
    if partial.exists() {
        // left by an interrupted run of this command: ours to replace
        std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io(&partial))?;
    if let Err(e) = write_files(&partial, summary, r) {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    if std::fs::symlink_metadata(out).is_ok() {
        let mut old = out.file_name().unwrap_or_default().to_os_string();
        old.push(".replaced");
        let old = out.with_file_name(old);
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(out, &old).map_err(io(out))?;
        std::fs::rename(&partial, out).map_err(io(out))?;
        if old.is_dir() {
            std::fs::remove_dir_all(&old).map_err(io(&old))
        } else {
            std::fs::remove_file(&old).map_err(io(&old))
        }
    } else {
        std::fs::rename(&partial, out).map_err(io(out))
    }
}

fn write_files(out: &Path, summary: &Summary, r: &ReplayResult) -> Result<(), ReplayError> {
    let csv_err = |p: &Path| {
        let p = p.to_path_buf();
        move |e: csv::Error| ReplayError::Csv {
            path: p.clone(),
            err: e,
        }
    };
    let write_csv = |name: &str,
                     f: &dyn Fn(&mut csv::Writer<std::fs::File>) -> Result<(), csv::Error>|
     -> Result<(), ReplayError> {
        let path = out.join(name);
        let tmp = out.join(format!(".{name}.tmp"));
        let mut w = csv::Writer::from_path(&tmp).map_err(csv_err(&tmp))?;
        f(&mut w).map_err(csv_err(&tmp))?;
        w.flush().map_err(|e| ReplayError::Io {
            path: tmp.clone(),
            err: e,
        })?;
        std::fs::rename(&tmp, &path).map_err(|e| ReplayError::Io { path, err: e })
    };
    write_csv("metrics.csv", &|w| {
        for h in r.metrics() {
            w.serialize(MetricsRow {
                policy: &summary.policy,
                budget: r.budget,
                layer: h.layer,
                head: h.head,
                rel_l2: h.rel_l2,
                cosine: h.cosine,
                attn_mass: h.attn_mass,
                kl: h.kl,
                bytes: h.bytes,
            })?;
        }
        Ok(())
    })?;
    write_csv("retention.csv", &|w| {
        w.write_record(["layer", "head", "position", "entry"])?;
        for l in &r.layers {
            for x in &l.retained {
                w.serialize((x.layer, x.head, x.position, x.entry))?;
            }
        }
        Ok(())
    })?;
    let path = out.join("summary.json");
    let tmp = out.join(".summary.json.tmp");
    let text = serde_json::to_string_pretty(summary).expect("summary serialises") + "\n";
    std::fs::write(&tmp, text).map_err(|e| ReplayError::Io {
        path: tmp.clone(),
        err: e,
    })?;
    std::fs::rename(&tmp, &path).map_err(|e| ReplayError::Io { path, err: e })
}
