//! A trace larger than the memory a replay may use: `kvreplay replay` and
//! `kvreplay sweep` stream it a layer at a time. The trace is synthetic
//! (written here, ~400 MB); the replay runs under a memory limit of 128 MiB,
//! enforced by a memory cgroup where this machine lets the test make one
//! (root, cgroup v1 or v2 with the memory controller) and checked through the
//! process's own peak resident set (`peak memory (RSS)`, from VmHWM) always.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvreplay_traces::{Manifest, TensorKind, TraceLayout, TraceWriter};

mod common;
use common::text;

const LIMIT: u64 = 128 << 20;

/// 48 layers of 4 query and 4 KV heads, head_dim 64, 4,096 + 8 positions,
/// f16: 8.4 MB per layer file, 403 MB in all; each layer's f32 copy for
/// replay (q, k, v) is 12.6 MB.
fn layout() -> TraceLayout {
    TraceLayout {
        n_layers: 48,
        n_heads: 4,
        n_kv_heads: 4,
        head_dim: 64,
        total_len: 4104,
        prompt_len: 4096,
        dtype: kvreplay_traces::Dtype::F16,
        attn_probs: false,
        query_start: 0,
    }
}

fn manifest(l: &TraceLayout) -> Manifest {
    let v = serde_json::json!({
        "format": "kvreplay-trace",
        "format_version": 1,
        "model": {
            "architecture": "llama", "name": "synthetic-large",
            "n_layers": l.n_layers, "n_heads": l.n_heads, "n_kv_heads": l.n_kv_heads,
            "head_dim": l.head_dim, "d_model": l.n_heads * l.head_dim, "ffn_dim": 64,
            "vocab_size": 100, "context_length": 8192, "norm_eps": 1e-5,
            "attn_scale": 0.125,
            "rope": {"theta": 10000.0, "style": "neox", "rotated_dims": l.head_dim,
                     "scaling": {"type": "none"}},
            "source": {"file_name": "none.gguf", "sha256": "0".repeat(64), "size": 0}
        },
        "tokens": {
            "ids": (0..l.total_len as u32).map(|i| i % 100).collect::<Vec<_>>(),
            "prompt_len": l.prompt_len,
            "text": (0..l.total_len).map(|i| format!("t{i}")).collect::<Vec<_>>()
        },
        "generation": {"method": "greedy", "n_decode": l.total_len - l.prompt_len},
        "capture": {
            "device": "cpu", "dtype": "f16", "compute_dtype": "f32", "prefill_chunk": 256,
            "threads": 1, "attn_probs": false, "chat_template": false,
            "prompt_source": "synthetic", "kvreplay_version": "test",
            "created": "2026-01-01T00:00:00Z"
        },
        "files": []
    });
    serde_json::from_value(v).unwrap()
}

/// Write the synthetic trace (values from a fixed xorshift stream).
fn write_large(dir: &Path) -> PathBuf {
    let lay = layout();
    let out = dir.join("large.kvtrace");
    let mut w = TraceWriter::create(&out, lay, false).unwrap();
    let (t, d, p) = (lay.total_len, lay.head_dim, lay.prompt_len);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rows = vec![0f32; t * d];
    for l in 0..lay.n_layers {
        let lw = w.layer(l);
        for kind in TensorKind::ALL {
            for h in 0..4 {
                for r in rows.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *r = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                }
                lw.write_rows(kind, h, 0, &rows);
            }
        }
        for h in 0..lay.n_heads {
            let colsum: Vec<f32> = (0..p).map(|j| ((j * 7 + h + l) % 13) as f32).collect();
            lw.write_colsum(h, &colsum);
        }
    }
    w.finish(manifest(&lay)).unwrap()
}

/// A memory cgroup limited to `limit` bytes, removed on drop.
struct Cgroup {
    dir: PathBuf,
}

impl Cgroup {
    /// Where the machine allows it (root, memory controller mounted).
    fn new(limit: u64) -> Result<Cgroup, String> {
        let name = format!("kvreplay-test-{}", std::process::id());
        let v2 = Path::new("/sys/fs/cgroup");
        let (dir, file) = if std::fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"))
        {
            (v2.join(&name), "memory.max")
        } else {
            (v2.join("memory").join(&name), "memory.limit_in_bytes")
        };
        std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let cg = Cgroup { dir };
        std::fs::write(cg.dir.join(file), limit.to_string())
            .map_err(|e| format!("cannot set {file}: {e}"))?;
        Ok(cg)
    }

    /// Run kvreplay with `args` inside the group.
    fn run(&self, args: &[&str]) -> Output {
        Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
            .arg(&self.dir)
            .arg(env!("CARGO_BIN_EXE_kvreplay"))
            .args(args)
            .output()
            .expect("sh runs")
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // the group is empty once its process has exited
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Run under the limit: in a cgroup when possible, else plainly (the peak
/// RSS check below holds either way).
fn run_limited(args: &[&str]) -> Output {
    match Cgroup::new(LIMIT) {
        Ok(cg) => cg.run(args),
        Err(why) => {
            println!("memory limit not enforced by a cgroup ({why}); checking peak RSS only");
            common::kvreplay(args)
        }
    }
}

/// The `peak memory (RSS): X MiB` line kvreplay prints, in bytes.
fn peak_rss(o: &Output) -> u64 {
    let t = text(o);
    let line = t
        .lines()
        .find_map(|l| l.strip_prefix("peak memory (RSS): "))
        .unwrap_or_else(|| panic!("no peak memory line in:\n{t}"));
    let mib: f64 = line.trim_end_matches(" MiB").parse().unwrap();
    (mib * (1u64 << 20) as f64) as u64
}

#[test]
fn a_trace_larger_than_the_memory_limit_replays_and_sweeps() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = write_large(tmp.path());
    let size = common::dir_bytes(&trace);
    assert!(
        size > 3 * LIMIT,
        "the trace ({size} B) must dwarf the limit"
    );
    let ts = trace.to_str().unwrap();

    // one replay: every layer read once, none kept
    let out = tmp.path().join("r");
    let o = run_limited(&[
        "replay",
        "--trace",
        ts,
        "--policy",
        "snapkv",
        "--budget",
        "256",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "replay under {LIMIT} B failed:\n{}",
        text(&o)
    );
    let peak = peak_rss(&o);
    println!("replay of a {size}-byte trace: peak RSS {peak} B (limit {LIMIT} B)");
    assert!(
        peak < LIMIT,
        "peak RSS {peak} B over the {LIMIT}-byte limit"
    );

    // a sweep keeping at most 32 MiB of layer copies between points...
    let policies = ["--policy", "h2o", "--policy", "streaming_llm"];
    let sweep = |dir: &str, mem: &str, limited: bool| {
        let out = tmp.path().join(dir);
        let mut args = vec!["sweep", "--traces", ts];
        args.extend(policies);
        args.extend(["--budget", "64,512", "--max-memory", mem, "--out"]);
        args.push(out.to_str().unwrap());
        let o = if limited {
            run_limited(&args)
        } else {
            common::kvreplay(&args)
        };
        assert!(
            o.status.success(),
            "sweep --max-memory {mem} failed:\n{}",
            text(&o)
        );
        (out, peak_rss(&o))
    };
    let (streamed, peak) = sweep("s-streamed", "32M", true);
    println!("sweep of the same trace with --max-memory 32M: peak RSS {peak} B");
    assert!(
        peak < LIMIT,
        "sweep peak RSS {peak} B over the {LIMIT}-byte limit"
    );
    // ...gives the same results as one that keeps every layer
    let (kept, peak_kept) = sweep("s-kept", "4G", false);
    println!("with --max-memory 4G (every layer kept): peak RSS {peak_kept} B");
    assert!(
        peak_kept > peak,
        "keeping layers should cost memory ({peak_kept} vs {peak})"
    );
    for f in ["results.csv", "summary.csv"] {
        let (a, b) = (
            std::fs::read(streamed.join(f)).unwrap(),
            std::fs::read(kept.join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs between streamed and kept layers");
    }
}
