//! The estimated cost of a sweep's points, and how `--shard i/n` splits a
//! plan into shards of about equal cost.
//!
//! Costs are in units of about one nanosecond of one core. A point costs
//! `layers × query heads × head_dim/64 × (per_token × tokens + fixed)`, with
//! the two numbers per policy measured with `kvreplay --threads 1 sweep` on
//! SmolLM2 traces of 1,040 and 2,064 tokens, budgets 32-1,024 (BENCHMARKS.md,
//! "Sharding"): most policies' points cost about the same at any length
//! (their work follows the budget), `full`, D2O and EMS grow with it. A trace
//! also costs its budget-independent work (opening and checking its files,
//! its f32 layers, the full-cache reference), once per shard that runs any of
//! its points.
//!
//! The split is a pure function of the plan (trace shapes, policies, budgets;
//! never paths, clocks or thread counts), in integers, so every shard of an
//! array computes the same assignment and `merge` can name the shard a missing
//! point belongs to. Each trace's points start as one chunk; chunks go,
//! largest first (longest processing time first), to the shard whose load
//! grows least (one that already holds the trace pays no second setup); while
//! the heaviest shard is more than 10% above the mean, the largest chunk on
//! that shard is split in two (contiguous points: a policy's budgets stay
//! together). The best split seen is kept: one within 10% of the mean before
//! one that is not, then the smallest heaviest shard.

use serde::{Deserialize, Serialize};

/// What the cost model needs to know of a trace (recorded in `plan.json`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceShape {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub prompt_len: usize,
    pub total_len: usize,
}

impl TraceShape {
    /// Layers × query heads × head_dim / 64 (at least 1): what every cost scales with.
    fn heads(&self) -> u64 {
        (self.n_layers as u64 * self.n_heads as u64 * self.head_dim as u64 / 64).max(1)
    }

    /// `heads × (per_token × tokens + fixed)`.
    fn cost(&self, c: Cost) -> u64 {
        self.heads() * (c.per_token * self.total_len as u64 + c.fixed)
    }

    /// Bytes of the trace's layers as f32 (q, o per query head; k, v per KV
    /// head), which a replay of it holds in memory.
    pub fn f32_bytes(&self) -> u64 {
        let per_token = (2 * self.n_heads + 2 * self.n_kv_heads) * self.head_dim * 4;
        (self.n_layers * self.total_len * per_token) as u64
    }
}

/// A cost per head: a part per token of the trace and a fixed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cost {
    per_token: u64,
    fixed: u64,
}

const fn c(per_token: u64, fixed: u64) -> Cost {
    Cost { per_token, fixed }
}

/// Each registered policy's point cost per head (see the module comment;
/// measured one thread, averaged over budgets 32-1,024). A policy not listed
/// costs as much as `snapkv`.
const POLICY: &[(&str, Cost)] = &[
    ("full", c(540, 0)),
    ("random", c(0, 263_000)),
    ("streaming_llm", c(0, 296_000)),
    ("h2o", c(0, 244_000)),
    ("snapkv", c(0, 370_000)),
    ("pyramidkv", c(0, 270_000)),
    ("adakv", c(0, 433_000)),
    ("tova", c(0, 274_000)),
    ("knorm", c(0, 256_000)),
    ("scissorhands", c(242, 359_000)),
    ("cam", c(108, 210_000)),
    ("ahakv", c(325, 610_000)),
    ("kvmerger", c(90, 310_000)),
    ("d2o", c(2_900, 0)),
    ("minicache", c(700, 0)),
    ("ems", c(7_500, 0)),
    // not measured alone: snapkv's cost scaled by each one's time against
    // snapkv's in one `kvreplay bench replay` run (2 threads; BENCHMARKS.md,
    // "The methods added for the methods issue")
    ("observed_attention", c(0, 354_000)),
    ("keydiff", c(0, 515_000)),
    ("lagkv", c(0, 333_000)),
    ("a2sf", c(0, 590_000)),
    ("leverage", c(0, 702_000)),
    ("cur", c(0, 359_000)),
    // the methods issue's second batch, measured like the first ones above
    // (CPU seconds of `kvreplay --threads 1 sweep` of six budgets on the
    // 1,040- and 2,064-token suite traces, less the trace's setup, over 6;
    // BENCHMARKS.md, "The cost model's calibration"); the first point's
    // budget-independent work (a head probe, an SVD) is spread over the six
    ("retrieval_head", c(133, 356_000)),
    ("compresskv", c(139, 343_000)),
    ("chunkkv", c(97, 270_000)),
    ("chunk", c(446, 302_000)),
    ("block", c(541, 0)),
    ("criticalkv", c(145, 263_000)),
    ("criticaladakv", c(157, 226_000)),
    ("prefilldecoding", c(90, 326_000)),
    ("expected_attention", c(440, 437_000)),
    ("simlayerkv", c(283, 378_000)),
    ("compactor", c(910, 627_000)),
    ("finch", c(127, 319_000)),
    ("kvcrush", c(66, 425_000)),
    ("lazyeviction", c(115, 764_000)),
    ("triforce", c(72, 832_000)),
    ("razor", c(434, 110_000)),
    ("windowkv", c(0, 383_000)),
    ("mikv", c(723, 62_000)),
    ("zipcache", c(657, 138_000)),
    ("kvquant", c(1_157, 99_000)),
    ("mustafar", c(934, 96_000)),
    ("gear", c(705, 501_000)),
    ("xkv", c(3_068, 11_031_000)),
];

/// What a wrapper adds to the policy it wraps, per head.
const WRAPPER: &[(&str, Cost)] = &[
    ("quant", c(0, 93_000)),
    // measured as `snapkv+X` less `snapkv` (same runs as the second batch):
    // `decoding` and `think` add nothing measurable on these traces
    // (`decoding` compresses every 512 steps, after their decodes end)
    ("decoding", c(0, 0)),
    ("think", c(0, 0)),
    ("keyrerotation", c(169, 0)),
];

/// A trace's budget-independent work per head, once per shard that runs any of its points.
const SETUP: Cost = c(723, 544_000);

fn policy_cost(name: &str) -> Cost {
    POLICY
        .iter()
        .chain(WRAPPER)
        .find(|(n, _)| *n == name)
        .map_or_else(|| policy_cost("snapkv"), |(_, c)| *c)
}

/// The per-head cost of a policy spec (`snapkv:w=16+quant:bits=2`,
/// `adakv:scorer=h2o,...`): the policy's own, plus what a scorer wrapper's
/// scorer costs beyond `snapkv`, plus each wrapper's.
fn spec_cost(spec: &str) -> Cost {
    let mut total = c(0, 0);
    let mut add = |x: Cost| {
        total.per_token += x.per_token;
        total.fixed += x.fixed;
    };
    for (i, part) in spec.split('+').enumerate() {
        let (name, params) = part.split_once(':').unwrap_or((part, ""));
        let name = name.trim();
        add(if i == 0 {
            policy_cost(name)
        } else {
            WRAPPER
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(policy_cost("quant"), |(_, c)| *c)
        });
        if let Some(s) = params
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("scorer="))
        {
            let (x, base) = (policy_cost(s.trim()), policy_cost("snapkv"));
            add(c(
                x.per_token.saturating_sub(base.per_token),
                x.fixed.saturating_sub(base.fixed),
            ));
        }
    }
    total
}

/// Estimated cost of one point of `spec` on a trace of `shape`.
pub fn point_cost(shape: &TraceShape, spec: &str) -> u64 {
    shape.cost(spec_cost(spec)).max(1)
}

/// Estimated budget-independent cost of a trace, paid once per shard.
pub fn setup_cost(shape: &TraceShape) -> u64 {
    shape.cost(SETUP).max(1)
}

/// Which shard runs each point of a plan, and each shard's estimated cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The shard of each point, in plan order.
    pub shard_of: Vec<usize>,
    /// Each shard's estimated cost (its points plus one setup per trace it touches).
    pub loads: Vec<u64>,
}

impl Assignment {
    /// Estimated cost of the heaviest shard over the mean, e.g. 1.04.
    pub fn imbalance(&self) -> f64 {
        let total: u64 = self.loads.iter().sum();
        let max = self.loads.iter().copied().max().unwrap_or(0);
        if total == 0 {
            1.0
        } else {
            max as f64 * self.loads.len() as f64 / total as f64
        }
    }
}

/// A run of consecutive points (plan order) of one trace.
#[derive(Clone, Debug)]
struct Chunk {
    trace: usize,
    start: usize,
    end: usize,
    cost: u64,
}

/// Split points, given as (trace, cost) in plan order with each trace's
/// points consecutive, into `count` shards (see the module comment).
/// `setup[t]` is trace t's budget-independent cost.
pub fn assign(points: &[(usize, u64)], setup: &[u64], count: usize) -> Assignment {
    assert!(count > 0, "at least one shard");
    let chunk_cost = |trace: usize, start: usize, end: usize| -> u64 {
        setup[trace] + points[start..end].iter().map(|p| p.1).sum::<u64>()
    };
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut k = 0;
    while k < points.len() {
        let t = points[k].0;
        let mut end = k;
        while end < points.len() && points[end].0 == t {
            end += 1;
        }
        chunks.push(Chunk {
            trace: t,
            start: k,
            end,
            cost: chunk_cost(t, k, end),
        });
        k = end;
    }
    // longest first onto the shard whose load grows least (a shard that
    // already holds the trace does not pay its setup again)
    let lpt = |chunks: &[Chunk]| -> (Vec<usize>, Vec<u64>) {
        let mut order: Vec<usize> = (0..chunks.len()).collect();
        order.sort_by(|&a, &b| {
            chunks[b]
                .cost
                .cmp(&chunks[a].cost)
                .then(chunks[a].start.cmp(&chunks[b].start))
        });
        let mut loads = vec![0u64; count];
        let mut holds = vec![Vec::<usize>::new(); count];
        let mut shard_of_chunk = vec![0; chunks.len()];
        for c in order {
            let ch = &chunks[c];
            let added = |s: usize| {
                if holds[s].contains(&ch.trace) {
                    ch.cost - setup[ch.trace]
                } else {
                    ch.cost
                }
            };
            let s = (0..count)
                .min_by_key(|&s| (loads[s] + added(s), s))
                .expect("count > 0");
            loads[s] += added(s);
            if !holds[s].contains(&ch.trace) {
                holds[s].push(ch.trace);
            }
            shard_of_chunk[c] = s;
        }
        (shard_of_chunk, loads)
    };
    let within = |loads: &[u64]| -> bool {
        let total: u64 = loads.iter().sum();
        let max = loads.iter().copied().max().unwrap_or(0);
        // max <= 1.1 × mean
        max as u128 * count as u128 * 10 <= total as u128 * 11
    };
    let mut best = (chunks.clone(), lpt(&chunks));
    let mut current = best.1.clone();
    while !within(&current.1) {
        // split at its cost midpoint the largest chunk of more than one
        // point on the heaviest shard (or anywhere, when that shard holds
        // only single points): a trace that fits a light shard stays whole
        let heaviest = (0..count)
            .max_by_key(|&s| (current.1[s], std::cmp::Reverse(s)))
            .expect("count > 0");
        let largest = |on_heaviest: bool| {
            (0..chunks.len())
                .filter(|&c| chunks[c].end - chunks[c].start > 1)
                .filter(|&c| !on_heaviest || current.0[c] == heaviest)
                .min_by_key(|&c| (std::cmp::Reverse(chunks[c].cost), chunks[c].start))
        };
        let Some(c) = largest(true).or_else(|| largest(false)) else {
            break;
        };
        let Chunk {
            trace, start, end, ..
        } = chunks[c].clone();
        let half: u64 = points[start..end].iter().map(|p| p.1).sum::<u64>() / 2;
        let mut mid = start + 1;
        let mut acc = points[start].1;
        while mid < end - 1 && acc + points[mid].1 / 2 <= half {
            acc += points[mid].1;
            mid += 1;
        }
        chunks[c] = Chunk {
            trace,
            start,
            end: mid,
            cost: chunk_cost(trace, start, mid),
        };
        chunks.insert(
            c + 1,
            Chunk {
                trace,
                start: mid,
                end,
                cost: chunk_cost(trace, mid, end),
            },
        );
        current = lpt(&chunks);
        // a split that meets the target beats one that does not (a split
        // pays a trace's setup again, so the total grows as well as the
        // max shrinks); then the smaller max
        let key = |l: &[u64]| (!within(l), l.iter().copied().max().unwrap_or(0));
        if key(&current.1) < key(&best.1 .1) {
            best = (chunks.clone(), current.clone());
        }
    }
    let (chunks, (shard_of_chunk, loads)) = best;
    let mut shard_of = vec![0; points.len()];
    for (c, s) in chunks.iter().zip(shard_of_chunk) {
        for x in &mut shard_of[c.start..c.end] {
            *x = s;
        }
    }
    Assignment { shard_of, loads }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_costs_add_scorers_and_wrappers() {
        let shape = TraceShape {
            n_layers: 2,
            n_heads: 3,
            n_kv_heads: 1,
            head_dim: 128,
            prompt_len: 90,
            total_len: 100,
        };
        // 2 × 3 × 128/64 = 12 heads' worth
        assert_eq!(point_cost(&shape, "full"), 12 * 540 * 100);
        assert_eq!(point_cost(&shape, "h2o:recent=8"), 12 * 244_000);
        assert_eq!(
            point_cost(&shape, "snapkv:w=16+quant:bits=2"),
            12 * (370_000 + 93_000)
        );
        // adakv with the AhaKV scorer: adakv's own plus what AhaKV costs
        // beyond snapkv
        assert_eq!(
            point_cost(&shape, "adakv:scorer=ahakv,alpha=0.2"),
            12 * (433_000 + 325 * 100 + 610_000 - 370_000)
        );
        assert_eq!(point_cost(&shape, "nonesuch"), point_cost(&shape, "snapkv"));
        assert_eq!(setup_cost(&shape), 12 * (723 * 100 + 544_000));
        assert_eq!(shape.f32_bytes(), 2 * 100 * (2 * 3 + 2) * 128 * 4);
    }

    #[test]
    fn one_chunk_per_trace_when_that_balances() {
        // four equal traces, four shards: one trace each, no split
        let points: Vec<(usize, u64)> = (0..4).flat_map(|t| [(t, 10), (t, 10)]).collect();
        let a = assign(&points, &[5; 4], 4);
        assert_eq!(a.shard_of, vec![0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(a.loads, vec![25; 4]);
    }

    #[test]
    fn a_large_trace_is_split_and_its_setup_paid_per_piece() {
        // one trace of 8 points of cost 10, setup 4, two shards
        let points = vec![(0, 10); 8];
        let a = assign(&points, &[4], 2);
        assert_eq!(a.shard_of, vec![0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(a.loads, vec![44, 44]);
    }
}
