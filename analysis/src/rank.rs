//! Policies ranked at matched memory, and the curves the report plots.
//!
//! On each trace, a policy's finished points (one per budget) form a curve of
//! a metric against memory share ([`Curve`], the same interpolation as
//! `kvreplay compare`: linear in memory between the two measured points that
//! bracket a share, no extrapolation). A policy is ranked at a share by the
//! mean over traces of its interpolated error there, with the percentile
//! bootstrap interval of that mean over traces
//! ([`crate::compare::bootstrap_mean_ci`], seeded, so the same folder gives
//! the same bytes). A policy whose measured range misses the share on some
//! trace is not ranked there: it "does not reach" it, and the trace and range
//! are named.

use std::collections::BTreeMap;

use crate::compare::{bootstrap_mean_ci, label, percent, short, Curve};
use crate::sweep::{compressible_share, trace_name, window_shares, Plan, PointResult, SummaryRow};
use kvreplay_replay::info::{Family, Phase};

/// Memory shares of the full cache the report ranks at.
pub const SHARES: [f64; 3] = [0.1, 0.2, 0.5];
/// The share the ranking is ordered by (and the paired comparison is made at).
pub const PRIMARY: f64 = 0.2;
pub const CONFIDENCE: f64 = 0.95;
pub const RESAMPLES: usize = 10_000;
pub const SEED: u64 = 0;

/// A policy's value at one memory share.
#[derive(Clone, Debug, PartialEq)]
pub enum At {
    /// Mean over traces, its bootstrap interval (`None` with one trace), traces.
    Value {
        mean: f64,
        ci: Option<[f64; 2]>,
        traces: usize,
    },
    /// The share is outside the measured range on a trace (or the policy has
    /// no finished point there): why, in words.
    NotReached(String),
}

impl At {
    pub fn mean(&self) -> Option<f64> {
        match self {
            At::Value { mean, .. } => Some(*mean),
            At::NotReached(_) => None,
        }
    }
}

/// One policy's row of the ranking.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The plan's spec, and its label in text.
    pub spec: String,
    pub label: String,
    pub family: String,
    /// One per share of [`Ranking::shares`].
    pub at: Vec<At>,
}

/// Policies ordered by their mean error at [`Ranking::primary`] (those that
/// do not reach it after, by the first other share they reach, then plan order).
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    pub shares: Vec<f64>,
    pub primary: usize,
    pub traces: usize,
    /// Per plan trace, the share of its full cache its sliding-window layers'
    /// windows hold ([`window_shares`]): where any is above 0, shares are of
    /// the cache beyond the windows ([`compressible_share`]).
    pub window: Vec<f64>,
    pub rows: Vec<Row>,
}

/// The x value a curve is drawn against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum X {
    /// `memory_ratio`: bytes as a share of the full cache.
    Memory,
    /// The budget (entries per KV head and layer).
    Budget,
}

/// A policy's curve of `metric` against `x` on each plan trace (`None`
/// where it has no finished point with the metric there), in plan order.
/// Memory is the [`compressible_share`] given each trace's `window` share.
pub fn curves(
    plan: &Plan,
    points: &[PointResult],
    spec: &str,
    x: X,
    window: &[f64],
    metric: &dyn Fn(&SummaryRow) -> Option<f64>,
) -> Vec<(String, Option<Curve>)> {
    plan.traces
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = trace_name(t);
            let w = window.get(i).copied().unwrap_or(0.0);
            let pts: Vec<(f64, f64, usize)> = points
                .iter()
                .map(|p| &p.summary)
                .filter(|s| s.trace == name && s.policy_spec == spec)
                .filter_map(|s| {
                    let xv = match x {
                        X::Memory => compressible_share(s.memory_ratio, w),
                        X::Budget => s.budget as f64,
                    };
                    Some((xv, metric(s)?, s.budget))
                })
                .collect();
            let c = Curve::new(&pts);
            (name, c)
        })
        .collect()
}

/// (x, mean over traces, its 95% t-interval: `None` with one trace).
pub type MeanPoint = (f64, f64, Option<[f64; 2]>);

/// The mean of several traces' curves where all are measured: at every
/// measured x of any of them inside the common range (the mean of
/// piecewise-linear curves is piecewise linear between those), with the 95%
/// t-interval of the mean over traces. `None` without a common range.
pub fn mean_curve(cs: &[&Curve]) -> Option<Vec<MeanPoint>> {
    let lo = cs.iter().map(|c| c.range().0).fold(f64::MIN, f64::max);
    let hi = cs.iter().map(|c| c.range().1).fold(f64::MAX, f64::min);
    if cs.is_empty() || lo > hi {
        return None;
    }
    let mut grid: Vec<f64> = cs
        .iter()
        .flat_map(|c| c.points.iter().map(|p| p.0))
        .filter(|&x| x > lo && x < hi)
        .chain([lo, hi])
        .collect();
    grid.sort_by(f64::total_cmp);
    grid.dedup();
    grid.into_iter()
        .map(|x| {
            let v: Vec<f64> = cs
                .iter()
                .map(|c| c.at(x).map(|a| a.0))
                .collect::<Option<_>>()?;
            Some((x, crate::stats::mean(&v), crate::stats::t_interval95(&v)))
        })
        .collect()
}

/// The family a spec's panel is drawn in: its registry family, eviction
/// split by when it acts; composed specs (`a+b`) apart.
pub fn family(spec: &str) -> String {
    let s = short(spec);
    if s.contains('+') {
        return "composed".into();
    }
    let Some(info) = kvreplay_replay::policies::find(&s) else {
        return "other".into();
    };
    match info.caps.family {
        Family::Eviction => match info.caps.phase {
            Phase::Prefill | Phase::PrefillByDefault => "eviction at prefill".into(),
            _ => "eviction during decode".into(),
        },
        f => f.name().into(),
    }
}

/// Rank the plan's policies at `shares` (ordered by the share nearest
/// [`PRIMARY`]) by their mean relative L2 error.
pub fn rank(plan: &Plan, points: &[PointResult], shares: &[f64]) -> Ranking {
    rank_by(plan, points, shares, &|s| Some(s.rel_l2_mean))
}

/// [`rank`] by another per-point metric (e.g. `predicted_kl`); a policy
/// without the metric on some trace does not reach any share.
pub fn rank_by(
    plan: &Plan,
    points: &[PointResult],
    shares: &[f64],
    metric: &dyn Fn(&SummaryRow) -> Option<f64>,
) -> Ranking {
    let primary = shares
        .iter()
        .enumerate()
        .min_by(|a, b| (a.1 - PRIMARY).abs().total_cmp(&(b.1 - PRIMARY).abs()))
        .map_or(0, |x| x.0);
    let window = window_shares(plan);
    let mut rows: Vec<Row> = plan
        .policies
        .iter()
        .map(|spec| {
            let cs = curves(plan, points, spec, X::Memory, &window, metric);
            let at = shares
                .iter()
                .map(|&m| {
                    let mut v = Vec::new();
                    for (name, c) in &cs {
                        let Some(c) = c else {
                            return At::NotReached(format!("no finished point on {name}"));
                        };
                        match c.at(m) {
                            Some((e, _)) => v.push(e),
                            None => {
                                let (lo, hi) = c.range();
                                return At::NotReached(format!(
                                    "measured from {} to {} on {name}",
                                    percent(lo),
                                    percent(hi)
                                ));
                            }
                        }
                    }
                    At::Value {
                        mean: crate::stats::mean(&v),
                        ci: bootstrap_mean_ci(&v, CONFIDENCE, RESAMPLES, SEED),
                        traces: v.len(),
                    }
                })
                .collect();
            Row {
                spec: spec.clone(),
                label: label(plan, spec),
                family: family(spec),
                at,
            }
        })
        .collect();
    let order: Vec<usize> = std::iter::once(primary)
        .chain((0..shares.len()).filter(|&k| k != primary))
        .collect();
    let key = |r: &Row| {
        order
            .iter()
            .enumerate()
            .find_map(|(o, &k)| r.at[k].mean().map(|m| (o, m)))
            .unwrap_or((usize::MAX, 0.0))
    };
    // stable: ties and unranked policies keep plan order
    rows.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
    });
    Ranking {
        shares: shares.to_vec(),
        primary,
        traces: plan.traces.len(),
        window,
        rows,
    }
}

impl Ranking {
    /// Whether some trace has sliding-window layers.
    pub fn windows(&self) -> bool {
        self.window.iter().any(|w| *w > 0.0)
    }

    /// The row ranked first at the primary share, if any reaches it.
    pub fn best(&self) -> Option<&Row> {
        self.rows
            .first()
            .filter(|r| r.at[self.primary].mean().is_some())
    }

    /// Rank (1-based) of each row at share `k`, `None` where it does not reach it.
    pub fn ranks_at(&self, k: usize) -> Vec<Option<usize>> {
        let mut means: Vec<(usize, f64)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.at[k].mean().map(|m| (i, m)))
            .collect();
        means.sort_by(|a, b| a.1.total_cmp(&b.1));
        let mut out = vec![None; self.rows.len()];
        for (rank, (i, _)) in means.into_iter().enumerate() {
            out[i] = Some(rank + 1);
        }
        out
    }

    /// The ranking as a text table (what `kvreplay compare --rank` prints).
    pub fn to_text(&self) -> String {
        let w = self
            .rows
            .iter()
            .map(|r| r.label.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let share = if self.windows() {
            "share of the full cache beyond the sliding-window layers' windows, which stay as they are"
        } else {
            "share of the full cache"
        };
        let mut s = format!(
            "mean relative L2 error of the attention output at matched memory ({share}), \
             interpolated per trace, mean over {} traces [95% bootstrap CI]; lower is better; \
             ordered by {}\n  {:w$}",
            self.traces,
            percent(self.shares[self.primary]),
            "policy"
        );
        for &m in &self.shares {
            s += &format!("  {:>24}", format!("at {}", percent(m)));
        }
        s += "\n";
        for r in &self.rows {
            s += &format!("  {:w$}", r.label);
            for a in &r.at {
                let cell = match a {
                    At::Value {
                        mean, ci: Some(c), ..
                    } => {
                        format!("{mean:.4} [{:.4}, {:.4}]", c[0], c[1])
                    }
                    At::Value { mean, ci: None, .. } => format!("{mean:.4}"),
                    At::NotReached(_) => "not reached".into(),
                };
                s += &format!("  {cell:>24}");
            }
            s += "\n";
        }
        s
    }
}

/// Traces grouped by task and prompt length (the first part of the trace
/// name, `passkey-0512-d10` -> `passkey`, and the manifest's prompt length),
/// in plan order: (title, plan indices).
pub fn trace_groups(plan: &Plan) -> Vec<(String, Vec<usize>)> {
    let mut groups: BTreeMap<(String, usize), Vec<usize>> = BTreeMap::new();
    for (i, t) in plan.traces.iter().enumerate() {
        let name = trace_name(t);
        let task = name
            .split(['-', '.', '_'])
            .next()
            .unwrap_or(&name)
            .to_string();
        let len = plan.shapes.get(i).map_or(0, |s| s.prompt_len);
        groups.entry((task, len)).or_default().push(i);
    }
    groups
        .into_iter()
        .map(|((task, len), ix)| {
            let title = if ix.len() == 1 {
                format!(
                    "{} ({len}-token prompt)",
                    trace_name(&plan.traces[ix[0]]).trim_end_matches(".kvtrace")
                )
            } else {
                format!("{task}, {len}-token prompt ({} traces)", ix.len())
            };
            (title, ix)
        })
        .collect()
}
