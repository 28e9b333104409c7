//! Causal softmax attention for one query head, with the statistics a trace records.

use super::simd::{exp, simd_fn, Simd};

/// Optional by-products of [`causal_attention_head`].
#[derive(Default)]
pub struct AttentionStats<'a> {
    /// (n_tracked,): `colsum[j] += Σ_i P[i, j]` over this call's queries, for j < n_tracked.
    pub colsum: Option<&'a mut [f32]>,
    /// (c, n_keys): each query's probabilities over all keys (zero above the diagonal).
    pub probs: Option<&'a mut [f32]>,
}

/// `out = softmax(scale · q kᵀ + causal mask) · v` for one head.
///
/// - `q`: (c, d), queries at positions `pos0 .. pos0 + c`
/// - `k`, `v`: (n_keys, d) with n_keys >= pos0 + c; key j is at position j
/// - `out`: (c, d)
///
/// Query i attends to keys `0 ..= pos0 + i`. Probabilities are normalised in
/// f32 after an f64 sum of the max-shifted exponentials.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    pos0: usize,
    scale: f32,
    out: &mut [f32],
    stats: AttentionStats<'_>,
) {
    windowed_attention_head(q, k, v, d, pos0, None, scale, out, stats)
}

/// [`causal_attention_head`] with an optional sliding window of `W` keys: the
/// query at position t attends to keys `max(0, t - W + 1) ..= t` (W keys
/// counting itself, W - 1 before it), as HF transformers' sliding-window mask
/// (`kv_idx > q_idx - W`) and llama.cpp (`q - k >= W` masked) define it.
/// Masked keys get probability exactly 0.
///
/// How each value is computed (the same for any number of queries, so a
/// query's results do not depend on the chunk it came in, on the thread
/// count, or on whether [`attention_heads`] runs it with other heads):
/// - score s_j = Σ_t q_t·k_jt, one fused multiply-add chain over t in order;
/// - [`softmax_row`] over the query's keys (e^(s·scale − max) by
///   [`super::simd::exp`], their f64 sum in eight lanes, 1/sum in f32);
/// - o_t = Σ_j p_j·v_jt, one fused chain over the keys in order.
///
/// The column sums add the queries [`ROWS`] at a time: each block's rows in
/// order from zero into a part, the parts into `colsum` in order.
#[allow(clippy::too_many_arguments)]
pub fn windowed_attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    pos0: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    mut stats: AttentionStats<'_>,
) {
    assert!(window != Some(0), "attention: a window of 0 keys");
    let c = q.len() / d;
    let n = pos0 + c;
    assert_eq!(q.len(), c * d, "attention: q is not (c, d)");
    assert!(
        k.len() >= n * d && v.len() >= n * d,
        "attention: k/v shorter than pos0 + c"
    );
    assert_eq!(out.len(), c * d, "attention: out is not (c, d)");
    if let Some(p) = stats.probs.as_deref() {
        assert_eq!(p.len(), c * n, "attention: probs is not (c, pos0 + c)");
    }
    if c == 0 {
        return;
    }
    let tracked = stats.colsum.as_deref().map_or(0, |cs| cs.len().min(n));
    let mut part = vec![0f32; tracked];
    // Many queries: the keys packed once into panels; one: 64 at a time.
    let packed = (c > 1).then(|| pack_panels(&k[..n * d], d, key_start(pos0, window)));
    let keys = match &packed {
        Some((k0, data)) => Keys::Panels { k0: *k0, data },
        None => Keys::Rows(&k[..n * d]),
    };
    let values = [VPart {
        data: &v[..n * d],
        stride: d,
        dims: (0, d),
    }];
    for r0 in (0..c).step_by(ROWS) {
        let rows = (c - r0).min(ROWS);
        let probs = stats
            .probs
            .as_deref_mut()
            .map(|p| &mut p[r0 * n..(r0 + rows) * n]);
        let cs = stats.colsum.is_some().then_some(&mut part[..]);
        let q = &q[r0 * d..(r0 + rows) * d];
        let out = &mut out[r0 * d..(r0 + rows) * d];
        attend(
            q,
            keys,
            &values,
            d,
            pos0 + r0,
            window,
            scale,
            out,
            probs,
            cs,
        );
        if let Some(colsum) = stats.colsum.as_deref_mut() {
            add_and_clear(&mut colsum[..tracked], &mut part);
        }
    }
}

/// Queries per block: a fixed size, so results never depend on the thread
/// count (and a block's score rows, 32 · n f32, stay in cache). The CUDA
/// column sums add their rows in the same blocks.
pub const ROWS: usize = crate::ATTN_ROWS as usize;

/// The first key the query at position t sees.
fn key_start(t: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (t + 1).saturating_sub(w))
}

/// `colsum += part`, then `part = 0`.
fn add_and_clear(colsum: &mut [f32], part: &mut [f32]) {
    for (c, p) in colsum.iter_mut().zip(part.iter_mut()) {
        *c += *p;
        *p = 0.0;
    }
}

/// Parts a layer's value cache splits each head's dimensions into, and a
/// one-query step its keys into: a fixed number (results do not depend on
/// it). Each part's value rows are contiguous, so a decode step's
/// weighted-values task streams one run of memory.
const PARTS: usize = 2;

/// f32 elements one KV head's keys take in a CPU key cache of `cap`
/// positions: whole panels of eight positions (see [`store_kv`]).
pub fn key_cache_len(cap: usize, d: usize) -> usize {
    cap.div_ceil(8) * 8 * d
}

/// The dimensions t0 .. t1 of each value part of a head of `d` dimensions:
/// the first parts whole vectors of eight, the last the rest (possibly
/// empty, for d < 8 the first).
fn value_dims(d: usize) -> [(usize, usize); PARTS] {
    let split = (d / 8).div_ceil(PARTS) * 8;
    core::array::from_fn(|i| {
        let t1 = if i + 1 == PARTS {
            d
        } else {
            ((i + 1) * split).min(d)
        };
        ((i * split).min(d), t1)
    })
}

/// KV head `g`'s value parts in a CPU value cache (n_kv_heads, cap, d).
fn value_parts(vc: &[f32], g: usize, cap: usize, d: usize) -> [VPart<'_>; PARTS] {
    let head = &vc[g * cap * d..(g + 1) * cap * d];
    value_dims(d).map(|(t0, t1)| VPart {
        data: &head[cap * t0..cap * t1],
        stride: t1 - t0,
        dims: (t0, t1),
    })
}

/// The parts of a layer's CPU KV cache (layout of [`store_kv`]) that a
/// decode step at position `pos` (keys `key_start .. pos + 1`) reads: per
/// KV head its key panels and its value parts, in the order attention reads
/// them. For [`ReadAhead::set`](super::ahead::ReadAhead::set).
pub fn decode_reads<'a>(
    kc: &'a [f32],
    vc: &'a [f32],
    (n_kv_heads, cap, d): (usize, usize, usize),
    pos: usize,
    window: Option<usize>,
) -> Vec<&'a [f32]> {
    let n = (pos + 1).min(cap);
    let kl = key_cache_len(cap, d);
    let k0 = key_start(pos, window) & !7;
    let mut out = Vec::with_capacity(n_kv_heads * (1 + PARTS));
    if kc.len() < n_kv_heads * kl || vc.len() < n_kv_heads * cap * d || d == 0 {
        return out;
    }
    for g in 0..n_kv_heads {
        out.push(&kc[g * kl + k0 * d..g * kl + n.div_ceil(8) * 8 * d]);
        for part in value_parts(vc, g, cap, d) {
            out.push(&part.data[k0 * part.stride..n * part.stride]);
        }
    }
    out
}

/// Writes positions pos0 .. pos0 + c of every KV head into a layer's CPU
/// KV cache, in the layout attention reads:
/// - `k`, `v`: (n_kv_heads, c, d), head-major rows;
/// - `kc` (n_kv_heads, ⌈cap/8⌉, d, 8): per KV head, panels of eight
///   positions, `kc[g·L + (⌊j/8⌋·d + t)·8 + j mod 8]` = key j, dimension t
///   (L = [`key_cache_len`]`(cap, d)`), which the score kernels read as
///   they are;
/// - `vc` (n_kv_heads, cap, d): per KV head, the dimensions in [`PARTS`]
///   parts t0 .. t1, each part (cap, t1 − t0) rows of its dimensions, so a
///   part's positions are contiguous.
///
/// Data movement only. Panics if the shapes do not fit (the backend
/// checks them first).
pub fn store_kv(
    k: &[f32],
    v: &[f32],
    (n_kv_heads, cap, d): (usize, usize, usize),
    pos0: usize,
    kc: &mut [f32],
    vc: &mut [f32],
) {
    let c = k.len() / (n_kv_heads * d).max(1);
    assert!(
        k.len() == n_kv_heads * c * d && v.len() == k.len(),
        "store_kv: k/v are not (heads, c, d)"
    );
    assert!(pos0 + c <= cap, "store_kv: positions past the capacity");
    let kl = key_cache_len(cap, d);
    assert!(
        kc.len() == n_kv_heads * kl && vc.len() == n_kv_heads * cap * d,
        "store_kv: caches are not (heads, cap, d)"
    );
    for g in 0..n_kv_heads {
        let (kg, vg) = (
            &k[g * c * d..(g + 1) * c * d],
            &v[g * c * d..(g + 1) * c * d],
        );
        let panels = &mut kc[g * kl..(g + 1) * kl];
        for (i, key) in kg.chunks_exact(d).enumerate() {
            let j = pos0 + i;
            let panel = &mut panels[(j / 8) * 8 * d..(j / 8 + 1) * 8 * d];
            for (t, x) in key.iter().enumerate() {
                panel[t * 8 + j % 8] = *x;
            }
        }
        let head = &mut vc[g * cap * d..(g + 1) * cap * d];
        for (t0, t1) in value_dims(d) {
            let w = t1 - t0;
            if w == 0 {
                continue;
            }
            let part = &mut head[cap * t0..cap * t1];
            for (i, row) in vg.chunks_exact(d).enumerate() {
                let j = pos0 + i;
                part[j * w..(j + 1) * w].copy_from_slice(&row[t0..t1]);
            }
        }
    }
}

/// Causal attention of every head of a layer, in parallel: the same bits as
/// [`windowed_attention_head`] per head, for any thread count. Tasks are
/// (head, block of [`ROWS`] queries), reading the keys' panels from the
/// cache as they are; a single query per head (decode) runs per KV head,
/// its query heads together, so each key and value is read once.
///
/// - `q`: (n_heads, c, d) at positions pos0 .. pos0 + c
/// - `kc`, `vc`: a layer's KV cache of `cap` positions in the layout of
///   [`store_kv`], holding positions 0 .. pos0 + c; query head h reads KV
///   head h / (n_heads / n_kv_heads)
/// - `out`: (n_heads, c, d)
/// - `colsum`: (n_heads, n_tracked), `+= Σ_i P[h, i, j]` for j < min(n_tracked, pos0 + c)
/// - `probs`: (n_heads, c, pos0 + c)
#[allow(clippy::too_many_arguments)]
pub fn attention_heads(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    (n_heads, n_kv_heads, cap, d): (usize, usize, usize, usize),
    pos0: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    colsum: Option<&mut [f32]>,
    probs: Option<&mut [f32]>,
) {
    use rayon::prelude::*;
    assert!(window != Some(0), "attention: a window of 0 keys");
    assert!(d > 0 && n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads));
    let c = q.len() / (n_heads * d).max(1);
    let n = pos0 + c;
    assert!(q.len() == n_heads * c * d && out.len() == q.len() && n <= cap);
    let kl = key_cache_len(cap, d);
    assert!(kc.len() == n_kv_heads * kl && vc.len() == n_kv_heads * cap * d);
    if n_heads == 0 || c == 0 {
        return;
    }
    if let Some(p) = &probs {
        assert_eq!(
            p.len(),
            n_heads * c * n,
            "attention: probs is not (heads, c, n)"
        );
    }
    if c == 1 {
        let shape = (n_heads, n_kv_heads, cap, d);
        return one_query_heads(q, kc, vc, shape, pos0, window, scale, out, colsum, probs);
    }
    let group = n_heads / n_kv_heads;
    let keys_of = |g: usize| Keys::Panels {
        k0: 0,
        data: &kc[g * kl..(g + 1) * kl],
    };
    let n_tracked = colsum.as_ref().map_or(0, |cs| cs.len() / n_heads);
    let tracked = n_tracked.min(n);
    let blocks = c.div_ceil(ROWS);
    let tasks = n_heads * blocks;
    // Per (head, block): its outputs, probability rows and column-sum part
    // (reduced in block order below).
    let mut parts = vec![0f32; if colsum.is_some() { tasks * tracked } else { 0 }];
    let mut probs_rows: Vec<Option<&mut [f32]>> = match probs {
        Some(p) => p
            .chunks_mut(c * n)
            .flat_map(|head| head.chunks_mut(ROWS * n))
            .map(Some)
            .collect(),
        None => (0..tasks).map(|_| None).collect(),
    };
    let mut part_rows: Vec<Option<&mut [f32]>> = if tracked > 0 {
        parts.chunks_mut(tracked).map(Some).collect()
    } else {
        (0..tasks).map(|_| None).collect()
    };
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(tasks);
    for head in out.chunks_mut(c * d) {
        outs.extend(head.chunks_mut(ROWS * d));
    }
    debug_assert!(outs.len() == tasks && probs_rows.len() == tasks && part_rows.len() == tasks);
    outs.par_iter_mut()
        .zip(probs_rows.par_iter_mut())
        .zip(part_rows.par_iter_mut())
        .enumerate()
        .for_each(|(t, ((o, pr), cs))| {
            let rows = o.len() / d;
            let (h, b) = (t / blocks, t % blocks);
            let g = h / group;
            let r0 = b * ROWS;
            let qs = &q[(h * c + r0) * d..(h * c + r0 + rows) * d];
            let values = value_parts(vc, g, cap, d);
            let (pr, cs) = (pr.as_deref_mut(), cs.as_deref_mut());
            attend(
                qs,
                keys_of(g),
                &values,
                d,
                pos0 + r0,
                window,
                scale,
                o,
                pr,
                cs,
            );
        });
    if let Some(colsum) = colsum {
        for h in 0..n_heads {
            let cs = &mut colsum[h * n_tracked..h * n_tracked + tracked];
            for b in 0..blocks {
                let at = (h * blocks + b) * tracked;
                add_and_clear(cs, &mut parts[at..at + tracked]);
            }
        }
    }
}

/// [`attention_heads`] for one query per head (decode). Two parallel
/// phases, so that both threads stream keys and values even with fewer KV
/// heads than 2 per thread: scores per (KV head, run of key panels), then
/// per (KV head, value part) the weighted values over the part's dimensions
/// of its query heads' probability rows (each KV head's softmax made once,
/// by the first of its tasks). Every value is computed as in [`attend`]
/// (the same bits).
#[allow(clippy::too_many_arguments)]
fn one_query_heads(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    (n_heads, n_kv_heads, cap, d): (usize, usize, usize, usize),
    pos: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    colsum: Option<&mut [f32]>,
    probs: Option<&mut [f32]>,
) {
    use rayon::prelude::*;
    let group = n_heads / n_kv_heads;
    let kl = key_cache_len(cap, d);
    let n = pos + 1;
    let klo = key_start(pos, window);
    let w = n - klo;
    // Score columns: keys ks .. n, from the panel holding the first key
    // (the keys before klo are scored and left out of the softmax), in
    // runs of whole packs of 64 keys, the last ragged.
    let ks = klo & !7;
    let ws = (n - ks).div_ceil(8) * 8;
    let run = (n - ks).div_ceil(PARTS).div_ceil(64) * 64;
    let runs: [(usize, usize); PARTS] =
        core::array::from_fn(|i| (ks + (i * run).min(n - ks), ks + ((i + 1) * run).min(n - ks)));
    // Phase 1: per (KV head, run) the scores of its query rows, (group,
    // run width rounded up to 8).
    let scored: Vec<Vec<f32>> = (0..n_kv_heads * PARTS)
        .into_par_iter()
        .map(|t| {
            let (g, (j0, j1)) = (t / PARTS, runs[t % PARTS]);
            let pw = (j1 - j0).div_ceil(8) * 8;
            let mut s = vec![0f32; group * pw];
            let qg = &q[g * group * d..(g + 1) * group * d];
            let kp = &kc[g * kl + j0 * d..g * kl + (j0 + pw) * d];
            scores(qg, kp, d, &mut s, pw, true);
            s
        })
        .collect();
    // Phase 2: per (KV head, value part) the weighted values over the
    // part's dimensions of the group's probability rows, which the first of
    // the head's tasks to need them makes (the others wait): each row whole,
    // (group, ws), column i for key ks + i, its softmax over keys klo .. n.
    let lo = klo - ks;
    let dims = value_dims(d);
    let probs_of: Vec<std::sync::OnceLock<Vec<f32>>> = (0..n_kv_heads)
        .map(|_| std::sync::OnceLock::new())
        .collect();
    let softmaxed = |g: usize| -> &[f32] {
        probs_of[g].get_or_init(|| {
            let mut p = vec![0f32; group * ws];
            for (i, &(j0, j1)) in runs.iter().enumerate() {
                let part = &scored[g * PARTS + i];
                let pw = (j1 - j0).div_ceil(8) * 8;
                for r in 0..group {
                    p[r * ws + j0 - ks..r * ws + j1 - ks]
                        .copy_from_slice(&part[r * pw..r * pw + (j1 - j0)]);
                }
            }
            for row in p.chunks_exact_mut(ws) {
                softmax_row(&mut row[lo..lo + w], scale);
            }
            p
        })
    };
    let done: Vec<Vec<f32>> = (0..n_kv_heads * PARTS)
        .into_par_iter()
        .map(|t| {
            let (g, i) = (t / PARTS, t % PARTS);
            let p = softmaxed(g);
            let part = value_parts(vc, g, cap, d)[i];
            let (t0, t1) = part.dims;
            let mut o = vec![0f32; group * (t1 - t0)];
            let vs = &part.data[klo * part.stride..n * part.stride];
            weighted_values(
                &p[lo..],
                ws,
                group,
                vs,
                part.stride,
                t1 - t0,
                &mut o,
                t1 - t0,
            );
            o
        })
        .collect();
    for (t, o) in done.iter().enumerate() {
        let (g, (t0, t1)) = (t / PARTS, dims[t % PARTS]);
        for r in 0..group {
            let h = g * group + r;
            out[h * d + t0..h * d + t1].copy_from_slice(&o[r * (t1 - t0)..(r + 1) * (t1 - t0)]);
        }
    }
    // Probabilities and column sums from each KV head's rows.
    let heads = || (0..n_kv_heads).map(|g| (g, softmaxed(g)));
    if let Some(pr) = probs {
        for (g, p) in heads() {
            for r in 0..group {
                let h = g * group + r;
                let dst = &mut pr[h * n..(h + 1) * n];
                dst[..klo].fill(0.0);
                dst[klo..].copy_from_slice(&p[r * ws + lo..r * ws + lo + w]);
            }
        }
    }
    if let Some(cs) = colsum {
        // A block of one row: its part is 0 + p, then added to the sum.
        let n_tracked = cs.len() / n_heads;
        let tracked = n_tracked.min(n);
        for (g, p) in heads() {
            for r in 0..group {
                let h = g * group + r;
                let csh = &mut cs[h * n_tracked..h * n_tracked + tracked];
                for j in klo..tracked {
                    csh[j] += 0.0 + p[r * ws + j - ks];
                }
            }
        }
    }
}

/// Keys as [`attend`] reads them.
#[derive(Clone, Copy)]
enum Keys<'a> {
    /// Panels of eight keys, each (d, 8), from key `k0` (a multiple of 8):
    /// `data[((j − k0)/8·d + t)·8 + (j − k0) mod 8]` = key j, dimension t.
    Panels { k0: usize, data: &'a [f32] },
    /// Plain (n, d) rows, packed 64 at a time as they are read (one query).
    Rows(&'a [f32]),
}

/// A run of a head's value dimensions: `data[j·stride + t − t0]` = value j,
/// dimension t, for t in `dims` (t0 .. t1).
#[derive(Clone, Copy)]
struct VPart<'a> {
    data: &'a [f32],
    stride: usize,
    dims: (usize, usize),
}

/// Keys from the panel holding `lo` to the end of the (n, d) rows `k`, as
/// panels: (k0, data) for [`Keys::Panels`].
fn pack_panels(k: &[f32], d: usize, lo: usize) -> (usize, Vec<f32>) {
    let n = k.len() / d;
    let k0 = lo & !7;
    let mut data = vec![0f32; (n - k0).div_ceil(8) * 8 * d];
    pack_keys(&k[k0 * d..], d, &mut data);
    (k0, data)
}

simd_fn! {
    /// `dst` (ceil(n / 8), d, 8) = the (n, d) rows of `k` as panels of
    /// eight (`dst` holds whole panels; lanes past the last key are left as
    /// they are). Data movement only.
    fn pack_keys(k: &[f32], d: usize, dst: &mut [f32]) = pack_keys_impl;
}

#[inline(always)]
fn pack_keys_impl<S: Simd>(k: &[f32], d: usize, dst: &mut [f32]) {
    let n = k.len() / d;
    assert!(dst.len() >= n.div_ceil(8) * 8 * d);
    let body = d - d % 8;
    for (p, keys) in k.chunks(8 * d).enumerate() {
        let panel = &mut dst[p * 8 * d..(p + 1) * 8 * d];
        // Keys stream from memory (decode): ask for the panel KEYS_AHEAD / 8
        // panels on.
        let ahead = keys.as_ptr().wrapping_add(KEYS_AHEAD * d).cast::<u8>();
        for line in (0..32 * d).step_by(64) {
            S::prefetch(ahead.wrapping_add(line));
        }
        if keys.len() == 8 * d {
            for c in (0..body).step_by(8) {
                // SAFETY: keys holds 8 rows of d >= c + 8; panel 8d elements.
                unsafe {
                    let r: [S::F; 8] = [
                        S::load(keys.as_ptr().add(c)),
                        S::load(keys.as_ptr().add(d + c)),
                        S::load(keys.as_ptr().add(2 * d + c)),
                        S::load(keys.as_ptr().add(3 * d + c)),
                        S::load(keys.as_ptr().add(4 * d + c)),
                        S::load(keys.as_ptr().add(5 * d + c)),
                        S::load(keys.as_ptr().add(6 * d + c)),
                        S::load(keys.as_ptr().add(7 * d + c)),
                    ];
                    let t = S::transpose8(r);
                    for (i, v) in t.iter().enumerate() {
                        S::store(panel.as_mut_ptr().add((c + i) * 8), *v);
                    }
                }
            }
            for t in body..d {
                for l in 0..8 {
                    panel[t * 8 + l] = keys[l * d + t];
                }
            }
        } else {
            for (l, key) in keys.chunks_exact(d).enumerate() {
                for (t, x) in key.iter().enumerate() {
                    panel[t * 8 + l] = *x;
                }
            }
        }
    }
}

/// Query rows (rows, d) at positions p0 .. p0 + rows over `keys` and the
/// value parts `values` (together the head's d dimensions): out (rows, d);
/// `probs` (rows, n), zero outside each query's keys; `part` (tracked,):
/// `+= P[i, j]` over the rows in order.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    keys: Keys<'_>,
    values: &[VPart<'_>],
    d: usize,
    p0: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    probs: Option<&mut [f32]>,
    part: Option<&mut [f32]>,
) {
    let rows = q.len() / d;
    let pos = |i: usize| p0 + i;
    let (klo, khi) = (key_start(p0, window), p0 + rows);
    SCRATCH.with(|cell| {
        let mut fresh = Vec::new();
        let mut held = cell.try_borrow_mut();
        let s: &mut Vec<f32> = match held.as_deref_mut() {
            Ok(v) => v,
            Err(_) => &mut fresh,
        };
        // Score columns cover keys ks .. ks + ws (whole panels): the keys
        // before a query's window start and after its position get 0.
        let ks = match keys {
            Keys::Panels { .. } => klo & !7,
            Keys::Rows(_) => klo,
        };
        let ws = (khi - ks).div_ceil(8) * 8;
        s.clear();
        s.resize(rows * ws, 0.0);
        match keys {
            Keys::Panels { k0, data } => {
                assert!(ks >= k0);
                let at = (ks - k0) * d;
                scores(q, &data[at..at + ws * d], d, s, ws, false);
            }
            Keys::Rows(k) => {
                // Pack 64 keys at a time into a small buffer.
                let mut panel = [0f32; 8 * 64];
                let mut big = Vec::new();
                let buf: &mut [f32] = if 64 * d <= panel.len() {
                    &mut panel[..64 * d]
                } else {
                    big.resize(64 * d, 0.0);
                    &mut big
                };
                for j0 in (klo..khi).step_by(64) {
                    let nk = (khi - j0).min(64);
                    let np = nk.div_ceil(8);
                    pack_keys(&k[j0 * d..(j0 + nk) * d], d, &mut buf[..np * 8 * d]);
                    let cols = &mut s[j0 - klo..];
                    scores(q, &buf[..np * 8 * d], d, cols, ws, false);
                }
            }
        }
        for (i, row) in s.chunks_exact_mut(ws).enumerate() {
            let t = pos(i);
            let (lo, valid) = (key_start(t, window) - ks, t + 1 - ks);
            row[..lo].fill(0.0);
            softmax_row(&mut row[lo..valid], scale);
            row[valid..].fill(0.0);
        }
        let cols = khi - ks;
        for vp in values {
            let (t0, t1) = vp.dims;
            let vs = &vp.data[ks * vp.stride..khi * vp.stride];
            weighted_values(s, ws, rows, vs, vp.stride, t1 - t0, &mut out[t0..], d);
        }
        if let Some(part) = part.filter(|p| p.len() > ks) {
            let m = (part.len() - ks).min(cols);
            for row in s.chunks_exact(ws) {
                for (c, p) in part[ks..ks + m].iter_mut().zip(&row[..m]) {
                    *c += *p;
                }
            }
        }
        if let Some(probs) = probs {
            let n = probs.len() / rows;
            for (pr, row) in probs.chunks_exact_mut(n).zip(s.chunks_exact(ws)) {
                pr[..ks].fill(0.0);
                pr[ks..khi].copy_from_slice(&row[..cols]);
                pr[khi..].fill(0.0);
            }
        }
    });
}

thread_local! {
    /// Score rows, kept between calls on a thread.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

simd_fn! {
    /// Softmax of one row of scores in place: p_j = e^(x_j·scale − m) / z
    /// with m = max_j x_j · scale, the exponentials by
    /// [`super::simd::exp`] (within 1.011 ulp), z their f64 sum in eight
    /// lanes (j mod 8, from the row's start) added by a fixed tree, and
    /// 1/z rounded to f32 once.
    pub fn softmax_row(row: &mut [f32], scale: f32) = softmax_row_impl;
}

#[inline(always)]
fn softmax_row_impl<S: Simd>(row: &mut [f32], scale: f32) {
    let n = row.len();
    if n == 0 {
        return;
    }
    let body = n - n % 8;
    let ninf = f32::NEG_INFINITY;
    // The tail, padded with -inf (exp gives 0, which adds nothing).
    let mut tail = [ninf; 8];
    tail[..n - body].copy_from_slice(&row[body..]);
    let mut mv = S::splat(ninf);
    for c in row[..body].chunks_exact(8) {
        // SAFETY: c holds 8 elements.
        mv = S::max(mv, unsafe { S::load(c.as_ptr()) });
    }
    mv = S::max(mv, unsafe { S::load(tail.as_ptr()) });
    let mx = S::splat(S::hmax(mv) * scale);
    let sc = S::splat(scale);
    let mut z = (S::dzero(), S::dzero());
    for c in row[..body].chunks_exact_mut(8) {
        // SAFETY: c holds 8 elements.
        z = unsafe { exp_step::<S>(c.as_mut_ptr(), sc, mx, z) };
    }
    // SAFETY: the tail buffer holds 8 elements.
    z = unsafe { exp_step::<S>(tail.as_mut_ptr(), sc, mx, z) };
    row[body..].copy_from_slice(&tail[..n - body]);
    let inv = (1.0 / S::dsum(z)) as f32;
    let iv = S::splat(inv);
    for c in row[..body].chunks_exact_mut(8) {
        // SAFETY: c holds 8 elements.
        unsafe { S::store(c.as_mut_ptr(), S::mul(S::load(c.as_ptr()), iv)) };
    }
    row[body..].iter_mut().for_each(|x| *x *= inv);
}

/// p[0..8] = e^(p·scale − mx), returning z plus them (f64 lanes).
#[inline(always)]
unsafe fn exp_step<S: Simd>(p: *mut f32, sc: S::F, mx: S::F, z: (S::D, S::D)) -> (S::D, S::D) {
    let e = exp::<S>(S::sub(S::mul(S::load(p), sc), mx));
    S::store(p, e);
    S::dacc(z, e)
}

// ---- micro-kernels: per output element one fused chain, whatever the tile.

/// Rows of query micro-tiles.
const MR: usize = 6;

/// Keys per cache block of the many-row scores (a block of packed keys,
/// 128 · d f32, is reused from L1/L2 by every row tile).
const KC: usize = 128;

/// Keys per cache block of the many-row weighted values (64 value rows).
const KV: usize = 64;

/// s (R, ·) at `s` (row stride ws), columns 0 .. 8P = q (R, d) · the P key
/// panels at `kp` (each (d, 8)): one fused chain over t per element.
#[inline(always)]
unsafe fn qk_tile<S: Simd, const R: usize, const P: usize>(
    q: *const f32,
    d: usize,
    kp: *const f32,
    s: *mut f32,
    ws: usize,
    stream: bool,
) {
    let mut acc = [[S::zero(); P]; R];
    for t in 0..d {
        if stream && t % 2 == 0 {
            // Keys stream from memory (decode): ask for each panel's line
            // KEYS_AHEAD keys on (the hardware prefetchers lose track of
            // a tile's interleaved panels).
            for p in 0..P {
                S::prefetch(kp.wrapping_add((p * d + t) * 8 + KEYS_AHEAD * d).cast());
            }
        }
        let mut b = [S::zero(); P];
        for (p, bp) in b.iter_mut().enumerate() {
            *bp = S::load(kp.add((p * d + t) * 8));
        }
        for (r, ar) in acc.iter_mut().enumerate() {
            let a = S::splat(*q.add(r * d + t));
            for (x, bp) in ar.iter_mut().zip(&b) {
                *x = S::fma(a, *bp, *x);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (p, x) in ar.iter().enumerate() {
            S::store(s.add(r * ws + 8 * p), *x);
        }
    }
}

simd_fn! {
    /// s (rows, ·) with row stride `ws`, its first kp.len() / d columns =
    /// q (rows, d) · the keys in `kp` (whole panels). `stream`: the keys
    /// come from memory once (decode), so the kernel prefetches them.
    fn scores(q: &[f32], kp: &[f32], d: usize, s: &mut [f32], ws: usize, stream: bool) = scores_impl;
}

#[inline(always)]
fn scores_impl<S: Simd>(q: &[f32], kp: &[f32], d: usize, s: &mut [f32], ws: usize, stream: bool) {
    let rows = q.len() / d;
    let cols = kp.len() / d;
    assert!(cols.is_multiple_of(8) && cols <= ws && q.len() == rows * d);
    assert!(rows == 0 || s.len() >= (rows - 1) * ws + cols);
    let np = cols / 8;
    macro_rules! tile {
        ($r:literal, $p:literal, $r0:expr, $p0:expr) => {
            // SAFETY: rows r0 .. r0 + R of q and s, panels p0 .. p0 + P,
            // checked above.
            unsafe {
                qk_tile::<S, $r, $p>(
                    q.as_ptr().add($r0 * d),
                    d,
                    kp.as_ptr().add($p0 * 8 * d),
                    s.as_mut_ptr().add($r0 * ws + 8 * $p0),
                    ws,
                    stream,
                )
            }
        };
    }
    if rows == 1 {
        // One query: eight panels at a time (eight independent chains).
        let mut p0 = 0;
        while p0 + 8 <= np {
            tile!(1, 8, 0, p0);
            p0 += 8;
        }
        while p0 < np {
            tile!(1, 1, 0, p0);
            p0 += 1;
        }
        return;
    }
    // Blocks of KC keys, each reused by every row tile.
    for c0 in (0..np).step_by(KC / 8) {
        let c1 = (c0 + KC / 8).min(np);
        for r0 in (0..rows).step_by(MR) {
            let mut p0 = c0;
            let r = (rows - r0).min(MR);
            // Two or three rows (a GQA group of one-query heads, a block's
            // last rows): four panels per tile, twelve chains.
            while r <= 3 && r > 1 && p0 + 4 <= c1 {
                match r {
                    3 => tile!(3, 4, r0, p0),
                    _ => tile!(2, 4, r0, p0),
                }
                p0 += 4;
            }
            while p0 < c1 {
                let two = p0 + 2 <= c1;
                match (r, two) {
                    (6, true) => tile!(6, 2, r0, p0),
                    (5, true) => tile!(5, 2, r0, p0),
                    (4, true) => tile!(4, 2, r0, p0),
                    (3, true) => tile!(3, 2, r0, p0),
                    (2, true) => tile!(2, 2, r0, p0),
                    (1, true) => tile!(1, 2, r0, p0),
                    (6, false) => tile!(6, 1, r0, p0),
                    (5, false) => tile!(5, 1, r0, p0),
                    (4, false) => tile!(4, 1, r0, p0),
                    (3, false) => tile!(3, 1, r0, p0),
                    (2, false) => tile!(2, 1, r0, p0),
                    _ => tile!(1, 1, r0, p0),
                }
                p0 += if two { 2 } else { 1 };
            }
        }
    }
}

/// Keys ahead that decode's key packing and weighted values ask the memory
/// for: far enough to cover a DRAM access at the rate these loops read.
const KEYS_AHEAD: usize = 64;
const PV_AHEAD: usize = 64;

/// out (R, 8V) at `o` (row stride `os`) = p (nk, R) at `p` (the R rows'
/// weights interleaved per key) · v (nk, ·) at `v` (row stride `vs`), added
/// to what `o` holds unless `first`: one fused chain over the keys per
/// element.
#[inline(always)]
unsafe fn pv_tile<S: Simd, const R: usize, const V: usize>(
    p: *const f32,
    nk: usize,
    (v, vs): (*const f32, usize),
    (o, os): (*mut f32, usize),
    first: bool,
) {
    let mut acc = [[S::zero(); V]; R];
    if !first {
        for (r, ar) in acc.iter_mut().enumerate() {
            for (u, x) in ar.iter_mut().enumerate() {
                *x = S::load(o.add(r * os + 8 * u));
            }
        }
    }
    for j in 0..nk {
        // Values stream from memory (decode): ask for the row PV_AHEAD keys
        // on, every line of it this tile reads.
        let ahead = v.wrapping_add((j + PV_AHEAD) * vs);
        for line in (0..8 * V).step_by(16) {
            S::prefetch(ahead.wrapping_add(line).cast());
        }
        let mut b = [S::zero(); V];
        for (u, bu) in b.iter_mut().enumerate() {
            *bu = S::load(v.add(j * vs + 8 * u));
        }
        for (r, ar) in acc.iter_mut().enumerate() {
            let a = S::splat(*p.add(j * R + r));
            for (x, bu) in ar.iter_mut().zip(&b) {
                *x = S::fma(a, *bu, *x);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (u, x) in ar.iter().enumerate() {
            S::store(o.add(r * os + 8 * u), *x);
        }
    }
}

/// pi[j·R + r] = src[r·ws + j] for j < jn.
#[inline(always)]
fn interleave<const R: usize>(src: &[f32], ws: usize, jn: usize, pi: &mut [f32]) {
    let rows: [&[f32]; R] = core::array::from_fn(|r| &src[r * ws..r * ws + jn]);
    for (j, dst) in pi[..jn * R].chunks_exact_mut(R).enumerate() {
        for (x, row) in dst.iter_mut().zip(&rows) {
            *x = row[j];
        }
    }
}

simd_fn! {
    /// out (rows, w) with row stride `os` = p (rows, ws; its first nk
    /// columns) · v (nk, w) with row stride `vs`, nk = v.len() / vs: per
    /// element one fused chain over the keys in order.
    fn weighted_values(p: &[f32], ws: usize, rows: usize, v: &[f32], vs: usize, w: usize, out: &mut [f32], os: usize) = weighted_values_impl;
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weighted_values_impl<S: Simd>(
    p: &[f32],
    ws: usize,
    rows: usize,
    v: &[f32],
    vs: usize,
    w: usize,
    out: &mut [f32],
    os: usize,
) {
    if rows == 0 || w == 0 {
        return;
    }
    assert!(w <= vs && w <= os);
    let nk = v.len() / vs;
    assert_eq!(nk * vs, v.len(), "weighted values: v is not (nk, stride)");
    assert!(nk <= ws && p.len() >= (rows - 1) * ws + nk);
    assert!(
        out.len() >= (rows - 1) * os + w,
        "weighted values: out is not (rows, w)"
    );
    // Whole vectors 0 .. nv of each row.
    let nv = w / 8;
    // The rows of a tile, interleaved per key: pi[j·R + r] = p[r, j].
    let mut pi = [0f32; MR * KV];
    macro_rules! tile {
        ($r:literal, $v:literal, $r0:expr, $u0:expr, $j0:expr, $jn:expr) => {
            // SAFETY: pi holds jn·R weights; dimensions 8u0 .. 8(u0 + V) <= d
            // of rows r0 .. r0 + R of out; keys j0 .. j0 + jn of v.
            unsafe {
                pv_tile::<S, $r, $v>(
                    pi.as_ptr(),
                    $jn,
                    (v.as_ptr().add($j0 * vs + 8 * $u0), vs),
                    (out.as_mut_ptr().add($r0 * os + 8 * $u0), os),
                    $j0 == 0,
                )
            }
        };
    }
    if nv > 0 {
        for j0 in (0..nk).step_by(KV) {
            let jn = (nk - j0).min(KV);
            for r0 in (0..rows).step_by(MR) {
                let r = (rows - r0).min(MR);
                let src = &p[r0 * ws + j0..];
                match r {
                    1 => pi[..jn].copy_from_slice(&src[..jn]),
                    2 => interleave::<2>(src, ws, jn, &mut pi),
                    3 => interleave::<3>(src, ws, jn, &mut pi),
                    4 => interleave::<4>(src, ws, jn, &mut pi),
                    5 => interleave::<5>(src, ws, jn, &mut pi),
                    _ => interleave::<6>(src, ws, jn, &mut pi),
                }
                let mut u0 = 0;
                while u0 < nv {
                    // Twelve chains or fewer per tile: one row, up to 64
                    // dimensions per pass over the keys; two, 32; three,
                    // 24; more, 16. (Two rows × 48 and three × 32, twelve
                    // chains with their six or four value vectors, spilled
                    // registers to the stack at every key.)
                    let step = match r {
                        1 => 8,
                        2 => 4,
                        3 => 3,
                        _ => 2,
                    }
                    .min(nv - u0);
                    match (r, step) {
                        (1, 8) => tile!(1, 8, r0, u0, j0, jn),
                        (1, 7) => tile!(1, 7, r0, u0, j0, jn),
                        (1, 6) => tile!(1, 6, r0, u0, j0, jn),
                        (1, 5) => tile!(1, 5, r0, u0, j0, jn),
                        (1, 4) => tile!(1, 4, r0, u0, j0, jn),
                        (1, 3) => tile!(1, 3, r0, u0, j0, jn),
                        (1, 2) => tile!(1, 2, r0, u0, j0, jn),
                        (1, _) => tile!(1, 1, r0, u0, j0, jn),
                        (3, 3) => tile!(3, 3, r0, u0, j0, jn),
                        (2, 4) => tile!(2, 4, r0, u0, j0, jn),
                        (2, 3) => tile!(2, 3, r0, u0, j0, jn),
                        (6, 2) => tile!(6, 2, r0, u0, j0, jn),
                        (5, 2) => tile!(5, 2, r0, u0, j0, jn),
                        (4, 2) => tile!(4, 2, r0, u0, j0, jn),
                        (3, 2) => tile!(3, 2, r0, u0, j0, jn),
                        (2, 2) => tile!(2, 2, r0, u0, j0, jn),
                        (6, _) => tile!(6, 1, r0, u0, j0, jn),
                        (5, _) => tile!(5, 1, r0, u0, j0, jn),
                        (4, _) => tile!(4, 1, r0, u0, j0, jn),
                        (3, _) => tile!(3, 1, r0, u0, j0, jn),
                        _ => tile!(2, 1, r0, u0, j0, jn),
                    }
                    u0 += step;
                }
            }
        }
        if nk == 0 {
            for r in 0..rows {
                out[r * os..r * os + 8 * nv].fill(0.0);
            }
        }
    }
    // Dimensions past the last multiple of 8: the same chain, in scalars.
    for t in 8 * nv..w {
        for r in 0..rows {
            let mut acc = 0f32;
            for j in 0..nk {
                acc = p[r * ws + j].mul_add(v[j * vs + t], acc);
            }
            out[r * os + t] = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// softmax(scale q·k) v in f64, one query at a time.
    fn naive(q: &[f32], k: &[f32], v: &[f32], d: usize, pos0: usize, scale: f64) -> Vec<f64> {
        let c = q.len() / d;
        let mut out = vec![0f64; c * d];
        for i in 0..c {
            let n = pos0 + i + 1;
            let l: Vec<f64> = (0..n)
                .map(|j| {
                    scale
                        * (0..d)
                            .map(|t| q[i * d + t] as f64 * k[j * d + t] as f64)
                            .sum::<f64>()
                })
                .collect();
            let mx = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = l.iter().map(|x| (x - mx).exp()).sum();
            for j in 0..n {
                let w = (l[j] - mx).exp() / z;
                for t in 0..d {
                    out[i * d + t] += w * v[j * d + t] as f64;
                }
            }
        }
        out
    }

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.731).sin() * 2.0)
            .collect()
    }

    #[test]
    fn matches_naive_with_offset_and_stats() {
        let (d, pos0, c) = (8, 5, 4);
        let n = pos0 + c;
        let (q, k, v) = (data(c * d, 0.1), data(n * d, 0.2), data(n * d, 0.3));
        let mut out = vec![0f32; c * d];
        let mut colsum = vec![0f32; 6];
        let mut probs = vec![0f32; c * n];
        let stats = AttentionStats {
            colsum: Some(&mut colsum),
            probs: Some(&mut probs),
        };
        causal_attention_head(&q, &k, &v, d, pos0, 0.5, &mut out, stats);
        let want = naive(&q, &k, &v, d, pos0, 0.5);
        for (a, b) in out.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
        for i in 0..c {
            let row = &probs[i * n..(i + 1) * n];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(row[pos0 + i + 1..].iter().all(|x| *x == 0.0), "causal mask");
        }
        for j in 0..6 {
            let s: f32 = (0..c).map(|i| probs[i * n + j]).sum();
            assert!((colsum[j] - s).abs() < 1e-6);
        }
    }

    #[test]
    fn window_keeps_the_last_w_keys_counting_the_query() {
        // Window 3 at positions 0..6: the query at t sees keys t-2, t-1, t.
        let (d, pos0, c, w) = (4, 2, 4, 3);
        let n = pos0 + c;
        let (q, k, v) = (data(c * d, 0.4), data(n * d, 0.5), data(n * d, 0.6));
        let mut out = vec![0f32; c * d];
        let mut probs = vec![0f32; c * n];
        let stats = AttentionStats {
            colsum: None,
            probs: Some(&mut probs),
        };
        windowed_attention_head(&q, &k, &v, d, pos0, Some(w), 1.0, &mut out, stats);
        for i in 0..c {
            let t = pos0 + i;
            let row = &probs[i * n..(i + 1) * n];
            for (j, p) in row.iter().enumerate() {
                let live = j <= t && j + w > t;
                assert_eq!(*p > 0.0, live, "query {t} key {j}: {p}");
            }
            // Hand-computed: the output equals full causal attention over the
            // window's keys alone (positions t-2..=t as a 3-key sequence).
            let lo = t + 1 - w;
            let mut o1 = vec![0f32; d];
            causal_attention_head(
                &q[i * d..(i + 1) * d],
                &k[lo * d..(t + 1) * d],
                &v[lo * d..(t + 1) * d],
                d,
                w - 1,
                1.0,
                &mut o1,
                AttentionStats::default(),
            );
            for (a, b) in out[i * d..(i + 1) * d].iter().zip(&o1) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        }
        // Two keys, window 1: each query attends to itself only.
        let (q, k, v) = (data(2 * d, 1.0), data(2 * d, 2.0), data(2 * d, 3.0));
        let mut out = vec![0f32; 2 * d];
        windowed_attention_head(
            &q,
            &k,
            &v,
            d,
            0,
            Some(1),
            1.0,
            &mut out,
            AttentionStats::default(),
        );
        assert_eq!(out, v);
    }

    #[test]
    fn a_window_wider_than_the_sequence_is_plain_causal_attention() {
        let (d, pos0, c) = (8, 3, 5);
        let n = pos0 + c;
        let (q, k, v) = (data(c * d, 0.7), data(n * d, 0.8), data(n * d, 0.9));
        let (mut a, mut b) = (vec![0f32; c * d], vec![0f32; c * d]);
        causal_attention_head(&q, &k, &v, d, pos0, 0.3, &mut a, AttentionStats::default());
        windowed_attention_head(
            &q,
            &k,
            &v,
            d,
            pos0,
            Some(n),
            0.3,
            &mut b,
            AttentionStats::default(),
        );
        assert_eq!(a, b);
    }

    /// Every head of a layer in one parallel call equals the single-head
    /// kernel per head, bit for bit, for any thread count: chunks that are
    /// and are not multiples of ROWS, one query (decode), GQA, windows,
    /// column sums and probabilities.
    #[test]
    fn all_heads_in_parallel_equal_one_head_at_a_time() {
        let (nh, nkv, cap) = (6, 2, 300);
        for &(d, c, pos0, window) in &[
            (12, 70usize, 5usize, None),
            (12, 1, 200, None),
            (12, 1, 200, Some(17usize)),
            // a decode window whose first key is off a panel boundary
            (12, 1, 203, Some(18)),
            (64, 1, 203, Some(18)),
            (5, 1, 203, Some(18)),
            (12, 33, 100, Some(40)),
            (72, 33, 100, Some(40)),
            (12, 64, 0, None),
            (5, 9, 290, None),
        ] {
            let n = pos0 + c;
            let q = data(nh * c * d, 0.11);
            let (k, v) = (data(nkv * cap * d, 0.21), data(nkv * cap * d, 0.31));
            // The cache in attention's layout, every position written.
            let (mut kc, mut vc) = (
                vec![0f32; nkv * key_cache_len(cap, d)],
                vec![0f32; nkv * cap * d],
            );
            store_kv(&k, &v, (nkv, cap, d), 0, &mut kc, &mut vc);
            let tracked = 150;
            let cs0: Vec<f32> = data(nh * tracked, 0.41).iter().map(|x| x.abs()).collect();
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (mut o, mut cs, mut pr) =
                    (vec![0f32; q.len()], cs0.clone(), vec![0f32; nh * c * n]);
                pool.install(|| {
                    attention_heads(
                        &q,
                        &kc,
                        &vc,
                        (nh, nkv, cap, d),
                        pos0,
                        window,
                        0.3,
                        &mut o,
                        Some(&mut cs),
                        Some(&mut pr),
                    )
                });
                (o, cs, pr)
            };
            let (o, cs, pr) = run(2);
            assert!(
                run(1) == (o.clone(), cs.clone(), pr.clone()),
                "d={d} c={c}: threads"
            );
            assert!(
                run(3) == (o.clone(), cs.clone(), pr.clone()),
                "d={d} c={c}: threads"
            );
            let group = nh / nkv;
            for h in 0..nh {
                let g = h / group;
                let (mut oh, mut csh, mut prh) = (
                    vec![0f32; c * d],
                    cs0[h * tracked..(h + 1) * tracked].to_vec(),
                    vec![0f32; c * n],
                );
                windowed_attention_head(
                    &q[h * c * d..(h + 1) * c * d],
                    &k[g * cap * d..(g * cap + n) * d],
                    &v[g * cap * d..(g * cap + n) * d],
                    d,
                    pos0,
                    window,
                    0.3,
                    &mut oh,
                    AttentionStats {
                        colsum: Some(&mut csh),
                        probs: Some(&mut prh),
                    },
                );
                assert_eq!(oh, o[h * c * d..(h + 1) * c * d], "d={d} c={c} head {h}: o");
                assert_eq!(
                    csh,
                    cs[h * tracked..(h + 1) * tracked],
                    "d={d} c={c} head {h}: colsum"
                );
                assert_eq!(
                    prh,
                    pr[h * c * n..(h + 1) * c * n],
                    "d={d} c={c} head {h}: probs"
                );
            }
        }
    }

    /// `decode_reads` names every part of the cache a decode step reads:
    /// with everything else NaN, the step gives the same bits.
    #[test]
    fn decode_reads_cover_what_a_decode_step_reads() {
        let (nh, nkv, cap) = (6, 2, 300);
        for (d, pos, window) in [
            (64usize, 299usize, None),
            (12, 200, Some(17usize)),
            (12, 203, Some(18)),
            (5, 0, None),
            (72, 130, Some(40)),
        ] {
            let n = pos + 1;
            let q = data(nh * d, 0.12);
            let (k, v) = (data(nkv * cap * d, 0.22), data(nkv * cap * d, 0.32));
            let (mut kc, mut vc) = (
                vec![0f32; nkv * key_cache_len(cap, d)],
                vec![0f32; nkv * cap * d],
            );
            store_kv(&k, &v, (nkv, cap, d), 0, &mut kc, &mut vc);
            let step = |kc: &[f32], vc: &[f32]| {
                let (mut o, mut pr) = (vec![0f32; nh * d], vec![0f32; nh * n]);
                let shape = (nh, nkv, cap, d);
                attention_heads(
                    &q,
                    kc,
                    vc,
                    shape,
                    pos,
                    window,
                    0.3,
                    &mut o,
                    None,
                    Some(&mut pr),
                );
                (o, pr)
            };
            let want = step(&kc, &vc);
            let (mut kn, mut vn) = (vec![f32::NAN; kc.len()], vec![f32::NAN; vc.len()]);
            let reads = decode_reads(&kc, &vc, (nkv, cap, d), pos, window);
            assert_eq!(reads.len(), nkv * (1 + PARTS));
            for r in reads {
                let at =
                    |base: &[f32]| (r.as_ptr() as usize).wrapping_sub(base.as_ptr() as usize) / 4;
                let (src, dst, i) = if at(&kc) < kc.len() {
                    (&kc, &mut kn, at(&kc))
                } else {
                    (&vc, &mut vn, at(&vc))
                };
                dst[i..i + r.len()].copy_from_slice(&src[i..i + r.len()]);
            }
            let got = step(&kn, &vn);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.0), bits(&want.0), "d={d} pos={pos} {window:?}: o");
            assert_eq!(
                bits(&got.1),
                bits(&want.1),
                "d={d} pos={pos} {window:?}: probs"
            );
            // and the reads are no more than the step's keys and values,
            // rounded out to panels of eight keys
            let keys = n - key_start(pos, window);
            let read: usize = decode_reads(&kc, &vc, (nkv, cap, d), pos, window)
                .iter()
                .map(|r| r.len())
                .sum();
            assert!(read >= 2 * nkv * keys * d && read <= 2 * nkv * (keys + 14) * d);
        }
    }

    /// A cache written a chunk or a position at a time equals one written at
    /// once, and holds key j, dimension t and value j, dimension t where
    /// attention reads them (panels of eight keys; values by part).
    #[test]
    fn the_kv_cache_holds_each_position_where_attention_reads_it() {
        for (nkv, cap, d) in [
            (2usize, 21usize, 12usize),
            (1, 16, 64),
            (3, 9, 5),
            (1, 10, 72),
        ] {
            let (k, v) = (data(nkv * cap * d, 0.6), data(nkv * cap * d, 0.7));
            let kl = key_cache_len(cap, d);
            let fresh = || (vec![0f32; nkv * kl], vec![0f32; nkv * cap * d]);
            let (mut ka, mut va) = fresh();
            store_kv(&k, &v, (nkv, cap, d), 0, &mut ka, &mut va);
            // (heads, c, d) rows of positions p0 .. p0 + c
            let rows = |x: &[f32], p0: usize, c: usize| -> Vec<f32> {
                (0..nkv)
                    .flat_map(|g| x[(g * cap + p0) * d..(g * cap + p0 + c) * d].to_vec())
                    .collect()
            };
            for chunk in [1usize, 3, 8] {
                let (mut kb, mut vb) = fresh();
                for p0 in (0..cap).step_by(chunk) {
                    let c = chunk.min(cap - p0);
                    store_kv(
                        &rows(&k, p0, c),
                        &rows(&v, p0, c),
                        (nkv, cap, d),
                        p0,
                        &mut kb,
                        &mut vb,
                    );
                }
                assert!(ka == kb && va == vb, "d={d}: chunks of {chunk}");
            }
            let dims = value_dims(d);
            for g in 0..nkv {
                let parts = value_parts(&va, g, cap, d);
                for j in 0..cap {
                    for t in 0..d {
                        let want = (k[(g * cap + j) * d + t], v[(g * cap + j) * d + t]);
                        let key = ka[g * kl + ((j / 8) * d + t) * 8 + j % 8];
                        let i = dims.iter().position(|&(t0, t1)| t0 <= t && t < t1).unwrap();
                        let p = parts[i];
                        let value = p.data[j * p.stride + t - p.dims.0];
                        assert_eq!((key, value), want, "d={d} head {g} position {j} dim {t}");
                    }
                }
            }
        }
    }

    /// A query's output and probabilities are the same bits whether it comes
    /// alone (decode) or in a chunk of any size, with and without a window.
    #[test]
    fn a_query_does_not_depend_on_its_chunk() {
        for (d, window) in [
            (64usize, None),
            (12, Some(9usize)),
            (5, None),
            (72, Some(30)),
        ] {
            let (pos0, c) = (40, 45);
            let n = pos0 + c;
            let (q, k, v) = (data(c * d, 0.5), data(n * d, 0.6), data(n * d, 0.7));
            let mut all = vec![0f32; c * d];
            let mut pall = vec![0f32; c * n];
            let stats = AttentionStats {
                colsum: None,
                probs: Some(&mut pall),
            };
            windowed_attention_head(&q, &k, &v, d, pos0, window, 0.4, &mut all, stats);
            for i in 0..c {
                let t = pos0 + i;
                let mut one = vec![0f32; d];
                let mut p = vec![0f32; t + 1];
                let stats = AttentionStats {
                    colsum: None,
                    probs: Some(&mut p),
                };
                let (kk, vv) = (&k[..(t + 1) * d], &v[..(t + 1) * d]);
                windowed_attention_head(
                    &q[i * d..(i + 1) * d],
                    kk,
                    vv,
                    d,
                    t,
                    window,
                    0.4,
                    &mut one,
                    stats,
                );
                assert_eq!(one, all[i * d..(i + 1) * d], "d={d} query {i}: output");
                assert_eq!(
                    p,
                    pall[i * n..i * n + t + 1],
                    "d={d} query {i}: probabilities"
                );
            }
        }
    }

    /// The AVX2 lanes give the portable lanes' bits (scores, weighted
    /// values, softmax), on head sizes with and without a tail of d % 8.
    #[test]
    fn lanes_are_bit_identical() {
        use crate::cpu::simd::Portable;
        for (d, w) in [(64usize, 301usize), (12, 9), (5, 3), (256, 40)] {
            let rows = 7;
            let (q, k, v) = (data(rows * d, 1.5), data(w * d, 2.5), data(w * d, 3.5));
            let np = w.div_ceil(8);
            let mut kp = vec![0f32; np * 8 * d];
            pack_keys(&k, d, &mut kp);
            let (mut s1, mut s2) = (vec![0f32; rows * np * 8], vec![0f32; rows * np * 8]);
            scores(&q, &kp, d, &mut s1, np * 8, true);
            scores_impl::<Portable>(&q, &kp, d, &mut s2, np * 8, false);
            assert_eq!(s1, s2, "d={d} scores");
            let (mut o1, mut o2) = (vec![0f32; rows * d], vec![0f32; rows * d]);
            weighted_values(&s1, np * 8, rows, &v, d, d, &mut o1, d);
            weighted_values_impl::<Portable>(&s1, np * 8, rows, &v, d, d, &mut o2, d);
            assert_eq!(o1, o2, "d={d} outputs");
            let mut r1 = data(w, 4.5);
            let mut r2 = r1.clone();
            softmax_row(&mut r1, 1.7);
            softmax_row_impl::<Portable>(&mut r2, 1.7);
            assert_eq!(r1, r2, "softmax w={w}");
        }
    }

    /// Rows weighted together (tiles of 2 to 6 rows, each with its own pass
    /// width) give each row the bits it gets alone: every output is one
    /// chain of FMAs over the keys in order, whatever the tile.
    #[test]
    fn weighted_values_of_a_row_do_not_depend_on_its_tile() {
        for (d, nk) in [(64usize, 75usize), (256, 9), (40, 130), (12, 5)] {
            let v = data(nk * d, 0.3);
            for rows in 1..=MR {
                let p: Vec<f32> = data(rows * nk, rows as f32)
                    .iter()
                    .map(|x| x.abs())
                    .collect();
                let mut all = vec![0f32; rows * d];
                weighted_values(&p, nk, rows, &v, d, d, &mut all, d);
                for r in 0..rows {
                    let mut one = vec![0f32; d];
                    weighted_values(&p[r * nk..(r + 1) * nk], nk, 1, &v, d, d, &mut one, d);
                    assert_eq!(one, all[r * d..(r + 1) * d], "d={d} rows={rows} row {r}");
                }
            }
        }
    }

    #[test]
    fn first_position_attends_only_to_itself() {
        let d = 4;
        let (q, k, v) = (data(d, 1.0), data(d, 2.0), data(d, 3.0));
        let mut out = vec![0f32; d];
        causal_attention_head(&q, &k, &v, d, 0, 1.0, &mut out, AttentionStats::default());
        assert_eq!(out, v);
    }
}
