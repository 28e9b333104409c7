//! Golden results: every registered policy at three budgets on a committed
//! tiny synthetic trace (`tests/golden/tiny.kvtrace`, three layers, GQA
//! 4:2, built by `golden_layers`), written as exact decimal floats and the
//! kept positions, and compared byte for byte with `tests/golden/results.csv`.
//!
//! Any change to a policy's result shows here. After a deliberate change,
//! `UPDATE_GOLDEN=1 cargo test -p kvreplay-replay --test golden` rewrites the
//! trace and the CSV, and the diff is visible in review.

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use common::{random_layer, write_trace};
use kvreplay_replay::policy::LayerData;
use kvreplay_replay::{replay, Budget, PolicySpec, REGISTRY};
use kvreplay_traces::Trace;

const BUDGETS: [usize; 3] = [4, 9, 16];

/// Non-default forms that reach the code paths the defaults cannot on a
/// 20-token prompt (windows smaller than the budgets, quantisation inside
/// the trace length, the switches of each policy).
const EXTRA_SPECS: &[&str] = &[
    "random:seed=3",
    "streaming_llm:n_sink=2,decode_evict=false",
    "h2o:recent=2",
    "h2o:decode_evict=false",
    "snapkv:w=3",
    "snapkv:w=3,k=3,pool=avg",
    "snapkv:w=3,pool=none",
    "pyramidkv:w=2,beta=2",
    "adakv:w=3",
    "adakv:w=3,normalize=true,alpha=0.5",
    "tova:per_kv_head=true",
    "tova:decode_evict=false",
    "knorm:skip_layers=none,decode_evict=true",
    "scissorhands:w_h=8,r=2,m=2",
    "scissorhands:threshold=uniform,include_masked=false,r=1",
    "cam:m=3,expected=true",
    "cam:n_sink=1,m=4,seed=5",
    "ahakv:recent=2,n_sink=1",
    "ahakv:gqa_mode=per_query_head,recent=2,gqa_agg=max",
    "ahakv:use_sg=false,use_vpe=false,recent=2,decode_evict=false",
    "quant:residual=4,group=4,bits=2",
    "snapkv:w=3+quant:residual=4,group=4",
    "h2o:recent=2+quant:residual=2,group=8,bits=8",
    "kvmerger:budget_mode=soft",
    "kvmerger:sigma=fixed,pivot=last_index,value_mode=logcount_bias",
    "d2o:preset=code",
    "d2o:threshold=none,merge=average",
    "minicache:start=0.3,rule=top_fraction",
    "minicache:start=0.3,merge=mean",
    "ems:window=2",
    "pyramidkv:scorer=h2o,recent=2,beta=2",
    "pyramidkv:scorer=knorm,skip_layers=none",
    "adakv:scorer=h2o,recent=2",
    "adakv:scorer=ahakv,recent=2,alpha=0.5",
    "cam:scorer=h2o,recent=2,expected=true",
    "cam:scorer=random,random.seed=2,m=4",
    "keydiff:block=3",
    "keydiff:preset=kvpress",
    "lagkv:n_sink=2,lag=4",
    "lagkv:n_sink=1,lag=5,cross_scoring=true",
    "adakv:scorer=lagkv,n_sink=2,lag=4",
    "a2sf:alpha=0.5,recent=2",
    "a2sf:alpha=0,decode_evict=false",
    "cur:window=4,n_sink=1",
    "cur:window=none,leverage=kv_avg",
    "cur:leverage=value,window=3",
    "leverage:sketch=4,seed=1",
    "adakv:scorer=leverage,sketch=8",
    "snapkv:preset=kvpress,w=3",
    "adakv:preset=kvpress,w=3",
    "adakv:preset=kvpress,w=3,alpha=0.5",
    "pyramidkv:preset=kvpress,w=2,beta=2",
    "pyramidkv:scorer=knorm,preset=kvpress,beta=2",
    "tova:preset=kvpress",
    "knorm:preset=kvpress",
    "streaming_llm:preset=kvpress",
    "h2o:preset=kvpress",
    "retrieval_head:scope=layer,n_sink=1",
    "razor:compensate=false,n_sink=2",
    "razor:scope=layer,frac=0.5,n_sink=1",
    "windowkv:suffix=2,window=3,group=2",
    "windowkv:suffix=2,window=2,task=other,schedule=uniform",
    "compresskv:w=2,heads=2",
    "compresskv:w=3,alloc=uniform,score=srh,kernel=3",
    "chunkkv:w=3,chunk_length=3",
    "chunk:w=2,chunk_length=8",
    "block:scorer=snapkv,w=3,block_size=4",
    "criticalkv:w=3",
    "criticaladakv:w=3,alpha=0.5",
    "snapkv:w=3+keyrerotation",
    "h2o:recent=2+decoding:scorer=tova,compression_interval=2",
    "prefilldecoding:w=3,compression_interval=3",
    "expected_attention:n_sink=1,n_future=8",
    "expected_attention:use_covariance=false,epsilon=0.01",
    "think:ratio=0.25,w=4",
    "snapkv:w=3+think:w=4",
    "simlayerkv:lazy_threshold=0.3,n_initial=1",
    "compactor:sink_start=1,sink_end=1,chunk=8",
    "finch:question=3",
    "finch:question=4,normalize=false",
    "kvcrush:recent=2,share=0.5,anchor=zeros",
    "kvcrush:scorer=snapkv,w=3,bit=mean,anchor=mean",
    "lazyeviction:window=2",
    "lazyeviction:window=1,alpha=0.5,decode_evict=false",
    "lazyeviction:window=2,threshold=uniform,alpha=1,score=ratio,per_query_head=true",
    "xkv:group=2",
    "xkv:group=3,rank_k=2,rank_v=3",
    "triforce:chunk=2",
    "triforce:chunk=3,refresh=2,per_query_head=true",
];

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Three layers of pseudo-random attention with sinks and heavy hitters:
/// 4 query heads, 2 KV heads, head_dim 8, 20 prompt + 4 decode tokens.
fn golden_layers() -> Vec<LayerData> {
    (0..3)
        .map(|l| {
            let mut d = random_layer(11 + l as u64, 4, 2, 8, 20, 24);
            d.layer = l;
            d.n_layers = 3;
            d
        })
        .collect()
}

/// One row per (policy, budget, layer, query head) with the metrics in
/// shortest round-trip form, then one per (policy, budget, layer, cache head)
/// with the kept prompt positions.
fn results(trace: &Trace) -> String {
    let mut out = String::from("policy,budget,layer,head,rel_l2,cosine,attn_mass,kl,bytes\n");
    let mut kept = String::from("policy,budget,layer,cache_head,kept_positions\n");
    let specs = REGISTRY
        .iter()
        .map(|i| i.name)
        .chain(EXTRA_SPECS.iter().copied());
    for name in specs {
        let spec = PolicySpec::parse(name).unwrap();
        let policy = spec.build().unwrap();
        for b in BUDGETS {
            let r = match replay(trace, policy.as_ref(), Budget::Entries(b)) {
                Ok(r) => r,
                Err(e) => {
                    // a refused point is part of the policy's behaviour too
                    writeln!(out, "{name},{b},error: {e}").unwrap();
                    continue;
                }
            };
            for m in r.metrics() {
                writeln!(
                    out,
                    "{},{b},{},{},{:?},{:?},{:?},{:?},{}",
                    name, m.layer, m.head, m.rel_l2, m.cosine, m.attn_mass, m.kl, m.bytes
                )
                .unwrap();
            }
            for layer in &r.layers {
                let mut per_head: std::collections::BTreeMap<usize, Vec<usize>> =
                    Default::default();
                for x in &layer.retained {
                    per_head.entry(x.head).or_default().push(x.position);
                }
                for (h, mut pos) in per_head {
                    pos.sort_unstable();
                    let l = layer.metrics[0].layer;
                    let pos: Vec<String> = pos.iter().map(|p| p.to_string()).collect();
                    writeln!(kept, "{name},{b},{l},{h},{}", pos.join(" ")).unwrap();
                }
            }
        }
    }
    out + &kept
}

#[test]
fn every_policy_matches_the_golden_results() {
    let dir = golden_dir();
    let csv = dir.join("results.csv");
    let trace_dir = dir.join("tiny.kvtrace");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let built = write_trace(tmp.path(), &golden_layers());
        std::fs::remove_dir_all(&trace_dir).ok();
        std::fs::create_dir_all(&trace_dir).unwrap();
        for e in std::fs::read_dir(&built).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), trace_dir.join(e.file_name())).unwrap();
        }
        let trace = Trace::open(&trace_dir).unwrap();
        std::fs::write(&csv, results(&trace)).unwrap();
        eprintln!(
            "golden: rewrote {} and {}",
            trace_dir.display(),
            csv.display()
        );
    }
    let trace = Trace::open(&trace_dir).unwrap_or_else(|e| {
        panic!("{e}; run UPDATE_GOLDEN=1 cargo test -p kvreplay-replay --test golden")
    });
    let want = std::fs::read_to_string(&csv).unwrap();
    let got = results(&trace);
    if got != want {
        let (n, (a, b)) = got
            .lines()
            .zip(want.lines())
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .map(|(i, x)| (i + 1, x))
            .unwrap_or((0, ("(length differs)", "")));
        panic!(
            "golden results differ from {} at line {n}:\n  got:  {a}\n  want: {b}\n\
             if the change is deliberate: UPDATE_GOLDEN=1 cargo test -p kvreplay-replay --test golden",
            csv.display()
        );
    }
}

#[test]
fn the_committed_trace_is_what_the_builder_writes() {
    // The committed trace must stay reproducible from its builder, so a
    // refreshed golden file never silently changes its input.
    let tmp = tempfile::tempdir().unwrap();
    let built = write_trace(tmp.path(), &golden_layers());
    let committed = golden_dir().join("tiny.kvtrace");
    let mut names: Vec<_> = std::fs::read_dir(&built)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(names.len() >= 2, "builder wrote {names:?}");
    for n in names {
        let a = std::fs::read(built.join(&n)).unwrap();
        let b = std::fs::read(committed.join(&n))
            .unwrap_or_else(|e| panic!("{}: {e}", committed.join(&n).display()));
        assert!(
            a == b,
            "{} differs from its builder's output",
            n.to_string_lossy()
        );
    }
}
