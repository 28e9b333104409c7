//! The causal policy interface (`Policy`, `PrefillCtx`, `StepCtx`) and the
//! small helpers policies share (group means, pooling, SplitMix64).
//!
//! A policy sees, at the end of prefill, only the prompt of one layer (its
//! q/k/v and prompt attention statistics) through [`PrefillCtx`], and returns
//! each KV head's compressed cache plus a [`DecodeState`]. At each decode
//! step the engine appends the step's exact entry, runs attention, and hands
//! the state only that step's attention ([`StepCtx`]). No view reaches a
//! future position, so the same code can drive a live model step by step.

use std::ops::Range;

use crate::cache::HeadCache;
use crate::ReplayError;

/// One layer of a trace as f32, all positions. Only the engine reads it
/// directly; policies see prompt-only views through `PrefillCtx`.
pub struct LayerData {
    pub layer: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d: usize,
    pub scale: f32,
    pub prompt_len: usize,
    pub total_len: usize,
    /// First position whose query is held: 0, or where a lean trace's
    /// stored queries start (see [`Policy::prompt_queries`]).
    pub q_start: usize,
    /// (n_heads, T − q_start, d): the queries of positions q_start..T
    pub q: Vec<f32>,
    /// (n_kv_heads, T, d)
    pub k: Vec<f32>,
    /// (n_kv_heads, T, d)
    pub v: Vec<f32>,
    /// (n_heads, P) attention each prompt key received from all prompt queries
    pub colsum: Vec<f32>,
    /// `Some(W)`: a sliding-window layer (Gemma 3): the query at position t
    /// attends to the entries whose newest member lies in t − W + 1 ..= t.
    /// None: full causal attention.
    pub window: Option<usize>,
    /// Per layer of the trace, its (n_heads, P) column sums: prompt statistics a
    /// live model also has at the end of prefill (for cross-layer budgets).
    /// None when a layer is replayed on its own.
    pub all_colsum: Option<std::sync::Arc<Vec<Vec<f32>>>>,
    /// The model's rotary embedding (to undo or redo the rotation of stored
    /// keys); None when unknown.
    pub rope: Option<kvreplay_kernels::cpu::RopeParams>,
    /// Where budget-independent results of this layer are kept and reused
    /// (owned by the [`TraceReplay`](crate::TraceReplay) that loaded the
    /// layer); None: computed every time.
    pub memo: Option<std::sync::Arc<crate::memo::Memo>>,
    /// Where attention is computed.
    pub backend: kvreplay_kernels::Backend,
    /// The trace's token ids and named prompt spans, for the policies that
    /// calibrate on the replayed trace itself (retrieval-head probes, read
    /// through [`PrefillCtx::oracle_tokens`]); None when the layer is replayed
    /// without its trace.
    pub tokens: Option<std::sync::Arc<TraceTokens>>,
}

/// The token ids of a trace (all T: prompt, then the generated continuation)
/// and its named prompt spans (`needle`, ...), half-open position ranges.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceTokens {
    pub ids: Vec<u32>,
    pub spans: Vec<(String, Range<usize>)>,
}

impl LayerData {
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
    pub fn q_row(&self, h: usize, t: usize) -> &[f32] {
        let r = self.q_index(h, t);
        &self.q[r * self.d..(r + 1) * self.d]
    }
    /// Row of the query of head `h` at position `t` in `q`.
    fn q_index(&self, h: usize, t: usize) -> usize {
        assert!(
            t >= self.q_start,
            "the query of position {t} is not in this lean trace (it keeps queries from position {}); \
             a policy that reads it must say so in Policy::prompt_queries",
            self.q_start
        );
        h * (self.total_len - self.q_start) + t - self.q_start
    }
    pub fn k_row(&self, g: usize, t: usize) -> &[f32] {
        let (tt, d) = (self.total_len, self.d);
        &self.k[(g * tt + t) * d..(g * tt + t + 1) * d]
    }
    pub fn v_row(&self, g: usize, t: usize) -> &[f32] {
        let (tt, d) = (self.total_len, self.d);
        &self.v[(g * tt + t) * d..(g * tt + t + 1) * d]
    }
}

/// What a policy may see at the end of prefill: the prompt of one layer.
pub struct PrefillCtx<'a> {
    data: &'a LayerData,
    /// B: entries to keep per KV head (the policy may redistribute it).
    pub budget: usize,
    /// Per query head, column sums computed on first use: set for a
    /// [`restricted`](Self::restricted) view, whose data holds none.
    lazy_colsum: Option<Vec<std::sync::OnceLock<Vec<f32>>>>,
}

impl<'a> PrefillCtx<'a> {
    /// Built by the engine; public so tests and embedders can drive a policy directly.
    pub fn new(data: &'a LayerData, budget: usize) -> Self {
        PrefillCtx {
            data,
            budget,
            lazy_colsum: None,
        }
    }

    /// The prompt restricted to `positions` (ascending, < P), as a layer of
    /// its own whose prompt is those positions in order: (n_heads, n, d)
    /// queries and (n_kv_heads, n, d) keys and values gathered from the
    /// trace (post-RoPE, at their original positions), no decode positions.
    /// A scorer sees it through [`PrefillCtx::of_restricted`]: attention
    /// rows are causal over the subset's order, column sums are those of the
    /// subset's own attention (computed when first asked), and nothing is
    /// shared with the full layer: no memo (a memoised full-prompt result
    /// would be wrong here), no RoPE parameters (a position there is an index
    /// into the subset, not a position of the model), no cross-layer column
    /// sums, no sliding window. Queries are held from the first position
    /// the trace holds (a wrapper whose scorer reads queries declares
    /// `prompt_queries` = P).
    pub fn restricted(&self, positions: &[usize]) -> LayerData {
        let x = self.data;
        let n = positions.len();
        debug_assert!(positions.windows(2).all(|w| w[0] < w[1]));
        // a lean trace holds the queries from q_start on: so does the view
        let q_start = positions.partition_point(|&i| i < x.q_start);
        let mut q = Vec::with_capacity(x.n_heads * (n - q_start) * x.d);
        for h in 0..x.n_heads {
            for &i in &positions[q_start..] {
                q.extend_from_slice(self.query(h, i));
            }
        }
        let gather = |row: &dyn Fn(usize, usize) -> &'a [f32]| {
            let mut out = Vec::with_capacity(x.n_kv_heads * n * x.d);
            for g in 0..x.n_kv_heads {
                for &i in positions {
                    out.extend_from_slice(row(g, i));
                }
            }
            out
        };
        let k = gather(&|g, i| x.k_row(g, i));
        let v = gather(&|g, i| x.v_row(g, i));
        LayerData {
            layer: x.layer,
            n_layers: x.n_layers,
            n_heads: x.n_heads,
            n_kv_heads: x.n_kv_heads,
            d: x.d,
            scale: x.scale,
            prompt_len: n,
            total_len: n,
            q_start,
            q,
            k,
            v,
            colsum: Vec::new(),
            window: None,
            all_colsum: None,
            rope: None,
            memo: None,
            backend: x.backend.clone(),
            // positions are renumbered: the trace's token ids do not apply
            tokens: None,
        }
    }

    /// The view of a [`restricted`](Self::restricted) layer (or of any layer
    /// a policy builds without column sums), budget `budget`: its column
    /// sums are computed from its own attention, over the query rows it
    /// holds, when first asked.
    pub fn of_restricted(data: &'a LayerData, budget: usize) -> Self {
        PrefillCtx {
            data,
            budget,
            lazy_colsum: Some((0..data.n_heads).map(|_| Default::default()).collect()),
        }
    }
    pub fn layer(&self) -> usize {
        self.data.layer
    }
    pub fn n_layers(&self) -> usize {
        self.data.n_layers
    }
    pub fn n_heads(&self) -> usize {
        self.data.n_heads
    }
    pub fn n_kv_heads(&self) -> usize {
        self.data.n_kv_heads
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.data.group()
    }
    pub fn head_dim(&self) -> usize {
        self.data.d
    }
    /// P: prompt length.
    pub fn prompt_len(&self) -> usize {
        self.data.prompt_len
    }
    /// Post-RoPE key of prompt position `i < P` in KV head `g`.
    pub fn key(&self, g: usize, i: usize) -> &[f32] {
        assert!(
            i < self.data.prompt_len,
            "policy asked for key {i} beyond the prompt"
        );
        self.data.k_row(g, i)
    }
    /// Value of prompt position `i < P` in KV head `g`.
    pub fn value(&self, g: usize, i: usize) -> &[f32] {
        assert!(
            i < self.data.prompt_len,
            "policy asked for value {i} beyond the prompt"
        );
        self.data.v_row(g, i)
    }
    /// Softmax scale of the model's logits.
    pub fn scale(&self) -> f32 {
        self.data.scale
    }
    /// Where attention is computed (for views a policy builds later, e.g.
    /// of its decode-time caches).
    pub fn backend(&self) -> kvreplay_kernels::Backend {
        self.data.backend.clone()
    }
    /// The model's rotary embedding, when the trace records it.
    pub fn rope(&self) -> Option<kvreplay_kernels::cpu::RopeParams> {
        self.data.rope
    }
    /// The layer's RoPE with a row for every position of the trace, shared
    /// by every policy and budget replayed on the layer (None without RoPE
    /// parameters).
    pub fn rope_cache(&self) -> Option<std::sync::Arc<kvreplay_kernels::cpu::RopeCache>> {
        #[derive(PartialEq, Debug)]
        struct RopeRows;
        impl crate::memo::MemoKey for RopeRows {
            type Value = kvreplay_kernels::cpu::RopeCache;
        }
        let p = self.rope()?;
        let n = self.data.total_len;
        Some(self.memo(RopeRows, || {
            kvreplay_kernels::cpu::RopeCache::with_positions(p, n)
        }))
    }
    /// `f()`, computed once per layer and `key` and reused by every budget
    /// and policy replayed through the same trace: for results that do not
    /// depend on the budget. The key names everything the value depends on
    /// besides the layer.
    pub fn memo<K: crate::memo::MemoKey>(
        &self,
        key: K,
        f: impl FnOnce() -> K::Value,
    ) -> std::sync::Arc<K::Value> {
        match &self.data.memo {
            Some(m) => m.get_or(key, f),
            None => std::sync::Arc::new(f()),
        }
    }
    /// Query of prompt position `i < P` of query head `h`.
    pub fn query(&self, h: usize, i: usize) -> &[f32] {
        assert!(
            i < self.data.prompt_len,
            "policy asked for query {i} beyond the prompt"
        );
        self.data.q_row(h, i)
    }
    /// ORACLE: the trace's token ids (prompt and generated continuation) and
    /// named spans. A live model does not know its continuation at the end of
    /// prefill: only policies that calibrate on the replayed trace itself
    /// (retrieval-head probes, whose papers calibrate on a separate task)
    /// read it, and their `caps.approximation` says so.
    pub fn oracle_tokens(&self) -> Option<&TraceTokens> {
        self.data.tokens.as_deref()
    }
    /// ORACLE: the query of query head `h` at any position `t < T`, decode
    /// positions included (see [`oracle_tokens`](Self::oracle_tokens)).
    pub fn oracle_query(&self, h: usize, t: usize) -> &[f32] {
        self.data.q_row(h, t)
    }
    /// ORACLE: the key of KV head `g` at any position `t < T`.
    pub fn oracle_key(&self, g: usize, t: usize) -> &[f32] {
        self.data.k_row(g, t)
    }
    /// T: prompt and decode positions of the trace.
    pub fn total_len(&self) -> usize {
        self.data.total_len
    }
    /// Column sums of query head `h` in layer `l` of the same trace: (P,).
    /// None when the layer is replayed without its trace.
    pub fn layer_colsum(&self, l: usize, h: usize) -> Option<&[f32]> {
        let p = self.data.prompt_len;
        self.data
            .all_colsum
            .as_ref()
            .map(|a| &a[l][h * p..(h + 1) * p])
    }
    /// Attention each prompt key received from all prompt queries of query head `h`: (P,).
    pub fn colsum(&self, h: usize) -> &[f32] {
        let p = self.data.prompt_len;
        match &self.lazy_colsum {
            Some(lazy) => lazy[h].get_or_init(|| {
                // summed in f64 over the causal rows the view holds (every
                // row of a prompt view; the buffered queries of a decode
                // view), as the capture sums them
                let rows = self.attn_rows(h, self.data.q_start.min(p)..p);
                let mut s = vec![0f64; p];
                for row in rows.chunks_exact(p.max(1)) {
                    s.iter_mut().zip(row).for_each(|(a, x)| *a += *x as f64);
                }
                s.into_iter().map(|x| x as f32).collect()
            }),
            None => &self.data.colsum[h * p..(h + 1) * p],
        }
    }
    /// Causal attention rows of prompt queries `rows` (within 0..P) of query head
    /// `h` over the prompt keys: (rows.len(), P), zero above the diagonal;
    /// softmax in f32 after an f64 sum, as the capture computed it.
    pub fn attn_rows(&self, h: usize, rows: Range<usize>) -> Vec<f32> {
        self.attn_rows_with_gain(h, rows, |_| 1.0)
    }
    /// As [`attn_rows`](Self::attn_rows), with the logits of row j multiplied
    /// by `gain(j)` before the softmax (temperature-scaled scoring rows).
    pub fn attn_rows_with_gain(
        &self,
        h: usize,
        rows: Range<usize>,
        gain: impl Fn(usize) -> f32,
    ) -> Vec<f32> {
        let p = self.data.prompt_len;
        assert!(
            rows.end <= p,
            "policy asked for attention rows beyond the prompt"
        );
        let (g, d, t) = (h / self.data.group(), self.data.d, self.data.total_len);
        let mut out = vec![0f32; rows.len() * p];
        if rows.is_empty() {
            return out;
        }
        let lens: Vec<usize> = rows.clone().map(|j| j + 1).collect();
        let gains: Vec<f32> = rows.clone().map(gain).collect();
        let r0 = self.data.q_index(h, rows.start);
        let q = &self.data.q[r0 * d..(r0 + rows.len()) * d];
        let keys = &self.data.k[g * t * d..(g * t + p) * d];
        // Shapes hold by construction; only a failing device can fail here.
        self.data
            .backend
            .attention_rows(q, keys, d, &lens, &gains, self.data.scale, &mut out)
            .unwrap_or_else(|e| {
                panic!(
                    "scoring rows on {}: {e}; rerun with --device cpu",
                    self.data.backend.describe()
                )
            });
        out
    }
    /// The caches a policy builds: one per KV head (with its group's query
    /// heads) or, with `per_query_head`, one per query head (with its KV head).
    /// Each item is (KV head, the query heads whose attention scores it).
    pub fn cache_units(&self, per_query_head: bool) -> Vec<(usize, Range<usize>)> {
        let gs = self.group();
        if per_query_head {
            (0..self.n_heads()).map(|h| (h / gs, h..h + 1)).collect()
        } else {
            (0..self.n_kv_heads())
                .map(|g| (g, g * gs..(g + 1) * gs))
                .collect()
        }
    }
    /// The exact entries of `positions` (ascending, < P) of KV head `g`.
    pub fn exact_cache(&self, g: usize, positions: &[usize]) -> HeadCache {
        // room for the decode steps' entries too
        let steps = self.data.total_len - self.data.prompt_len;
        let mut c = HeadCache::with_capacity(self.data.d, positions.len() + steps);
        for &i in positions {
            assert!(i < self.data.prompt_len);
            c.push_exact(i, self.data.k_row(g, i), self.data.v_row(g, i));
        }
        c
    }
    /// Every prompt entry of KV head `g`, uncompressed.
    pub fn full_cache(&self, g: usize) -> HeadCache {
        self.exact_cache(g, &(0..self.data.prompt_len).collect::<Vec<_>>())
    }
    /// Every KV head uncompressed (what a policy returns when P <= B).
    pub fn full_caches(&self) -> Vec<HeadCache> {
        (0..self.n_kv_heads()).map(|g| self.full_cache(g)).collect()
    }
}

/// What a decode-time policy sees after decode step `pos`: the attention of
/// that step's queries over the current caches (the new entry is the last).
pub struct StepCtx<'a> {
    pub layer: usize,
    pub pos: usize,
    pub budget: usize,
    pub group: usize,
    /// Per query head, probabilities over the entries of its KV head's cache.
    pub probs: &'a [Vec<f32>],
    /// Per query head, this step's query (post-RoPE), for policies that score
    /// with their own logits.
    pub queries: &'a [&'a [f32]],
    /// Softmax scale of the model's logits.
    pub scale: f32,
}

impl StepCtx<'_> {
    /// Query heads whose attention belongs to cache `c` (see `PrefillCtx::cache_units`).
    pub fn heads_of(&self, c: usize, per_query_head: bool) -> Range<usize> {
        if per_query_head {
            c..c + 1
        } else {
            c * self.group..(c + 1) * self.group
        }
    }
    /// Mean of the step's attention over query heads `heads` (the heads that
    /// read one cache), added to that cache's accumulated scores; the step's
    /// new entry starts at 0 (H2O's and CaM's accumulated attention).
    pub fn accumulate(&self, scores: &mut Vec<f32>, heads: Range<usize>) {
        scores.push(0.0);
        let mean = mean_rows(self.probs[heads].iter().map(|v| v.as_slice()));
        scores.iter_mut().zip(mean).for_each(|(x, a)| *x += a);
    }
    /// Group mean of the step's attention for KV head `g`.
    pub fn group_mean(&self, g: usize) -> Vec<f32> {
        let heads = &self.probs[g * self.group..(g + 1) * self.group];
        mean_rows(heads.iter().map(|v| v.as_slice()))
    }
}

/// A compression policy. `prefill` must be causal (it only gets a `PrefillCtx`).
pub trait Policy: Send + Sync {
    /// Name for error messages (the Rust type, unless the policy says better).
    fn name(&self) -> String {
        std::any::type_name::<Self>()
            .rsplit("::")
            .next()
            .unwrap_or("policy")
            .to_string()
    }

    fn prefill(
        &self,
        ctx: &PrefillCtx,
    ) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError>;

    /// How many of the last prompt positions' queries `prefill` reads (through
    /// `attn_rows` or `query`) for a budget of `budget` entries on a
    /// `prompt_len`-token prompt: 0 when it scores from keys, values and
    /// column sums only, `prompt_len` when it needs every row. A lean trace
    /// (`capture --keep lean`) holds the last N; the engine refuses, before
    /// any work, a policy that needs more. Default: every row (a policy that
    /// reads fewer says so).
    fn prompt_queries(&self, prompt_len: usize, _budget: usize) -> usize {
        prompt_len
    }

    /// Whether the caches, and so every metric, do not depend on the budget
    /// (the uncompressed cache, a store at a fixed precision): a sweep then
    /// replays the policy once per trace and reports it at every budget.
    /// Only say so when the budget reaches nothing: `prefill` never reads
    /// `ctx.budget`, and `layer_groups` and `prompt_queries` ignore it (a
    /// registry test replays each such policy at two budgets and compares).
    fn budget_independent(&self) -> bool {
        false
    }

    /// Whether a group of `group_len` layers replayed together keeps the
    /// uncompressed cache: its prefill gives `ctx.full_caches()` and decode
    /// only appends (`full`; MiniCache's layers alone, below the first merged
    /// one). The engine then takes every step's attention from the
    /// full-cache reference it already holds instead of recomputing the same
    /// bits (a test compares the two on every such policy). Default: no.
    fn keeps_full_cache(&self, _group_len: usize) -> bool {
        false
    }

    /// Whether every entry of its caches that stands for one position holds
    /// that position's captured key unchanged, with no logit bias (entries
    /// are only kept or evicted; values may change). Then, at a step whose
    /// cache keeps a position of the full cache's largest logit, every such
    /// entry's shifted logit and weight are the full cache's at its
    /// position, and the metrics take them from the step itself instead of
    /// reading the reference (a test compares the two on every policy that
    /// says so). Default: no.
    fn exact_keys(&self) -> bool {
        false
    }

    /// Budgets that give the same caches, and so every metric: two budgets
    /// (in entries per cache) with the same `Some` class replay identically,
    /// so a sweep replays one of them and reports its result at the others
    /// (MiniCache: the budget only picks the first merged layer). None (the
    /// default): every budget is its own. Only say so when, within a class,
    /// nothing the budget reaches changes (a registry test replays each
    /// budget of a class and compares).
    fn budget_class(&self, _n_layers: usize, _budget: usize, _prompt_len: usize) -> Option<usize> {
        None
    }

    /// Whether a layer group's replay reads no budget: `prefill_group` and
    /// the decode steps never read `ctx.budget`, so the budget reaches a
    /// group's results only through which groups [`layer_groups`](Self::layer_groups)
    /// makes. A sweep then replays each group once per trace and spec and
    /// reports it at every budget whose grouping holds it (MiniCache: the
    /// budget picks the first merged layer, and a pair above it merges the
    /// same way at any budget). Only say so when that holds (a registry
    /// test replays such a policy's groups at several budgets and
    /// compares). Default: no.
    fn group_budget_free(&self) -> bool {
        false
    }

    /// Caches that share one KV head's budget: the group size G when the
    /// policy keeps one cache per query head and counts `--budget` per KV
    /// head (`budget_per=kv_head`, the default: B entries' memory per KV head
    /// and layer, as every other policy), 1 otherwise. The engine and the
    /// closed loop replay it at [`cache_budget`] = ⌊B / share⌋ entries per
    /// cache. Wrappers say what their base says.
    fn budget_share(&self, _group: usize) -> usize {
        1
    }

    /// Whether the policy also compresses sliding-window layers (the
    /// `+sliding` wrapper). By default a sliding layer keeps its window
    /// uncompressed: its cache is already bounded by W.
    fn compress_sliding(&self) -> bool {
        false
    }

    /// Layers replayed together, for a budget of `budget` entries on a
    /// `prompt_len`-token prompt. Default: every layer on its own; cross-layer
    /// policies (MiniCache) group adjacent layers.
    fn layer_groups(&self, n_layers: usize, _budget: usize, _prompt_len: usize) -> Vec<Vec<usize>> {
        (0..n_layers).map(|l| vec![l]).collect()
    }

    /// Prefill of one group of layers. Default: `prefill` on each layer.
    #[allow(clippy::type_complexity)]
    fn prefill_group(
        &self,
        ctxs: &[PrefillCtx],
    ) -> Result<(Vec<Vec<HeadCache>>, Box<dyn GroupDecodeState>), ReplayError> {
        let mut caches = Vec::new();
        let mut states = Vec::new();
        for c in ctxs {
            let (cs, st) = self.prefill(c)?;
            caches.push(cs);
            states.push(st);
        }
        Ok((caches, Box::new(PerLayer(states))))
    }
}

/// Decode-time state of a group of layers; `ctxs[i]` and `caches[i]` belong to
/// the group's i-th layer.
pub trait GroupDecodeState: Send {
    fn step(&mut self, ctxs: &[StepCtx], caches: &mut [Vec<HeadCache>]);
}

/// Independent per-layer states (the default grouping).
pub struct PerLayer(pub Vec<Box<dyn DecodeState>>);

impl PerLayer {
    /// The decode state of a prefill-only group of `n` layers: every layer
    /// appends its decode entries.
    pub fn append_only(n: usize) -> Box<dyn GroupDecodeState> {
        Box::new(PerLayer(
            (0..n)
                .map(|_| Box::new(AppendOnly) as Box<dyn DecodeState>)
                .collect(),
        ))
    }
}

/// `prefill` of a prefill-only policy that compresses groups of layers
/// (`prefill_group`), replayed on one layer as a group of its own.
pub fn prefill_alone<P: Policy + ?Sized>(
    policy: &P,
    ctx: &PrefillCtx,
) -> Result<(Vec<HeadCache>, Box<dyn DecodeState>), ReplayError> {
    let (mut caches, _) = policy.prefill_group(std::slice::from_ref(ctx))?;
    Ok((caches.remove(0), Box::new(AppendOnly)))
}

impl GroupDecodeState for PerLayer {
    fn step(&mut self, ctxs: &[StepCtx], caches: &mut [Vec<HeadCache>]) {
        for ((s, c), x) in self.0.iter_mut().zip(ctxs).zip(caches.iter_mut()) {
            s.step(c, x);
        }
    }
}

/// Per-layer state of a policy during decode.
pub trait DecodeState: Send {
    /// Called after each decode step's attention; may evict or merge entries.
    fn step(&mut self, ctx: &StepCtx, caches: &mut [HeadCache]);
}

/// The entries per cache that `--budget b` (per KV head and layer) gives
/// `policy` on a model with `group` query heads per KV head: ⌊b / share⌋
/// for a policy whose G query-head caches share a KV head's budget
/// ([`Policy::budget_share`]), at least 1; b otherwise. `PrefillCtx::budget`,
/// `prompt_queries` and `layer_groups` all see this figure.
pub fn cache_budget(policy: &dyn Policy, b: usize, group: usize) -> usize {
    (b / policy.budget_share(group).max(1)).max(1)
}

/// `budget_per`, the parameter of every policy that can keep one cache per
/// query head: whether `--budget` counts per KV head (equal memory, the
/// default) or per query-head cache (the old meaning: G× the memory).
pub const BUDGET_PER: crate::params::ParamInfo = crate::params::ParamInfo {
    name: "budget_per",
    default: "kv_head",
    kind: crate::params::Kind::Choice(&["kv_head", "query_head"]),
    help: "with one cache per query head: kv_head = B entries' memory per KV head, ⌊B/G⌋ per query-head cache (equal memory with every policy); query_head = B per query-head cache (G× the memory)",
};

/// [`Policy::budget_share`] of a policy with one cache per query head when
/// `per_query_head`, counting its budget per KV head unless
/// `budget_per_cache` (`budget_per=query_head`).
pub fn share_of(per_query_head: bool, budget_per_cache: bool, group: usize) -> usize {
    if per_query_head && !budget_per_cache {
        group
    } else {
        1
    }
}

/// Decode-time no-op: decode entries are appended on top of the prompt budget.
pub struct AppendOnly;
impl DecodeState for AppendOnly {
    fn step(&mut self, _: &StepCtx, _: &mut [HeadCache]) {}
}

pub use kvreplay_kernels::cpu::{cosine, dot, l2_norm, softmax_in_place};

/// Element-wise mean of equally long rows, summed in row order.
pub fn mean_rows<'a>(rows: impl Iterator<Item = &'a [f32]>) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::new();
    let mut n = 0;
    for r in rows {
        if out.is_empty() {
            out = r.to_vec();
        } else {
            out.iter_mut().zip(r).for_each(|(a, b)| *a += b);
        }
        n += 1;
    }
    out.iter_mut().for_each(|a| *a /= n as f32);
    out
}

crate::params::choice_enum! {
    /// 1-D pooling along positions, kernel `k` (odd), stride 1, padding k/2.
    /// Max ignores the padding; average counts the zero padding (divides by k), as PyTorch does.
    pub enum Pool {
        Max = "max",
        Avg = "avg",
        None = "none",
    }
}

pub fn pool1d(x: &[f32], k: usize, pool: Pool) -> Vec<f32> {
    let h = k / 2;
    let n = x.len();
    (0..n)
        .map(|i| {
            let w = &x[i.saturating_sub(h)..(i + h + 1).min(n)];
            match pool {
                Pool::Max => w.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)),
                Pool::Avg => w.iter().sum::<f32>() / k as f32,
                Pool::None => x[i],
            }
        })
        .collect()
}

/// SplitMix64: a tiny, stable, seedable generator (results never change with
/// a dependency upgrade).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// A generator for (seed, layer, head), independent of scheduling.
    pub fn for_head(seed: u64, layer: usize, head: usize) -> Self {
        let mut s = SplitMix64(seed ^ 0x9E37_79B9_7F4A_7C15);
        let a = s.next_u64() ^ (layer as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let mut s = SplitMix64(a);
        SplitMix64(s.next_u64() ^ (head as u64).wrapping_mul(0x94D0_49BB_1331_11EB))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_f64() * n as f64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_edges() {
        let x = [1.0, 5.0, 2.0, 0.0, 4.0];
        assert_eq!(pool1d(&x, 3, Pool::Max), vec![5.0, 5.0, 5.0, 4.0, 4.0]);
        // avg counts zero padding: first = (0 + 1 + 5) / 3
        let a = pool1d(&x, 3, Pool::Avg);
        assert_eq!(a[0], 2.0);
        assert_eq!(a[2], 7.0 / 3.0);
        assert_eq!(a[4], 4.0 / 3.0);
    }

    #[test]
    fn splitmix_is_stable() {
        // Published first outputs of SplitMix64 with seed 0.
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220A8397B1DCDAF);
        assert_eq!(r.next_u64(), 0x6E789E6AA1B965F4);
    }
}
