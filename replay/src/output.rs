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
}

pub fn summary(trace: &Trace, spec: &PolicySpec, budget: Budget, r: &ReplayResult) -> Summary {
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
        },
        kvreplay_version: env!("CARGO_PKG_VERSION").into(),
    }
}

/// Write metrics.csv, retention.csv and summary.json into `out` (created),
/// each through a temporary name so no file looks complete before it is.
pub fn write(out: &Path, summary: &Summary, r: &ReplayResult) -> Result<(), ReplayError> {
    std::fs::create_dir_all(out).map_err(|e| ReplayError::Io {
        path: out.into(),
        err: e,
    })?;
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
