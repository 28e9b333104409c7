//! The scorer layer: a scorer says how much each prompt position is worth
//! (one score per cache and position, higher is kept), and one selection
//! ([`TopK`]) turns scores into caches for every scorer: sinks and the recent
//! window inside the budget, the tie rule, per-layer or per-head budgets
//! (the allocation wrappers `pyramidkv` and `adakv`), decode-time eviction,
//! and CaM's merge of evicted values. A scorer is the kvpress `score()`
//! contract; everything else is written here once.

use std::ops::Range;
use std::sync::Arc;

use crate::cache::HeadCache;
use crate::policy::{AppendOnly, DecodeState, Policy, PrefillCtx, StepCtx};
use crate::select::{keep_positions, victim, Protect, Tie};
use crate::ReplayError;

/// One cache a scorer scores: its KV head and the query heads that read it
/// (the KV head's group, or a single query head for per-query-head caches).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    pub kv_head: usize,
    pub heads: Range<usize>,
}

/// The caches `s` scores at this layer: one per KV head, or one per query
/// head for a per-query-head scorer.
pub fn units(ctx: &PrefillCtx, s: &dyn Scorer) -> Vec<Unit> {
    units_of(ctx, s.per_query_head())
}

/// One unit per KV head (with its query group) or, with `per_query_head`,
/// one per query head ([`PrefillCtx::cache_units`] as [`Unit`]s).
pub fn units_of(ctx: &PrefillCtx, per_query_head: bool) -> Vec<Unit> {
    ctx.cache_units(per_query_head)
        .into_iter()
        .map(|(kv_head, heads)| Unit { kv_head, heads })
        .collect()
}

/// A finished prefill: the layer's caches and their decode state.
pub type Prefill = (Vec<HeadCache>, Box<dyn DecodeState>);

/// The caches a prefill-only wrapper around `s` compresses, or (`Err`) the
/// finished prefill when it compresses nothing at this layer: the prompt
/// fits the budget (`P <= B`) or the scorer skips the layer, so every cache
/// is kept whole and only appended to.
pub fn units_to_compress(ctx: &PrefillCtx, s: &dyn Scorer) -> Result<Vec<Unit>, Prefill> {
    let units = units(ctx, s);
    if ctx.prompt_len() <= ctx.budget || s.skip_layer(ctx.layer()) {
        let caches = units.iter().map(|u| ctx.full_cache(u.kv_head)).collect();
        return Err((caches, Box::new(AppendOnly)));
    }
    Ok(units)
}

/// How much each prompt position of a layer is worth.
pub trait Scorer: Send + Sync {
    /// Scores of `unit`'s prompt positions, indexed by position, higher kept.
    /// Protected positions (sinks, the recent window) are never read at
    /// prefill, so a prefill-only scorer's vector may stop before the window,
    /// (P − recent,); a decode-time scorer returns all (P,) (the kept
    /// positions' scores start its decode scores).
    fn score(&self, ctx: &PrefillCtx, unit: &Unit) -> Vec<f32>;

    /// How many of the last prompt positions' queries `score` reads (see
    /// [`Policy::prompt_queries`]); default: every row.
    fn prompt_queries(&self, prompt_len: usize, _budget: usize) -> usize {
        prompt_len
    }

    /// Positions kept inside budget `b` whatever their score.
    fn protect(&self, _b: usize) -> Result<Protect, ReplayError> {
        Ok(Protect::default())
    }

    /// Which of two equal scores survives.
    fn tie(&self) -> Tie {
        Tie::KeepLater
    }

    /// One cache per query head (the papers' `repeat_kv` mode) instead of one per KV head.
    fn per_query_head(&self) -> bool {
        false
    }

    /// [`Policy::budget_share`] of the scorer's caches: G for per-query-head
    /// caches that count `--budget` per KV head (`budget_per=kv_head`), else 1.
    fn budget_share(&self, _group: usize) -> usize {
        1
    }

    /// A layer left uncompressed (KNorm's first layers).
    fn skip_layer(&self, _layer: usize) -> bool {
        false
    }

    /// Whether the cache holds its budget during decode (then [`decoder`](Self::decoder)
    /// scores the entries and the lowest outside the protected ones is evicted).
    fn decode_evict(&self) -> bool {
        false
    }

    /// Decode-time scores, when [`decode_evict`](Self::decode_evict).
    fn decoder(&self, _ctx: &PrefillCtx, _sel: &Selected) -> Option<Box<dyn StepScorer>> {
        None
    }

    /// Entries evicted at once when the cache exceeds its budget (Scissorhands' m).
    fn evict_batch(&self) -> usize {
        1
    }

    /// The form whose scores are compared across heads (AdaKV's global
    /// top-k): SnapKV averages its window votes there instead of summing them.
    fn across_heads(&self) -> Option<Arc<dyn Scorer>> {
        None
    }
}

/// What the selection kept at prefill, per unit (cache).
pub struct Selected<'a> {
    pub units: &'a [Unit],
    /// Kept prompt positions, ascending.
    pub kept: &'a [Vec<usize>],
    /// The prefill scores, indexed by position.
    pub scores: &'a [Vec<f32>],
}

impl Selected<'_> {
    /// Unit u's prefill scores of its kept positions (the decode scores' start).
    pub fn kept_scores(&self, u: usize) -> Vec<f32> {
        self.kept[u].iter().map(|&i| self.scores[u][i]).collect()
    }
}

/// Decode-time scores of one layer's caches.
pub trait StepScorer: Send {
    /// After each step's attention, before any eviction: update what cache
    /// `c` keeps (its last entry is the step's new one).
    fn observe(&mut self, _ctx: &StepCtx, _c: usize, _cache: &HeadCache) {}
    /// Scores of cache `c`'s entries, (cache.len(),); asked only when the
    /// cache must evict.
    fn scores(&mut self, ctx: &StepCtx, c: usize, cache: &HeadCache) -> &[f32];
    /// Entry `e` of cache `c` was evicted.
    fn evicted(&mut self, _c: usize, _e: usize) {}
}

/// Equal scores for every entry: the tie rule alone picks the victim
/// (StreamingLLM's oldest non-sink entry).
#[derive(Default)]
pub struct Equal {
    zeros: Vec<f32>,
}

impl StepScorer for Equal {
    fn scores(&mut self, _: &StepCtx, _: usize, cache: &HeadCache) -> &[f32] {
        if self.zeros.len() < cache.len() {
            self.zeros.resize(cache.len(), 0.0);
        }
        &self.zeros[..cache.len()]
    }
}

/// A step scorer that computes its scores afresh when asked (no state).
pub struct Computed<F> {
    f: F,
    buf: Vec<f32>,
}

impl<F: FnMut(&StepCtx, usize, &HeadCache) -> Vec<f32> + Send> Computed<F> {
    pub fn boxed(f: F) -> Option<Box<dyn StepScorer>>
    where
        F: 'static,
    {
        Some(Box::new(Computed { f, buf: Vec::new() }))
    }
}

impl<F: FnMut(&StepCtx, usize, &HeadCache) -> Vec<f32> + Send> StepScorer for Computed<F> {
    fn scores(&mut self, ctx: &StepCtx, c: usize, cache: &HeadCache) -> &[f32] {
        self.buf = (self.f)(ctx, c, cache);
        &self.buf
    }
}

/// A scorer whose score of a position is a function of its key alone
/// (KNorm's −‖k‖₂): at decode, when `decode_evict`, every entry is rescored
/// from its stored key (so a quantised key is scored as stored).
pub struct KeyScorer {
    pub score: fn(&[f32]) -> f32,
    /// Layers left uncompressed.
    pub skip_layers: Vec<usize>,
    pub decode_evict: bool,
}

impl Scorer for KeyScorer {
    fn prompt_queries(&self, _: usize, _: usize) -> usize {
        0
    }
    fn score(&self, ctx: &PrefillCtx, u: &Unit) -> Vec<f32> {
        (0..ctx.prompt_len())
            .map(|i| (self.score)(ctx.key(u.kv_head, i)))
            .collect()
    }
    fn skip_layer(&self, layer: usize) -> bool {
        self.skip_layers.contains(&layer)
    }
    fn decode_evict(&self) -> bool {
        self.decode_evict
    }
    fn decoder(&self, _: &PrefillCtx, _: &Selected) -> Option<Box<dyn StepScorer>> {
        let f = self.score;
        Computed::boxed(move |_: &StepCtx, _: usize, c: &HeadCache| {
            (0..c.len()).map(|e| f(c.key(e))).collect()
        })
    }
}

/// How a layer's budget is spread over its caches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Allocation {
    /// B per cache.
    Uniform,
    /// PyramidKV: per-layer counts shrinking with depth (`kvpress`: kvpress
    /// PyramidKVPress's float schedule, protected entries counted inside).
    Pyramid { beta: usize, kvpress: bool },
    /// AdaKV: per-head counts from where the layer's top scores fall
    /// (`reserve_first`: kvpress AdaKVPress's safeguard, each head's top
    /// ⌊α·B⌋ entries, protected ones first, before the global top-k).
    Ada {
        alpha: f64,
        normalize: bool,
        reserve_first: bool,
    },
}

/// Something done to an entry just before it is evicted (CaM merges its value
/// into the entries that follow). Built per layer at prefill.
pub trait EvictMerge: Send + Sync {
    /// Prefill: `full` holds every prompt entry of `unit`; apply the evictions
    /// of the positions not in `keep`, then keep only `keep`. Returns the
    /// cache and the per-entry state the decode merges need.
    fn prefill(
        &self,
        ctx: &PrefillCtx,
        unit: &Unit,
        index: usize,
        full: HeadCache,
        keep: &[usize],
    ) -> (HeadCache, Box<dyn EvictMergeState>);

    /// Whether it leaves every kept entry's key and bias as they are (it
    /// changes values only): [`Policy::exact_keys`]. Default: no.
    fn exact_keys(&self) -> bool {
        false
    }
}

/// Decode-time state of an [`EvictMerge`] for one cache.
pub trait EvictMergeState: Send {
    /// After the step's attention, before any eviction.
    fn observe(&mut self, ctx: &StepCtx, heads: Range<usize>);
    /// Entry `e` is about to be evicted from `cache`.
    fn before_evict(&mut self, cache: &mut HeadCache, e: usize);
}

/// The shared selection over any scorer: a policy in its own right (every
/// scorer is one) and the body of the allocation and merge wrappers.
pub struct TopK {
    /// The registered name (for messages).
    pub name: &'static str,
    pub scorer: Arc<dyn Scorer>,
    pub allocation: Allocation,
    pub merge: Option<Arc<dyn EvictMerge>>,
}

impl TopK {
    pub fn new(name: &'static str, scorer: Arc<dyn Scorer>) -> TopK {
        TopK {
            name,
            scorer,
            allocation: Allocation::Uniform,
            merge: None,
        }
    }

    /// Selected entries (protected ones excluded) per unit, for a prompt longer than B.
    fn counts(&self, ctx: &PrefillCtx, prot: Protect, scores: &[Vec<f32>]) -> Vec<usize> {
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let avg = b - prot.total();
        let n = scores.len();
        match self.allocation {
            _ if avg == 0 => vec![0; n],
            Allocation::Uniform => vec![avg; n],
            Allocation::Pyramid {
                beta,
                kvpress: false,
            } => {
                let c = crate::allocation::layer_count(
                    p,
                    b,
                    prot.total(),
                    beta,
                    ctx.layer(),
                    ctx.n_layers(),
                )
                .unwrap_or(avg);
                vec![c; n]
            }
            Allocation::Pyramid {
                beta,
                kvpress: true,
            } => {
                let kept = crate::allocation::layer_count_kvpress(
                    p,
                    b,
                    prot.total(),
                    beta,
                    ctx.layer(),
                    ctx.n_layers(),
                );
                // the protected entries count inside the layer's entries
                let c = kept.saturating_sub(prot.total()).min(p - prot.total());
                vec![c; n]
            }
            Allocation::Ada {
                alpha,
                normalize,
                reserve_first,
            } => {
                let cand = prot.sinks..p - prot.recent;
                let s: Vec<&[f32]> = scores.iter().map(|s| &s[cand.clone()]).collect();
                if reserve_first {
                    // kvpress: int(n_kept·α) per head, protected entries first
                    let reserve =
                        ((alpha * b as f64).floor() as usize).saturating_sub(prot.total());
                    crate::allocation::head_budgets_reserved(&s, avg, reserve, normalize)
                } else {
                    crate::allocation::head_budgets(&s, avg, alpha, normalize)
                }
            }
        }
    }
}

impl Policy for TopK {
    /// Selection only keeps or evicts entries; a merge keeps keys only
    /// where it says so (CAM changes values).
    fn exact_keys(&self) -> bool {
        self.merge.as_ref().is_none_or(|m| m.exact_keys())
    }
    fn name(&self) -> String {
        self.name.to_string()
    }

    fn budget_share(&self, group: usize) -> usize {
        self.scorer.budget_share(group)
    }

    fn prompt_queries(&self, prompt_len: usize, budget: usize) -> usize {
        // AdaKV scores in the scorer's cross-head form
        let across = match self.allocation {
            Allocation::Ada { .. } => self.scorer.across_heads(),
            _ => None,
        };
        across
            .iter()
            .map(|s| s.prompt_queries(prompt_len, budget))
            .fold(self.scorer.prompt_queries(prompt_len, budget), usize::max)
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
        let s = &*self.scorer;
        let (p, b) = (ctx.prompt_len(), ctx.budget);
        let units = units(ctx, s);
        if s.skip_layer(ctx.layer()) {
            let caches = units.iter().map(|u| ctx.full_cache(u.kv_head)).collect();
            return Ok((caches, Box::new(AppendOnly)));
        }
        let prot = s.protect(b)?;
        let compress = p > b;
        // AdaKV compares scores across heads in the scorer's cross-head form.
        let scorer = match self.allocation {
            Allocation::Ada { .. } => s.across_heads(),
            _ => None,
        };
        let scorer = scorer.as_deref().unwrap_or(s);
        let decoding = scorer.decode_evict();
        let selecting = compress && b > prot.total();
        let scores: Vec<Vec<f32>> = if selecting || decoding {
            units.iter().map(|u| scorer.score(ctx, u)).collect()
        } else {
            vec![Vec::new(); units.len()]
        };
        let short = |want: usize| scores.iter().any(|s| s.len() < want);
        if (decoding && short(p)) || (selecting && short(p - prot.recent.min(p))) {
            return Err(ReplayError::Contract {
                policy: self.name.to_string(),
                msg: format!(
                    "its scorer returned fewer scores than the {} positions it must score",
                    if decoding { p } else { p - prot.recent.min(p) }
                ),
            });
        }
        let (kept, capacity): (Vec<Vec<usize>>, Vec<usize>) = if compress {
            let counts = self.counts(ctx, prot, &scores);
            units
                .iter()
                .enumerate()
                .map(|(u, _)| {
                    let keep = keep_positions(p, prot, &scores[u], counts[u], s.tie());
                    (keep, prot.total() + counts[u])
                })
                .unzip()
        } else {
            units.iter().map(|_| ((0..p).collect(), b)).unzip()
        };
        let mut merges = Vec::new();
        let caches = units
            .iter()
            .zip(&kept)
            .enumerate()
            .map(|(i, (u, keep))| match &self.merge {
                Some(m) => {
                    let (c, st) = m.prefill(ctx, u, i, ctx.full_cache(u.kv_head), keep);
                    merges.push(st);
                    c
                }
                None => ctx.exact_cache(u.kv_head, keep),
            })
            .collect();
        let step = decoding
            .then(|| {
                let sel = Selected {
                    units: &units,
                    kept: &kept,
                    scores: &scores,
                };
                scorer.decoder(ctx, &sel)
            })
            .flatten();
        let state: Box<dyn DecodeState> = match step {
            Some(step) => Box::new(Evict {
                step,
                prot,
                tie: s.tie(),
                batch: s.evict_batch().max(1),
                capacity,
                heads: units.into_iter().map(|u| u.heads).collect(),
                merges,
            }),
            None => Box::new(AppendOnly),
        };
        Ok((caches, state))
    }
}

/// Decode-time eviction for every scorer: after each step, while a cache
/// holds more than its budget, evict the lowest-scoring entry outside the
/// sinks and the recent window (`batch` at a time).
struct Evict {
    step: Box<dyn StepScorer>,
    prot: Protect,
    tie: Tie,
    batch: usize,
    /// Per cache: entries it may hold.
    capacity: Vec<usize>,
    /// Per cache: the query heads that read it.
    heads: Vec<Range<usize>>,
    /// Per cache, when evicted entries are merged (CaM).
    merges: Vec<Box<dyn EvictMergeState>>,
}

impl DecodeState for Evict {
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]) {
        for (c, cache) in caches.iter_mut().enumerate() {
            if let Some(m) = self.merges.get_mut(c) {
                m.observe(ctx, self.heads[c].clone());
            }
            self.step.observe(ctx, c, cache);
            while cache.len() > self.capacity[c] {
                let room = cache.len().saturating_sub(self.prot.total());
                // capacity >= protected entries, so there is always a candidate
                debug_assert!(room > 0, "capacity below the protected entries");
                if room == 0 {
                    break;
                }
                for _ in 0..self.batch.min(room) {
                    let n = cache.len();
                    let cand = self.prot.sinks..n - self.prot.recent;
                    let s = self.step.scores(ctx, c, cache);
                    debug_assert_eq!(s.len(), n);
                    let pos = |e: usize| cache.members[e][0] as usize;
                    let e = victim(s, cand, pos, self.tie).expect("room > 0");
                    if let Some(m) = self.merges.get_mut(c) {
                        m.before_evict(cache, e);
                    }
                    cache.remove(e);
                    self.step.evicted(c, e);
                }
            }
        }
    }
}
