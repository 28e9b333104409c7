//! A trace's depth-sensitivity profile (`sensitivity.json` beside the
//! manifest, optional): per layer, how far a perturbation of that layer's
//! attention outputs during decode moves the model's next-token
//! distribution. `kvreplay sensitivity` measures it with the model (a closed
//! loop); replay turns per-layer output errors into a predicted end-to-end
//! KL with it, without the model. Not covered by the manifest's checksums:
//! it is derived from the model and the trace, and can be remeasured.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::TraceError;

/// File name of the profile inside a trace directory.
pub const SENSITIVITY_FILE: &str = "sensitivity.json";
/// Value of [`Sensitivity::format`].
pub const SENSITIVITY_FORMAT: &str = "kvreplay-sensitivity-1";

/// Per-layer sensitivity of the next-token distribution to the layer's
/// attention outputs, measured on a trace's decode steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sensitivity {
    pub format: String,
    /// sha256 of the model file the profile was measured with (the trace's
    /// `model.source.sha256`).
    pub model_sha256: String,
    /// Relative size ε of the perturbation: each head's output o gets
    /// ε·‖o‖·u, u a random unit vector per (decode step, head).
    pub eps: f64,
    /// Random directions averaged per layer.
    pub draws: usize,
    /// Teacher-forced decode steps the KL is averaged over.
    pub decode_steps: usize,
    /// Per layer: mean KL(full ‖ perturbed) of the next-token distribution
    /// over the decode steps, divided by ε² (the KL a relative error of 1 on
    /// every head of that layer alone would cause, to second order).
    pub per_layer: Vec<f64>,
    /// Per (layer, query head): the same with one head perturbed at a time,
    /// when measured (`kvreplay sensitivity --per-head`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_head: Option<Vec<Vec<f64>>>,
    /// Factor applied to the sum (1: uncalibrated, the second-order
    /// estimate itself; `kvreplay validate --calibrate` writes the overall
    /// factor it fitted on its selection traces).
    pub scale: f64,
    /// Factors per policy family (the families of `kvreplay policies`),
    /// fitted by `kvreplay validate --calibrate`: a family's errors move the
    /// model more or less than random perturbations of the same size (its
    /// errors are more or less coherent). A family without one uses `scale`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub family_scale: std::collections::BTreeMap<String, f64>,
    /// kvreplay version that measured it.
    pub kvreplay_version: String,
}

impl Sensitivity {
    /// The profile of the trace at `dir`, None when it has none.
    pub fn read(dir: &Path) -> Result<Option<Sensitivity>, TraceError> {
        let path = dir.join(SENSITIVITY_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(TraceError::Io { path, err }),
        };
        let bad = |path: PathBuf, msg: String| TraceError::Output {
            path,
            msg: format!("{msg}; remeasure it with `kvreplay sensitivity` or delete the file"),
        };
        let s: Sensitivity = serde_json::from_slice(&bytes)
            .map_err(|e| bad(path.clone(), format!("not a sensitivity profile ({e})")))?;
        if s.format != SENSITIVITY_FORMAT {
            return Err(bad(
                path,
                format!("format `{}`, expected `{SENSITIVITY_FORMAT}`", s.format),
            ));
        }
        if s.per_layer.iter().any(|x| !(x.is_finite() && *x >= 0.0))
            || !(s.scale.is_finite() && s.scale > 0.0)
            || s.family_scale
                .values()
                .any(|x| !(x.is_finite() && *x > 0.0))
        {
            return Err(bad(
                path,
                "holds a negative or non-finite sensitivity or scale".into(),
            ));
        }
        Ok(Some(s))
    }

    /// Whether the profile was measured on this model (`model.source.sha256`)
    /// and has one figure per layer of it: a profile of another model is
    /// not used.
    pub fn fits(&self, model: &crate::ModelInfo) -> bool {
        self.model_sha256 == model.source.sha256 && self.per_layer.len() == model.n_layers
    }

    /// The profile stored with `trace` when it [`fits`](Self::fits) the
    /// trace's own model; None without one or for another model's (it is
    /// not used).
    pub fn of(trace: &crate::Trace) -> Result<Option<Sensitivity>, TraceError> {
        Ok(Sensitivity::read(trace.dir())?.filter(|s| s.fits(&trace.manifest.model)))
    }

    /// Write the profile into the trace at `dir` (a temporary file renamed
    /// into place: never half-written).
    pub fn write(&self, dir: &Path) -> Result<(), TraceError> {
        let path = dir.join(SENSITIVITY_FILE);
        let tmp = dir.join(format!(".{SENSITIVITY_FILE}.{}", std::process::id()));
        let text = serde_json::to_string_pretty(self).expect("a profile serialises");
        std::fs::write(&tmp, text + "\n").map_err(|err| TraceError::Io {
            path: tmp.clone(),
            err,
        })?;
        std::fs::rename(&tmp, &path).map_err(|err| TraceError::Io { path, err })
    }

    /// The calibrated prediction for a policy of `family`:
    /// [`predict_raw`](Self::predict_raw) times the family's factor, or
    /// `scale` without one.
    pub fn predict(&self, family: &str, sq_err: &[f64]) -> f64 {
        self.family_scale.get(family).copied().unwrap_or(self.scale) * self.predict_raw(sq_err)
    }

    /// The second-order estimate of the end-to-end KL of a replay whose
    /// layer l has mean squared relative output error `sq_err[l]` (mean
    /// over heads of the squared per-head rel_l2): Σ_l per_layer[l] ·
    /// sq_err[l], uncalibrated.
    pub fn predict_raw(&self, sq_err: &[f64]) -> f64 {
        assert_eq!(sq_err.len(), self.per_layer.len(), "one error per layer");
        self.per_layer
            .iter()
            .zip(sq_err)
            .map(|(s, e)| s * e)
            .sum::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Sensitivity {
        Sensitivity {
            format: SENSITIVITY_FORMAT.into(),
            model_sha256: "ab".into(),
            eps: 0.2,
            draws: 1,
            decode_steps: 16,
            per_layer: vec![2.0, 0.5, 0.0],
            per_head: None,
            scale: 1.0,
            family_scale: Default::default(),
            kvreplay_version: "0".into(),
        }
    }

    #[test]
    fn profiles_round_trip_and_predict_the_weighted_sum() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Sensitivity::read(dir.path()).unwrap(), None);
        let p = profile();
        p.write(dir.path()).unwrap();
        let back = Sensitivity::read(dir.path()).unwrap().unwrap();
        assert_eq!(back, p);
        // 2·0.01 + 0.5·0.04 + 0·1
        assert!((back.predict_raw(&[0.01, 0.04, 1.0]) - 0.04).abs() < 1e-15);
        let mut cal = back.clone();
        (cal.scale, cal.family_scale) = (3.0, [("merging".to_string(), 10.0)].into());
        cal.write(dir.path()).unwrap();
        let cal = Sensitivity::read(dir.path()).unwrap().unwrap();
        assert!((cal.predict("merging", &[0.01, 0.04, 1.0]) - 0.4).abs() < 1e-15);
        assert!((cal.predict("eviction", &[0.01, 0.04, 1.0]) - 0.12).abs() < 1e-15);
        assert!(!dir
            .path()
            .join(format!(".{SENSITIVITY_FILE}.{}", std::process::id()))
            .exists());
    }

    #[test]
    fn bad_profiles_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = profile();
        p.per_layer[1] = -1.0;
        p.write(dir.path()).unwrap();
        let e = Sensitivity::read(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("sensitivity.json") && e.contains("negative"),
            "{e}"
        );
        std::fs::write(dir.path().join(SENSITIVITY_FILE), "{}").unwrap();
        let e = Sensitivity::read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a sensitivity profile"), "{e}");
    }
}
