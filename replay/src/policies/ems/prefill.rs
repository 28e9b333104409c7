//! EMS at prefill: per-head global and local scores, then each head's
//! classification into class centres (with the to-be-merged tokens folded in),
//! the window and the evicted rest.

use kvreplay_kernels::cpu::l2_norm;

use super::config::{Ems, Score, Shape, Similarity, ZeroClass};
use super::entry::{unit, Entry, HeadState, Slot, EPS};
use crate::policy::{pool1d, Pool, PrefillCtx};
use crate::select::{ranked, Tie};

/// One KV head's prompt rows (n, d) as `build` reads them, the same at
/// every budget (the unit similarity vectors of the few rows a budget
/// compares are made by [`unit_rows`]).
struct Rows {
    /// Keys in the merge space (un-rotated in raw space).
    k_tilde: Vec<f32>,
    /// ‖k̃_j‖ + ε.
    kt_norm: Vec<f64>,
    /// ‖k_j‖ of the captured key.
    knorm: Vec<f32>,
}

/// x / (‖x‖ + ε) per element in f64, rounded to f32, appended to `out`.
fn unit32(x: &[f32], out: &mut Vec<f32>) {
    let nx = l2_norm(x) + EPS;
    out.extend(x.iter().map(|v| (*v as f64 / nx) as f32));
}

/// (s_glo, s_loc) of one query head over the prompt positions.
type Scores = (Vec<f64>, Vec<f64>);

/// Memo key: every query head's global and local scores for a window of `lw` rows.
#[derive(Debug, PartialEq)]
struct GlobalLocal {
    lw: usize,
}
impl crate::memo::MemoKey for GlobalLocal {
    type Value = Vec<Scores>;
}

/// Memo key: a KV head's [`Rows`] (they depend on the merge space, not on
/// the budget).
#[derive(Debug, PartialEq)]
struct KvRows {
    g: usize,
    raw: bool,
}
impl crate::memo::MemoKey for KvRows {
    type Value = Rows;
}

/// Memo key: one cache's combined scores and its prompt positions ranked
/// (from the mean scores of query heads `heads`, a window of `lw` rows,
/// pooled over `kernel`): the same at every budget with that window.
#[derive(Debug, PartialEq)]
struct Ranking {
    heads: std::ops::Range<usize>,
    lw: usize,
    kernel: usize,
    score: Score,
}

/// A cache's scores as [`Ems::build`] reads them: s_glo, s_loc, their
/// combination s, and the positions before the window ranked by pooled s.
struct Ranked {
    s_glo: Vec<f64>,
    s_loc: Vec<f64>,
    s: Vec<f64>,
    order: Vec<usize>,
}
impl crate::memo::MemoKey for Ranking {
    type Value = Ranked;
}

impl Ems {
    /// Every cache's state after prefill: scores per query head (column sums
    /// and last-window column sums), each cache scoring with the mean of its
    /// query heads' scores.
    pub(super) fn prefill_states(&self, ctx: &PrefillCtx, sh: &Shape) -> Vec<HeadState> {
        let n = ctx.prompt_len();
        let lw = sh.l_win.min(n);
        // Budget-independent for a given window: computed once per trace and layer.
        let per_head = ctx.memo(GlobalLocal { lw }, || {
            (0..ctx.n_heads())
                .map(|h| {
                    let glo: Vec<f64> = ctx.colsum(h).iter().map(|x| *x as f64).collect();
                    let rows = ctx.attn_rows(h, n - lw..n);
                    let mut loc = vec![0f64; n];
                    for row in rows.chunks_exact(n) {
                        loc.iter_mut().zip(row).for_each(|(a, x)| *a += *x as f64);
                    }
                    (glo, loc)
                })
                .collect::<Vec<Scores>>()
        });
        // Each cache scores with the mean of its query heads' scores (one head per
        // cache with per_query_head, the group's mean with per_kv_head).
        let mean_of = |heads: std::ops::Range<usize>, pick: fn(&Scores) -> &Vec<f64>| -> Vec<f64> {
            let k = heads.len() as f64;
            let mut out = vec![0f64; n];
            for h in heads {
                out.iter_mut()
                    .zip(pick(&per_head[h]))
                    .for_each(|(o, v)| *o += v / k);
            }
            out
        };
        // The KV head's rows, shared by the caches of its query heads and
        // by every budget.
        ctx.cache_units(self.per_query_head())
            .into_iter()
            .map(|(g, heads)| {
                let key = KvRows {
                    g,
                    raw: self.raw_space(),
                };
                let rows = ctx.memo(key, || self.rows(ctx, g, sh));
                let key = Ranking {
                    heads: heads.clone(),
                    lw,
                    kernel: self.kernel,
                    score: self.score,
                };
                let ranked = ctx.memo(key, || {
                    let (s_glo, s_loc) =
                        (mean_of(heads.clone(), |x| &x.0), mean_of(heads, |x| &x.1));
                    self.rank(s_glo, s_loc, n - lw)
                });
                self.build(ctx, g, &rows, &ranked, sh)
            })
            .collect()
    }

    /// A cache's combined scores s = combine(α, s_glo, s_loc), α the ratio
    /// of the mean s_loc to the mean s_glo, and the first `c_len` positions
    /// ranked by s average-pooled over the kernel (ties: the earlier
    /// position).
    fn rank(&self, s_glo: Vec<f64>, s_loc: Vec<f64>, c_len: usize) -> Ranked {
        let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
        let alpha = mean(&s_loc) / mean(&s_glo).max(1e-30);
        let s: Vec<f64> = s_glo
            .iter()
            .zip(&s_loc)
            .map(|(g, l)| self.combine(alpha, *g, *l))
            .collect();
        let order = if c_len == 0 {
            Vec::new()
        } else {
            let pooled = pool1d(
                &s[..c_len].iter().map(|x| *x as f32).collect::<Vec<_>>(),
                self.kernel,
                Pool::Avg,
            );
            ranked(&pooled, 0..c_len, |i| i, Tie::KeepEarlier)
        };
        Ranked {
            s_glo,
            s_loc,
            s,
            order,
        }
    }

    /// One KV head's prompt rows in the forms `build` reads: keys in the
    /// merge space (k̃), their norms, and each key's own norm.
    fn rows(&self, ctx: &PrefillCtx, g: usize, sh: &Shape) -> Rows {
        let (n, d) = (ctx.prompt_len(), sh.d);
        let mut r = Rows {
            k_tilde: Vec::with_capacity(n * d),
            kt_norm: Vec::with_capacity(n),
            knorm: Vec::with_capacity(n),
        };
        for j in 0..n {
            let kt = self.key_space(ctx.key(g, j), j, &sh.rope);
            r.kt_norm.push(l2_norm(&kt) + EPS);
            r.knorm.push(l2_norm(ctx.key(g, j)) as f32);
            r.k_tilde.extend_from_slice(&kt);
        }
        r
    }

    /// The unit similarity vectors (|idx|, d) of positions `idx` of KV head
    /// `g`: of the keys (k̃, or the captured key with `sim_pos`) or of the
    /// values.
    fn unit_rows(
        &self,
        ctx: &PrefillCtx,
        (g, d): (usize, usize),
        rows: &Rows,
        idx: &[usize],
        values: bool,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(idx.len() * d);
        for &j in idx {
            let x = match (values, self.sim_pos) {
                (true, _) => ctx.value(g, j),
                (false, true) => ctx.key(g, j),
                (false, false) => &rows.k_tilde[j * d..(j + 1) * d],
            };
            unit32(x, &mut out);
        }
        out
    }

    /// Build one head's state after prefill. `g` is the KV head; `s_glo`,
    /// `s_loc` are this head's scores over prompt positions.
    fn build(
        &self,
        ctx: &PrefillCtx,
        g: usize,
        rows: &Rows,
        ranked: &Ranked,
        sh: &Shape,
    ) -> HeadState {
        let n = ctx.prompt_len();
        let (s_glo, s_loc, s) = (&ranked.s_glo, &ranked.s_loc, &ranked.s);
        let d = sh.d;
        let k_tilde = |j: usize| &rows.k_tilde[j * d..(j + 1) * d];
        let mut st = HeadState {
            entries: Vec::new(),
            slots: Vec::new(),
            loc_counter: 0,
            windows: Default::default(),
            n_centres: 0,
            simt: Default::default(),
            valt: Default::default(),
        };
        let add_entry = |st: &mut HeadState,
                         dir: Vec<f32>,
                         val: Vec<f32>,
                         window: bool,
                         anchor: usize,
                         members: &[usize]| {
            let id = st.entries.len();
            let mut e = Entry::new(dir, val, window, anchor, false);
            e.refresh(self, &sh.rope);
            st.entries.push(Some(e));
            for &j in members {
                st.slots.push(Slot {
                    pos: j,
                    entry: id,
                    knorm: rows.knorm[j],
                    s_glo: s_glo[j],
                    s_loc_past: s_loc[j],
                    s_loc_cur: 0.0,
                });
            }
        };
        let singleton = |j: usize| unit(&k_tilde(j).iter().map(|x| *x as f64).collect::<Vec<_>>());
        let lw = sh.l_win.min(n);
        if n <= sh.n_budget {
            for j in 0..n {
                add_entry(
                    &mut st,
                    singleton(j),
                    ctx.value(g, j).to_vec(),
                    j >= n - lw,
                    j,
                    &[j],
                );
            }
        } else {
            let c_len = n - lw;
            // centres, then the to-be-merged band, by rank
            let order = &ranked.order;
            let mut imp: Vec<usize> = order[..sh.n_imp.min(c_len)].to_vec();
            imp.sort_unstable();
            let tbm_n = sh.n_tbm.min(c_len - imp.len());
            let tbm = &order[imp.len()..imp.len() + tbm_n];
            // cos⁺ of every (to-be-merged, centre) pair at once, from the unit
            // similarity vectors: (|tbm|, |imp|)
            let nc = imp.len();
            let pairs = |values: bool, used: bool| -> Vec<f32> {
                if !used || self.tau >= 1.0 {
                    return Vec::new();
                }
                let unit = |idx: &[usize]| self.unit_rows(ctx, (g, d), rows, idx, values);
                let mut out = vec![0f32; tbm.len() * nc];
                kvreplay_kernels::cpu::dot_rows(&unit(tbm), &unit(&imp), d, &mut out);
                out
            };
            let kdot = pairs(false, self.similarity.uses_keys());
            let vdot = pairs(true, self.similarity.uses_values());
            let mut members: Vec<Vec<usize>> = imp.iter().map(|&c| vec![c]).collect();
            let mut zero_members: Vec<usize> = Vec::new();
            // dest_i = the most redundant centre if R >= τ and τ < 1, else the zero class
            let mut r = vec![0f64; nc];
            for (ti, &i) in tbm.iter().enumerate() {
                let mut best = (0usize, -1.0f64);
                if self.tau < 1.0 {
                    let row = ti * nc..(ti + 1) * nc;
                    let pos = |x: &f32| (*x as f64).max(0.0);
                    match self.similarity {
                        Similarity::KeyValue => {
                            for ((o, k), v) in r.iter_mut().zip(&kdot[row.clone()]).zip(&vdot[row])
                            {
                                *o = pos(k) * pos(v);
                            }
                        }
                        Similarity::Key => {
                            r.iter_mut().zip(&kdot[row]).for_each(|(o, k)| *o = pos(k))
                        }
                        Similarity::Value => {
                            r.iter_mut().zip(&vdot[row]).for_each(|(o, v)| *o = pos(v))
                        }
                    }
                    for (ci, x) in r.iter().enumerate() {
                        if *x > best.1 {
                            best = (ci, *x);
                        }
                    }
                }
                if self.tau < 1.0 && best.1 >= self.tau {
                    members[best.0].push(i);
                } else if self.zero_class == ZeroClass::LiteralZero {
                    zero_members.push(i);
                }
            }
            // One entry per centre (members merged), then the window, in position order of anchors.
            for (ci, &c) in imp.iter().enumerate() {
                let mut m = members[ci].clone();
                m.sort_unstable();
                let total: f64 = m.iter().map(|&j| s[j]).sum();
                let w: Vec<f64> = if total > 0.0 {
                    m.iter().map(|&j| s[j] / total).collect()
                } else {
                    vec![1.0 / m.len() as f64; m.len()]
                };
                let (mut dir, mut val) = (vec![0f64; d], vec![0f64; d]);
                for (&j, wj) in m.iter().zip(&w) {
                    let kn = rows.kt_norm[j];
                    // the rows as slices: a loop that vectorises (the same
                    // operations per element)
                    let (kt, vr) = (k_tilde(j), ctx.value(g, j));
                    for ((dx, vx), (k, v)) in
                        dir.iter_mut().zip(val.iter_mut()).zip(kt.iter().zip(vr))
                    {
                        *dx += wj * *k as f64 / kn;
                        *vx += wj * *v as f64;
                    }
                }
                add_entry(
                    &mut st,
                    unit(&dir),
                    val.iter().map(|x| *x as f32).collect(),
                    false,
                    c,
                    &m,
                );
            }
            for j in c_len..n {
                add_entry(
                    &mut st,
                    singleton(j),
                    ctx.value(g, j).to_vec(),
                    true,
                    j,
                    &[j],
                );
            }
            if !zero_members.is_empty() {
                zero_members.sort_unstable();
                add_entry(
                    &mut st,
                    vec![0.0; d],
                    vec![0.0; d],
                    false,
                    zero_members[0],
                    &zero_members,
                );
                let z = st.entries.last_mut().unwrap().as_mut().unwrap();
                z.zero = true;
                z.refresh(self, &sh.rope);
            }
            st.slots.sort_by_key(|x| x.pos);
        }
        st.index();
        st
    }
}
