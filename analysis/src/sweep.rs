//! Sweeps: every (trace, policy, budget) point, written as `results.csv`
//! (one row per point, layer and head) and `summary.csv` (one row per point).
//!
//! A sweep folder holds `plan.json` (what is swept) and one `points/ID.json`
//! per finished point, each written to a temporary name and renamed, so an
//! interrupted sweep loses nothing it finished and a rerun of the same command
//! does only the missing points. The CSVs are assembled from the point files
//! in plan order, so they are byte-identical however the work was split:
//! resumed, sharded (`--shard i/n`, shards of about equal estimated cost with
//! each trace's points kept together where that balances: [`crate::cost`])
//! and merged, or run in one go. A shard's folder records which shard it is
//! in `shard-I-of-N.json`, so `merge` names the shards still missing.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::cost::{self, Assignment, TraceShape};
use kvreplay_kernels::{Backend, Device};
use kvreplay_replay::{Budget, PolicySpec, ReplayError, TraceReplay};
use kvreplay_traces::{Reads, Trace};

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{0}")]
    Plan(String),
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> SweepError + '_ {
    move |err| SweepError::Io {
        path: path.to_path_buf(),
        err,
    }
}

/// The device of a plan or point file that does not name one: written
/// before devices were recorded, when sweeps ran on the CPU (CUDA was never
/// the default).
pub const DEFAULT_DEVICE: &str = "cpu";

fn default_device() -> String {
    DEFAULT_DEVICE.into()
}

/// What a sweep covers; checked in full before any work starts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Plan {
    /// Trace directories, in the order given.
    pub traces: Vec<PathBuf>,
    /// Policy specs with every default filled in.
    pub policies: Vec<String>,
    /// Budgets, ascending.
    pub budgets: Vec<usize>,
    /// Each trace's content id when planned (sha256 of its manifest, which
    /// records every layer file's sha256): a point's result belongs to the
    /// capture it was computed from, not to the folder's name.
    #[serde(default)]
    pub trace_ids: Vec<String>,
    /// Each trace's shape, for the cost model that splits the plan into shards.
    #[serde(default)]
    pub shapes: Vec<TraceShape>,
    /// Where the points are computed (`cpu`, `cuda`; [`Device::name`]).
    /// Devices give close but not identical results, so a sweep folder holds
    /// one device's: a run, resume, shard or merge with another is refused.
    #[serde(default = "default_device")]
    pub device: String,
}

/// One (trace, policy, budget) point of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    pub trace: usize,
    pub policy: usize,
    pub budget: usize,
}

impl Plan {
    /// Validate everything up front: specs parse, traces open and have decode
    /// tokens, names are unique, budgets are positive.
    pub fn new(
        traces: &[PathBuf],
        policies: &[String],
        budgets: &[usize],
    ) -> Result<Plan, SweepError> {
        if traces.is_empty() || policies.is_empty() || budgets.is_empty() {
            return Err(SweepError::Plan(
                "a sweep needs at least one trace, one --policy and one --budget".into(),
            ));
        }
        let mut specs = policies
            .iter()
            .map(|p| Ok(PolicySpec::parse(p)?.canonical()))
            .collect::<Result<Vec<String>, SweepError>>()?;
        // equivalent specs (`h2o`, `h2o:recent=half`) are one policy: plan it once
        let mut seen = std::collections::HashSet::new();
        specs.retain(|s| seen.insert(s.clone()));
        let mut names = std::collections::HashSet::new();
        let mut trace_ids = Vec::with_capacity(traces.len());
        let mut shapes = Vec::with_capacity(traces.len());
        for t in traces {
            // files, headers and shapes now; checksums when a point reads them
            let tr = Trace::open_unverified(t).map_err(ReplayError::from)?;
            trace_ids.push(tr.content_id().to_string());
            let m = &tr.manifest;
            shapes.push(TraceShape {
                n_layers: m.model.n_layers,
                n_heads: m.model.n_heads,
                n_kv_heads: m.model.n_kv_heads,
                head_dim: m.model.head_dim,
                prompt_len: m.prompt_len(),
                total_len: m.tokens.ids.len(),
            });
            if tr.manifest.generation.n_decode == 0 {
                return Err(SweepError::Plan(format!(
                    "{}: has no decode tokens; capture it with --decode N",
                    t.display()
                )));
            }
            if !names.insert(trace_name(t)) {
                return Err(SweepError::Plan(format!(
                    "two traces are named {}; give every trace of a sweep its own name",
                    trace_name(t)
                )));
            }
        }
        if budgets.contains(&0) {
            return Err(SweepError::Plan("budgets must be at least 1".into()));
        }
        // a lean trace lacking the prompt queries a policy reads is refused
        // now, before any point runs
        for t in traces {
            let m = kvreplay_traces::Manifest::read(t).map_err(ReplayError::from)?;
            if !m.is_lean() {
                continue;
            }
            for s in &specs {
                let policy = PolicySpec::parse(s)?.build()?;
                for &b in budgets {
                    kvreplay_replay::check_reads_of(&m, t, policy.as_ref(), Budget::Entries(b))
                        .map_err(|e| SweepError::Plan(format!("policy {s}: {e}")))?;
                }
            }
        }
        let mut b = budgets.to_vec();
        b.sort_unstable();
        b.dedup();
        Ok(Plan {
            traces: traces.to_vec(),
            policies: specs,
            budgets: b,
            trace_ids,
            shapes,
            device: default_device(),
        })
    }

    /// This plan computed on `device` (a new plan is for the CPU).
    pub fn on_device(mut self, device: Device) -> Plan {
        self.device = device.name().into();
        self
    }

    /// The shape of trace `t` for the cost model (a unit shape when the plan
    /// predates recorded shapes).
    fn shape(&self, t: usize) -> TraceShape {
        self.shapes.get(t).copied().unwrap_or(TraceShape {
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 64,
            prompt_len: 1,
            total_len: 1,
        })
    }

    /// Estimated cost of each point, in plan order ([`crate::cost`]).
    pub fn point_costs(&self) -> Vec<u64> {
        self.points()
            .iter()
            .map(|p| cost::point_cost(&self.shape(p.trace), &self.policies[p.policy]))
            .collect()
    }

    /// Estimated budget-independent cost of each trace, paid once per shard.
    pub fn setup_costs(&self) -> Vec<u64> {
        (0..self.traces.len())
            .map(|t| cost::setup_cost(&self.shape(t)))
            .collect()
    }

    /// Which of `count` shards runs each point: balanced by estimated cost,
    /// each trace's points together where that balances. Deterministic.
    pub fn assignment(&self, count: usize) -> Assignment {
        let points: Vec<(usize, u64)> = self
            .points()
            .iter()
            .zip(self.point_costs())
            .map(|(p, c)| (p.trace, c))
            .collect();
        cost::assign(&points, &self.setup_costs(), count)
    }

    /// The points of `shard`, in plan order.
    pub fn shard_points(&self, shard: Shard) -> Vec<Point> {
        self.points_in(&self.assignment(shard.count), shard.index)
    }

    /// The points `a` gives to shard `index`, in plan order.
    pub fn points_in(&self, a: &Assignment, index: usize) -> Vec<Point> {
        self.points()
            .into_iter()
            .zip(&a.shard_of)
            .filter(|(_, s)| **s == index)
            .map(|(p, _)| p)
            .collect()
    }

    /// Estimated cost of the whole plan run once: every point, and each
    /// trace's budget-independent work once.
    pub fn estimated_cost(&self) -> u64 {
        self.point_costs().iter().sum::<u64>() + self.setup_costs().iter().sum::<u64>()
    }

    /// Memory to ask for a run of this plan: twice the largest trace's f32
    /// layers plus 512 MiB, a generous bound (a point on the default suite's
    /// 4,112-token trace peaks at about 920 MB resident, BENCHMARKS.md; this
    /// gives 2.0 GB for it).
    pub fn memory_estimate(&self) -> u64 {
        let largest = (0..self.traces.len())
            .map(|t| self.shape(t).f32_bytes())
            .max()
            .unwrap_or(0);
        2 * largest + (512 << 20)
    }

    /// Whether `other` sweeps the same traces (compared as canonical paths,
    /// so `./a` and `/abs/a` are one trace), policies and budgets.
    pub fn same_sweep(&self, other: &Plan) -> bool {
        self.policies == other.policies && self.budgets == other.budgets && self.same_traces(other)
    }

    /// Whether `other` sweeps the same traces, in the same order (compared
    /// as canonical paths).
    pub fn same_traces(&self, other: &Plan) -> bool {
        let canon = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        self.traces.len() == other.traces.len()
            && self
                .traces
                .iter()
                .zip(&other.traces)
                .all(|(a, b)| a == b || canon(a) == canon(b))
    }

    /// Traces whose content differs between the two plans of one sweep.
    fn changed_traces(&self, old: &Plan) -> Vec<usize> {
        (0..self.traces.len())
            .filter(|&i| old.trace_ids.get(i) != self.trace_ids.get(i))
            .collect()
    }

    pub fn points(&self) -> Vec<Point> {
        let mut v = Vec::new();
        for trace in 0..self.traces.len() {
            for policy in 0..self.policies.len() {
                for &budget in &self.budgets {
                    v.push(Point {
                        trace,
                        policy,
                        budget,
                    });
                }
            }
        }
        v
    }

    /// Stable identifier of a point (file name of its result). A point on
    /// another device than the CPU has another id; a CPU point keeps the id it
    /// had before devices were recorded, so existing sweeps resume.
    pub fn point_id(&self, p: &Point) -> String {
        use sha2::{Digest, Sha256};
        let mut key = format!(
            "{}|{}|{}|{}",
            trace_name(&self.traces[p.trace]),
            self.trace_ids.get(p.trace).map_or("", |s| s.as_str()),
            self.policies[p.policy],
            p.budget
        );
        if self.device != DEFAULT_DEVICE {
            key.push_str(&format!("|device={}", self.device));
        }
        let h = Sha256::digest(key.as_bytes());
        h.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }
}

/// Per plan trace, the share of its full cache that sliding-window layers'
/// windows hold ([`kvreplay_traces::Manifest::window_share`]; 0 for models
/// without sliding layers, and for a trace that can no longer be read).
pub fn window_shares(plan: &Plan) -> Vec<f64> {
    plan.traces
        .iter()
        .map(|t| kvreplay_traces::Manifest::read(t).map_or(0.0, |m| m.window_share()))
        .collect()
}

/// A point's memory as a share of the cache a policy compresses: on a model
/// with sliding-window layers (Gemma 3) the windows' part `window` of the
/// full cache stays as it is by default, so 10% means the windows plus 10%
/// of the rest; without sliding layers, `memory_ratio` itself.
pub fn compressible_share(memory_ratio: f64, window: f64) -> f64 {
    if window == 0.0 {
        memory_ratio
    } else {
        (memory_ratio - window) / (1.0 - window)
    }
}

/// A trace's name in the outputs: its directory name.
pub fn trace_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ResultRow {
    pub trace: String,
    pub policy: String,
    pub budget: usize,
    pub layer: usize,
    pub head: usize,
    pub rel_l2: f64,
    pub cosine: f64,
    pub attn_mass: f64,
    pub kl: f64,
    pub bytes: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SummaryRow {
    pub trace: String,
    pub policy: String,
    pub budget: usize,
    pub rel_l2_mean: f64,
    pub rel_l2_p95: f64,
    pub cosine_mean: f64,
    pub attn_mass_mean: f64,
    pub kl_mean: f64,
    pub bytes: u64,
    pub memory_ratio: f64,
    /// Share of the needle span's positions still represented, over layers
    /// and cache heads; empty when the trace has no `needle` span.
    pub needle_retention: Option<f64>,
    /// The end-to-end KL predicted from the per-layer errors with the
    /// trace's depth-sensitivity profile (`sensitivity.json`, written by
    /// `kvreplay sensitivity` or `kvreplay validate`); empty without one.
    #[serde(default)]
    pub predicted_kl: Option<f64>,
    /// The policy spec with every default filled in.
    pub policy_spec: String,
}

/// Bins of relative prompt position in a point's retention profile.
pub const RETENTION_BINS: usize = 10;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PointResult {
    pub rows: Vec<ResultRow>,
    pub summary: SummaryRow,
    /// Share of the prompt positions of each tenth of the prompt still
    /// represented at the end, over layers and cache heads.
    pub retention: Vec<f64>,
    /// The trace was read without checking its files (`--no-verify`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unverified: bool,
    /// Where it was computed (the plan's device).
    #[serde(default = "default_device")]
    pub device: String,
}

/// A point whose replay failed or gave a non-finite metric: recorded with its
/// reason (a result like any other: reruns keep it) and listed in `failed.csv`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct FailedPoint {
    pub trace: String,
    pub policy: String,
    pub budget: usize,
    pub policy_spec: String,
    pub reason: String,
}

/// What a point file holds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(untagged)]
enum PointFile {
    Done(Box<PointResult>),
    Failed {
        failed: FailedPoint,
        /// Where it was tried (the plan's device).
        #[serde(default = "default_device")]
        device: String,
    },
}

impl PointFile {
    fn device(&self) -> &str {
        match self {
            PointFile::Done(r) => &r.device,
            PointFile::Failed { device, .. } => device,
        }
    }
}

fn read_point(path: &Path) -> Result<Option<PointFile>, SweepError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            SweepError::Plan(format!(
                "{}: unreadable point result ({e}); delete it and rerun the sweep",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SweepError::Io {
            path: path.to_path_buf(),
            err: e,
        }),
    }
}

/// The first non-finite number of a point's results, named.
fn non_finite(r: &PointResult) -> Option<String> {
    for x in &r.rows {
        for (name, v) in [
            ("rel_l2", x.rel_l2),
            ("cosine", x.cosine),
            ("attn_mass", x.attn_mass),
            ("kl", x.kl),
        ] {
            if !v.is_finite() {
                return Some(format!(
                    "{name} is {v} at layer {}, head {}: the policy produced a non-finite cache \
                     (an extreme parameter value?)",
                    x.layer, x.head
                ));
            }
        }
    }
    let s = &r.summary;
    [s.memory_ratio, s.rel_l2_p95]
        .iter()
        .chain(&r.retention)
        .find(|v| !v.is_finite())
        .map(|v| format!("a summary value is {v}"))
}

/// Which points this run does: shard `index` of `count`, as
/// [`Plan::assignment`] splits the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> Result<Shard, String> {
        let bad = || format!("`{s}` is not i/n with 0 <= i < n (e.g. 0/4)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count): (usize, usize) =
            (i.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

/// Write `bytes` to a temporary name unique to this process, then rename:
/// readers and concurrent writers only ever see whole files, and a failed
/// write (a full disk) leaves the previous file as it was.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SweepError> {
    let mut name = std::ffi::OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(name);
    if let Err(e) = std::fs::write(&tmp, bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(path)(e)
    })
}

/// The advisory lock one run holds on a sweep folder (one per shard, so
/// shards may share a folder): released when dropped or when the process dies.
pub struct Lock {
    _file: std::fs::File,
}

/// Take the lock of `out` (or of its shard), refusing if another process holds it.
pub fn lock(out: &Path, shard: Option<Shard>) -> Result<Lock, SweepError> {
    lock_with(out, shard, None)
}

/// [`lock`]; with `wait`, a lock held by another process is waited for
/// (`wait` is told who holds it) instead of refused: a duplicated or
/// requeued shard task then finds the points done and does nothing.
pub fn lock_with(
    out: &Path,
    shard: Option<Shard>,
    wait: Option<&dyn Fn(&str)>,
) -> Result<Lock, SweepError> {
    use std::io::Write;
    std::fs::create_dir_all(out).map_err(io(out))?;
    let name = match shard {
        None => ".lock".to_string(),
        Some(s) => format!(".lock.shard-{}-of-{}", s.index, s.count),
    };
    let path = out.join(name);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(&path))?;
    // A child this process forks (another thread running a command) holds a
    // copy of a lock file it opened until the child execs; a lock that
    // names this very process is such a copy and is gone in a moment.
    let mut tries = 0;
    let taken = loop {
        match file.try_lock() {
            Err(std::fs::TryLockError::WouldBlock)
                if tries < 500
                    && std::fs::read_to_string(&path)
                        .is_ok_and(|h| h.trim() == std::process::id().to_string()) =>
            {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => break r,
        }
    };
    match taken {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let msg = format!(
                "{}: another kvreplay (pid {}) is writing this sweep{}",
                out.display(),
                holder
                    .trim()
                    .parse::<u32>()
                    .map_or("unknown".into(), |p| p.to_string()),
                shard.map_or(String::new(), |s| format!(" shard {}/{}", s.index, s.count)),
            );
            match wait {
                Some(tell) => {
                    tell(&format!("{msg}; waiting for it to finish"));
                    file.lock().map_err(io(&path))?;
                }
                None => {
                    return Err(SweepError::Plan(format!(
                        "{msg}; wait for it to finish or use another --out"
                    )))
                }
            }
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(&path)(e)),
    }
    file.set_len(0).map_err(io(&path))?;
    write!(file, "{}", std::process::id()).map_err(io(&path))?;
    Ok(Lock { _file: file })
}

/// What a shard's folder records about the shard that ran in it
/// (`shard-I-of-N.json`), so `merge` can name missing shards and say how to
/// rerun them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ShardRecord {
    pub shard: Shard,
    /// Points of the plan in this shard.
    pub points: usize,
    /// This shard's estimated cost, and the whole plan's (one setup per trace).
    pub estimated_cost: u64,
    pub plan_estimated_cost: u64,
    /// The command that ran it, as given (for merge's rerun hint).
    #[serde(default)]
    pub command: Vec<String>,
    /// A script that resubmits chosen shards and the merge (`kvreplay slurm`
    /// writes one), to be called with the shard indices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resubmit: Option<String>,
}

fn shard_record_name(s: Shard) -> String {
    format!("shard-{}-of-{}.json", s.index, s.count)
}

/// The shard records in a folder (none for an unsharded run).
pub fn read_shard_records(dir: &Path) -> Result<Vec<ShardRecord>, SweepError> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io(dir))? {
        let e = e.map_err(io(dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("shard-") && name.ends_with(".json") {
            let path = e.path();
            let text = std::fs::read_to_string(&path).map_err(io(&path))?;
            let r: ShardRecord = serde_json::from_str(&text).map_err(|e| {
                SweepError::Plan(format!(
                    "{}: not a shard record ({e}); delete it and rerun that shard",
                    path.display()
                ))
            })?;
            v.push(r);
        }
    }
    v.sort_by_key(|r| (r.shard.count, r.shard.index));
    Ok(v)
}

/// Refuse to run `plan` in `out` if the sweep there (`old`, its plan) was
/// made on another device.
fn check_device(out: &Path, old: &Plan, plan: &Plan) -> Result<(), SweepError> {
    if old.device == plan.device {
        return Ok(());
    }
    Err(SweepError::Plan(format!(
        "{} holds a sweep run on {} (its plan.json), but this run asks for --device {}: \
         devices give close but not identical results, and one sweep folder holds one \
         device's; to resume it use --device {}, or give a new --out for a {} sweep",
        out.display(),
        old.device,
        plan.device,
        old.device,
        plan.device
    )))
}

/// Create `out` for `plan`, or check that it already holds a sweep of the
/// same traces. Returns a notice when the policies or budgets changed (the
/// points both plans share are reused) and one per trace recaptured since the
/// folder was made (its points are invalidated, deleted, and computed again).
fn prepare(out: &Path, plan: &Plan) -> Result<Vec<String>, SweepError> {
    std::fs::create_dir_all(out.join("points")).map_err(io(out))?;
    let path = out.join("plan.json");
    let text = serde_json::to_string_pretty(plan).expect("plan serialises") + "\n";
    let old = match std::fs::read_to_string(&path) {
        Ok(old) if old == text => return Ok(Vec::new()),
        Ok(old) => old,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            write_atomic(&path, text.as_bytes())?;
            return Ok(Vec::new());
        }
        Err(e) => return Err(io(&path)(e)),
    };
    let old: Plan = serde_json::from_str(&old).map_err(|e| {
        SweepError::Plan(format!(
            "{}: not a sweep plan ({e}); use another --out or remove the folder",
            path.display()
        ))
    })?;
    check_device(out, &old, plan)?;
    if !plan.same_traces(&old) {
        return Err(SweepError::Plan(format!(
            "{} holds a sweep of other traces; use another --out or remove it",
            out.display()
        )));
    }
    let mut notices = Vec::new();
    if !plan.same_sweep(&old) {
        // more or other policies or budgets on the same traces: a point's file
        // is named by its (trace, policy, budget), so the finished points the
        // new plan shares are reused as they are
        let (new_points, old_points) = (plan.points(), old.points());
        let kept: std::collections::HashSet<String> =
            new_points.iter().map(|p| plan.point_id(p)).collect();
        let shared = old_points
            .iter()
            .filter(|p| kept.contains(&old.point_id(p)))
            .count();
        notices.push(format!(
            "{}: the sweep's policies or budgets changed ({} points before, {} now, {shared} in both); \
             finished points of both are reused, the CSVs cover the new plan",
            out.display(),
            old_points.len(),
            new_points.len()
        ));
    }
    for i in plan.changed_traces(&old) {
        let mut gone = 0;
        if !old.trace_ids.is_empty() {
            for p in old.points().into_iter().filter(|p| p.trace == i) {
                let f = out
                    .join("points")
                    .join(format!("{}.json", old.point_id(&p)));
                match std::fs::remove_file(&f) {
                    Ok(()) => gone += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io(&f)(e)),
                }
            }
        }
        notices.push(format!(
            "{}: its content changed since this sweep began (recaptured); {gone} of its finished points invalidated, to be computed again",
            plan.traces[i].display()
        ));
    }
    write_atomic(&path, text.as_bytes())?;
    Ok(notices)
}

/// Run one point on `tr`, the replay of the point's trace (kept across the
/// trace's points, so budget-independent work is done once per trace).
fn run_point(plan: &Plan, p: &Point, tr: &TraceReplay) -> Result<PointResult, SweepError> {
    let trace = tr.trace();
    let spec = PolicySpec::parse(&plan.policies[p.policy])?;
    let r = tr.replay_spec(
        &plan.policies[p.policy],
        spec.build()?.as_ref(),
        Budget::Entries(p.budget),
    )?;
    let name = trace_name(&plan.traces[p.trace]);
    let short = spec.short();
    let rows: Vec<ResultRow> = r
        .metrics()
        .map(|h| ResultRow {
            trace: name.clone(),
            policy: short.clone(),
            budget: p.budget,
            layer: h.layer,
            head: h.head,
            rel_l2: h.rel_l2,
            cosine: h.cosine,
            attn_mass: h.attn_mass,
            kl: h.kl,
            bytes: h.bytes,
        })
        .collect();
    let mut errs: Vec<f64> = rows.iter().map(|x| x.rel_l2).collect();
    errs.sort_by(|a, b| kvreplay_replay::select::cmp_f64(*a, *b));
    let p95 = errs[((0.95 * errs.len() as f64).ceil() as usize).clamp(1, errs.len()) - 1];
    // cache heads per layer: KV heads, or query heads for per-query-head policies
    let heads: usize = r
        .layers
        .iter()
        .map(|l| l.retained.iter().map(|x| x.head).max().map_or(0, |m| m + 1))
        .max()
        .unwrap_or(1)
        .max(1);
    let needle = trace
        .manifest
        .spans
        .iter()
        .find(|s| s.name == "needle")
        .filter(|s| s.end > s.start)
        .map(|s| {
            let kept = r
                .layers
                .iter()
                .map(|l| {
                    l.retained
                        .iter()
                        .filter(|x| x.position >= s.start && x.position < s.end)
                        .count()
                })
                .sum::<usize>();
            kept as f64 / ((s.end - s.start) * heads * r.layers.len()) as f64
        });
    let family = kvreplay_replay::policies::family_of(&short);
    // the trace's profile when it fits its model (an unreadable one is an
    // error naming the file, so the point is recorded as failed)
    let profile = kvreplay_traces::Sensitivity::of(trace)
        .map_err(ReplayError::from)?
        .map(|s| r.predicted_kl(&s, family));
    let summary = SummaryRow {
        trace: name,
        policy: short,
        budget: p.budget,
        rel_l2_mean: r.mean(|h| h.rel_l2),
        rel_l2_p95: p95,
        cosine_mean: r.mean(|h| h.cosine),
        attn_mass_mean: r.mean(|h| h.attn_mass),
        kl_mean: r.mean(|h| h.kl),
        bytes: r.bytes(),
        memory_ratio: r.bytes() as f64 / r.full_bytes() as f64,
        needle_retention: needle,
        predicted_kl: profile,
        policy_spec: plan.policies[p.policy].clone(),
    };
    let p_len = trace.manifest.prompt_len();

    let mut bins = [0f64; RETENTION_BINS];
    let mut sizes = [0f64; RETENTION_BINS];
    let bin = |pos: usize| (pos * RETENTION_BINS / p_len).min(RETENTION_BINS - 1);
    for pos in 0..p_len {
        sizes[bin(pos)] += 1.0;
    }
    for l in &r.layers {
        for x in &l.retained {
            bins[bin(x.position)] += 1.0;
        }
    }
    let retention = bins
        .iter()
        .zip(&sizes)
        .map(|(k, n)| k / (n * (heads * r.layers.len()) as f64).max(1.0))
        .collect();
    Ok(PointResult {
        rows,
        summary,
        retention,
        unverified: !trace.verified(),
        device: plan.device.clone(),
    })
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub points: usize,
    pub ran: usize,
    pub reused: usize,
    pub complete: bool,
    /// Points of the whole plan recorded as failed (listed in `failed.csv`).
    pub failed: Vec<FailedPoint>,
    /// What changed since the folder was made: a trace recaptured (its
    /// points redone), or the plan's policies or budgets (shared points reused).
    pub notices: Vec<String>,
}

/// Run the points of `plan` that belong to `shard` and are not done yet, on
/// the CPU with verified reads, then assemble the CSVs from every finished
/// point ([`run_opts`] for every other choice).
pub fn run(
    plan: &Plan,
    out: &Path,
    shard: Option<Shard>,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<RunReport, SweepError> {
    let opts = RunOptions {
        shard,
        ..RunOptions::new(&Backend::Cpu)
    };
    run_opts(plan, out, &opts, progress)
}

/// How [`run_opts`] runs a plan.
pub struct RunOptions<'a> {
    pub shard: Option<Shard>,
    pub backend: &'a Backend,
    pub reads: Reads,
    /// Wait for another process writing this folder (shard) instead of
    /// refusing; told who holds it.
    pub wait: Option<&'a dyn Fn(&str)>,
    /// The command line, recorded in the shard's record.
    pub command: Vec<String>,
    /// A resubmission script, recorded in the shard's record.
    pub resubmit: Option<String>,
    /// Bytes of layer copies a trace's replay keeps between points (None:
    /// half the memory available); beyond it layers stream from the trace.
    /// Results do not depend on it.
    pub max_memory: Option<u64>,
}

impl<'a> RunOptions<'a> {
    /// Every point, on `backend`, verified reads, no waiting, nothing recorded.
    pub fn new(backend: &'a Backend) -> RunOptions<'a> {
        RunOptions {
            shard: None,
            backend,
            reads: Reads::Verified,
            wait: None,
            command: Vec::new(),
            resubmit: None,
            max_memory: None,
        }
    }
}

/// Run a plan as `opts` say: [`run`] with every option.
pub fn run_opts(
    plan: &Plan,
    out: &Path,
    opts: &RunOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<RunReport, SweepError> {
    let (shard, backend, reads) = (opts.shard, opts.backend, opts.reads);
    // a folder of another device is refused first, whatever the backend
    // (prepare checks again under the lock)
    if let Ok(old) = read_plan(out) {
        check_device(out, &old, plan)?;
    }
    if backend.device().name() != plan.device {
        return Err(SweepError::Plan(format!(
            "the plan is for device {} but the backend runs on {}; make the plan with \
             Plan::on_device(backend.device())",
            plan.device,
            backend.device().name()
        )));
    }
    let _lock = lock_with(out, shard, opts.wait)?;
    let notices = prepare(out, plan)?;
    let mine: Vec<Point> = match shard {
        None => plan.points(),
        Some(s) => {
            let a = plan.assignment(s.count);
            let mine = plan.points_in(&a, s.index);
            let record = ShardRecord {
                shard: s,
                points: mine.len(),
                estimated_cost: a.loads[s.index],
                plan_estimated_cost: plan.estimated_cost(),
                command: opts.command.clone(),
                resubmit: opts.resubmit.clone(),
            };
            let text = serde_json::to_string_pretty(&record).expect("record serialises") + "\n";
            write_atomic(&out.join(shard_record_name(s)), text.as_bytes())?;
            mine
        }
    };
    let (mut ran, mut reused) = (0, 0);
    let mut i = 0;
    // Points come in trace order: one open trace (and its replay, which keeps
    // the budget-independent results) per run of points of the same trace,
    // opened only if one of them is still to be computed.
    for run in mine.chunk_by(|a, b| a.trace == b.trace) {
        let trace = std::cell::OnceCell::new();
        let replay = std::cell::OnceCell::new();
        for p in run {
            let path = point_path(out, plan, p);
            let label = format!(
                "{} {} B={}",
                trace_name(&plan.traces[p.trace]),
                plan.policies[p.policy].split(':').next().unwrap_or(""),
                p.budget
            );
            progress(i, mine.len(), &label);
            i += 1;
            if path.exists() {
                reused += 1;
                continue;
            }
            if trace.get().is_none() {
                let t =
                    Trace::open_with(&plan.traces[p.trace], reads).map_err(ReplayError::from)?;
                if plan
                    .trace_ids
                    .get(p.trace)
                    .is_some_and(|id| id != t.content_id())
                {
                    return Err(SweepError::Plan(format!(
                        "{}: recaptured while this sweep runs; rerun the sweep",
                        plan.traces[p.trace].display()
                    )));
                }
                let _ = trace.set(t);
            }
            if replay.get().is_none() {
                let t = trace.get().expect("opened above");
                let _ = replay.set(TraceReplay::new(t, backend)?.with_max_memory(opts.max_memory));
            }
            // a point that cannot be computed is recorded as failed, with
            // its reason, and the sweep goes on
            let file = match run_point(plan, p, replay.get().expect("made above")) {
                Ok(r) => match non_finite(&r) {
                    None => PointFile::Done(Box::new(r)),
                    Some(why) => failed(plan, p, why),
                },
                Err(e) => failed(plan, p, e.to_string()),
            };
            write_atomic(&path, &serde_json::to_vec(&file).expect("point serialises"))?;
            ran += 1;
        }
    }
    progress(mine.len(), mine.len(), "");
    let (complete, failed) = assemble_report(out, plan)?;
    Ok(RunReport {
        points: mine.len(),
        ran,
        reused,
        complete,
        failed,
        notices,
    })
}

fn failed(plan: &Plan, p: &Point, reason: String) -> PointFile {
    let spec = &plan.policies[p.policy];
    PointFile::Failed {
        failed: FailedPoint {
            trace: trace_name(&plan.traces[p.trace]),
            policy: PolicySpec::parse(spec).map_or_else(|_| spec.clone(), |s| s.short()),
            budget: p.budget,
            policy_spec: spec.clone(),
            reason,
        },
        device: plan.device.clone(),
    }
}

fn point_path(out: &Path, plan: &Plan, p: &Point) -> PathBuf {
    out.join("points")
        .join(format!("{}.json", plan.point_id(p)))
}

/// Every point file of the plan, in plan order (`None`: not done yet); one
/// computed on another device than the plan's is refused.
fn point_files(out: &Path, plan: &Plan) -> Result<Vec<Option<PointFile>>, SweepError> {
    plan.points()
        .iter()
        .map(|p| {
            let path = point_path(out, plan, p);
            let f = read_point(&path)?;
            match &f {
                Some(f) if f.device() != plan.device => Err(SweepError::Plan(format!(
                    "{}: computed on {}, but this sweep runs on {}; results of different \
                     devices are not mixed: delete the file and rerun the sweep",
                    path.display(),
                    f.device(),
                    plan.device
                ))),
                _ => Ok(f),
            }
        })
        .collect()
}

/// The finished (not failed) points of a sweep folder, in plan order.
pub fn load_points(out: &Path, plan: &Plan) -> Result<Vec<PointResult>, SweepError> {
    load_results(out, plan).map(|(done, _)| done)
}

/// The finished points and the points recorded as failed, each in plan
/// order, from one read of the point files.
pub fn load_results(
    out: &Path,
    plan: &Plan,
) -> Result<(Vec<PointResult>, Vec<FailedPoint>), SweepError> {
    let (mut done, mut failed) = (Vec::new(), Vec::new());
    for f in point_files(out, plan)?.into_iter().flatten() {
        match f {
            PointFile::Done(r) => done.push(*r),
            PointFile::Failed { failed: f, .. } => failed.push(f),
        }
    }
    Ok((done, failed))
}

/// Write results.csv and summary.csv from the finished points, in plan
/// order, and `failed.csv` when some failed. Returns whether every point of
/// the plan is done (finished or failed).
pub fn assemble(out: &Path, plan: &Plan) -> Result<bool, SweepError> {
    assemble_report(out, plan).map(|(complete, _)| complete)
}

fn assemble_report(out: &Path, plan: &Plan) -> Result<(bool, Vec<FailedPoint>), SweepError> {
    let mut rows = Vec::new();
    let mut summaries = Vec::new();
    let mut failed = Vec::new();
    let mut complete = true;
    for f in point_files(out, plan)? {
        match f {
            Some(PointFile::Done(r)) => {
                rows.extend(r.rows);
                summaries.push(r.summary);
            }
            Some(PointFile::Failed { failed: f, .. }) => failed.push(f),
            None => complete = false,
        }
    }
    write_csv(&out.join("results.csv"), &rows)?;
    write_csv(&out.join("summary.csv"), &summaries)?;
    let path = out.join("failed.csv");
    if failed.is_empty() {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&path)(e)),
            _ => {}
        }
    } else {
        write_csv(&path, &failed)?;
    }
    Ok((complete, failed))
}

fn write_csv<T: Serialize>(path: &Path, rows: &[T]) -> Result<(), SweepError> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in rows {
        w.serialize(r)
            .map_err(|e| SweepError::Plan(format!("{}: {e}", path.display())))?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| SweepError::Plan(format!("{}: {e}", path.display())))?;
    write_atomic(path, &bytes)
}

/// The plan of a sweep folder.
pub fn read_plan(dir: &Path) -> Result<Plan, SweepError> {
    let path = dir.join("plan.json");
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    serde_json::from_str(&text).map_err(|e| {
        SweepError::Plan(format!(
            "{}: not a sweep plan ({e}); is this a folder `kvreplay sweep` wrote?",
            path.display()
        ))
    })
}

/// What `merge` found: whether every point is there and, for a sharded
/// sweep, each shard's state.
#[derive(Clone, Debug, PartialEq)]
pub struct MergeReport {
    pub complete: bool,
    /// Points of the plan, and those still missing.
    pub points: usize,
    pub missing: usize,
    /// Every shard of the split the folders record (empty when none does).
    pub shards: Vec<ShardStatus>,
}

/// One shard of a merged split.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardStatus {
    pub shard: Shard,
    /// The merged folders that ran it (none: no folder of this shard was given).
    pub folders: Vec<PathBuf>,
    pub points: usize,
    /// Its points missing from the merge.
    pub missing: usize,
    /// A recorded way to rerun it (the command of this or another shard).
    pub record: Option<ShardRecord>,
}

impl MergeReport {
    /// The shards with points missing.
    pub fn incomplete(&self) -> impl Iterator<Item = &ShardStatus> {
        self.shards.iter().filter(|s| s.missing > 0)
    }
}

/// Join shard folders of one plan into `out`, exactly what one run writes.
pub fn merge(shards: &[PathBuf], out: &Path) -> Result<MergeReport, SweepError> {
    let first = shards
        .first()
        .ok_or_else(|| SweepError::Plan("merge needs at least one shard folder".into()))?;
    let plan = read_plan(first)?;
    for s in &shards[1..] {
        let other = read_plan(s)?;
        if other.device != plan.device {
            return Err(SweepError::Plan(format!(
                "{} ran on {} but {} ran on {}: a merge joins the shards of one device \
                 (their results are close, not identical); merge each device's shards into \
                 its own --out, or rerun the {} shards with --device {}",
                first.display(),
                plan.device,
                s.display(),
                other.device,
                other.device,
                plan.device
            )));
        }
        if !other.same_sweep(&plan) {
            return Err(SweepError::Plan(format!(
                "{} and {} are shards of different sweeps",
                first.display(),
                s.display()
            )));
        }
        if let Some(&i) = other.changed_traces(&plan).first() {
            return Err(SweepError::Plan(format!(
                "{} and {} ran on different captures of {}; rerun the stale shard",
                first.display(),
                s.display(),
                plan.traces[i].display()
            )));
        }
    }
    // which shards the folders hold: one split, or none recorded
    let mut records: Vec<(PathBuf, ShardRecord)> = Vec::new();
    for s in shards {
        for r in read_shard_records(s)? {
            if let Some((d, other)) = records.iter().find(|(_, o)| o.shard.count != r.shard.count) {
                return Err(SweepError::Plan(format!(
                    "{} holds shard {}/{} but {} holds shard {}/{}: merge the folders of one split",
                    d.display(),
                    other.shard.index,
                    other.shard.count,
                    s.display(),
                    r.shard.index,
                    r.shard.count
                )));
            }
            records.push((s.clone(), r));
        }
    }
    let _lock = lock(out, None)?;
    prepare(out, &plan)?;
    for s in shards {
        let dir = s.join("points");
        for e in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let e = e.map_err(io(&dir))?;
            let name = e.file_name();
            let name_str = name.to_string_lossy();
            // whole point files only (not another process's temporary name)
            if name_str.ends_with(".json") && !name_str.starts_with('.') {
                let dst = out.join("points").join(&name);
                if !dst.exists() {
                    let bytes = std::fs::read(e.path()).map_err(io(&e.path()))?;
                    write_atomic(&dst, &bytes)?;
                }
            }
        }
    }
    let complete = assemble(out, &plan)?;
    let points = plan.points();
    let done: Vec<bool> = points
        .iter()
        .map(|p| {
            out.join("points")
                .join(format!("{}.json", plan.point_id(p)))
                .exists()
        })
        .collect();
    let missing = done.iter().filter(|d| !**d).count();
    let mut statuses = Vec::new();
    if let Some((_, r0)) = records.first() {
        let count = r0.shard.count;
        let a = plan.assignment(count);
        for index in 0..count {
            let mine: Vec<usize> = (0..points.len())
                .filter(|&k| a.shard_of[k] == index)
                .collect();
            let own: Vec<&(PathBuf, ShardRecord)> = records
                .iter()
                .filter(|(_, r)| r.shard.index == index)
                .collect();
            statuses.push(ShardStatus {
                shard: Shard { index, count },
                folders: own.iter().map(|(d, _)| d.clone()).collect(),
                points: mine.len(),
                missing: mine.iter().filter(|&&k| !done[k]).count(),
                record: own
                    .first()
                    .map(|(_, r)| r.clone())
                    .or_else(|| Some(r0.clone())),
            });
        }
    }
    Ok(MergeReport {
        complete,
        points: points.len(),
        missing,
        shards: statuses,
    })
}
