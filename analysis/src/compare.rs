//! Paired comparison of two methods of a sweep at matched memory.
//!
//! Policies do not use equal memory at equal budget, so A and B are compared
//! at equal *memory*: on each trace, each method's finished points (one per
//! budget) form a curve of mean relative L2 error against memory share
//! (`memory_ratio`, bytes as a share of the full cache), and the error at a
//! requested share is interpolated linearly in memory between the two
//! measured points that bracket it. Points at the same memory share are
//! averaged. A share outside a method's measured range on a trace is refused
//! (no extrapolation), naming the trace and the range.
//!
//! The per-trace differences (A - B: negative where A's error is lower) are
//! paired by trace; their mean gets a percentile bootstrap interval over
//! traces (traces resampled with replacement, a seeded splitmix64 generator,
//! one thread), so the same folder, options and seed give the same bytes.
//!
//! Memory shares compared by default: the round shares 5%, 10%, 20%, ...,
//! 90% and 100% that both methods reach on every trace (inside the
//! intersection of their measured ranges); where none is, the midpoint of
//! that intersection.

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

use crate::sweep::{
    compressible_share, load_points, read_plan, trace_name, Plan, PointResult, SweepError,
};
use kvreplay_replay::PolicySpec;

#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error(transparent)]
    Sweep(#[from] SweepError),
    /// A method that is not in the sweep, or names several of its policies.
    #[error("{0}")]
    Method(String),
    /// A memory share outside a method's measured range on a trace.
    #[error("{0}")]
    OutOfRange(String),
    /// Options or data that allow no comparison.
    #[error("{0}")]
    Input(String),
}

/// What to compare.
#[derive(Clone, Debug)]
pub struct Options {
    /// Method A and B: a policy spec or a policy's short name (`snapkv`).
    pub a: String,
    pub b: String,
    /// Memory shares (of the full cache) to compare at; `None`: the default
    /// levels (module docs).
    pub memory: Option<Vec<f64>>,
    /// Level of the bootstrap interval, in (0, 1).
    pub confidence: f64,
    pub resamples: usize,
    pub seed: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            a: String::new(),
            b: String::new(),
            memory: None,
            confidence: 0.95,
            resamples: 10_000,
            seed: 0,
        }
    }
}

/// One trace's interpolated errors at one memory share.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct TraceDiff {
    pub trace: String,
    pub a_error: f64,
    pub b_error: f64,
    /// `a_error - b_error`.
    pub diff: f64,
    /// The budgets whose points bracket the memory share, for A and for B
    /// (equal where a point sits at exactly that share).
    pub a_budgets: [usize; 2],
    pub b_budgets: [usize; 2],
}

/// The comparison at one memory share.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Level {
    /// Share of the full cache.
    pub memory: f64,
    pub traces: Vec<TraceDiff>,
    /// Mean of the per-trace differences (A - B).
    pub mean_diff: f64,
    /// Percentile bootstrap interval of the mean over traces; `None` with one trace.
    pub ci: Option<[f64; 2]>,
    /// Two-sided p-value of the paired sign-flip permutation test of a zero
    /// mean difference (exact over all 2^n sign patterns up to 20 traces);
    /// `None` with one trace. With n traces it cannot fall below 2^(1-n).
    pub p_value: Option<f64>,
    /// Traces where A's error is lower, higher, equal.
    pub a_lower: usize,
    pub a_higher: usize,
    pub ties: usize,
    /// The result in one sentence.
    pub statement: String,
    /// The same paired comparison per (layer, head), each row's `rel_l2`
    /// interpolated at this memory share between the same points as the
    /// trace's mean; only (layer, head) pairs every compared trace has. The
    /// intervals are per head, not adjusted for the number of heads.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub heads: Vec<HeadDiff>,
}

/// The paired comparison of one (layer, head) at one memory share.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct HeadDiff {
    pub layer: usize,
    pub head: usize,
    /// Mean over traces of A's minus B's error of this head.
    pub mean_diff: f64,
    pub ci: Option<[f64; 2]>,
    /// Traces where A's error of this head is lower.
    pub a_lower: usize,
}

/// A measured point: (memory share, error, budget).
type CurvePoint = (f64, f64, usize);

/// Per trace compared: A's and B's curves per (layer, head).
type HeadCurves = BTreeMap<(usize, usize), Curve>;

fn head_level(heads: &[(HeadCurves, HeadCurves)], m: f64, opts: &Options) -> Vec<HeadDiff> {
    let Some((first, _)) = heads.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    'key: for &(layer, head) in first.keys() {
        let mut d = Vec::with_capacity(heads.len());
        for (ha, hb) in heads {
            let at = |h: &HeadCurves| h.get(&(layer, head)).and_then(|c| c.at(m));
            match (at(ha), at(hb)) {
                (Some((ea, _)), Some((eb, _))) => d.push(ea - eb),
                _ => continue 'key,
            }
        }
        out.push(HeadDiff {
            layer,
            head,
            mean_diff: crate::stats::mean(&d),
            ci: bootstrap_mean_ci(&d, opts.confidence, opts.resamples, opts.seed),
            a_lower: d.iter().filter(|&&x| x < 0.0).count(),
        });
    }
    out
}

/// A comparison of two methods of one sweep.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Comparison {
    /// The methods as the sweep names them (full specs) and as the text does.
    pub a: String,
    pub b: String,
    pub a_label: String,
    pub b_label: String,
    pub metric: String,
    pub confidence: f64,
    pub resamples: usize,
    pub seed: u64,
    pub levels: Vec<Level>,
    /// Traces left out (no finished point of a method on them), with why.
    pub skipped: Vec<String>,
}

/// The round memory shares tried by default.
pub const DEFAULT_SHARES: [f64; 11] = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// Shares this close to an end of a measured range count as inside it
/// (a share typed as `0.2` against a ratio computed as 0.2000000000000001).
const EPS: f64 = 1e-9;

/// Compare two methods of the sweep folder `dir` (also a merged one).
pub fn compare(dir: &Path, opts: &Options) -> Result<Comparison, CompareError> {
    let plan = read_plan(dir)?;
    let points = load_points(dir, &plan)?;
    compare_points(&plan, &points, opts)
}

/// A policy's short name: the policy names of its parts, without parameters.
pub fn short(spec: &str) -> String {
    spec.split('+')
        .map(|p| p.split(':').next().unwrap_or(p))
        .collect::<Vec<_>>()
        .join("+")
}

/// The plan's policy spec that `method` names: a spec (exactly, or once
/// defaults are filled in) or a short name only one of its policies has.
pub fn resolve_method(plan: &Plan, method: &str) -> Result<String, CompareError> {
    let method = method.trim();
    if plan.policies.iter().any(|p| p == method) {
        return Ok(method.to_string());
    }
    if let Ok(spec) = PolicySpec::parse(method) {
        let c = spec.canonical();
        if plan.policies.contains(&c) {
            return Ok(c);
        }
    }
    let named: Vec<&String> = plan
        .policies
        .iter()
        .filter(|p| short(p) == method)
        .collect();
    match named.as_slice() {
        [one] => Ok((*one).clone()),
        [] => Err(CompareError::Method(format!(
            "`{method}` is not a policy of this sweep; its policies: {}",
            plan.policies.join(", ")
        ))),
        many => Err(CompareError::Method(format!(
            "`{method}` names {} policies of this sweep ({}); give the full spec",
            many.len(),
            many.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The label of a spec in the text: its short name where no other policy of
/// the plan shares it, else the spec.
pub fn label(plan: &Plan, spec: &str) -> String {
    let s = short(spec);
    if plan.policies.iter().filter(|p| short(p) == s).count() > 1 {
        spec.to_string()
    } else {
        s
    }
}

/// One method's curve on one trace: (memory share, error, budget), by
/// memory, points at equal memory merged (errors averaged, the budget range
/// kept).
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// (memory, error, lowest budget, highest budget) at each distinct memory, ascending.
    pub points: Vec<(f64, f64, usize, usize)>,
}

impl Curve {
    /// The curve of (memory, error, budget) points in any order; `None` if empty.
    pub fn new(pts: &[(f64, f64, usize)]) -> Option<Curve> {
        let mut v = pts.to_vec();
        v.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.2.cmp(&y.2)));
        let mut out: Vec<(f64, f64, usize, usize)> = Vec::new();
        let mut i = 0;
        while i < v.len() {
            let mut j = i;
            while j + 1 < v.len() && v[j + 1].0 == v[i].0 {
                j += 1;
            }
            let run = &v[i..=j];
            let err = run.iter().map(|p| p.1).sum::<f64>() / run.len() as f64;
            out.push((v[i].0, err, run[0].2, run[run.len() - 1].2));
            i = j + 1;
        }
        (!out.is_empty()).then_some(Curve { points: out })
    }

    /// Lowest and highest memory share measured.
    pub fn range(&self) -> (f64, f64) {
        (self.points[0].0, self.points[self.points.len() - 1].0)
    }

    /// Error at memory share `m`, linear in memory between the bracketing
    /// points, with the budgets of those points; `None` outside the range.
    pub fn at(&self, m: f64) -> Option<(f64, [usize; 2])> {
        let (lo, hi) = self.range();
        if !(m >= lo - EPS && m <= hi + EPS) {
            return None;
        }
        let p = &self.points;
        if let Some(x) = p.iter().find(|x| (x.0 - m).abs() <= EPS) {
            return Some((x.1, [x.2, x.3]));
        }
        let k = p.iter().position(|x| x.0 > m)?; // >= 1: m > lo + EPS here
        let (a, b) = (p[k - 1], p[k]);
        let t = (m - a.0) / (b.0 - a.0);
        Some((a.1 + t * (b.1 - a.1), [a.3, b.2]))
    }
}

/// splitmix64: a small, well-known generator (Steele, Lea and Flood 2014).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (multiply-shift; bias below 2^-50 for small n).
    fn below(&mut self, n: usize) -> usize {
        ((self.next() as u128 * n as u128) >> 64) as usize
    }
}

/// Quantile `q` of sorted `v`, linear between order statistics (type 7).
fn quantile(v: &[f64], q: f64) -> f64 {
    let h = (v.len() - 1) as f64 * q;
    let (i, f) = (h.floor() as usize, h - h.floor());
    if i + 1 < v.len() {
        v[i] + f * (v[i + 1] - v[i])
    } else {
        v[i]
    }
}

/// Percentile bootstrap interval at `confidence` of the mean of `x`:
/// `resamples` resamples of `x` with replacement from a generator seeded
/// with `seed`. `None` with fewer than two values.
pub fn bootstrap_mean_ci(
    x: &[f64],
    confidence: f64,
    resamples: usize,
    seed: u64,
) -> Option<[f64; 2]> {
    if x.len() < 2 || resamples == 0 {
        return None;
    }
    let mut rng = SplitMix64(seed);
    let n = x.len();
    let mut means: Vec<f64> = (0..resamples)
        .map(|_| (0..n).map(|_| x[rng.below(n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let alpha = 1.0 - confidence;
    Some([
        quantile(&means, alpha / 2.0),
        quantile(&means, 1.0 - alpha / 2.0),
    ])
}

/// Two-sided p-value of the sign-flip permutation test that the paired
/// differences `x` have mean zero: the share of sign patterns whose |mean| is
/// at least the observed one (a relative 1e-12 slack absorbs rounding). Exact
/// over all 2^n patterns for n <= 20; beyond that `resamples` random patterns
/// from `seed`, counting the observed one. `None` with fewer than two values.
pub fn sign_flip_p(x: &[f64], resamples: usize, seed: u64) -> Option<f64> {
    let n = x.len();
    if n < 2 {
        return None;
    }
    let observed = x.iter().sum::<f64>().abs();
    let slack = 1e-12 * x.iter().map(|v| v.abs()).sum::<f64>();
    let extreme = |signs: u64| {
        let s: f64 = x
            .iter()
            .enumerate()
            .map(|(i, v)| if signs >> i & 1 == 1 { -v } else { *v })
            .sum();
        s.abs() >= observed - slack
    };
    if n <= 20 {
        let total = 1u64 << n;
        let hits = (0..total).filter(|&s| extreme(s)).count();
        Some(hits as f64 / total as f64)
    } else {
        let mut rng = SplitMix64(seed);
        let hits = (0..resamples)
            .filter(|_| {
                let s: f64 = x
                    .iter()
                    .map(|v| if rng.next() & 1 == 1 { -v } else { *v })
                    .sum();
                s.abs() >= observed - slack
            })
            .count();
        Some((hits + 1) as f64 / (resamples + 1) as f64)
    }
}

/// A p-value in words, with the floor n traces allow when that is what it is.
fn p_text(p: f64, traces: usize) -> String {
    let floor = if traces <= 20 {
        2f64.powi(1 - traces as i32)
    } else {
        0.0
    };
    if p <= floor * (1.0 + 1e-9) {
        format!("{p:.3} (the smallest {traces} traces can give)")
    } else {
        format!("{p:.3}")
    }
}

/// `x` with three significant digits at the scale of `scale` (so an interval
/// shares its mean's decimals).
fn num(x: f64, scale: f64) -> String {
    // the scale rounded to three significant digits first, so 0.09999999999999998 reads as 0.100
    let scale: f64 = format!("{:.2e}", scale.abs()).parse().unwrap_or(0.0);
    let d = if scale == 0.0 || !scale.is_finite() {
        3
    } else {
        (2 - scale.log10().floor() as i32).clamp(0, 12) as usize
    };
    let s = format!("{x:.d$}");
    // no "-0.000"
    if s.trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        s.trim_start_matches('-').to_string()
    } else {
        s
    }
}

/// A memory share as a percentage (`20%`, `12.5%`).
pub fn percent(m: f64) -> String {
    let s = format!("{:.2}", m * 100.0);
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}%")
}

fn statement(c: &Comparison, l: &Level, traces: usize) -> String {
    let pl = |n: usize| if n == 1 { "trace" } else { "traces" };
    let mut s = format!(
        "{}'s error is lower than {}'s at {} of the full cache on {} of {} {}",
        c.a_label,
        c.b_label,
        percent(l.memory),
        l.a_lower,
        traces,
        pl(traces)
    );
    if l.ties > 0 {
        s += &format!(" ({} tied)", l.ties);
    }
    match l.ci {
        Some([lo, hi]) => {
            let scale = [l.mean_diff, lo, hi]
                .iter()
                .map(|v| v.abs())
                .fold(0.0, f64::max);
            s += &format!(
                "; mean difference {} [{}, {}], {} bootstrap CI over traces",
                num(l.mean_diff, scale),
                num(lo, scale),
                num(hi, scale),
                percent(c.confidence)
            );
            if let Some(p) = l.p_value {
                s += &format!("; paired sign-flip test p = {}", p_text(p, traces));
            }
            s += ".";
        }
        None => {
            s += &format!(
                "; difference {}; with one trace no interval can be computed.",
                num(l.mean_diff, l.mean_diff.abs())
            );
        }
    }
    s
}

/// [`compare`] on a plan and its finished points.
pub fn compare_points(
    plan: &Plan,
    points: &[PointResult],
    opts: &Options,
) -> Result<Comparison, CompareError> {
    if !(opts.confidence > 0.0 && opts.confidence < 1.0) {
        return Err(CompareError::Input(format!(
            "--confidence {} is not between 0 and 1 (e.g. 0.95)",
            opts.confidence
        )));
    }
    if opts.resamples == 0 {
        return Err(CompareError::Input("--resamples must be at least 1".into()));
    }
    let a = resolve_method(plan, &opts.a)?;
    let b = resolve_method(plan, &opts.b)?;
    // memory as a share of what a policy compresses (beyond sliding windows)
    let window = crate::sweep::window_shares(plan);
    let curve = |trace: &str, spec: &str, w: f64| {
        let pts: Vec<(f64, f64, usize)> = points
            .iter()
            .map(|p| &p.summary)
            .filter(|s| s.trace == trace && s.policy_spec == spec)
            .map(|s| {
                (
                    compressible_share(s.memory_ratio, w),
                    s.rel_l2_mean,
                    s.budget,
                )
            })
            .collect();
        Curve::new(&pts)
    };
    // per (layer, head): the curve of that row's rel_l2 over the same points
    let head_curves = |trace: &str, spec: &str, w: f64| -> HeadCurves {
        let mut m: BTreeMap<(usize, usize), Vec<CurvePoint>> = BTreeMap::new();
        for p in points
            .iter()
            .filter(|p| p.summary.trace == trace && p.summary.policy_spec == spec)
        {
            for r in &p.rows {
                m.entry((r.layer, r.head)).or_default().push((
                    compressible_share(p.summary.memory_ratio, w),
                    r.rel_l2,
                    p.summary.budget,
                ));
            }
        }
        m.into_iter()
            .filter_map(|(k, v)| Some((k, Curve::new(&v)?)))
            .collect()
    };
    // (trace, A's curve, B's curve) for traces with points of both methods
    let mut curves = Vec::new();
    let mut skipped = Vec::new();
    let mut heads = Vec::new();
    for (t, &w) in plan.traces.iter().zip(&window) {
        let name = trace_name(t);
        match (curve(&name, &a, w), curve(&name, &b, w)) {
            (Some(ca), Some(cb)) => {
                heads.push((head_curves(&name, &a, w), head_curves(&name, &b, w)));
                curves.push((name, ca, cb));
            }
            (ca, _) => skipped.push(format!(
                "{name}: no finished point of {} (a shard still missing, or failed points?)",
                if ca.is_none() { &a } else { &b }
            )),
        }
    }
    if curves.is_empty() {
        return Err(CompareError::Input(format!(
            "no trace has finished points of both {a} and {b}{}",
            skipped.first().map_or(String::new(), |s| format!(" ({s})"))
        )));
    }
    let levels = match &opts.memory {
        Some(m) if !m.is_empty() => {
            if let Some(x) = m.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(CompareError::Input(format!(
                    "--memory {x}: a memory share must be positive (0.2 is 20% of the full cache)"
                )));
            }
            m.clone()
        }
        _ => {
            // (share, method, trace) where the common range starts and ends
            let ends = |first: bool| {
                let mut best: Option<(f64, &str, &str)> = None;
                for (name, ca, cb) in &curves {
                    for (cu, spec) in [(ca, a.as_str()), (cb, b.as_str())] {
                        let (lo, hi) = cu.range();
                        let x = if first { lo } else { hi };
                        if best.is_none_or(|(y, _, _)| if first { x > y } else { x < y }) {
                            best = Some((x, spec, name.as_str()));
                        }
                    }
                }
                best.expect("a trace")
            };
            let ((lo, ma, ta), (hi, mb, tb)) = (ends(true), ends(false));
            if lo > hi + EPS {
                return Err(CompareError::OutOfRange(format!(
                    "no memory share is measured for both {a} and {b} on every trace: {ma} \
                     starts at {} on {ta}, {mb} ends at {} on {tb}; sweep budgets that \
                     overlap in memory, or compare other methods",
                    percent(lo),
                    percent(hi)
                )));
            }
            let v: Vec<f64> = DEFAULT_SHARES
                .iter()
                .copied()
                .filter(|&m| m >= lo - EPS && m <= hi + EPS)
                .collect();
            if v.is_empty() {
                vec![(lo + hi) / 2.0]
            } else {
                v
            }
        }
    };
    let mut c = Comparison {
        a_label: label(plan, &a),
        b_label: label(plan, &b),
        a,
        b,
        metric: "rel_l2_mean".into(),
        confidence: opts.confidence,
        resamples: opts.resamples,
        seed: opts.seed,
        levels: Vec::new(),
        skipped,
    };
    for &m in &levels {
        let mut traces = Vec::new();
        for (name, ca, cb) in &curves {
            let at = |cu: &Curve, spec: &str| {
                cu.at(m).ok_or_else(|| {
                    let (lo, hi) = cu.range();
                    CompareError::OutOfRange(format!(
                        "{} of the full cache is outside what {spec} was measured at on {name} \
                         ({} to {}); choose --memory within every trace's range, or sweep more \
                         budgets",
                        percent(m),
                        percent(lo),
                        percent(hi)
                    ))
                })
            };
            let (ea, ba) = at(ca, &c.a)?;
            let (eb, bb) = at(cb, &c.b)?;
            traces.push(TraceDiff {
                trace: name.clone(),
                a_error: ea,
                b_error: eb,
                diff: ea - eb,
                a_budgets: ba,
                b_budgets: bb,
            });
        }
        let d: Vec<f64> = traces.iter().map(|t| t.diff).collect();
        let head_diffs = head_level(&heads, m, opts);
        let mut l = Level {
            memory: m,
            mean_diff: crate::stats::mean(&d),
            ci: bootstrap_mean_ci(&d, opts.confidence, opts.resamples, opts.seed),
            p_value: sign_flip_p(&d, opts.resamples, opts.seed),
            a_lower: d.iter().filter(|&&x| x < 0.0).count(),
            a_higher: d.iter().filter(|&&x| x > 0.0).count(),
            ties: d.iter().filter(|&&x| x == 0.0).count(),
            traces,
            heads: head_diffs,
            statement: String::new(),
        };
        l.statement = statement(&c, &l, d.len());
        c.levels.push(l);
    }
    Ok(c)
}

impl Comparison {
    /// The comparison as text: per level, a table of traces and the sentence.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "A = {}\nB = {}\nerror: {} (mean relative L2 error of the attention output), \
             interpolated in memory share; difference A - B (negative: A lower)\n",
            self.a, self.b, self.metric
        );
        for k in &self.skipped {
            s += &format!("skipped {k}\n");
        }
        let w = self
            .levels
            .iter()
            .flat_map(|l| l.traces.iter().map(|t| t.trace.len()))
            .max()
            .unwrap_or(5)
            .max(5);
        for l in &self.levels {
            s += &format!(
                "\nat {} of the full cache\n  {:w$}  {:>10}  {:>10}  {:>11}\n",
                percent(l.memory),
                "trace",
                "A error",
                "B error",
                "A - B"
            );
            for t in &l.traces {
                s += &format!(
                    "  {:w$}  {:>10.6}  {:>10.6}  {:>+11.6}\n",
                    t.trace, t.a_error, t.b_error, t.diff
                );
            }
            s += &format!("  {}\n", l.statement);
            if !l.heads.is_empty() {
                let n = l.heads.len();
                let lower = l.heads.iter().filter(|h| h.mean_diff < 0.0).count();
                let below = l
                    .heads
                    .iter()
                    .filter(|h| h.ci.is_some_and(|c| c[1] < 0.0))
                    .count();
                let above = l
                    .heads
                    .iter()
                    .filter(|h| h.ci.is_some_and(|c| c[0] > 0.0))
                    .count();
                s += &format!(
                    "  per (layer, head): A's mean error is lower on {lower} of {n} heads{}\n",
                    if l.ci.is_some() {
                        format!(
                            "; the interval lies below 0 on {below} and above 0 on {above} \
                             (each {}, not adjusted for {n} comparisons)",
                            percent(self.confidence)
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
        s
    }
}
