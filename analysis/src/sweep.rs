//! Sweeps: every (trace, policy, budget) point, written as `results.csv`
//! (one row per point, layer and head) and `summary.csv` (one row per point).
//!
//! A sweep folder holds `plan.json` (what is swept) and one `points/ID.json`
//! per finished point, each written to a temporary name and renamed, so an
//! interrupted sweep loses nothing it finished and a rerun of the same command
//! does only the missing points. The CSVs are assembled from the point files
//! in plan order, so they are byte-identical however the work was split:
//! resumed, sharded (`--shard i/n`, point k belongs to shard k mod n) and
//! merged, or run in one go.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use kvreplay_kernels::Backend;
use kvreplay_replay::{Budget, PolicySpec, ReplayError, TraceReplay};
use kvreplay_traces::Trace;

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("{0}")]
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

/// What a sweep covers; checked in full before any work starts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Plan {
    /// Trace directories, in the order given.
    pub traces: Vec<PathBuf>,
    /// Policy specs with every default filled in.
    pub policies: Vec<String>,
    /// Budgets, ascending.
    pub budgets: Vec<usize>,
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
        for t in traces {
            let tr = Trace::open(t).map_err(ReplayError::from)?;
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
        let mut b = budgets.to_vec();
        b.sort_unstable();
        b.dedup();
        Ok(Plan {
            traces: traces.to_vec(),
            policies: specs,
            budgets: b,
        })
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

    /// Stable identifier of a point (file name of its result).
    pub fn point_id(&self, p: &Point) -> String {
        use sha2::{Digest, Sha256};
        let key = format!(
            "{}|{}|{}",
            trace_name(&self.traces[p.trace]),
            self.policies[p.policy],
            p.budget
        );
        let h = Sha256::digest(key.as_bytes());
        h.iter().take(8).map(|b| format!("{b:02x}")).collect()
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
}

/// Which points this run does: point k belongs to shard k mod count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SweepError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Create `out` for `plan`, or check that it already holds the same plan.
fn prepare(out: &Path, plan: &Plan) -> Result<(), SweepError> {
    std::fs::create_dir_all(out.join("points")).map_err(io(out))?;
    let path = out.join("plan.json");
    let text = serde_json::to_string_pretty(plan).expect("plan serialises") + "\n";
    match std::fs::read_to_string(&path) {
        Ok(old) if old == text => Ok(()),
        Ok(_) => Err(SweepError::Plan(format!(
            "{} holds a different sweep (traces, policies or budgets differ); use another --out or remove it",
            out.display()
        ))),
        Err(_) => write_atomic(&path, text.as_bytes()),
    }
}

/// Run one point on `tr`, the replay of the point's trace (kept across the
/// trace's points, so budget-independent work is done once per trace).
fn run_point(plan: &Plan, p: &Point, tr: &TraceReplay) -> Result<PointResult, SweepError> {
    let trace = tr.trace();
    let spec = PolicySpec::parse(&plan.policies[p.policy])?;
    let r = tr.replay(spec.build()?.as_ref(), Budget::Entries(p.budget))?;
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
    })
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub points: usize,
    pub ran: usize,
    pub reused: usize,
    pub complete: bool,
}

/// Run the points of `plan` that belong to `shard` and are not done yet, then
/// assemble the CSVs from every finished point.
pub fn run(
    plan: &Plan,
    out: &Path,
    shard: Option<Shard>,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<RunReport, SweepError> {
    run_on(plan, out, shard, &Backend::Cpu, progress)
}

/// [`run`] with attention computed on `backend`.
pub fn run_on(
    plan: &Plan,
    out: &Path,
    shard: Option<Shard>,
    backend: &Backend,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<RunReport, SweepError> {
    prepare(out, plan)?;
    let mine: Vec<Point> = plan
        .points()
        .into_iter()
        .enumerate()
        .filter(|(k, _)| shard.is_none_or(|s| k % s.count == s.index))
        .map(|(_, p)| p)
        .collect();
    let (mut ran, mut reused) = (0, 0);
    let mut i = 0;
    // Points come in trace order: one open trace (and its replay, which keeps
    // the budget-independent results) per run of points of the same trace,
    // opened only if one of them is still to be computed.
    for run in mine.chunk_by(|a, b| a.trace == b.trace) {
        let trace = std::cell::OnceCell::new();
        let replay = std::cell::OnceCell::new();
        for p in run {
            let path = out
                .join("points")
                .join(format!("{}.json", plan.point_id(p)));
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
                let t = Trace::open(&plan.traces[p.trace]).map_err(ReplayError::from)?;
                let _ = trace.set(t);
            }
            if replay.get().is_none() {
                let t = trace.get().expect("opened above");
                let _ = replay.set(TraceReplay::new(t, backend)?);
            }
            let r = run_point(plan, p, replay.get().expect("made above"))?;
            write_atomic(&path, &serde_json::to_vec(&r).expect("point serialises"))?;
            ran += 1;
        }
    }
    progress(mine.len(), mine.len(), "");
    let complete = assemble(out, plan)?;
    Ok(RunReport {
        points: mine.len(),
        ran,
        reused,
        complete,
    })
}

/// The finished points of a sweep folder, in plan order.
pub fn load_points(out: &Path, plan: &Plan) -> Result<Vec<PointResult>, SweepError> {
    let mut v = Vec::new();
    for p in plan.points() {
        let path = out
            .join("points")
            .join(format!("{}.json", plan.point_id(&p)));
        if let Ok(bytes) = std::fs::read(&path) {
            v.push(serde_json::from_slice(&bytes).map_err(|e| {
                SweepError::Plan(format!(
                    "{}: unreadable point result ({e}); delete it and rerun the sweep",
                    path.display()
                ))
            })?);
        }
    }
    Ok(v)
}

/// Write results.csv and summary.csv from the finished points, in plan order.
/// Returns whether every point of the plan is done.
pub fn assemble(out: &Path, plan: &Plan) -> Result<bool, SweepError> {
    let mut rows = Vec::new();
    let mut summaries = Vec::new();
    let mut complete = true;
    for p in plan.points() {
        let path = out
            .join("points")
            .join(format!("{}.json", plan.point_id(&p)));
        match std::fs::read(&path) {
            Ok(bytes) => {
                let r: PointResult = serde_json::from_slice(&bytes).map_err(|e| {
                    SweepError::Plan(format!(
                        "{}: unreadable point result ({e}); delete it and rerun the sweep",
                        path.display()
                    ))
                })?;
                rows.extend(r.rows);
                summaries.push(r.summary);
            }
            Err(_) => complete = false,
        }
    }
    write_csv(&out.join("results.csv"), &rows)?;
    write_csv(&out.join("summary.csv"), &summaries)?;
    Ok(complete)
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

/// Join shard folders of one plan into `out`, exactly what one run writes.
pub fn merge(shards: &[PathBuf], out: &Path) -> Result<bool, SweepError> {
    let first = shards
        .first()
        .ok_or_else(|| SweepError::Plan("merge needs at least one shard folder".into()))?;
    let read_plan = |d: &Path| -> Result<Plan, SweepError> {
        let path = d.join("plan.json");
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        serde_json::from_str(&text)
            .map_err(|e| SweepError::Plan(format!("{}: {e}", path.display())))
    };
    let plan = read_plan(first)?;
    for s in &shards[1..] {
        if read_plan(s)? != plan {
            return Err(SweepError::Plan(format!(
                "{} and {} are shards of different sweeps",
                first.display(),
                s.display()
            )));
        }
    }
    prepare(out, &plan)?;
    for s in shards {
        let dir = s.join("points");
        for e in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let e = e.map_err(io(&dir))?;
            let name = e.file_name();
            if name.to_string_lossy().ends_with(".json") {
                let dst = out.join("points").join(&name);
                if !dst.exists() {
                    std::fs::copy(e.path(), &dst).map_err(io(&dst))?;
                }
            }
        }
    }
    assemble(out, &plan)
}
