//! The replay loop (semantics in `replay/SEMANTICS.md`).

use rayon::prelude::*;
use serde::Serialize;
use std::sync::Arc;

use kvreplay_traces::Trace;

use crate::cache::HeadCache;
use crate::policy::{LayerData, Policy, PrefillCtx};
use crate::session::Session;
use crate::ReplayError;
use kvreplay_kernels::cpu::ahead::prefetch_lines;
use kvreplay_kernels::Backend;
use std::ops::Range;

/// How much prompt cache to keep per KV head and layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    /// B entries.
    Entries(usize),
    /// B = floor(r * prompt_len), r in (0, 1].
    Ratio(f64),
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Entries(n) => write!(f, "--budget {n}"),
            Budget::Ratio(r) => write!(f, "--ratio {r}"),
        }
    }
}

impl Budget {
    /// Check the value itself (before any trace is opened).
    pub fn validate(self) -> Result<(), ReplayError> {
        match self {
            Budget::Entries(0) => Err(ReplayError::BadBudget(
                "--budget must be at least 1 entry".into(),
            )),
            Budget::Ratio(r) if !(r > 0.0 && r <= 1.0) => Err(ReplayError::BadBudget(format!(
                "--ratio {r} must lie in (0, 1]"
            ))),
            _ => Ok(()),
        }
    }

    /// B for a prompt of `prompt_len` tokens.
    pub fn resolve(self, prompt_len: usize) -> Result<usize, ReplayError> {
        self.validate()?;
        let b = match self {
            Budget::Entries(n) => n,
            Budget::Ratio(r) => (r * prompt_len as f64).floor() as usize,
        };
        if b == 0 {
            return Err(ReplayError::BadBudget(format!(
                "{self} of a {prompt_len}-token prompt keeps no entry; raise it"
            )));
        }
        Ok(b)
    }
}

/// Metrics of one (layer, query head), averaged over the decode steps.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HeadMetrics {
    pub layer: usize,
    pub head: usize,
    pub rel_l2: f64,
    pub cosine: f64,
    pub attn_mass: f64,
    pub kl: f64,
    /// Bytes of this head's KV-head cache at the end of the run.
    pub bytes: u64,
}

/// One original prompt position still represented at the end of the run.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Retained {
    pub layer: usize,
    /// The cache head: the KV head, or the query head for policies that keep
    /// one cache per query head.
    pub head: usize,
    pub position: usize,
    /// Index of the entry that represents it.
    pub entry: usize,
}

#[derive(Clone, Debug)]
pub struct LayerResult {
    pub metrics: Vec<HeadMetrics>,
    pub retained: Vec<Retained>,
    /// Storage of the compressed caches at the end of the run, all KV heads.
    pub bytes: u64,
    /// Storage of the full f16 cache of T entries, all KV heads.
    pub full_bytes: u64,
}

#[derive(Clone, Debug)]
pub struct ReplayResult {
    pub budget: usize,
    pub layers: Vec<LayerResult>,
}

impl ReplayResult {
    pub fn metrics(&self) -> impl Iterator<Item = &HeadMetrics> {
        self.layers.iter().flat_map(|l| l.metrics.iter())
    }
    pub fn mean(&self, f: impl Fn(&HeadMetrics) -> f64) -> f64 {
        let (s, n) = self.metrics().fold((0.0, 0), |(s, n), m| (s + f(m), n + 1));
        s / n.max(1) as f64
    }
    pub fn bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes).sum()
    }
    pub fn full_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.full_bytes).sum()
    }
    /// Per layer, the mean over query heads of the squared relative L2
    /// error of the attention output (each head's rel_l2 is its mean over
    /// decode steps): (n_layers,).
    pub fn layer_sq_rel_l2(&self) -> Vec<f64> {
        self.layers
            .iter()
            .map(|l| {
                l.metrics.iter().map(|m| m.rel_l2 * m.rel_l2).sum::<f64>()
                    / l.metrics.len().max(1) as f64
            })
            .collect()
    }
    /// The end-to-end KL the trace's depth-sensitivity profile predicts for
    /// this replay of a policy of `family` (`Sensitivity::predict` of
    /// [`Self::layer_sq_rel_l2`]: calibrated where the profile carries
    /// factors).
    pub fn predicted_kl(&self, profile: &kvreplay_traces::Sensitivity, family: &str) -> f64 {
        profile.predict(family, &self.layer_sq_rel_l2())
    }
}

/// The kernels' RoPE parameters for a trace's manifest entry.
pub fn rope_params(r: &kvreplay_traces::Rope) -> kvreplay_kernels::cpu::RopeParams {
    use kvreplay_kernels::cpu::{RopeParams, RopeStyle};
    RopeParams {
        theta: r.theta,
        style: match r.style {
            kvreplay_traces::RopeStyle::Neox => RopeStyle::Neox,
            kvreplay_traces::RopeStyle::Interleaved => RopeStyle::Interleaved,
        },
        rotated_dims: r.rotated_dims,
        linear_factor: match r.scaling {
            kvreplay_traces::RopeScaling::None => 1.0,
            kvreplay_traces::RopeScaling::Linear { factor } => factor,
            kvreplay_traces::RopeScaling::Llama3 { .. } => 1.0,
        },
        llama3: match r.scaling {
            kvreplay_traces::RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Some(kvreplay_kernels::cpu::Llama3Rope {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }),
            _ => None,
        },
    }
}

/// Layer `l`'s RoPE: the model's, with the layer's own base where the
/// manifest gives one (a layer with another base is unscaled, as in Gemma 3's
/// sliding layers).
pub fn layer_rope(m: &kvreplay_traces::ModelInfo, l: usize) -> kvreplay_kernels::cpu::RopeParams {
    let mut r = rope_params(&m.rope);
    if let Some(la) = m.layers.get(l) {
        if la.rope_theta != m.rope.theta {
            r.theta = la.rope_theta;
            r.linear_factor = 1.0;
            r.llama3 = None;
        }
    }
    r
}

/// Bytes, and retained positions, of the entries of `cache` visible at the
/// last position `last` (all of them without a window): what a sliding layer
/// holds, its older entries having been dropped.
fn visible_bytes(cache: &HeadCache, last: usize, w: Option<usize>) -> u64 {
    if w.is_none() {
        return cache.bytes();
    }
    (0..cache.len())
        .filter(|&e| cache.in_window(e, last, w))
        .map(|e| cache.bits[e])
        .sum::<u64>()
        .div_ceil(8)
}

/// Every layer's (n_heads, P) column sums.
pub fn prompt_colsums(trace: &Trace) -> Arc<Vec<Vec<f32>>> {
    let nh = trace.manifest.model.n_heads;
    Arc::new(
        (0..trace.n_layers())
            .map(|l| {
                (0..nh)
                    .flat_map(|h| trace.layer(l).attn_colsum(h).to_vec())
                    .collect()
            })
            .collect(),
    )
}

/// Read layer `l` of a trace as f32 (with every layer's prompt column sums).
pub fn load_layer(trace: &Trace, l: usize) -> LayerData {
    load_layer_shared(trace, l, &prompt_colsums(trace))
}

/// Read layer `l`, sharing one copy of every layer's column sums (from
/// [`prompt_colsums`]) when loading many layers.
pub fn load_layer_shared(trace: &Trace, l: usize, all_colsum: &Arc<Vec<Vec<f32>>>) -> LayerData {
    let m = &trace.manifest;
    let view = trace.layer(l);
    // (n, T, d): each head's rows converted straight into place
    fn cat<'a>(n: usize, get: impl Fn(usize) -> kvreplay_traces::HeadView<'a>) -> Vec<f32> {
        let rows = get(0).rows;
        let cols = get(0).cols;
        let mut out = vec![0f32; n * rows * cols];
        for (h, o) in out.chunks_exact_mut(rows * cols).enumerate() {
            let v = get(h);
            v.rows_into(v.first, v.first + rows, o);
        }
        out
    }
    LayerData {
        layer: l,
        n_layers: m.model.n_layers,
        n_heads: m.model.n_heads,
        n_kv_heads: m.model.n_kv_heads,
        d: m.model.head_dim,
        scale: m.model.attn_scale as f32,
        prompt_len: m.prompt_len(),
        total_len: m.total_len(),
        q_start: m.query_start(),
        q: cat(m.model.n_heads, |h| view.q(h)),
        k: cat(m.model.n_kv_heads, |h| view.k(h)),
        v: cat(m.model.n_kv_heads, |h| view.v(h)),
        colsum: all_colsum[l].clone(),
        window: m.model.window(l),
        all_colsum: Some(all_colsum.clone()),
        rope: Some(layer_rope(&m.model, l)),
        memo: None,
        backend: Backend::Cpu,
        tokens: Some(Arc::new(crate::policy::TraceTokens {
            ids: m.tokens.ids.clone(),
            spans: m
                .spans
                .iter()
                .map(|s| (s.name.clone(), s.start..s.end))
                .collect(),
        })),
    }
}

/// Refuse, before any work, a policy that reads more prompt queries than a
/// lean trace holds: the error names the policy, what it needs and the
/// capture flags that provide it.
pub fn check_reads(trace: &Trace, policy: &dyn Policy, budget: Budget) -> Result<(), ReplayError> {
    check_reads_of(&trace.manifest, trace.dir(), policy, budget)
}

/// [`check_reads`] from a trace's manifest (`dir` names it in the error).
pub fn check_reads_of(
    m: &kvreplay_traces::Manifest,
    dir: &std::path::Path,
    policy: &dyn Policy,
    budget: Budget,
) -> Result<(), ReplayError> {
    let p = m.prompt_len();
    let b = crate::policy::cache_budget(
        policy,
        budget.resolve(p)?,
        m.model.n_heads / m.model.n_kv_heads,
    );
    let (need, have) = (policy.prompt_queries(p, b).min(p), p - m.query_start());
    if need > have {
        let spec = policy.name();
        return Err(ReplayError::TraceLacks {
            path: dir.display().to_string(),
            msg: format!(
                "is a lean trace holding the queries of the last {have} prompt positions, but policy `{spec}` at {budget} reads the last {need}{}; recapture with `kvreplay capture --keep lean --keep-queries {need}` (or `--keep full`), or choose a policy that reads fewer (`kvreplay inspect` lists what this trace can replay)",
                if need == p { " (every prompt query)" } else { "" }
            ),
        });
    }
    Ok(())
}

/// Attention of query `q` over `cache`: the output (d,), the unnormalised
/// weights exp(logit - max) (n,) and their sum (f64).
pub fn attend(
    q: &[f32],
    cache: &HeadCache,
    scale: f32,
    backend: &Backend,
) -> Result<(Vec<f64>, Vec<f64>, f64), ReplayError> {
    let mut w = vec![0f64; cache.len()];
    let mut z = [0f64];
    // Output accumulated in f32 (vectorised), reported in f64.
    let mut acc = vec![0f32; cache.d];
    backend.attend_biased(
        q,
        &cache.keys,
        &cache.values,
        &cache.bias,
        scale,
        &mut w,
        &mut z,
        &mut acc,
    )?;
    Ok((acc.iter().map(|x| *x as f64).collect(), w, z[0]))
}

/// ln of f64::MIN_POSITIVE: the KL's floor for ln q (a compressed weight
/// that underflows counts as the smallest positive probability).
const LN_MIN_POSITIVE: f64 = -708.3964185322641;

/// Step metrics of one query: [rel_l2, cosine, attn_mass, kl].
///
/// - `o_c` (d,): the compressed attention's output; `c_x` (n,): its shifted
///   logits per entry (weights exp(x)); `c_z`: the weights' sum
/// - `r`: the full cache's attention of the same query (weights indexed by
///   position)
/// - `single` (n,): each entry's one member position, or `MULTI` where it
///   stands for several positions (or none); `cell` (n,): scratch
///
/// The KL of the full attention aggregated onto the cache's entries and
/// renormalised (p) to the compressed attention (q) is
/// Σ_e p_e (ln p_e − ln q_e) with ln q_e = x_e − ln c_z and, for an entry
/// of one member m, ln p_e = y_m − ln kept (y: the reference's shifted
/// logits, so no logarithm per entry; ln of the cell's weight for a merged
/// entry). ln q is floored at ln f64::MIN_POSITIVE.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn step_metrics(
    o_c: &[f32],
    r: &RefHead,
    cache: &HeadCache,
    single: &[u32],
    c_x: &[f32],
    c_z: f64,
    buf: &mut MetricBuf,
) -> [f64; 4] {
    heads_metrics::<1>([o_c], [r], cache, single, [c_x], None, false, [c_z], buf)[0]
}

/// Reused buffers of [`heads_metrics`]: per entry and head, the cell's
/// full-attention weight, its logarithm, and the KL term.
#[derive(Default)]
struct MetricBuf {
    cell: Vec<f64>,
    ln_cell: Vec<f64>,
    term: Vec<f64>,
}

/// [`step_metrics`] of `M` query heads reading one cache, in one pass over
/// its entries: every sum keeps its order (the heads' sums interleave), and
/// the per-entry KL terms are computed as a batch before they are summed.
///
/// `c_w`: the compressed attention's weights per entry when each is
/// exp(x as f64) of its shifted logit `c_x` (the CPU's attention). Then an
/// entry of one member m whose logit has the bits of the reference's y_m
/// has the reference's weight w_m = exp(y_m) = its own, which is taken from
/// `c_w` (in cache) instead of the reference (from memory): the same bits.
///
/// `exact`: every entry of one member holds its position's captured key
/// with no bias ([`Policy::exact_keys`], no sliding window; with `c_w`).
/// Then, for a head whose largest logit is at an entry whose position has
/// the reference's largest (both shifted logits +0), the two largest are
/// the same number, so every such entry's shifted logit is the reference's
/// y at its position and is taken from the step, with its weight, without
/// reading the reference at all.
///
/// Compiled for AVX2 where the CPU has it: the same bits, as Rust fuses no
/// multiply-add and no sum changes its order; the per-entry KL terms
/// vectorise four to a register instead of two.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)] // element i of every head's vectors
fn heads_metrics<const M: usize>(
    o_c: [&[f32]; M],
    r: [&RefHead; M],
    cache: &HeadCache,
    single: &[u32],
    c_x: [&[f32]; M],
    c_w: Option<[&[f64]; M]>,
    exact: bool,
    c_z: [f64; M],
    buf: &mut MetricBuf,
) -> [[f64; 4]; M] {
    // compiled for AVX2 where the CPU has it (the closure is inlined there)
    kvreplay_kernels::cpu::with_avx2(
        #[inline(always)]
        || {
            let n = single.len();
            let mut out = [[0f64; 4]; M];
            // four sums per head in one pass, each in element order from -0.0
            // (as `Iterator::sum` adds), the heads' sums interleaved so that
            // all 4·M chains of additions overlap
            let d = o_c[0].len();
            debug_assert!((0..M).all(|j| o_c[j].len() == d && r[j].out.len() == d));
            let mut sums = [[-0.0f64; 4]; M];
            for i in 0..d {
                for j in 0..M {
                    let (a, b) = (o_c[j][i] as f64, r[j].out[i]);
                    let [diff, nf, nc, dotp] = &mut sums[j];
                    *diff += (a - b) * (a - b);
                    *nf += b * b;
                    *nc += a * a;
                    *dotp += a * b;
                }
            }
            for (o, [diff, nf, nc, dotp]) in out.iter_mut().zip(sums) {
                o[0] = (diff / nf.max(1e-300)).sqrt();
                o[1] = dotp / (nf.sqrt() * nc.sqrt()).max(1e-300);
            }
            // Full-attention weight on each entry's members (and its logarithm: the
            // reference's shifted logit for one member), and on everything represented.
            let MetricBuf {
                cell,
                ln_cell,
                term,
            } = buf;
            cell.resize(M * n, 0.0);
            ln_cell.resize(M * n, 0.0);
            term.resize(M * n, 0.0);
            let mut kept = [-0.0f64; M];
            // heads whose step and reference share their largest logit (`exact`)
            // (the step's first largest: the entry of shifted logit +0)
            let same_max: [bool; M] = std::array::from_fn(|j| {
                exact
                    && c_w.is_some()
                    && first_zero(c_x[j], single).is_some_and(|m| r[j].is_top(m as usize))
            });
            // Every head's largest shared and every entry one position: each
            // cell is the step's own weight and logit, and `kept`, their sum
            // in entry order, is the step's own c_z (the same additions in the
            // same order; weights are ≥ +0, so a start at −0 or +0 gives the
            // same sum). The terms then read them where they are.
            let own = same_max.iter().all(|&s| s) && !single.contains(&MULTI);
            if own {
                #[cfg(test)]
                tests::FROM_STEP.with(|c| c.set(c.get() + M * n));
                #[cfg(test)]
                tests::OWN_CELLS.with(|c| c.set(c.get() + 1));
                kept = c_z;
            } else {
                for (e, &m) in single.iter().enumerate() {
                    // an entry of several positions: every head's weight on
                    // them, the heads' sums side by side in one pass over the
                    // members (each in member order from −0.0, as
                    // `Iterator::sum` adds)
                    let mut multi = [-0.0f64; M];
                    if m == MULTI {
                        for &p in cache.members[e].iter() {
                            for j in 0..M {
                                multi[j] += r[j].w[p as usize];
                            }
                        }
                    }
                    for j in 0..M {
                        let (c, l) = match m {
                            m if m != MULTI && same_max[j] => {
                                #[cfg(test)]
                                tests::FROM_STEP.with(|n| n.set(n.get() + 1));
                                let cw = c_w.expect("same_max implies c_w");
                                (cw[j][e], c_x[j][e] as f64)
                            }
                            MULTI => (multi[j], multi[j].ln()),
                            m => {
                                let y = r[j].y[m as usize];
                                let w = match c_w {
                                    Some(cw) if y.to_bits() == c_x[j][e].to_bits() => cw[j][e],
                                    _ => r[j].w[m as usize],
                                };
                                (w, y as f64)
                            }
                        };
                        cell[j * n + e] = c;
                        ln_cell[j * n + e] = l;
                        kept[j] += c;
                    }
                }
            }
            // rows whose every term is +0 without computing them (`own`, below)
            let mut zero_row = [false; M];
            for j in 0..M {
                out[j][2] = kept[j] / r[j].z;
                let (ln_kept, ln_cz) = (kept[j].ln(), c_z[j].ln());
                let rows = j * n..(j + 1) * n;
                let (t, x) = (&mut term[rows.clone()], c_x[j]);
                match own {
                    // each cell the step's own weight and logit
                    true => {
                        // Here kept = c_z, so ln_kept = ln_cz, and an entry's
                        // term is (w/kept)·((x − ln_cz) − ln_q) with ln_q =
                        // max(x − ln_cz, ln MIN_POSITIVE): where x − ln_cz ≥
                        // ln MIN_POSITIVE, the difference of two equal numbers,
                        // +0, so the term is +0 (w/kept is finite and ≥ 0).
                        // A row without an entry below that floor (or NaN)
                        // is +0 throughout.
                        let mut below = false;
                        for v in x {
                            let a = *v as f64 - ln_cz;
                            below |= a < LN_MIN_POSITIVE || a.is_nan();
                        }
                        if !below {
                            zero_row[j] = true;
                            continue;
                        }
                        let cw = c_w.expect("same_max implies c_w")[j];
                        for ((t, we), x) in t.iter_mut().zip(cw).zip(x) {
                            *t = kl_term(*we, *x as f64, *x, kept[j], ln_kept, ln_cz);
                        }
                    }
                    false => {
                        let cells = cell[rows.clone()].iter().zip(&ln_cell[rows]);
                        for ((t, (we, lc)), x) in t.iter_mut().zip(cells).zip(x) {
                            *t = kl_term(*we, *lc, *x, kept[j], ln_kept, ln_cz);
                        }
                    }
                }
            }
            // the sums in entry order; where every term is +0 (an exact cache
            // that keeps the largest logit: p and q agree on every entry), the
            // sum is +0 without the additions
            let mut bits = 0u64;
            for j in (0..M).filter(|&j| !zero_row[j]) {
                for t in &term[j * n..(j + 1) * n] {
                    bits |= t.to_bits();
                }
            }
            if bits != 0 {
                for j in (0..M).filter(|&j| zero_row[j]) {
                    term[j * n..(j + 1) * n].fill(0.0);
                }
            }
            let mut kl = [0f64; M];
            for e in (0..n).take(if bits == 0 { 0 } else { n }) {
                for j in 0..M {
                    kl[j] += term[j * n + e];
                }
            }
            for j in 0..M {
                out[j][3] = kl[j];
            }
            out
        },
    )
}

/// One entry's KL term of [`heads_metrics`]: its cell's full-attention
/// weight `we` and that weight's logarithm `lc`, the step's shifted logit
/// `x`, with the cells' sum `kept` and the step's normaliser c_z (as logs).
/// An entry without full-attention weight adds nothing (+0 leaves the sum,
/// which starts at +0, unchanged).
#[inline(always)]
fn kl_term(we: f64, lc: f64, x: f32, kept: f64, ln_kept: f64, ln_cz: f64) -> f64 {
    let ln_q = (x as f64 - ln_cz).max(LN_MIN_POSITIVE);
    let v = (we / kept) * (lc - ln_kept - ln_q);
    if we > 0.0 {
        v
    } else {
        0.0
    }
}

/// The member of the first entry of one member whose shifted logit `x` is
/// +0 (a largest), eight entries compared at a time.
#[inline(always)]
fn first_zero(x: &[f32], single: &[u32]) -> Option<u32> {
    for (xs, ms) in x.chunks(8).zip(single.chunks(8)) {
        let mut any = false;
        for v in xs {
            any |= v.to_bits() == 0;
        }
        if any {
            let hit = xs
                .iter()
                .zip(ms)
                .find(|(v, &m)| v.to_bits() == 0 && m != MULTI);
            if let Some((_, &m)) = hit {
                return Some(m);
            }
        }
    }
    None
}

/// `single` marker of an entry that stands for several positions (or none).
const MULTI: u32 = u32::MAX;

/// Each entry's one member position, or [`MULTI`].
fn single_members(cache: &HeadCache, out: &mut Vec<u32>) {
    out.clear();
    out.extend(cache.members.iter().map(|m| match m.as_slice() {
        [p] => *p,
        _ => MULTI,
    }));
}

/// The full cache's attention of one decode query: output (d,), weights
/// exp(y) and shifted logits y per position, their sum.
struct RefHead {
    out: Vec<f64>,
    w: Vec<f64>,
    y: Vec<f32>,
    z: f64,
    /// The first position of the largest logit (its y is +0), and whether
    /// another position ties with it.
    top: (u32, bool),
}

impl RefHead {
    fn new(out: Vec<f64>, w: Vec<f64>, y: Vec<f32>, z: f64) -> RefHead {
        let mut zeros = y.iter().enumerate().filter(|(_, v)| v.to_bits() == 0);
        let first = zeros.next().map_or(u32::MAX, |(p, _)| p as u32);
        let top = (first, zeros.next().is_some());
        RefHead { out, w, y, z, top }
    }

    /// Whether position `p` holds the largest logit (y = +0), from `top`
    /// unless positions tie.
    #[inline(always)]
    fn is_top(&self, p: usize) -> bool {
        match self.top {
            (first, false) => p == first as usize,
            _ => self.y[p].to_bits() == 0,
        }
    }
}

/// Per decode step, per query head: the full cache's attention.
type Reference = Vec<Vec<RefHead>>;

/// Attention of every decode query of `data` over the full cache of its KV head.
fn full_reference(data: &LayerData) -> Result<Reference, ReplayError> {
    let ctx = PrefillCtx::new(data, 1);
    let mut full = ctx.full_caches();
    let group = data.group();
    let mut s = Scratch::default();
    (data.prompt_len..data.total_len)
        .map(|pos| {
            for (g, f) in full.iter_mut().enumerate() {
                f.push_exact(pos, data.k_row(g, pos), data.v_row(g, pos));
            }
            let mut heads = Vec::with_capacity(data.n_heads);
            for (g, f) in full.iter().enumerate() {
                attend_heads(data, g * group..(g + 1) * group, pos, f, &mut s)?;
                let (n, d) = (f.len(), f.d);
                for j in 0..group {
                    heads.push(RefHead::new(
                        s.out[j * d..(j + 1) * d]
                            .iter()
                            .map(|x| *x as f64)
                            .collect(),
                        s.w[j * n..(j + 1) * n].to_vec(),
                        s.x[j * n..(j + 1) * n].to_vec(),
                        s.z[j],
                    ));
                }
            }
            Ok(heads)
        })
        .collect()
}

/// Buffers of one attention call, reused across calls: per query head of
/// the call, weights `w` (nq, n), sums `z` (nq,), outputs `out` (nq, d),
/// shifted logits `x` and probabilities `p` (nq, n).
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    w: Vec<f64>,
    z: Vec<f64>,
    out: Vec<f32>,
    x: Vec<f32>,
    p: Vec<f32>,
    masked: Vec<f32>,
}

/// Attention of the step-`pos` queries of query heads `heads` over one
/// cache, in one pass over it, into `s`.
fn attend_heads(
    data: &LayerData,
    heads: Range<usize>,
    pos: usize,
    cache: &HeadCache,
    s: &mut Scratch,
) -> Result<(), ReplayError> {
    let (nq, n, d) = (heads.len(), cache.len(), cache.d);
    s.q.clear();
    s.q.extend(heads.flat_map(|h| data.q_row(h, pos).iter().copied()));
    s.w.resize(nq * n, 0.0);
    s.x.resize(nq * n, 0.0);
    s.p.resize(nq * n, 0.0);
    s.z.resize(nq, 0.0);
    s.out.resize(nq * d, 0.0);
    // a sliding layer: entries older than the window get no weight
    let bias = match data.window {
        None => &cache.bias,
        Some(_) => {
            s.masked.clear();
            s.masked
                .extend((0..n).map(|e| match cache.in_window(e, pos, data.window) {
                    true => cache.bias[e],
                    false => f32::NEG_INFINITY,
                }));
            &s.masked
        }
    };
    data.backend.attend_biased_probs(
        &s.q,
        &cache.keys,
        &cache.values,
        bias,
        data.scale,
        &mut s.w,
        &mut s.z,
        &mut s.out,
        &mut s.x,
        &mut s.p,
    )?;
    Ok(())
}

/// What [`attend_heads`] computes for query heads `heads` over `cache` when
/// it is the full cache (the same entries, in position order, as the
/// reference attended over), as far as a replay step reads it: the
/// reference's own output, shifted logits, sum and probabilities, so the
/// same bits without the attention (`s.w` is left as it is: only the
/// reference itself reads it).
fn reference_into(r: &[RefHead], heads: Range<usize>, cache: &HeadCache, s: &mut Scratch) {
    let (nq, n, d) = (heads.len(), cache.len(), cache.d);
    s.out.clear();
    s.x.clear();
    s.p.clear();
    s.z.clear();
    for h in heads {
        let rh = &r[h];
        debug_assert!(
            rh.y.len() == n && rh.out.len() == d,
            "reference of another cache"
        );
        s.out.extend(rh.out.iter().map(|x| *x as f32));
        s.x.extend_from_slice(&rh.y);
        s.p.extend(rh.w.iter().map(|w| (w / rh.z) as f32));
        s.z.push(rh.z);
    }
    debug_assert!(s.z.len() == nq && s.x.len() == nq * n);
}

/// The full-cache reference of a layer (memo key): per decode step and
/// query head, the output, weights and their sum.
#[derive(PartialEq, Debug)]
struct FullReference;
impl crate::memo::MemoKey for FullReference {
    type Value = Reference;
}

/// Replay `policy` on layer `data` with budget `b`.
pub fn replay_layer(
    data: &LayerData,
    policy: &dyn Policy,
    b: usize,
) -> Result<LayerResult, ReplayError> {
    Ok(replay_group(std::slice::from_ref(data), policy, b)?.remove(0))
}

/// Replay `policy` on a group of layers replayed together (one layer for most
/// policies; adjacent pairs for cross-layer ones such as MiniCache).
pub fn replay_group(
    datas: &[LayerData],
    policy: &dyn Policy,
    b: usize,
) -> Result<Vec<LayerResult>, ReplayError> {
    replay_group_refs(&datas.iter().collect::<Vec<_>>(), policy, b)
}

/// The layer groups `policy` is replayed in on a model whose layer `l` has a
/// sliding window when `sliding[l]`: the policy's own groups, except that,
/// unless it compresses sliding layers too (`+sliding`), a group mixing the
/// two kinds is split into each sliding layer alone (it keeps its window)
/// and the group's full-attention layers together. (MiniCache pairs adjacent
/// layers; no two full-attention layers of Gemma 3 are adjacent, so without
/// `+sliding` it has no pair to merge there.) Replay and the closed loop
/// (validate) both group layers with it.
pub fn replay_groups(
    policy: &dyn Policy,
    sliding: &[bool],
    budget: usize,
    prompt_len: usize,
) -> Vec<Vec<usize>> {
    let groups = policy.layer_groups(sliding.len(), budget, prompt_len);
    if policy.compress_sliding() {
        return groups;
    }
    let mut out = Vec::new();
    for g in groups {
        let (win, full): (Vec<usize>, Vec<usize>) = g
            .iter()
            .partition(|&&l| sliding.get(l).copied().unwrap_or(false));
        if win.is_empty() || full.is_empty() {
            out.push(g);
        } else {
            out.extend(win.into_iter().map(|l| vec![l]));
            out.push(full);
        }
    }
    out
}

/// The policy that builds the caches of a group of layers replayed together
/// (one of [`replay_groups`], prefilled with [`Session::prefill_group`]):
/// `full` for sliding-window layers unless the policy compresses them too
/// (`+sliding`), else the policy. A group mixing the two kinds is refused
/// (replay_groups never makes one).
pub fn group_policy<'a>(
    policy: &'a dyn Policy,
    datas: &[&LayerData],
) -> Result<&'a dyn Policy, ReplayError> {
    static FULL: crate::policies::full::Full = crate::policies::full::Full;
    let sliding = datas.iter().filter(|d| d.window.is_some()).count();
    let keep_window = sliding > 0 && !policy.compress_sliding();
    if keep_window && sliding < datas.len() {
        return Err(ReplayError::Contract {
            policy: policy.name(),
            msg: format!(
                "it replays layers {:?} together, mixing sliding-window and full-attention layers; compose it with +sliding to compress the sliding layers too",
                datas.iter().map(|d| d.layer).collect::<Vec<_>>()
            ),
        });
    }
    Ok(if keep_window { &FULL } else { policy })
}

fn replay_group_refs(
    datas: &[&LayerData],
    policy: &dyn Policy,
    b: usize,
) -> Result<Vec<LayerResult>, ReplayError> {
    replay_group_with(datas, policy, b, true)
}

/// [`replay_group_refs`]; `shortcut`: take the attention of a group that
/// keeps the full cache ([`Policy::keeps_full_cache`]) from the reference,
/// and an exact entry's full-attention weight from the step's own where
/// they are the same bits ([`heads_metrics`]'s `c_w`) (false only in the
/// test that compares both ways).
fn replay_group_with(
    datas: &[&LayerData],
    policy: &dyn Policy,
    b: usize,
    shortcut: bool,
) -> Result<Vec<LayerResult>, ReplayError> {
    let (p, t) = (datas[0].prompt_len, datas[0].total_len);
    let policy = group_policy(policy, datas)?;
    let mut session = Session::prefill_group(policy, datas, b)?;
    // The full-cache reference of every decode step: independent of the policy
    // and the budget, so computed once per trace and layer in a sweep.
    let reference: Vec<Arc<Reference>> = datas
        .iter()
        .map(|d| match &d.memo {
            Some(m) => m.try_get_or(FullReference, || full_reference(d)),
            None => full_reference(d).map(Arc::new),
        })
        .collect::<Result<_, _>>()?;
    let mut sums: Vec<Vec<[f64; 4]>> = datas.iter().map(|d| vec![[0f64; 4]; d.n_heads]).collect();
    let mut probs: Vec<Vec<Vec<f32>>> = datas.iter().map(|d| vec![Vec::new(); d.n_heads]).collect();
    let (mut s, mut single, mut mb) = (Scratch::default(), Vec::new(), MetricBuf::default());
    // caches that are the full cache: their attention is the reference's
    let whole = shortcut && policy.keeps_full_cache(datas.len());
    // whether a step's weights are exp of its shifted logits (heads_metrics)
    let own_w = shortcut && !whole && datas.iter().all(|d| matches!(d.backend, Backend::Cpu));
    // whether its exact entries' logits are the reference's where the
    // largest is (heads_metrics)
    let exact = own_w && policy.exact_keys() && datas.iter().all(|d| d.window.is_none());
    for pos in p..t {
        // the next step's reference outputs, which its metrics read first
        // (separate allocations, each cold)
        for r in reference.iter().filter_map(|r| r.get(pos + 1 - p)) {
            r.iter().for_each(|h| prefetch_lines(&h.out));
        }
        for (i, data) in datas.iter().enumerate() {
            session.append(i, pos, |g| (data.k_row(g, pos), data.v_row(g, pos)));
            // the query heads that read each cache attend together (GQA)
            for (c, cache) in session.caches(i).iter().enumerate() {
                let heads = session.heads_of(i, c);
                match whole {
                    true => reference_into(&reference[i][pos - p], heads.clone(), cache, &mut s),
                    false => attend_heads(data, heads.clone(), pos, cache, &mut s)?,
                }
                single_members(cache, &mut single);
                let (n, d) = (cache.len(), cache.d);
                let heads: Vec<usize> = heads.collect();
                // up to four heads of the cache at once
                for hs in heads.chunks(4) {
                    let j0 = hs[0] - heads[0];
                    let o = |k: usize| &s.out[(j0 + k) * d..(j0 + k + 1) * d];
                    let x = |k: usize| &s.x[(j0 + k) * n..(j0 + k + 1) * n];
                    let w = |k: usize| &s.w[(j0 + k) * n..(j0 + k + 1) * n];
                    let rf = |k: usize| &reference[i][pos - p][hs[k]];
                    let z = |k: usize| s.z[j0 + k];
                    let ms: Vec<[f64; 4]> = match hs.len() {
                        1 => heads_metrics::<1>(
                            [o(0)],
                            [rf(0)],
                            cache,
                            &single,
                            [x(0)],
                            own_w.then(|| [w(0)]),
                            exact,
                            [z(0)],
                            &mut mb,
                        )
                        .to_vec(),
                        2 => heads_metrics::<2>(
                            [o(0), o(1)],
                            [rf(0), rf(1)],
                            cache,
                            &single,
                            [x(0), x(1)],
                            own_w.then(|| [w(0), w(1)]),
                            exact,
                            [z(0), z(1)],
                            &mut mb,
                        )
                        .to_vec(),
                        3 => heads_metrics::<3>(
                            [o(0), o(1), o(2)],
                            [rf(0), rf(1), rf(2)],
                            cache,
                            &single,
                            [x(0), x(1), x(2)],
                            own_w.then(|| [w(0), w(1), w(2)]),
                            exact,
                            [z(0), z(1), z(2)],
                            &mut mb,
                        )
                        .to_vec(),
                        _ => heads_metrics::<4>(
                            [o(0), o(1), o(2), o(3)],
                            [rf(0), rf(1), rf(2), rf(3)],
                            cache,
                            &single,
                            [x(0), x(1), x(2), x(3)],
                            own_w.then(|| [w(0), w(1), w(2), w(3)]),
                            exact,
                            [z(0), z(1), z(2), z(3)],
                            &mut mb,
                        )
                        .to_vec(),
                    };
                    for (k, m) in ms.into_iter().enumerate() {
                        for (acc, v) in sums[i][hs[k]].iter_mut().zip(m) {
                            *acc += v;
                        }
                    }
                }
                for (j, &h) in heads.iter().enumerate() {
                    probs[i][h].clear();
                    probs[i][h].extend_from_slice(&s.p[j * n..(j + 1) * n]);
                }
            }
        }
        let queries: Vec<Vec<&[f32]>> = datas
            .iter()
            .map(|d| (0..d.n_heads).map(|h| d.q_row(h, pos)).collect())
            .collect();
        session.step(pos, &probs, &queries);
    }
    let steps = (t - p) as f64;
    let cache_of: Vec<Vec<usize>> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| (0..d.n_heads).map(|h| session.cache_of(i, h)).collect())
        .collect();
    let caches = session.into_caches();
    Ok(datas
        .iter()
        .zip(&caches)
        .zip(&sums)
        .enumerate()
        .map(|(i, ((data, caches), sums))| {
            let metrics = (0..data.n_heads)
                .map(|h| HeadMetrics {
                    layer: data.layer,
                    head: h,
                    rel_l2: sums[h][0] / steps,
                    cosine: sums[h][1] / steps,
                    attn_mass: sums[h][2] / steps,
                    kl: sums[h][3] / steps,
                    bytes: visible_bytes(&caches[cache_of[i][h]], t - 1, data.window),
                })
                .collect();
            let mut retained = Vec::new();
            for (g, c) in caches.iter().enumerate() {
                for (e, m) in c.members.iter().enumerate() {
                    if !c.in_window(e, t - 1, data.window) {
                        continue;
                    }
                    for &pos in m.iter().filter(|&&x| (x as usize) < p) {
                        retained.push(Retained {
                            layer: data.layer,
                            head: g,
                            position: pos as usize,
                            entry: e,
                        });
                    }
                }
            }
            LayerResult {
                metrics,
                retained,
                bytes: caches
                    .iter()
                    .map(|c| visible_bytes(c, t - 1, data.window))
                    .sum(),
                // the uncompressed cache: T entries, or W on a sliding layer
                full_bytes: data.n_kv_heads as u64
                    * data.window.map_or(t, |w| w.min(t)) as u64
                    * HeadCache::exact_bits(data.d)
                    / 8,
            }
        })
        .collect())
}

/// A trace opened for replay: each layer's f32 copy (converted on first use)
/// and its budget-independent results, kept for every policy and budget
/// replayed through it, so a sweep pays the conversion and the full-cache
/// reference once per trace. Dropping it frees them; a new one starts cold.
///
/// The copies kept are bounded by a memory cap ([`memory::default_cap`](crate::memory::default_cap)
/// unless [`with_max_memory`](Self::with_max_memory) says otherwise): the
/// first layers that fit stay, every later one is read from the memory map
/// when a point needs it and dropped after, so a trace larger than memory
/// replays a layer group at a time. Results do not depend on the cap.
pub struct TraceReplay<'t> {
    trace: &'t Trace,
    backend: Backend,
    colsums: Arc<Vec<Vec<f32>>>,
    layers: Vec<std::sync::OnceLock<Arc<LayerData>>>,
    /// Bytes of layer copies (and their full-cache references) kept.
    held: std::sync::Mutex<u64>,
    cap: u64,
    /// Results of budget-independent policies, by spec, and of policies'
    /// budget classes, by spec and class ([`Self::replay_spec`]).
    fixed: std::sync::Mutex<std::collections::HashMap<String, ReplayResult>>,
    /// Results of layer groups whose replay reads no budget
    /// ([`Policy::group_budget_free`]), by spec and the group's layers.
    group_results: std::sync::Mutex<GroupResults>,
}

/// [`TraceReplay`]'s kept group results: (spec, layers) → their results.
type GroupResults = std::collections::HashMap<(String, Vec<usize>), Vec<LayerResult>>;

impl<'t> TraceReplay<'t> {
    /// Replay on `backend`; checks that the trace has decode queries.
    pub fn new(trace: &'t Trace, backend: &Backend) -> Result<TraceReplay<'t>, ReplayError> {
        if trace.manifest.generation.n_decode == 0 {
            return Err(ReplayError::TraceLacks {
                path: trace.dir().display().to_string(),
                msg: "has no decode tokens, so there are no decode queries to replay; capture it with --decode N (N >= 1)".into(),
            });
        }
        Ok(TraceReplay {
            trace,
            backend: backend.clone(),
            colsums: prompt_colsums(trace),
            layers: (0..trace.n_layers()).map(|_| Default::default()).collect(),
            held: Default::default(),
            cap: crate::memory::default_cap(),
            fixed: Default::default(),
            group_results: Default::default(),
        })
    }

    /// Keep at most `bytes` of layer copies between points (None: the default
    /// share of available memory).
    pub fn with_max_memory(mut self, bytes: Option<u64>) -> Self {
        self.cap = bytes.unwrap_or_else(crate::memory::default_cap);
        self
    }

    /// Estimated bytes a kept layer holds: its f32 q, k, v and the full-cache
    /// reference of every decode step (per query head: f64 weights and f32
    /// shifted logits over T entries, the f64 output).
    pub fn layer_bytes(&self) -> u64 {
        let m = &self.trace.manifest;
        let (h, kv, d) = (m.model.n_heads, m.model.n_kv_heads, m.model.head_dim);
        let (t, qs, steps) = (m.total_len(), m.query_start(), m.generation.n_decode);
        let copy = ((h * (t - qs) + 2 * kv * t) * d * 4) as u64;
        let reference = (steps * h * (t * 12 + d * 8)) as u64;
        copy + reference
    }

    pub fn trace(&self) -> &Trace {
        self.trace
    }

    /// Layer `l` as f32 with its memo: the kept copy, or a fresh one (kept
    /// when it fits under the cap).
    pub fn layer(&self, l: usize) -> Arc<LayerData> {
        if let Some(d) = self.layers[l].get() {
            return d.clone();
        }
        let mut d = load_layer_shared(self.trace, l, &self.colsums);
        // the copy holds what the policies read: the mapped pages can go
        self.trace.release_layer(l);
        d.backend = self.backend.clone();
        d.memo = Some(Default::default());
        let d = Arc::new(d);
        let cost = self.layer_bytes();
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.saturating_add(cost) <= self.cap && self.layers[l].set(d.clone()).is_ok() {
            *held += cost;
        }
        d
    }

    /// Replay `policy` on every layer (layer groups in parallel; results do
    /// not depend on the thread count).
    pub fn replay(&self, policy: &dyn Policy, budget: Budget) -> Result<ReplayResult, ReplayError> {
        self.replay_keyed(policy, budget, None)
    }

    /// [`replay`](Self::replay); with the policy's `spec` where its groups'
    /// replays read no budget ([`Policy::group_budget_free`]), each group's
    /// results are kept and taken at any budget whose grouping holds the
    /// same group.
    fn replay_keyed(
        &self,
        policy: &dyn Policy,
        budget: Budget,
        spec: Option<&str>,
    ) -> Result<ReplayResult, ReplayError> {
        let m = &self.trace.manifest;
        check_reads(self.trace, policy, budget)?;
        let b = budget.resolve(m.prompt_len())?;
        // entries per cache (B, or ⌊B/G⌋ for query-head caches sharing a KV head's)
        let cb = crate::policy::cache_budget(policy, b, m.model.n_heads / m.model.n_kv_heads);
        let sliding: Vec<bool> = (0..self.trace.n_layers())
            .map(|l| m.model.window(l).is_some())
            .collect();
        let groups = replay_groups(policy, &sliding, cb, m.prompt_len());
        let results = groups
            .par_iter()
            .map(|group| {
                let key = spec.map(|s| (s.to_string(), group.clone()));
                let lock = || self.group_results.lock().unwrap_or_else(|e| e.into_inner());
                let kept = key.as_ref().and_then(|k| lock().get(k).cloned());
                let results = match kept {
                    Some(r) => r,
                    None => {
                        let datas: Vec<Arc<LayerData>> =
                            group.iter().map(|&l| self.layer(l)).collect();
                        let refs: Vec<&LayerData> = datas.iter().map(|d| d.as_ref()).collect();
                        let r = replay_group_refs(&refs, policy, cb)?;
                        if let Some(k) = key {
                            lock().insert(k, r.clone());
                        }
                        r
                    }
                };
                Ok(group.iter().copied().zip(results).collect::<Vec<_>>())
            })
            .collect::<Result<Vec<_>, ReplayError>>()?;
        let mut layers: Vec<(usize, LayerResult)> = results.into_iter().flatten().collect();
        layers.sort_by_key(|x| x.0);
        if !layers.iter().enumerate().all(|(i, x)| x.0 == i) {
            return Err(ReplayError::Contract {
                policy: policy.name(),
                msg: format!("its layer groups {groups:?} do not cover every layer once"),
            });
        }
        Ok(ReplayResult {
            budget: b,
            layers: layers.into_iter().map(|x| x.1).collect(),
        })
    }
}

impl TraceReplay<'_> {
    /// [`replay`](Self::replay) of the policy `spec` builds, for sweeps: a
    /// policy whose caches do not depend on the budget
    /// ([`Policy::budget_independent`]: `full`, the fixed-precision stores)
    /// is replayed once per spec and its result reported at every budget,
    /// and one whose budgets fall into classes ([`Policy::budget_class`]:
    /// MiniCache) once per class (the same bytes a replay at that budget
    /// gives).
    pub fn replay_spec(
        &self,
        spec: &str,
        policy: &dyn Policy,
        budget: Budget,
    ) -> Result<ReplayResult, ReplayError> {
        let m = &self.trace.manifest;
        let key = if policy.budget_independent() {
            spec.to_string()
        } else {
            let b = budget.resolve(m.prompt_len())?;
            let cb = crate::policy::cache_budget(policy, b, m.model.n_heads / m.model.n_kv_heads);
            match policy.budget_class(self.trace.n_layers(), cb, m.prompt_len()) {
                Some(class) => format!("{spec}\u{0}class {class}"),
                None => return self.replay_keyed(policy, budget, groups_key(spec, policy)),
            }
        };
        check_reads(self.trace, policy, budget)?;
        let b = budget.resolve(m.prompt_len())?;
        let lock = || self.fixed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = lock().get(&key) {
            return Ok(ReplayResult {
                budget: b,
                layers: r.layers.clone(),
            });
        }
        let r = self.replay_keyed(policy, budget, groups_key(spec, policy))?;
        lock().insert(key, r.clone());
        Ok(r)
    }
}

/// The key a policy's group results are kept under, where its groups'
/// replays read no budget.
fn groups_key<'s>(spec: &'s str, policy: &dyn Policy) -> Option<&'s str> {
    policy.group_budget_free().then_some(spec)
}

/// Replay `policy` on every layer of `trace` on the CPU, from a cold start
/// (for many points of one trace, keep a [`TraceReplay`]).
pub fn replay(
    trace: &Trace,
    policy: &dyn Policy,
    budget: Budget,
) -> Result<ReplayResult, ReplayError> {
    replay_on(trace, policy, budget, &Backend::Cpu)
}

/// [`replay`] with attention computed on `backend`.
pub fn replay_on(
    trace: &Trace,
    policy: &dyn Policy,
    budget: Budget,
    backend: &Backend,
) -> Result<ReplayResult, ReplayError> {
    // one point reads each layer once: nothing is worth keeping
    TraceReplay::new(trace, backend)?
        .with_max_memory(Some(0))
        .replay(policy, budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pseudo-random layer `l` of `n` (9 query heads over 3 KV heads, d =
    /// 16), its window `w`.
    fn layer(l: usize, n: usize, (p, t): (usize, usize), w: Option<usize>) -> LayerData {
        let (nh, nkv, d) = (9, 3, 16);
        let f = |i: usize, s: usize| (((i * 2654435761 + s) >> 7) % 1999) as f32 / 999.0 - 1.0;
        let s = 7 * l;
        LayerData {
            layer: l,
            n_layers: n,
            n_heads: nh,
            n_kv_heads: nkv,
            d,
            scale: 0.25,
            prompt_len: p,
            total_len: t,
            q_start: 0,
            q: (0..nh * t * d).map(|i| f(i, s + 1) * 2.0).collect(),
            k: (0..nkv * t * d).map(|i| f(i, s + 2) * 2.0).collect(),
            v: (0..nkv * t * d).map(|i| f(i, s + 3)).collect(),
            colsum: (0..nh * p).map(|i| f(i, s + 4).abs()).collect(),
            window: w,
            all_colsum: None,
            rope: None,
            memo: None,
            backend: Default::default(),
            tokens: None,
        }
    }

    thread_local! {
        /// Entries whose logit and weight heads_metrics took from the step
        /// (`exact`), on this thread.
        pub(super) static FROM_STEP: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
        /// Calls of heads_metrics whose every cell was the step's own
        /// (no reference read per entry), on this thread.
        pub(super) static OWN_CELLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// Every policy whose groups keep the full cache (`full`; MiniCache's
    /// unmerged layers, full and sliding-window) gives, with its attention
    /// taken from the reference, the bits it gives recomputing it; policies
    /// that evict, merge or quantise give, with exact entries' weights taken
    /// from their own step, the bits the reference's give; and so does
    /// every policy of exact keys ([`Policy::exact_keys`]: each registered
    /// one at its defaults) with its entries' logits taken from the step.
    #[test]
    fn a_group_keeping_the_full_cache_takes_the_reference_bit_for_bit() {
        let (n, pt) = (5, (24, 31));
        let datas: Vec<LayerData> = (0..n)
            .map(|l| layer(l, n, pt, (l % 2 == 1).then_some(6)))
            .collect();
        let mut seen = 0;
        let exact: Vec<String> = crate::REGISTRY
            .iter()
            .map(|info| info.name.to_string())
            .filter(|name| {
                let p = crate::PolicySpec::parse(name).and_then(|s| s.build());
                p.is_ok_and(|p| p.exact_keys())
            })
            .collect();
        for name in [
            "h2o",
            "snapkv",
            "tova",
            "pyramidkv",
            "adakv",
            "scissorhands",
            "cam",
            "d2o",
        ] {
            assert!(exact.iter().any(|x| x == name), "{name} has exact keys");
        }
        let fixed = [
            "full",
            "minicache",
            "minicache+sliding",
            "minicache:start=0.5",
            "d2o:match_on=values",
            "d2o:match_on=split",
            "d2o:preset=code",
            "quant",
            "snapkv:w=4+quant",
        ];
        FROM_STEP.with(|c| c.set(0));
        OWN_CELLS.with(|c| c.set(0));
        for spec in fixed
            .iter()
            .copied()
            .chain(exact.iter().map(|s| s.as_str()))
        {
            let Ok(policy) = crate::PolicySpec::parse(spec).and_then(|s| s.build()) else {
                continue;
            };
            let sliding: Vec<bool> = datas.iter().map(|d| d.window.is_some()).collect();
            for b in [4, 12, 24] {
                for g in replay_groups(policy.as_ref(), &sliding, b, pt.0) {
                    let refs: Vec<&LayerData> = g.iter().map(|&l| &datas[l]).collect();
                    let eff = group_policy(policy.as_ref(), &refs).unwrap();
                    seen += eff.keeps_full_cache(g.len()) as usize;
                    let fast = replay_group_with(&refs, policy.as_ref(), b, true).unwrap();
                    let slow = replay_group_with(&refs, policy.as_ref(), b, false).unwrap();
                    let bits = |r: &[LayerResult]| {
                        r.iter()
                            .flat_map(|l| &l.metrics)
                            .flat_map(|m| [m.rel_l2, m.cosine, m.attn_mass, m.kl])
                            .map(f64::to_bits)
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(bits(&fast), bits(&slow), "{spec} at {b}, layers {g:?}");
                    assert_eq!(
                        format!("{fast:?}"),
                        format!("{slow:?}"),
                        "{spec} at {b}, layers {g:?}"
                    );
                }
            }
        }
        // full (5 layers x 3 budgets), and MiniCache's single layers
        assert!(seen > 15, "{seen} groups took the reference");
        let n = FROM_STEP.with(|c| c.get());
        assert!(n > 10_000, "{n} entries' logits came from their step");
        let own = OWN_CELLS.with(|c| c.get());
        assert!(
            own > 1_000,
            "{own} metric passes took every cell from their step"
        );
    }

    /// One query's attention over `c` (scale 0.5): weights, their sum,
    /// output and shifted logits.
    fn attend_one(q: &[f32], c: &HeadCache) -> (Vec<f64>, f64, Vec<f32>, Vec<f32>) {
        let (n, d) = (c.len(), c.d);
        let (mut w, mut z, mut o) = (vec![0f64; n], vec![0f64], vec![0f32; d]);
        let (mut x, mut p) = (vec![0f32; n], vec![0f32; n]);
        kvreplay_kernels::cpu::attend_biased_probs(
            q, &c.keys, &c.values, &c.bias, 0.5, &mut w, &mut z, &mut o, &mut x, &mut p,
        );
        (w, z[0], o, x)
    }

    /// The first largest of one member: past entries standing for several
    /// positions, past a chunk of eight, and none where no single entry has
    /// one; and the reference's largest, with and without a tie.
    #[test]
    fn the_first_single_largest_and_the_references_largest() {
        let mut x = vec![-1.0f32; 20];
        let mut single: Vec<u32> = (100..120).collect();
        assert_eq!(first_zero(&x, &single), None);
        x[3] = 0.0;
        single[3] = MULTI;
        assert_eq!(
            first_zero(&x, &single),
            None,
            "a largest of several positions"
        );
        x[11] = 0.0;
        x[17] = 0.0;
        assert_eq!(first_zero(&x, &single), Some(111));
        x[5] = -0.0; // not +0: a shifted logit is +0 only at the largest
        assert_eq!(first_zero(&x, &single), Some(111));
        let y = |zeros: &[usize]| {
            let mut y = vec![-2.0f32; 8];
            zeros.iter().for_each(|&p| y[p] = 0.0);
            RefHead::new(vec![0.0; 2], vec![0.5; 8], y, 4.0)
        };
        let one = y(&[6]);
        assert_eq!(one.top, (6, false));
        assert!(one.is_top(6) && !one.is_top(2));
        let tied = y(&[2, 6]);
        assert_eq!(tied.top, (2, true));
        assert!(tied.is_top(2) && tied.is_top(6) && !tied.is_top(3));
        assert_eq!(y(&[]).top, (u32::MAX, false));
    }

    /// The KL without a logarithm per entry equals the direct
    /// Σ p ln(p / q) (q floored at f64::MIN_POSITIVE) on a cache with merged
    /// entries, a biased entry and one whose compressed weight underflows.
    #[test]
    fn kl_from_shifted_logits_equals_the_direct_formula() {
        let (d, t) = (4usize, 12usize);
        let f = |i: usize| (((i * 2654435761 + 17) >> 7) % 1999) as f32 / 499.0 - 2.0;
        let q: Vec<f32> = (0..d).map(|i| f(i + 1000)).collect();
        let keys: Vec<f32> = (0..t * d).map(f).collect();
        let vals: Vec<f32> = (0..t * d).map(|i| f(i + 500)).collect();
        // the full cache: every position, exact
        let mut full = HeadCache::new(d);
        for p in 0..t {
            full.push_exact(p, &keys[p * d..(p + 1) * d], &vals[p * d..(p + 1) * d]);
        }
        let attend = |c: &HeadCache| attend_one(&q, c);
        let (fw, fz, fo, fy) = attend(&full);
        let r = RefHead::new(fo.iter().map(|x| *x as f64).collect(), fw.clone(), fy, fz);
        // compressed: positions 0, 3 exact; {5, 6, 7} merged (mean key, bias
        // ln 3); 9 exact but with a bias that makes its weight underflow; 11 exact
        let mut c = HeadCache::new(d);
        for p in [0usize, 3] {
            c.push_exact(p, &keys[p * d..(p + 1) * d], &vals[p * d..(p + 1) * d]);
        }
        let mean = |m: &[f32]| -> Vec<f32> {
            (0..d)
                .map(|j| (5..8).map(|p| m[p * d + j]).sum::<f32>() / 3.0)
                .collect()
        };
        c.push_exact(5, &mean(&keys), &mean(&vals));
        c.members[2] = vec![5, 6, 7].into();
        c.bias[2] = 3f32.ln();
        c.push_exact(9, &keys[9 * d..10 * d], &vals[9 * d..10 * d]);
        c.bias[3] = -2000.0;
        c.push_exact(11, &keys[11 * d..12 * d], &vals[11 * d..12 * d]);
        let (cw, cz, co, cx) = attend(&c);
        let mut single = Vec::new();
        single_members(&c, &mut single);
        assert_eq!(single, vec![0, 3, MULTI, 9, 11]);
        let m = step_metrics(&co, &r, &c, &single, &cx, cz, &mut MetricBuf::default());
        // the direct formula
        let cell: Vec<f64> = c
            .members
            .iter()
            .map(|m| m.iter().map(|&p| fw[p as usize]).sum())
            .collect();
        let kept: f64 = cell.iter().sum();
        let mut kl = 0f64;
        for (e, we) in cell.iter().enumerate() {
            let p = we / kept;
            let q = (cw[e] / cz).max(f64::MIN_POSITIVE);
            kl += p * (p / q).ln();
        }
        assert!(cw[3] == 0.0, "the biased entry's weight underflows");
        assert!(kl > 1.0, "the underflowing entry dominates: {kl}");
        assert!((m[3] - kl).abs() <= 1e-12 * kl, "kl {} against {kl}", m[3]);
        assert_eq!(m[2], kept / fz);
    }

    /// An exact cache that keeps the largest logit (`own` in
    /// [`heads_metrics`]) has a KL of +0, without its terms, unless an
    /// entry's log-probability falls below ln f64::MIN_POSITIVE: then its
    /// weight, subnormal but positive, gives a term of its own, and the
    /// shortcut computes the row as the reference path does.
    #[test]
    fn an_own_row_below_the_smallest_log_probability_keeps_its_terms() {
        let d = 4;
        let q = [2f32, 0.0, 0.0, 0.0];
        // logits 0.5 · 2 · k0: 0, −1, −720 (exp(−720) is subnormal), −2
        let k0 = [0f32, -1.0, -720.0, -2.0];
        let keys: Vec<f32> = k0.iter().flat_map(|k| [*k, 0.0, 0.0, 0.0]).collect();
        let vals: Vec<f32> = (0..4 * d).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut full = HeadCache::new(d);
        for p in 0..4 {
            full.push_exact(p, &keys[p * d..(p + 1) * d], &vals[p * d..(p + 1) * d]);
        }
        let (fw, fz, fo, fy) = attend_one(&q, &full);
        assert!(fw[2] > 0.0 && fw[2] < f64::MIN_POSITIVE, "weight {}", fw[2]);
        let r = RefHead::new(fo.iter().map(|x| *x as f64).collect(), fw, fy, fz);
        for ps in [vec![0usize, 1, 2, 3], vec![0, 2], vec![0, 1, 3]] {
            let mut c = HeadCache::new(d);
            for &p in &ps {
                c.push_exact(p, &keys[p * d..(p + 1) * d], &vals[p * d..(p + 1) * d]);
            }
            let (cw, cz, co, cx) = attend_one(&q, &c);
            let mut single = Vec::new();
            single_members(&c, &mut single);
            let mut b = MetricBuf::default();
            let mut metrics = |w: Option<[&[f64]; 1]>, exact: bool| {
                heads_metrics::<1>([&co], [&r], &c, &single, [&cx], w, exact, [cz], &mut b)[0]
            };
            OWN_CELLS.with(|c| c.set(0));
            let own = metrics(Some([&cw]), true);
            assert_eq!(OWN_CELLS.with(|c| c.get()), 1, "{ps:?}: own cells");
            let direct = metrics(None, false);
            assert_eq!(own.map(f64::to_bits), direct.map(f64::to_bits), "{ps:?}");
            // position 2 kept: its term, negative; else every term +0
            match ps.contains(&2) {
                true => assert!(own[3] < 0.0, "{ps:?}: kl {}", own[3]),
                false => assert_eq!(own[3].to_bits(), 0, "{ps:?}: kl {}", own[3]),
            }
        }
    }

    /// An exact entry whose shifted logit has the reference's bits takes its
    /// own step's weight (exp of the same f32): the metrics are the bits the
    /// reference's weights give, on caches that keep the reference's
    /// maximum (every logit the same bits), lose it (none), or merge.
    #[test]
    fn exact_entries_take_their_own_weight_with_the_same_bits() {
        let (d, t) = (4usize, 12usize);
        let f = |i: usize| (((i * 2654435761 + 29) >> 7) % 1999) as f32 / 499.0 - 2.0;
        let q: Vec<f32> = (0..d).map(|i| f(i + 1000)).collect();
        let keys: Vec<f32> = (0..t * d).map(f).collect();
        let vals: Vec<f32> = (0..t * d).map(|i| f(i + 500)).collect();
        let attend = |c: &HeadCache| attend_one(&q, c);
        let cache = |ps: &[usize]| {
            let mut c = HeadCache::new(d);
            for &p in ps {
                c.push_exact(p, &keys[p * d..(p + 1) * d], &vals[p * d..(p + 1) * d]);
            }
            c
        };
        let full = cache(&(0..t).collect::<Vec<_>>());
        let (fw, fz, fo, fy) = attend(&full);
        let argmax = (0..t).find(|&p| fy[p] == 0.0).unwrap();
        let r = RefHead::new(fo.iter().map(|x| *x as f64).collect(), fw, fy, fz);
        let without: Vec<usize> = (0..t).filter(|&p| p != argmax).collect();
        let mut merged = cache(&[argmax, (argmax + 1) % t, (argmax + 2) % t]);
        merged.members[1] = vec![((argmax + 1) % t) as u32, ((argmax + 5) % t) as u32].into();
        merged.bias[1] = 2f32.ln();
        let (mut hits, mut misses) = (0, 0);
        for c in [cache(&[argmax, 2, 7]), cache(&without), merged] {
            let (cw, cz, co, cx) = attend(&c);
            let mut single = Vec::new();
            single_members(&c, &mut single);
            for (e, &m) in single.iter().enumerate() {
                if m != MULTI {
                    match cx[e].to_bits() == r.y[m as usize].to_bits() {
                        true => hits += 1,
                        false => misses += 1,
                    }
                }
            }
            let mut b = MetricBuf::default();
            let metrics = |w: Option<[&[f64]; 1]>, b: &mut MetricBuf| {
                heads_metrics::<1>([&co], [&r], &c, &single, [&cx], w, false, [cz], b)[0]
                    .map(f64::to_bits)
            };
            let own = metrics(Some([&cw]), &mut b);
            assert_eq!(own, metrics(None, &mut b), "{:?}", c.members);
            // its single entries are captured keys without bias: the same
            // from the step's own logits where the largest is shared
            let from_step = heads_metrics::<1>(
                [&co],
                [&r],
                &c,
                &single,
                [&cx],
                Some([&cw]),
                true,
                [cz],
                &mut b,
            );
            assert_eq!(from_step[0].map(f64::to_bits), own, "{:?}", c.members);
            // the control: other weights on the same entries change the KL
            let wrong: Vec<f64> = cw.iter().map(|w| w * 0.5).collect();
            let hit = single
                .iter()
                .enumerate()
                .any(|(e, &m)| m != MULTI && cx[e].to_bits() == r.y[m as usize].to_bits());
            assert_eq!(
                metrics(Some([&wrong]), &mut b) != own,
                hit,
                "{:?}",
                c.members
            );
        }
        assert!(hits >= 5 && misses >= 10, "{hits} hits, {misses} misses");
    }
}
