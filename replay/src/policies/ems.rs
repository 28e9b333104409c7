//! EMS: evict-then-merge with a global-local score, head-wise.
//!
//! Rule (docs/methods/ems.md, spec §2): per head, score tokens by
//! s = max(α·s_glo, s_loc) (accumulated attention over all prompt queries,
//! rescaled to the mean of the last-L_win-queries attention s_loc). After
//! prefill the older tokens split by the mean-pooled score into N_imp class
//! centres, N_tbm to-be-merged tokens and the evicted rest; the last L_win are
//! a window. Each to-be-merged token joins the centre with the largest
//! cos⁺(keys)·cos⁺(values) if that reaches τ, else it is evicted (zero class).
//! A centre stores one score-weighted unit key direction (in raw, pre-RoPE
//! space) and a weighted value; every member keeps a slot with its own key
//! norm, re-rotated at its own position when attended (about γ·N_budget slots
//! attend, N_budget entries are stored). Each decode step the token leaving the
//! window becomes a centre, the least important centre is merged into its most
//! similar centre (or freed), and the slot table is capped at γ·N_budget.

use std::sync::Arc;

use kvreplay_kernels::cpu::RopeCache;

use crate::info::{Build, Caps, Family, Phase, PolicyInfo};
use crate::cache::{HeadCache, F16_BITS};
use crate::policy::{pool1d, DecodeState, Policy, Pool, PrefillCtx, StepCtx};
use crate::params::{Kind, ParamInfo, Params};
use crate::ReplayError;

pub static INFO: PolicyInfo = PolicyInfo {
    name: "ems",
    summary: "head-wise evict-then-merge: global-local scores pick class centres; similar tokens merge into them, the rest are evicted",
    paper: "EMS: Adaptive Evict-then-Merge Strategy for Head-wise KV Cache Compression Based on Global-Local Importance (Li et al., arXiv 2412.08521)",
    params: &[
        ParamInfo { name: "window", default: "auto", kind: Kind::IntOr("auto"), help: "L_win: window kept and used for s_loc; auto = min(32, ⌊B/2⌋) (paper 32, requires B > L_win)" },
        ParamInfo { name: "tau", default: "0.6", kind: Kind::Float, help: "merge threshold on cos⁺·cos⁺ (≥ 1 evicts every candidate)" },
        ParamInfo { name: "gamma", default: "4", kind: Kind::FloatOr("inf"), help: "magnification: slots ≤ γ·N_budget, to-be-merged N_tbm = ⌊(γ−1)·N_budget⌋" },
        ParamInfo { name: "kernel", default: "7", kind: Kind::Int, help: "mean-pool width of the prefill ranking (odd)" },
        ParamInfo { name: "sim_pos", default: "false", kind: Kind::Bool, help: "similarity on post-RoPE keys (\"w. pos\") instead of raw keys" },
        ParamInfo { name: "gqa_mode", default: "per_query_head", kind: Kind::Choice(&["per_query_head", "per_kv_head"]), help: "one cache per query head (paper) or per KV head with group-mean attention" },
        ParamInfo { name: "merge_space", default: "raw", kind: Kind::Choice(&["raw", "post_rope"]), help: "merge un-rotated keys and re-rotate each member, or merge the captured keys" },
        ParamInfo { name: "demote_rank", default: "cluster_sum", kind: Kind::Choice(&["cluster_sum", "anchor_slot"]), help: "which centre is demoted at decode" },
        ParamInfo { name: "score", default: "global_local", kind: Kind::Choice(&["global_local", "global", "local"]), help: "Table 4 ablation of the score" },
        ParamInfo { name: "zero_class", default: "free", kind: Kind::Choice(&["free", "literal_zero"]), help: "evicted to-be-merged tokens: freed, or kept as zero key/value slots that still take softmax mass" },
        ParamInfo { name: "similarity", default: "key_value", kind: Kind::Choice(&["key_value", "key", "value"]), help: "Table 8 ablation of the redundancy measure" },
    ],
    caps: Caps { family: Family::Merging, phase: Phase::Decode, merges: true, per_query_head: true, holds_capacity: true, exact_when_covering: false, ..Caps::EVICT_PREFILL },
    test: "ems_merges_a_scaled_copy_of_a_centre",
    build: Build::Policy(|p| {
        Ok(Arc::new(Ems::from_params(p)?))
    }),
};

#[derive(Clone, Debug)]
pub struct Ems {
    pub window: Option<usize>,
    pub tau: f64,
    /// None = infinite.
    pub gamma: Option<f64>,
    pub kernel: usize,
    pub sim_pos: bool,
    pub per_query_head: bool,
    pub raw_space: bool,
    pub anchor_slot: bool,
    /// 0 global-local, 1 global, 2 local
    pub score: u8,
    /// 0 key·value, 1 key, 2 value
    pub similarity: u8,
    /// Zero-class members keep a zero key/value slot (ems.md A3) instead of being freed.
    pub literal_zero: bool,
}

impl Ems {
    fn from_params(p: &Params) -> Result<Ems, ReplayError> {
        let bad = |k: &str, v: String, m: &str| ReplayError::BadParam {
            policy: "ems".into(),
            key: k.into(),
            value: v,
            msg: m.into(),
        };
        let gamma = match p.word("gamma") {
            "inf" => None,
            _ => Some(p.float("gamma")?),
        };
        if gamma.is_some_and(|g| g < 1.0) {
            return Err(bad("gamma", p.word("gamma").into(), "must be at least 1"));
        }
        let kernel = p.int("kernel")?;
        if kernel % 2 == 0 {
            return Err(bad(
                "kernel",
                kernel.to_string(),
                "the pooling kernel must be odd",
            ));
        }
        let raw_space = p.word("merge_space") == "raw";
        let sim_pos = p.bool("sim_pos")?;
        Ok(Ems {
            window: if p.word("window") == "auto" {
                None
            } else {
                Some(p.int("window")?)
            },
            tau: p.float("tau")?,
            gamma,
            kernel,
            // with post-RoPE merging there are no raw keys to compare: similarity is positional
            sim_pos: sim_pos || !raw_space,
            per_query_head: p.word("gqa_mode") == "per_query_head",
            raw_space,
            anchor_slot: p.word("demote_rank") == "anchor_slot",
            score: match p.word("score") {
                "global" => 1,
                "local" => 2,
                _ => 0,
            },
            similarity: match p.word("similarity") {
                "key" => 1,
                "value" => 2,
                _ => 0,
            },
            literal_zero: p.word("zero_class") == "literal_zero",
        })
    }

    fn window(&self, b: usize) -> usize {
        self.window.unwrap_or(32.min(b / 2))
    }
}

const EPS: f64 = 1e-6;

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

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt()
}

fn unit(x: &[f64]) -> Vec<f32> {
    let n = x.iter().map(|v| v * v).sum::<f64>().sqrt();
    x.iter().map(|v| (v / (n + EPS)) as f32).collect()
}

#[derive(Clone, Debug)]
struct Entry {
    dir: Vec<f32>,
    val: Vec<f32>,
    window: bool,
    anchor: usize,
    /// The zero class (zero_class=literal_zero): zero key and value, nothing stored.
    zero: bool,
    /// Cached for the decode-time redundancy: the similarity vector of `dir`
    /// and the norms of it and of `val` (kept in step by `refresh`).
    sim: Vec<f32>,
    sim_norm: f64,
    val_norm: f64,
}

impl Entry {
    fn new(dir: Vec<f32>, val: Vec<f32>, window: bool, anchor: usize, zero: bool) -> Entry {
        Entry {
            dir,
            val,
            window,
            anchor,
            zero,
            sim: Vec::new(),
            sim_norm: 0.0,
            val_norm: 0.0,
        }
    }

    /// Recompute the cached similarity vector and norms after `dir` or `val` changed.
    fn refresh(&mut self, cfg: &Ems, rope: &Option<RopeCache>) {
        self.sim = cfg.sim_vec(&self.dir, self.anchor, rope);
        self.sim_norm = norm(&self.sim);
        self.val_norm = norm(&self.val);
    }
}

/// max(cos, 0) from cached norms (the same value as `cos_plus`).
fn cos_plus_normed(a: &[f32], na: f64, b: &[f32], nb: f64) -> f64 {
    let ab: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    (ab / (na * nb + EPS)).max(0.0)
}

#[derive(Clone, Debug)]
struct Slot {
    pos: usize,
    entry: usize,
    knorm: f32,
    s_glo: f64,
    s_loc_past: f64,
    s_loc_cur: f64,
    /// The expanded key, cached; empty when its entry's direction changed.
    key: Vec<f32>,
}

/// One head's state: stored entries (by id; None once deleted) and active slots in position order.
struct HeadState {
    entries: Vec<Option<Entry>>,
    slots: Vec<Slot>,
    loc_counter: usize,
}

struct Shape {
    d: usize,
    n_budget: usize,
    n_imp: usize,
    n_tbm: usize,
    s_max: usize,
    l_win: usize,
    rope: Option<RopeCache>,
}

impl Ems {
    /// Key as merged: raw (un-rotated at its position) or as captured.
    fn key_space(&self, k: &[f32], pos: usize, rope: &Option<RopeCache>) -> Vec<f32> {
        let mut x = k.to_vec();
        if self.raw_space {
            rope.as_ref()
                .expect("checked at prefill")
                .rotate(&mut x, pos, -1.0);
        }
        x
    }

    /// Similarity vector of an entry's direction (positional with sim_pos in raw space).
    fn sim_vec(&self, dir: &[f32], anchor: usize, rope: &Option<RopeCache>) -> Vec<f32> {
        let mut x = dir.to_vec();
        if self.sim_pos && self.raw_space {
            rope.as_ref()
                .expect("checked at prefill")
                .rotate(&mut x, anchor, 1.0);
        }
        x
    }

    fn combine(&self, alpha: f64, glo: f64, loc: f64) -> f64 {
        match self.score {
            1 => glo,
            2 => loc,
            _ => (alpha * glo).max(loc),
        }
    }

    /// Build one head's state after prefill. `g` is the KV head; `s_glo`,
    /// `s_loc` are this head's scores over prompt positions.
    fn build(
        &self,
        ctx: &PrefillCtx,
        g: usize,
        s_glo: &[f64],
        s_loc: &[f64],
        sh: &Shape,
    ) -> HeadState {
        let n = ctx.prompt_len();
        let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
        let alpha = mean(s_loc) / mean(s_glo).max(1e-30);
        let s: Vec<f64> = (0..n)
            .map(|j| self.combine(alpha, s_glo[j], s_loc[j]))
            .collect();
        let k_tilde: Vec<Vec<f32>> = (0..n)
            .map(|j| self.key_space(ctx.key(g, j), j, &sh.rope))
            .collect();
        let mut st = HeadState {
            entries: Vec::new(),
            slots: Vec::new(),
            loc_counter: 0,
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
                    knorm: norm(ctx.key(g, j)) as f32,
                    s_glo: s_glo[j],
                    s_loc_past: s_loc[j],
                    s_loc_cur: 0.0,
                    key: Vec::new(),
                });
            }
        };
        let singleton = |j: usize| unit(&k_tilde[j].iter().map(|x| *x as f64).collect::<Vec<_>>());
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
            let pooled = pool1d(
                &s[..c_len].iter().map(|x| *x as f32).collect::<Vec<_>>(),
                self.kernel,
                Pool::Avg,
            );
            let mut order: Vec<usize> = (0..c_len).collect();
            order.sort_by(|&a, &b| {
                pooled[b]
                    .partial_cmp(&pooled[a])
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.cmp(&b))
            });
            let mut imp: Vec<usize> = order[..sh.n_imp.min(c_len)].to_vec();
            imp.sort_unstable();
            let tbm_n = sh.n_tbm.min(c_len - imp.len());
            let tbm = &order[imp.len()..imp.len() + tbm_n];
            // Similarity vectors and values, normalised once: cos⁺ becomes a clamped dot product.
            let unit32 = |x: &[f32]| -> Vec<f32> {
                let n = norm(x) + EPS;
                x.iter().map(|v| (*v as f64 / n) as f32).collect()
            };
            let ksim: Vec<Vec<f32>> = (0..n)
                .map(|j| {
                    unit32(if self.sim_pos {
                        ctx.key(g, j)
                    } else {
                        &k_tilde[j]
                    })
                })
                .collect();
            let vsim: Vec<Vec<f32>> = (0..n).map(|j| unit32(ctx.value(g, j))).collect();
            // cos⁺ of every (to-be-merged, centre) pair at once: (|tbm|, |imp|)
            let nc = imp.len();
            let pairs = |v: &[Vec<f32>], used: bool| -> Vec<f32> {
                if !used || self.tau >= 1.0 {
                    return Vec::new();
                }
                let rows = |idx: &[usize]| -> Vec<f32> {
                    idx.iter().flat_map(|&j| v[j].iter().copied()).collect()
                };
                let mut out = vec![0f32; tbm.len() * nc];
                kvreplay_kernels::cpu::dot_rows(&rows(tbm), &rows(&imp), sh.d, &mut out);
                out
            };
            let kdot = pairs(&ksim, self.similarity != 2);
            let vdot = pairs(&vsim, self.similarity != 1);
            let redundancy = |ti: usize, ci: usize| -> f64 {
                let kc = || (kdot[ti * nc + ci] as f64).max(0.0);
                let vc = || (vdot[ti * nc + ci] as f64).max(0.0);
                match self.similarity {
                    1 => kc(),
                    2 => vc(),
                    _ => kc() * vc(),
                }
            };
            let mut members: Vec<Vec<usize>> = imp.iter().map(|&c| vec![c]).collect();
            let mut zero_members: Vec<usize> = Vec::new();
            // dest_i = the most redundant centre if R >= τ and τ < 1, else the zero class
            for (ti, &i) in tbm.iter().enumerate() {
                let mut best = (0usize, -1.0f64);
                if self.tau < 1.0 {
                    for ci in 0..imp.len() {
                        let r = redundancy(ti, ci);
                        if r > best.1 {
                            best = (ci, r);
                        }
                    }
                }
                if self.tau < 1.0 && best.1 >= self.tau {
                    members[best.0].push(i);
                } else if self.literal_zero {
                    zero_members.push(i);
                }
            }
            // One entry per centre (members merged), then the window, in position order of anchors.
            let d = sh.d;
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
                    let kn = norm(&k_tilde[j]) + EPS;
                    for x in 0..d {
                        dir[x] += wj * k_tilde[j][x] as f64 / kn;
                        val[x] += wj * ctx.value(g, j)[x] as f64;
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
        st
    }

    /// The engine's view of a head: one entry per active slot, in slot order.
    fn expand(&self, st: &mut HeadState, sh: &Shape) -> HeadCache {
        let mut c = HeadCache::new(sh.d);
        self.expand_into(st, sh, &mut c);
        c
    }

    /// [`expand`](Self::expand) into `c`, reusing its buffers.
    fn expand_into(&self, st: &mut HeadState, sh: &Shape, c: &mut HeadCache) {
        let d = sh.d;
        let aux = F16_BITS + ((sh.n_budget + 1) as f64).log2().ceil() as u64;
        c.d = d;
        c.keys.clear();
        c.values.clear();
        c.bias.clear();
        c.bits.clear();
        // member lists are reused in place (one position per slot)
        c.members.truncate(st.slots.len());
        let mut charged = vec![false; st.entries.len()];
        for s in st.slots.iter_mut() {
            let e = st.entries[s.entry]
                .as_ref()
                .expect("slots point at live entries");
            if s.key.is_empty() {
                s.key = e.dir.iter().map(|x| x * s.knorm).collect();
                if self.raw_space {
                    sh.rope
                        .as_ref()
                        .expect("checked")
                        .rotate(&mut s.key, s.pos, 1.0);
                }
            }
            c.keys.extend_from_slice(&s.key);
            c.values.extend_from_slice(&e.val);
            c.bias.push(0.0);
            let i = c.bias.len() - 1;
            match c.members.get_mut(i) {
                Some(m) => {
                    m.clear();
                    m.push(s.pos as u32);
                }
                None => c.members.push(vec![s.pos as u32]),
            }
            let entry_bits = if charged[s.entry] || e.zero {
                0
            } else {
                HeadCache::exact_bits(d)
            };
            charged[s.entry] = true;
            c.bits.push(entry_bits + aux);
        }
    }
}

impl Policy for Ems {
    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let (n, b, d) = (ctx.prompt_len(), ctx.budget, ctx.head_dim());
        let l_win = self.window(b);
        if b <= l_win {
            return Err(ReplayError::BadParam {
                policy: "ems".into(),
                key: "window".into(),
                value: l_win.to_string(),
                msg: format!("N_budget {b} must exceed the window L_win = {l_win}; lower `window` or raise the budget"),
            });
        }
        if self.raw_space && ctx.rope().is_none() {
            return Err(ReplayError::BadParam {
                policy: "ems".into(),
                key: "merge_space".into(),
                value: "raw".into(),
                msg:
                    "needs the trace's RoPE parameters to un-rotate keys; use merge_space=post_rope"
                        .into(),
            });
        }
        let n_tbm = match self.gamma {
            None => usize::MAX / 4,
            Some(g) => ((g - 1.0) * b as f64).floor() as usize,
        };
        let sh = Shape {
            d,
            n_budget: b,
            n_imp: b - l_win,
            n_tbm,
            s_max: b.saturating_add(n_tbm),
            l_win,
            rope: ctx.rope().map(RopeCache::new),
        };
        // Scores per query head: column sums and last-window column sums.
        let lw = l_win.min(n);
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
        let mut states: Vec<HeadState> = ctx
            .cache_units(self.per_query_head)
            .into_iter()
            .map(|(g, heads)| {
                self.build(
                    ctx,
                    g,
                    &mean_of(heads.clone(), |x| &x.0),
                    &mean_of(heads, |x| &x.1),
                    &sh,
                )
            })
            .collect();
        let caches = states.iter_mut().map(|st| self.expand(st, &sh)).collect();
        Ok((
            caches,
            Box::new(Decode {
                cfg: self.clone(),
                sh,
                states,
            }),
        ))
    }
}

struct Decode {
    cfg: Ems,
    sh: Shape,
    states: Vec<HeadState>,
}

impl Decode {
    fn sgl(&self, st: &HeadState) -> Vec<f64> {
        let n = st.slots.len() as f64;
        let mg = st.slots.iter().map(|s| s.s_glo).sum::<f64>() / n;
        let ml = st
            .slots
            .iter()
            .map(|s| s.s_loc_past + s.s_loc_cur)
            .sum::<f64>()
            / n;
        let alpha = ml / mg.max(1e-30);
        st.slots
            .iter()
            .map(|s| self.cfg.combine(alpha, s.s_glo, s.s_loc_past + s.s_loc_cur))
            .collect()
    }
}

impl DecodeState for Decode {
    #[allow(clippy::needless_range_loop)] // hi indexes the states and the caches alike
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for hi in 0..self.states.len() {
            let a: Vec<f32> = if self.cfg.per_query_head {
                ctx.probs[hi].clone()
            } else {
                ctx.group_mean(hi)
            };
            let c = &caches[hi];
            let last = c.len() - 1;
            let (k_new, v_new) = (c.key(last).to_vec(), c.value(last).to_vec());
            let (cfg, sh) = (&self.cfg, &self.sh);
            let st = &mut self.states[hi];
            // 1. the new token: a window entry and its slot
            let kt = cfg.key_space(&k_new, ctx.pos, &sh.rope);
            let id = st.entries.len();
            let mut e = Entry::new(
                unit(&kt.iter().map(|x| *x as f64).collect::<Vec<_>>()),
                v_new,
                true,
                ctx.pos,
                false,
            );
            e.refresh(cfg, &sh.rope);
            st.entries.push(Some(e));
            st.slots.push(Slot {
                pos: ctx.pos,
                entry: id,
                knorm: norm(&k_new) as f32,
                s_glo: 0.0,
                s_loc_past: 0.0,
                s_loc_cur: 0.0,
                key: Vec::new(),
            });
            // 3. scores (a covers every active slot, the new one last)
            for (s, x) in st.slots.iter_mut().zip(&a) {
                s.s_glo += *x as f64;
                s.s_loc_cur += *x as f64;
            }
            st.loc_counter += 1;
            if st.loc_counter == sh.l_win {
                for s in st.slots.iter_mut() {
                    s.s_loc_past = s.s_loc_cur;
                    s.s_loc_cur = 0.0;
                }
                st.loc_counter = 0;
            }
            // 4. the oldest window entry beyond L_win becomes a centre
            let mut windows: Vec<usize> = (0..st.entries.len())
                .filter(|&e| st.entries[e].as_ref().is_some_and(|x| x.window))
                .collect();
            windows.sort_by_key(|&e| st.entries[e].as_ref().unwrap().anchor);
            if windows.len() > sh.l_win {
                st.entries[windows[0]].as_mut().unwrap().window = false;
            }
            // 5. demote the least important centre
            let centres: Vec<usize> = (0..st.entries.len())
                .filter(|&e| st.entries[e].as_ref().is_some_and(|x| !x.window && !x.zero))
                .collect();
            if centres.len() > sh.n_imp {
                let sgl = self.sgl_of(hi);
                let st = &mut self.states[hi];
                // Per entry, in one pass over the slots: the cluster sum of sgl, the
                // sgl of the slot at the anchor, and the largest slot sgl.
                let n_e = st.entries.len();
                let (mut sums, mut at_anchor, mut best) =
                    (vec![0f64; n_e], vec![None; n_e], vec![f64::MIN; n_e]);
                for (sl, v) in st.slots.iter().zip(&sgl) {
                    sums[sl.entry] += v;
                    best[sl.entry] = best[sl.entry].max(*v);
                    if st.entries[sl.entry]
                        .as_ref()
                        .is_some_and(|e| e.anchor == sl.pos)
                    {
                        at_anchor[sl.entry] = Some(*v);
                    }
                }
                let cluster = |e: usize| sums[e];
                let rank = |e: usize| {
                    if cfg.anchor_slot {
                        at_anchor[e].unwrap_or(best[e])
                    } else {
                        sums[e]
                    }
                };
                let anchor = |e: usize| st.entries[e].as_ref().unwrap().anchor;
                let c = *centres
                    .iter()
                    .min_by(|&&x, &&y| {
                        rank(x)
                            .partial_cmp(&rank(y))
                            .unwrap_or(std::cmp::Ordering::Equal)
                            .then(anchor(x).cmp(&anchor(y)))
                    })
                    .unwrap();
                let mut target = None;
                if sh.n_tbm > 0 && cfg.tau < 1.0 {
                    let ec = st.entries[c].as_ref().unwrap();
                    let mut best: Option<(usize, f64)> = None;
                    for &e in centres.iter().filter(|&&e| e != c) {
                        let ee = st.entries[e].as_ref().unwrap();
                        let kc = || cos_plus_normed(&ec.sim, ec.sim_norm, &ee.sim, ee.sim_norm);
                        let vc = || cos_plus_normed(&ec.val, ec.val_norm, &ee.val, ee.val_norm);
                        let r = match cfg.similarity {
                            1 => kc(),
                            2 => vc(),
                            _ => kc() * vc(),
                        };
                        let better = match best {
                            None => true,
                            Some((b, rb)) => r > rb || (r == rb && ee.anchor < anchor(b)),
                        };
                        if better {
                            best = Some((e, r));
                        }
                    }
                    if let Some((e, r)) = best {
                        if r >= cfg.tau {
                            target = Some(e);
                        }
                    }
                }
                match target {
                    Some(t) => {
                        let (s_t, s_c) = (cluster(t), cluster(c));
                        let ec = st.entries[c].clone().unwrap();
                        let et = st.entries[t].as_mut().unwrap();
                        let den = s_t + s_c;
                        let (wt, wc) = if den > 0.0 {
                            (s_t / den, s_c / den)
                        } else {
                            (0.5, 0.5)
                        };
                        let dir: Vec<f64> = et
                            .dir
                            .iter()
                            .zip(&ec.dir)
                            .map(|(x, y)| s_t * *x as f64 + s_c * *y as f64)
                            .collect();
                        et.dir = unit(&dir);
                        et.val = et
                            .val
                            .iter()
                            .zip(&ec.val)
                            .map(|(x, y)| (wt * *x as f64 + wc * *y as f64) as f32)
                            .collect();
                        et.refresh(cfg, &sh.rope);
                        st.slots
                            .iter_mut()
                            .filter(|s| s.entry == c || s.entry == t)
                            .for_each(|s| {
                                s.entry = t;
                                s.key.clear();
                            });
                    }
                    None if cfg.literal_zero => {
                        let z = match st
                            .entries
                            .iter()
                            .position(|e| e.as_ref().is_some_and(|x| x.zero))
                        {
                            Some(z) => z,
                            None => {
                                let mut z = Entry::new(
                                    vec![0.0; sh.d],
                                    vec![0.0; sh.d],
                                    false,
                                    anchor(c),
                                    true,
                                );
                                z.refresh(cfg, &sh.rope);
                                st.entries.push(Some(z));
                                st.entries.len() - 1
                            }
                        };
                        st.slots.iter_mut().filter(|s| s.entry == c).for_each(|s| {
                            s.entry = z;
                            s.key.clear();
                        });
                    }
                    None => st.slots.retain(|s| s.entry != c),
                }
                st.entries[c] = None;
            }
            // 6. cap the slot table: drop the lowest-sgl slot of a centre that keeps another slot
            loop {
                if self.states[hi].slots.len() <= self.sh.s_max {
                    break;
                }
                let sgl = self.sgl_of(hi);
                let st = &mut self.states[hi];
                let mut counts = vec![0usize; st.entries.len()];
                st.slots.iter().for_each(|sl| counts[sl.entry] += 1);
                let count = |e: usize| counts[e];
                // zero-class slots go first (lowest sgl), then centre slots whose cluster keeps another
                let is_zero = |i: usize| st.entries[st.slots[i].entry].as_ref().unwrap().zero;
                let lowest = |pred: &dyn Fn(usize) -> bool| {
                    (0..st.slots.len()).filter(|&i| pred(i)).min_by(|&x, &y| {
                        sgl[x]
                            .partial_cmp(&sgl[y])
                            .unwrap_or(std::cmp::Ordering::Equal)
                            .then(st.slots[x].pos.cmp(&st.slots[y].pos))
                    })
                };
                let victim = lowest(&is_zero).or_else(|| {
                    lowest(&|i: usize| {
                        let e = st.slots[i].entry;
                        let en = st.entries[e].as_ref().unwrap();
                        !en.window && !en.zero && count(e) >= 2
                    })
                });
                match victim {
                    Some(i) => {
                        st.slots.remove(i);
                    }
                    None => break,
                }
            }
            self.cfg
                .expand_into(&mut self.states[hi], &self.sh, &mut caches[hi]);
        }
    }
}

impl Decode {
    fn sgl_of(&self, hi: usize) -> Vec<f64> {
        self.sgl(&self.states[hi])
    }
}
