//! The CUDA kernels, run on the CPU: every `extern "C" __global__` kernel of
//! `kernels/src/cuda/*.cu` is compiled with the host C++ compiler against a
//! small emulation of the CUDA execution model (`kernels/emu/cuda_emu.h`: one
//! OS thread per GPU thread, `__syncthreads` a real barrier, blocks one at a
//! time), launched with the same configurations as the CUDA backend
//! ([`kvreplay_kernels::launch`]) and checked against its CPU twin in
//! [`kvreplay_kernels::cpu`]. Each case runs under three builds of the driver
//! (`kernels/emu/driver.cpp`): plain, AddressSanitizer + UBSan (every buffer
//! is its own exact-size allocation, so one element past the end is
//! reported) and ThreadSanitizer (a missing `__syncthreads` is a race); a
//! sanitizer report fails the test, and the three builds must agree bit for
//! bit. No GPU, CUDA toolkit or `cuda` feature is needed.
//!
//! Needs a C++17 compiler (`$CXX`, else `c++`, `g++` or `clang++`) with the
//! ASan/UBSan/TSan runtimes. Without one the tests print why and pass, unless
//! KVREPLAY_REQUIRE_EMU=1 (set by scripts/test.sh), which makes them fail.
//!
//! Adding a kernel: add a `#[test] fn emu_<name>()` that launches it here
//! (`Launch::new("<name>", ...)`); `emu_every_kernel_is_named_launched_and_tested`
//! names any kernel without one.
//!
//! Tolerances: u = 2⁻²⁴ (f32 unit roundoff). Where the kernel and its twin do
//! the same f32/f64 operations in the same order the comparison is exact (bit
//! for bit). Where only the summation order differs, an f32 sum of k terms is
//! within k·u·Σ|terms| of the exact sum in any order, so two orders are within
//! 2k·u·Σ|terms| of each other; the bounds below follow from that, per value.

mod common;
use common::Rng;
use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use kvreplay_kernels::cpu::{self, AttentionStats, RopeParams, RopeStyle};
use kvreplay_kernels::launch::{self, Launch as Cfg};
use kvreplay_kernels::{ATTN_ROWS, BLOCK, KEY_SPLIT};

const U: f64 = 1.0 / (1u64 << 24) as f64;
const CUDA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda");
const EMU_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/emu");

// ------------------------------------------------------------ sources

/// Every kernel source: (file name, text), sorted by name.
fn sources() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(CUDA_DIR)
        .expect("kernels/src/cuda")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// The kernels a source defines: every `extern "C" __global__ void NAME(`.
fn kernel_names(src: &str) -> Vec<String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    src.match_indices(MARK)
        .map(|(i, _)| {
            let rest = &src[i + MARK.len()..];
            let end = rest.find('(').expect("a kernel's parameter list");
            rest[..end].trim().to_string()
        })
        .collect()
}

// ------------------------------------------------------------ builds

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    Plain,
    Asan,
    Tsan,
}
const BUILDS: [Build; 3] = [Build::Plain, Build::Asan, Build::Tsan];

impl Build {
    fn name(self) -> &'static str {
        match self {
            Build::Plain => "plain",
            Build::Asan => "asan+ubsan",
            Build::Tsan => "tsan",
        }
    }
    fn flags(self) -> &'static [&'static str] {
        match self {
            Build::Plain => &["-O1"],
            Build::Asan => &[
                "-O1",
                "-g",
                "-fsanitize=address,undefined",
                "-fno-sanitize-recover=all",
                "-fno-omit-frame-pointer",
            ],
            Build::Tsan => &["-O1", "-g", "-fsanitize=thread"],
        }
    }
    /// Sanitizer options: stop at the first report, with a non-zero status.
    fn env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Build::Plain => &[],
            Build::Asan => &[
                ("ASAN_OPTIONS", "halt_on_error=1:detect_leaks=1"),
                ("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1"),
            ],
            Build::Tsan => &[("TSAN_OPTIONS", "halt_on_error=1:exitcode=66")],
        }
    }
}

/// Flags every build gets: C++17, threads, no fused multiply-add (NVRTC gets
/// --fmad=false), and the block size the CUDA backend uses.
fn common_flags() -> Vec<String> {
    vec![
        "-std=c++17".into(),
        "-pthread".into(),
        "-ffp-contract=off".into(),
        format!("-DBLOCK={BLOCK}"),
        format!("-DKEY_SPLIT={KEY_SPLIT}"),
        format!("-DATTN_ROWS={ATTN_ROWS}"),
        format!("-I{EMU_DIR}"),
        format!("-I{CUDA_DIR}"),
    ]
}

enum Unavailable {
    /// Not run here (no compiler or sanitizer runtime), and not required.
    Skip(String),
    /// Required but missing, or the kernels do not build.
    Fail(String),
}

fn required() -> bool {
    std::env::var("KVREPLAY_REQUIRE_EMU").as_deref() == Ok("1")
}

fn missing(why: String) -> Unavailable {
    if required() {
        Unavailable::Fail(format!("KVREPLAY_REQUIRE_EMU=1 but {why}"))
    } else {
        Unavailable::Skip(why)
    }
}

/// The C++ compiler and its `--version` line.
fn compiler() -> Result<(String, String), String> {
    let candidates: Vec<String> = match std::env::var("CXX") {
        Ok(c) if !c.is_empty() => vec![c],
        _ => vec!["c++".into(), "g++".into(), "clang++".into()],
    };
    for c in &candidates {
        if let Ok(o) = Command::new(c).arg("--version").output() {
            if o.status.success() {
                let v = String::from_utf8_lossy(&o.stdout);
                return Ok((c.clone(), v.lines().next().unwrap_or("").to_string()));
            }
        }
    }
    Err(format!(
        "no C++ compiler found (tried {candidates:?}; set CXX or install g++, e.g. `apt-get install g++ libasan8 libubsan1 libtsan2`)"
    ))
}

/// The generated part of the driver: every source, and the kernel list.
fn generated_include() -> String {
    let mut s =
        String::from("// generated by kernels/tests/emulated.rs\n#include \"prelude.cuh\"\n");
    let mut names = Vec::new();
    for (file, src) in sources() {
        s += &format!("#include \"{file}\"\n");
        names.extend(kernel_names(&src));
    }
    s += "#define KVEMU_FOR_EACH_KERNEL(X)";
    for n in names {
        s += &format!(" X({n})");
    }
    s + "\n"
}

/// The three driver builds, compiled once per test process (in parallel)
/// and cached under the target dir by a hash of everything that goes in.
fn drivers() -> &'static Result<Vec<PathBuf>, Unavailable> {
    static DRIVERS: OnceLock<Result<Vec<PathBuf>, Unavailable>> = OnceLock::new();
    DRIVERS.get_or_init(|| {
        let (cxx, version) = compiler().map_err(missing)?;
        let gen = generated_include();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&cxx, &version, &gen, common_flags()).hash(&mut h);
        for dir in [CUDA_DIR, EMU_DIR] {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            files.sort();
            for f in files {
                if let Ok(text) = std::fs::read(&f) {
                    (f.file_name(), text).hash(&mut h);
                }
            }
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("kvreplay-emu")
            .join(format!("{:016x}", h.finish()));
        std::fs::create_dir_all(&dir).unwrap();
        let unique = format!("{}", std::process::id());
        let gen_path = dir.join("kernels.gen.inc");
        let tmp = dir.join(format!("kernels.gen.inc.{unique}"));
        std::fs::write(&tmp, &gen).unwrap();
        std::fs::rename(&tmp, &gen_path).unwrap();
        let handles: Vec<_> = BUILDS
            .iter()
            .map(|&b| {
                let (cxx, dir, unique) = (cxx.clone(), dir.clone(), unique.clone());
                std::thread::spawn(move || build(b, &cxx, &dir, &unique))
            })
            .collect();
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

fn build(b: Build, cxx: &str, dir: &Path, unique: &str) -> Result<PathBuf, Unavailable> {
    let exe = dir.join(format!("driver-{}", b.name()));
    if exe.exists() {
        return Ok(exe);
    }
    let tmp = dir.join(format!("driver-{}.{unique}", b.name()));
    let out = Command::new(cxx)
        .args(common_flags())
        .args(b.flags())
        .arg(format!("-I{}", dir.display()))
        .arg(Path::new(EMU_DIR).join("driver.cpp"))
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| Unavailable::Fail(format!("{cxx}: {e}")))?;
    if !out.status.success() {
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        // A compiler without this sanitizer's runtime cannot build even an
        // empty program: that is a missing tool, not a kernel error.
        let probe = dir.join(format!("probe-{}.{unique}", b.name()));
        let ok = Command::new(cxx)
            .args(b.flags())
            .args(["-x", "c++", "-", "-o"])
            .arg(&probe)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin
                    .take()
                    .unwrap()
                    .write_all(b"int main() { return 0; }\n")?;
                c.wait()
            })
            .is_ok_and(|s| s.success());
        let _ = std::fs::remove_file(&probe);
        return Err(if ok {
            Unavailable::Fail(format!("the {} driver does not build:\n{log}", b.name()))
        } else {
            missing(format!(
                "{cxx} cannot link a {} program (install the sanitizer runtimes, e.g. `apt-get install libasan8 libubsan1 libtsan2`):\n{log}",
                b.name()
            ))
        });
    }
    std::fs::rename(&tmp, &exe).unwrap();
    Ok(exe)
}

// ------------------------------------------------------------ case files

enum Arg {
    Buf(Vec<u8>),
    Scalar(u8, Vec<u8>),
}

/// One kernel launch: name, configuration and arguments in parameter order.
struct Launch {
    name: &'static str,
    cfg: Cfg,
    args: Vec<Arg>,
}

trait Elem: Copy {
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
    const SIZE: usize;
}
macro_rules! elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap())
            }
            const SIZE: usize = std::mem::size_of::<$t>();
        }
    )*};
}
elem!(u8, u32, i32, f32, f64);

impl Launch {
    fn new(name: &'static str, cfg: Cfg) -> Launch {
        Launch {
            name,
            cfg,
            args: Vec::new(),
        }
    }
    /// A buffer argument holding exactly `x`.
    fn buf<T: Elem>(mut self, x: &[T]) -> Launch {
        let mut b = Vec::with_capacity(x.len() * T::SIZE);
        x.iter().for_each(|v| v.put(&mut b));
        self.args.push(Arg::Buf(b));
        self
    }
    fn int(mut self, v: i32) -> Launch {
        self.args.push(Arg::Scalar(b'i', v.to_le_bytes().to_vec()));
        self
    }
    fn i64(mut self, v: i64) -> Launch {
        self.args.push(Arg::Scalar(b'l', v.to_le_bytes().to_vec()));
        self
    }
    fn float(mut self, v: f32) -> Launch {
        self.args.push(Arg::Scalar(b'f', v.to_le_bytes().to_vec()));
        self
    }
}

/// The buffers of one launch after it ran, by argument position.
struct Ran(Vec<Option<Vec<u8>>>);
impl Ran {
    fn get<T: Elem>(&self, arg: usize) -> Vec<T> {
        let b = self.0[arg].as_ref().expect("argument is a buffer");
        b.chunks_exact(T::SIZE).map(T::get).collect()
    }
}

fn case_file(launches: &[Launch]) -> Vec<u8> {
    let mut f = b"KVEMU01\n".to_vec();
    f.extend_from_slice(&(launches.len() as u32).to_le_bytes());
    for l in launches {
        f.extend_from_slice(&(l.name.len() as u32).to_le_bytes());
        f.extend_from_slice(l.name.as_bytes());
        let (g, b) = (l.cfg.grid, l.cfg.block);
        for v in [g.0, g.1, g.2, b.0, b.1, b.2, l.cfg.shared_bytes] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        f.extend_from_slice(&(l.args.len() as u32).to_le_bytes());
        for a in &l.args {
            let (kind, bytes) = match a {
                Arg::Buf(b) => (b'p', b),
                Arg::Scalar(k, b) => (*k, b),
            };
            f.push(kind);
            f.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            f.extend_from_slice(bytes);
        }
    }
    f
}

fn parse_out(launches: &[Launch], out: &[u8]) -> Vec<Ran> {
    let mut at = 0;
    let ran = launches
        .iter()
        .map(|l| {
            Ran(l
                .args
                .iter()
                .map(|a| {
                    let Arg::Buf(sent) = a else { return None };
                    let len = u64::from_le_bytes(out[at..at + 8].try_into().unwrap()) as usize;
                    assert_eq!(len, sent.len(), "{}: buffer length changed", l.name);
                    at += 8 + len;
                    Some(out[at - len..at].to_vec())
                })
                .collect())
        })
        .collect();
    assert_eq!(at, out.len(), "driver output has trailing bytes");
    ran
}

/// Run `launches` under every build; the builds must succeed without a
/// sanitizer report and agree bit for bit. None (after saying why) when the
/// emulation cannot run here and is not required.
fn emulate(test: &str, launches: Vec<Launch>) -> Option<Vec<Ran>> {
    let exes = match drivers() {
        Ok(e) => e,
        Err(Unavailable::Skip(why)) => {
            eprintln!("{test}: not run: {why}");
            return None;
        }
        Err(Unavailable::Fail(why)) => panic!("{test}: {why}"),
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvreplay-emu/cases");
    std::fs::create_dir_all(&dir).unwrap();
    let case = dir.join(format!("{test}.case"));
    std::fs::write(&case, case_file(&launches)).unwrap();
    // Every build runs before anything is judged, so a sanitizer's report is
    // shown even when another build's numbers already went wrong.
    let mut outs = Vec::new();
    let mut failed = Vec::new();
    for (b, exe) in BUILDS.iter().zip(exes) {
        let out_path = dir.join(format!("{test}.{}.out", b.name()));
        let o = Command::new(exe)
            .arg(&case)
            .arg(&out_path)
            .envs(b.env().iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        if o.status.success() && stderr.trim().is_empty() {
            outs.push((b, std::fs::read(&out_path).unwrap()));
        } else {
            failed.push(format!(
                "the {} build failed ({}):\n{}",
                b.name(),
                o.status,
                stderr.chars().take(8_000).collect::<String>()
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{test} (case file {}): {}",
        case.display(),
        failed.join("\n")
    );
    let (_, plain) = &outs[0];
    for (b, out) in &outs[1..] {
        assert!(
            out == plain,
            "{test}: the {} build's buffers differ from the plain build's (a race or an uninitialised read)",
            b.name()
        );
    }
    Some(parse_out(&launches, plain))
}

// ------------------------------------------------------------ data and checks

/// Bit for bit (NaNs: both NaN).
fn exact(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}[{i}]: emulated kernel {g:e} ({:#010x}), CPU twin {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn close<T: Into<f64> + Copy>(got: &[T], want: &[T], tol: impl Fn(usize) -> f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = ((*g).into(), (*w).into());
        let e = (g - w).abs();
        assert!(
            e <= tol(i),
            "{what}[{i}]: emulated kernel {g:e}, CPU twin {w:e} (difference {e:.3e} > tolerance {:.3e})",
            tol(i)
        );
    }
}

/// Bound on the difference of two f32 dot products of `a` and `b` summed in
/// different orders: 2·d·u·Σ|a_t b_t| (see the module comment).
fn dot_orders(a: &[f32], b: &[f32]) -> f64 {
    2.0 * a.len() as f64
        * U
        * a.iter()
            .zip(b)
            .map(|(x, y)| (x * y).abs() as f64)
            .sum::<f64>()
}

/// Relative bound on softmax weights whose logits differ by at most `delta`:
/// l - max moves by 2δ, so each exp(l - max) by a factor e^{±2δ} and their
/// sum too (4δ for the quotient), plus a few roundings (exp, the f32
/// subtraction of logits up to `span` apart, 1/z, the product): 8u·(1 + span).
fn softmax_rel(delta: f64, span: f64) -> f64 {
    4.0 * delta + 8.0 * U * (1.0 + span)
}

// ------------------------------------------------------------ layer

/// Exact: a gather.
#[test]
fn emu_embedding() {
    let mut r = Rng(11);
    // (vocab, dim, ids): n = 65 < BLOCK with an odd dim; n = 297 > BLOCK.
    let shapes = [(7usize, 5usize, 13usize), (4, 33, 9), (1, 1, 1)];
    let data: Vec<(Vec<f32>, Vec<u32>)> = shapes
        .iter()
        .map(|&(v, d, n)| {
            (
                r.vec(v * d),
                (0..n).map(|_| r.below(v as u64) as u32).collect(),
            )
        })
        .collect();
    let launches = shapes
        .iter()
        .zip(&data)
        .map(|(&(_, d, n), (table, ids))| {
            Launch::new("embedding", launch::grid_1d(n * d))
                .buf(table)
                .buf(ids)
                .buf(&vec![0f32; n * d])
                .int(d as i32)
                .i64((n * d) as i64)
        })
        .collect();
    let Some(ran) = emulate("emu_embedding", launches) else {
        return;
    };
    for ((&(_, d, n), (table, ids)), got) in shapes.iter().zip(&data).zip(&ran) {
        let mut want = vec![0f32; n * d];
        cpu::embedding(table, d, ids, &mut want);
        exact(
            &got.get::<f32>(2),
            &want,
            &format!("embedding dim={d} ids={n}"),
        );
    }
}

/// The mean square is an f64 sum in a different order (a tree over BLOCK
/// threads vs left to right); its relative difference (~dim·2⁻⁵³) can move
/// the f32 rounding of 1/sqrt by one ulp, which moves x·inv·w by at most two
/// ulps: |diff| ≤ 4u·|want|.
#[test]
fn emu_rms_norm() {
    let mut r = Rng(12);
    // (rows, dim): dim > BLOCK and not a multiple; a single row with dim < BLOCK, odd.
    let shapes = [(3usize, 300usize), (1, 7), (2, 256)];
    let data: Vec<(Vec<f32>, Vec<f32>)> = shapes
        .iter()
        .map(|&(rows, dim)| (r.vec(rows * dim), r.vec(dim)))
        .collect();
    let eps = 1e-5f32;
    let launches = shapes
        .iter()
        .zip(&data)
        .map(|(&(rows, dim), (x, w))| {
            Launch::new("rms_norm", launch::rows(rows, BLOCK))
                .buf(x)
                .buf(w)
                .int(dim as i32)
                .float(eps)
        })
        .collect();
    let Some(ran) = emulate("emu_rms_norm", launches) else {
        return;
    };
    for ((&(rows, dim), (x, w)), got) in shapes.iter().zip(&data).zip(&ran) {
        let mut want = x.clone();
        cpu::rms_norm(&mut want, w, eps);
        close(
            &got.get::<f32>(0),
            &want,
            |i| 4.0 * U * want[i].abs() as f64,
            &format!("rms_norm rows={rows} dim={dim}"),
        );
    }
}

/// A gated activation kernel `name(gate, up, n)` against its CPU twin, on
/// 300, 1 and 256 elements (gates up to ±8): exact.
fn check_gate_kernel(test: &str, name: &'static str, seed: u64, twin: fn(&mut [f32], &[f32])) {
    let mut r = Rng(seed);
    let sizes = [300usize, 1, 256];
    let data: Vec<(Vec<f32>, Vec<f32>)> = sizes
        .iter()
        .map(|&n| {
            let g = r.vec(n).iter().map(|v| v * 8.0).collect();
            (g, r.vec(n))
        })
        .collect();
    let launches = sizes
        .iter()
        .zip(&data)
        .map(|(&n, (g, u))| {
            Launch::new(name, launch::grid_1d(n))
                .buf(g)
                .buf(u)
                .i64(n as i64)
        })
        .collect();
    let Some(ran) = emulate(test, launches) else {
        return;
    };
    for ((&n, (g, u)), got) in sizes.iter().zip(&data).zip(&ran) {
        let mut want = g.clone();
        twin(&mut want, u);
        exact(&got.get::<f32>(0), &want, &format!("{name} n={n}"));
    }
}

/// Exact: the same f32 operations, e^x by the same polynomial (`kv_exp`,
/// `cpu::simd::exp`).
#[test]
fn emu_silu_mul() {
    check_gate_kernel("emu_silu_mul", "silu_mul", 13, cpu::silu_mul);
}

/// Exact: the same f32 operations in the same order, e^x by the same
/// polynomial.
#[test]
fn emu_gelu_tanh_mul() {
    check_gate_kernel("emu_gelu_tanh_mul", "gelu_tanh_mul", 23, cpu::gelu_tanh_mul);
}

/// Exact: one f32 product per element.
#[test]
fn emu_scale_inplace() {
    let mut r = Rng(29);
    let sizes = [640usize, 1, 257];
    let data: Vec<Vec<f32>> = sizes.iter().map(|&n| r.vec(n)).collect();
    let s = 25.298_22f32; // sqrt(640), Gemma 3 270M's embedding scale
    let launches = sizes
        .iter()
        .zip(&data)
        .map(|(&n, x)| {
            Launch::new("scale_inplace", launch::grid_1d(n))
                .buf(x)
                .float(s)
                .i64(n as i64)
        })
        .collect();
    let Some(ran) = emulate("emu_scale_inplace", launches) else {
        return;
    };
    for ((&n, x), got) in sizes.iter().zip(&data).zip(&ran) {
        let mut want = x.clone();
        cpu::scale(&mut want, s);
        exact(&got.get::<f32>(0), &want, &format!("scale_inplace n={n}"));
    }
}

/// Exact: the same table and the same f32 rotation.
#[test]
fn emu_rope() {
    let mut r = Rng(14);
    // (rows, heads, head_dim, rotated, pos0, style): partial rotation of an
    // odd head_dim, both pairings, r·heads·half = 384 (> BLOCK, not a
    // multiple), and a single pair.
    let shapes = [
        (3usize, 5usize, 7usize, 6usize, 4usize, RopeStyle::Neox),
        (2, 3, 7, 6, 9, RopeStyle::Interleaved),
        (4, 3, 64, 64, 100, RopeStyle::Neox),
        (4, 3, 64, 64, 100, RopeStyle::Interleaved),
        (1, 1, 2, 2, 0, RopeStyle::Neox),
    ];
    let data: Vec<(Vec<f32>, RopeParams, Vec<f32>)> = shapes
        .iter()
        .map(|&(rows, heads, hd, rot, pos0, style)| {
            let p = RopeParams {
                theta: 10000.0,
                style,
                rotated_dims: rot,
                linear_factor: 1.0,
                llama3: None,
            };
            let table = cpu::rope_table(rows, pos0, &p, 1.0);
            (r.vec(rows * heads * hd), p, table)
        })
        .collect();
    let launches = shapes
        .iter()
        .zip(&data)
        .map(|(&(rows, heads, hd, rot, _, style), (x, _, table))| {
            Launch::new("rope", launch::grid_1d(rows * heads * (rot / 2)))
                .buf(x)
                .buf(table)
                .int(rows as i32)
                .int(heads as i32)
                .int(hd as i32)
                .int((rot / 2) as i32)
                .int((style == RopeStyle::Interleaved) as i32)
        })
        .collect();
    let Some(ran) = emulate("emu_rope", launches) else {
        return;
    };
    for ((&(rows, heads, hd, rot, pos0, style), (x, p, table)), got) in
        shapes.iter().zip(&data).zip(&ran)
    {
        let mut want = x.clone();
        cpu::rotate_with_table(&mut want, heads, hd, p.style, p.rotated_dims, table);
        exact(
            &got.get::<f32>(0),
            &want,
            &format!(
                "rope rows={rows} heads={heads} head_dim={hd} rotated={rot} pos0={pos0} {style:?}"
            ),
        );
    }
}

/// The kernel sums each output in k order; `cpu::linear` (the gemm crate)
/// in its own order: |diff| ≤ 2k·u·Σ_t|x_t w_t|.
#[test]
fn emu_linear_tiled() {
    let mut r = Rng(15);
    // (m, k, n): nothing a multiple of the 16-wide tile, k over three tiles;
    // one output; exact tiles.
    let shapes = [(5usize, 37usize, 19usize), (1, 3, 1), (16, 16, 32)];
    let data: Vec<(Vec<f32>, Vec<f32>)> = shapes
        .iter()
        .map(|&(m, k, n)| (r.vec(m * k), r.vec(n * k)))
        .collect();
    let launches = shapes
        .iter()
        .zip(&data)
        .map(|(&(m, k, n), (x, w))| {
            Launch::new("linear_tiled", launch::tiles(m, n))
                .buf(x)
                .buf(w)
                .buf(&vec![0f32; m * n])
                .int(m as i32)
                .int(k as i32)
                .int(n as i32)
        })
        .collect();
    let Some(ran) = emulate("emu_linear_tiled", launches) else {
        return;
    };
    for ((&(m, k, n), (x, w)), got) in shapes.iter().zip(&data).zip(&ran) {
        let mut want = vec![0f32; m * n];
        cpu::linear(x, w, &mut want, m, k, n);
        let tol = |o: usize| {
            let (i, j) = (o / n, o % n);
            dot_orders(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k])
        };
        close(
            &got.get::<f32>(2),
            &want,
            tol,
            &format!("linear_tiled {m}x{k}x{n}"),
        );
    }
}

// ------------------------------------------------------------ attention

/// A layer's causal attention problem (every head, grouped KV heads in a
/// cache with spare capacity) and the CPU twin's results on it, head by head.
struct Causal {
    c: usize,
    d: usize,
    pos0: usize,
    heads: usize,
    kv_heads: usize,
    cap: usize,
    /// Sliding window (keys per query, counting itself), if any.
    window: Option<usize>,
    scale: f32,
    q: Vec<f32>,       // (heads, c, d)
    k: Vec<f32>,       // (kv_heads, cap, d)
    v: Vec<f32>,       // (kv_heads, cap, d)
    probs: Vec<f32>,   // (heads, c, n)
    out: Vec<f32>,     // (heads, c, d)
    colsum0: Vec<f32>, // (heads, tracked)
    colsum: Vec<f32>,  // (heads, tracked)
}

impl Causal {
    fn n(&self) -> usize {
        self.pos0 + self.c
    }
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn tracked(&self) -> usize {
        self.colsum0.len() / self.heads
    }
    /// Key j of the KV head query head h reads.
    fn key(&self, h: usize, j: usize) -> &[f32] {
        let at = (h / self.group() * self.cap + j) * self.d;
        &self.k[at..at + self.d]
    }
}

/// (c, d, pos0, tracked columns, heads, KV heads, cache capacity, window):
/// d odd and tiny; n = 300 keys (> BLOCK and several KEY_SPLIT runs) with
/// pos0 > 0 and fewer tracked columns than keys; a single query over a
/// single key; 6 heads over 2 KV heads (group 3) in a cache with unused
/// capacity, d = 33; sliding windows (Gemma 3): 3 keys over a chunk that
/// starts inside and ends past it, 270 keys (> BLOCK) of 300, and a window
/// wider than every row (masks nothing).
fn causal_problems() -> Vec<Causal> {
    let mut r = Rng(16);
    [
        (3usize, 5usize, 0usize, 3usize, 1usize, 1usize, 3usize, None),
        (2, 8, 298, 299, 2, 1, 303, None),
        (1, 1, 0, 1, 1, 1, 1, None),
        (4, 33, 5, 9, 6, 2, 12, None),
        (6, 8, 1, 7, 4, 1, 9, Some(3usize)),
        (2, 8, 298, 299, 2, 1, 303, Some(270)),
        (3, 4, 2, 5, 2, 2, 5, Some(40)),
    ]
    .iter()
    .map(|&(c, d, pos0, tracked, heads, kv_heads, cap, window)| {
        let n = pos0 + c;
        let (q, k, v) = (
            r.vec(heads * c * d),
            r.vec(kv_heads * cap * d),
            r.vec(kv_heads * cap * d),
        );
        let scale = 1.0 / (d as f32).sqrt();
        let colsum0: Vec<f32> = r.vec(heads * tracked).iter().map(|x| x.abs()).collect();
        let (mut probs, mut out, mut colsum) = (
            vec![0f32; heads * c * n],
            vec![0f32; heads * c * d],
            colsum0.clone(),
        );
        let group = heads / kv_heads;
        for h in 0..heads {
            let kv = (h / group * cap) * d..(h / group * cap + n) * d;
            cpu::windowed_attention_head(
                &q[h * c * d..(h + 1) * c * d],
                &k[kv.clone()],
                &v[kv],
                d,
                pos0,
                window,
                scale,
                &mut out[h * c * d..(h + 1) * c * d],
                AttentionStats {
                    colsum: Some(&mut colsum[h * tracked..(h + 1) * tracked]),
                    probs: Some(&mut probs[h * c * n..(h + 1) * c * n]),
                },
            );
        }
        Causal {
            c,
            d,
            pos0,
            heads,
            kv_heads,
            cap,
            window,
            scale,
            q,
            k,
            v,
            probs,
            out,
            colsum0,
            colsum,
        }
    })
    .collect()
}

/// Logits differ only by the dot products' summation order (the CPU uses
/// the gemm crate); the tolerance is [`softmax_rel`] of the row's largest
/// bound, and masked entries must be exactly zero.
#[test]
fn emu_causal_softmax() {
    let probs = causal_problems();
    let launches = probs
        .iter()
        .map(|p| {
            let n = p.n();
            Launch::new("causal_softmax", launch::rows_heads(p.c, p.heads, BLOCK))
                .buf(&p.q)
                .buf(&p.k)
                .buf(&vec![0f32; p.heads * p.c * n])
                .int(p.c as i32)
                .int(n as i32)
                .int(p.d as i32)
                .int(p.pos0 as i32)
                .int(p.cap as i32)
                .int(p.group() as i32)
                .float(p.scale)
                .int(p.window.unwrap_or(0) as i32)
        })
        .collect();
    let Some(ran) = emulate("emu_causal_softmax", launches) else {
        return;
    };
    for (p, got) in probs.iter().zip(&ran) {
        let (n, d) = (p.n(), p.d);
        // one tolerance per (head, row)
        let rel: Vec<f64> = (0..p.heads * p.c)
            .map(|row| {
                let (h, i) = (row / p.c, row % p.c);
                let qi = &p.q[row * d..(row + 1) * d];
                let valid = p.pos0 + i + 1;
                let lo = p.window.map_or(0, |w| valid.saturating_sub(w));
                let logits = (lo..valid).map(|j| (qi, p.key(h, j)));
                let delta = logits
                    .clone()
                    .map(|(a, b)| dot_orders(a, b))
                    .fold(0.0, f64::max);
                let dots: Vec<f64> = logits.map(|(a, b)| cpu::dot(a, b) as f64).collect();
                let span = dots.iter().cloned().fold(f64::MIN, f64::max)
                    - dots.iter().cloned().fold(f64::MAX, f64::min);
                softmax_rel(delta * p.scale as f64, span * p.scale as f64)
            })
            .collect();
        close(
            &got.get::<f32>(2),
            &p.probs,
            |o| rel[o / n] * p.probs[o].abs() as f64,
            &format!(
                "causal_softmax c={} d={d} pos0={} heads={}/{} window {:?}",
                p.c, p.pos0, p.heads, p.kv_heads, p.window
            ),
        );
    }
}

/// Given the twin's probabilities, each split's partial sum is the f32 sum
/// of its KEY_SPLIT keys in key order: computed here the same way, exact.
#[test]
fn emu_probs_times_v() {
    let probs = causal_problems();
    let split = KEY_SPLIT as usize;
    let launches = probs
        .iter()
        .map(|p| {
            let (n, splits) = (p.n(), p.n().div_ceil(split));
            Launch::new("probs_times_v", launch::probs_times_v(p.c, p.heads, n, p.d))
                .buf(&p.probs)
                .buf(&p.v)
                .buf(&vec![0f32; p.heads * p.c * splits * p.d])
                .int(p.c as i32)
                .int(n as i32)
                .int(p.d as i32)
                .int(p.cap as i32)
                .int(p.group() as i32)
        })
        .collect();
    let Some(ran) = emulate("emu_probs_times_v", launches) else {
        return;
    };
    for (p, got) in probs.iter().zip(&ran) {
        let (n, d, splits) = (p.n(), p.d, p.n().div_ceil(split));
        let mut want = vec![0f32; p.heads * p.c * splits * d];
        for h in 0..p.heads {
            let g = h / p.group();
            for i in 0..p.c {
                for sp in 0..splits {
                    for t in 0..d {
                        let mut acc = 0f32;
                        for j in sp * split..((sp + 1) * split).min(n) {
                            acc += p.probs[(h * p.c + i) * n + j] * p.v[(g * p.cap + j) * d + t];
                        }
                        want[((h * p.c + i) * splits + sp) * d + t] = acc;
                    }
                }
            }
        }
        exact(
            &got.get::<f32>(2),
            &want,
            &format!("probs_times_v c={} n={n} d={d} heads={}", p.c, p.heads),
        );
    }
}

/// Summing the splits gives the attention output: within the f32 sum's
/// order bound 2n·u·Σ_j|p_j v_j| of the twin's (its key order differs). The
/// partials come from the twin's probabilities as `probs_times_v` makes them.
#[test]
fn emu_sum_splits() {
    let probs = causal_problems();
    let split = KEY_SPLIT as usize;
    let parts: Vec<Vec<f32>> = probs
        .iter()
        .map(|p| {
            let (n, d, splits) = (p.n(), p.d, p.n().div_ceil(split));
            let mut part = vec![0f32; p.heads * p.c * splits * d];
            for h in 0..p.heads {
                for i in 0..p.c {
                    for j in 0..n {
                        for t in 0..d {
                            part[((h * p.c + i) * splits + j / split) * d + t] += p.probs
                                [(h * p.c + i) * n + j]
                                * p.v[(h / p.group() * p.cap + j) * d + t];
                        }
                    }
                }
            }
            part
        })
        .collect();
    let launches = probs
        .iter()
        .zip(&parts)
        .map(|(p, part)| {
            let rows = p.heads * p.c;
            Launch::new("sum_splits", launch::grid_1d(rows * p.d))
                .buf(part)
                .buf(&vec![0f32; rows * p.d])
                .int(rows as i32)
                .int(p.n().div_ceil(split) as i32)
                .int(p.d as i32)
        })
        .collect();
    let Some(ran) = emulate("emu_sum_splits", launches) else {
        return;
    };
    for (p, got) in probs.iter().zip(&ran) {
        let (n, d) = (p.n(), p.d);
        let tol = |o: usize| {
            let (row, t) = (o / d, o % d);
            let g = row / p.c / p.group();
            let mass: f64 = (0..n)
                .map(|j| (p.probs[row * n + j] * p.v[(g * p.cap + j) * d + t]).abs() as f64)
                .sum();
            2.0 * n as f64 * U * mass
        };
        close(
            &got.get::<f32>(1),
            &p.out,
            tol,
            &format!("sum_splits c={} n={n} d={d} heads={}", p.c, p.heads),
        );
    }
}

/// Exact: given the twin's probabilities, rows are added in the same order
/// (ATTN_ROWS at a time into a part, parts in order).
#[test]
fn emu_column_sums() {
    let probs = causal_problems();
    let launches = probs
        .iter()
        .map(|p| {
            let m = p.tracked().min(p.n());
            Launch::new("column_sums", launch::column_sums(m, p.heads))
                .buf(&p.probs)
                .buf(&p.colsum0)
                .int(p.c as i32)
                .int(p.n() as i32)
                .int(m as i32)
                .int(p.tracked() as i32)
        })
        .collect();
    let Some(ran) = emulate("emu_column_sums", launches) else {
        return;
    };
    for (p, got) in probs.iter().zip(&ran) {
        exact(
            &got.get::<f32>(1),
            &p.colsum,
            &format!("column_sums c={} n={} m={}", p.c, p.n(), p.tracked()),
        );
    }
}

/// Exact: one f32 add per element.
#[test]
fn emu_add_inplace() {
    let mut r = Rng(21);
    let sizes = [300usize, 1, 256];
    let data: Vec<(Vec<f32>, Vec<f32>)> = sizes.iter().map(|&n| (r.vec(n), r.vec(n))).collect();
    let launches = sizes
        .iter()
        .zip(&data)
        .map(|(&n, (x, y))| {
            Launch::new("add_inplace", launch::grid_1d(n))
                .buf(x)
                .buf(y)
                .i64(n as i64)
        })
        .collect();
    let Some(ran) = emulate("emu_add_inplace", launches) else {
        return;
    };
    for ((&n, (x, y)), got) in sizes.iter().zip(&data).zip(&ran) {
        let want: Vec<f32> = x.iter().zip(y).map(|(a, b)| a + b).collect();
        exact(&got.get::<f32>(0), &want, &format!("add_inplace n={n}"));
    }
}

/// Exact: a permutation, both directions, checked against the CPU backend.
#[test]
fn emu_transpose_heads() {
    let mut r = Rng(22);
    // (c, heads, d): more elements than BLOCK; a single position; d odd
    let shapes = [(7usize, 9usize, 5usize), (1, 3, 4), (33, 2, 7)];
    let data: Vec<Vec<f32>> = shapes.iter().map(|&(c, h, d)| r.vec(c * h * d)).collect();
    let mut launches = Vec::new();
    for (&(c, h, d), x) in shapes.iter().zip(&data) {
        for to_heads in [1, 0] {
            launches.push(
                Launch::new("transpose_heads", launch::grid_1d(c * h * d))
                    .buf(x)
                    .buf(&vec![0f32; x.len()])
                    .int(c as i32)
                    .int(h as i32)
                    .int(d as i32)
                    .int(to_heads),
            );
        }
    }
    let Some(ran) = emulate("emu_transpose_heads", launches) else {
        return;
    };
    let be = kvreplay_kernels::Backend::Cpu;
    for (i, (&(c, h, d), x)) in shapes.iter().zip(&data).enumerate() {
        for (k, to_heads) in [true, false].into_iter().enumerate() {
            let want = be
                .transpose_heads(&be.upload(x).unwrap(), c, h, d, to_heads)
                .unwrap();
            exact(
                &ran[2 * i + k].get::<f32>(1),
                &be.download(&want).unwrap(),
                &format!("transpose_heads ({c}, {h}, {d}) to_heads={to_heads}"),
            );
        }
    }
}

/// Logits differ by the dot products' order (δ per query); w and z are
/// relatively within [`softmax_rel`]; out within Σ_e rel·p_e·|v_e| plus the
/// f32 entry-order sum's 2n·u·Σ|p v|.
#[test]
fn emu_attend_biased() {
    let mut r = Rng(17);
    // (nq, n, d): n > BLOCK, d odd; one query, one entry, d = 1; d = 32 (the
    // twin's AVX2 path); an empty cache.
    let shapes = [
        (3usize, 300usize, 5usize),
        (1, 1, 1),
        (2, 37, 32),
        (2, 0, 4),
    ];
    struct P {
        nq: usize,
        n: usize,
        d: usize,
        q: Vec<f32>,
        keys: Vec<f32>,
        vals: Vec<f32>,
        bias: Vec<f32>,
    }
    let probs: Vec<P> = shapes
        .iter()
        .map(|&(nq, n, d)| P {
            nq,
            n,
            d,
            q: r.vec(nq * d),
            keys: r.vec(n * d),
            vals: r.vec(n * d),
            bias: r.vec(n),
        })
        .collect();
    let scale = 0.37f32;
    let launches = probs
        .iter()
        .map(|p| {
            Launch::new("attend_biased", launch::rows(p.nq, BLOCK))
                .buf(&p.q)
                .buf(&p.keys)
                .buf(&p.vals)
                .buf(&p.bias)
                .buf(&vec![0f64; p.nq * p.n])
                .buf(&vec![0f64; p.nq])
                .buf(&vec![0f32; p.nq * p.d])
                .int(p.n as i32)
                .int(p.d as i32)
                .float(scale)
        })
        .collect();
    let Some(ran) = emulate("emu_attend_biased", launches) else {
        return;
    };
    for (p, got) in probs.iter().zip(&ran) {
        let (nq, n, d) = (p.nq, p.n, p.d);
        let (mut w, mut z, mut out) = (vec![0f64; nq * n], vec![0f64; nq], vec![0f32; nq * d]);
        cpu::attend_biased_multi(
            &p.q, &p.keys, &p.vals, &p.bias, scale, &mut w, &mut z, &mut out,
        );
        let rel: Vec<f64> = (0..nq)
            .map(|i| {
                let qi = &p.q[i * d..(i + 1) * d];
                let delta = (0..n)
                    .map(|e| dot_orders(qi, &p.keys[e * d..(e + 1) * d]) * scale as f64)
                    .fold(0.0, f64::max);
                let span = w[i * n..(i + 1) * n]
                    .iter()
                    .map(|x| -x.ln())
                    .fold(0.0, f64::max);
                softmax_rel(delta, span)
            })
            .collect();
        let what = format!("attend_biased nq={nq} n={n} d={d}");
        close(
            &got.get::<f64>(4),
            &w,
            |o| rel[o / n.max(1)] * w[o],
            &format!("{what} w"),
        );
        close(
            &got.get::<f64>(5),
            &z,
            |i| rel[i] * z[i],
            &format!("{what} z"),
        );
        let tol = |o: usize| {
            let (i, t) = (o / d, o % d);
            (0..n)
                .map(|e| {
                    let pv = (w[i * n + e] / z[i]) * (p.vals[e * d + t] as f64).abs();
                    rel[i] * pv + 2.0 * n as f64 * U * pv
                })
                .sum()
        };
        close(&got.get::<f32>(6), &out, tol, &format!("{what} out"));
    }
}

/// Logits dot·scale·gain differ by the dot products' order; the tolerance is
/// [`softmax_rel`] of the row's bound, and entries at and beyond a row's
/// length must be exactly zero.
#[test]
fn emu_attention_rows() {
    let mut r = Rng(18);
    // (n, d, lens): n > BLOCK, d odd, a full row, an empty row, one key, a
    // row longer than BLOCK but short of n; a single row over a single key;
    // d > 8 (the twin's vector dot).
    let shapes: [(usize, usize, Vec<usize>); 3] = [
        (300, 3, vec![300, 0, 1, 257]),
        (1, 1, vec![1]),
        (20, 9, vec![20, 7, 13]),
    ];
    struct P {
        n: usize,
        d: usize,
        lens: Vec<usize>,
        q: Vec<f32>,
        keys: Vec<f32>,
        gains: Vec<f32>,
    }
    let probs: Vec<P> = shapes
        .iter()
        .map(|(n, d, lens)| P {
            n: *n,
            d: *d,
            lens: lens.clone(),
            q: r.vec(lens.len() * d),
            keys: r.vec(n * d),
            gains: lens.iter().map(|_| 0.5 + r.f().abs()).collect(),
        })
        .collect();
    let scale = 0.41f32;
    let launches = probs
        .iter()
        .map(|p| {
            let lens: Vec<i32> = p.lens.iter().map(|&l| l as i32).collect();
            Launch::new("attention_rows", launch::rows(p.lens.len(), BLOCK))
                .buf(&p.q)
                .buf(&p.keys)
                .buf(&lens)
                .buf(&p.gains)
                .buf(&vec![0f32; p.lens.len() * p.n])
                .int(p.n as i32)
                .int(p.d as i32)
                .float(scale)
        })
        .collect();
    let Some(ran) = emulate("emu_attention_rows", launches) else {
        return;
    };
    for (p, got) in probs.iter().zip(&ran) {
        let (n, d) = (p.n, p.d);
        let mut want = vec![0f32; p.lens.len() * n];
        cpu::attention_rows(&p.q, &p.keys, d, &p.lens, &p.gains, scale, &mut want);
        let rel: Vec<f64> = (0..p.lens.len())
            .map(|i| {
                let qi = &p.q[i * d..(i + 1) * d];
                let g = (scale * p.gains[i]) as f64;
                let keys = (0..p.lens[i]).map(|j| &p.keys[j * d..(j + 1) * d]);
                let delta = keys
                    .clone()
                    .map(|k| dot_orders(qi, k) * g)
                    .fold(0.0, f64::max);
                let l: Vec<f64> = keys.map(|k| cpu::dot(qi, k) as f64 * g).collect();
                let span = l.iter().cloned().fold(f64::MIN, f64::max)
                    - l.iter().cloned().fold(f64::MAX, f64::min);
                softmax_rel(delta, span.max(0.0))
            })
            .collect();
        close(
            &got.get::<f32>(4),
            &want,
            |o| rel[o / n] * want[o].abs() as f64,
            &format!("attention_rows n={n} d={d} lens={:?}", p.lens),
        );
    }
}

// ------------------------------------------------------------ coverage

/// Every kernel defined in the sources is listed in `nvrtc::SOURCES`,
/// launched by name by the CUDA backend, and has a test here; the sources
/// listed are the ones on disk; `TILE` agrees with the Rust side.
#[test]
fn emu_every_kernel_is_named_launched_and_tested() {
    let srcs = sources();
    let defined: BTreeSet<String> = srcs.iter().flat_map(|(_, s)| kernel_names(s)).collect();
    let files: BTreeSet<String> = srcs.iter().map(|(f, _)| f.clone()).collect();
    // The parser against a plain count of the keyword (no kernel missed).
    let keyword: usize = srcs
        .iter()
        .map(|(_, s)| s.matches("__global__").count())
        .sum();
    assert!(
        defined.len() == keyword && keyword > 0,
        "{} kernels parsed, {keyword} `__global__` in the sources: {defined:?}",
        defined.len()
    );

    // nvrtc::SOURCES is built with the `cuda` feature, which the tests always
    // have (the package's self dev-dependency enables it).
    #[cfg(feature = "cuda")]
    {
        use kvreplay_kernels::cuda::nvrtc::SOURCES;
        let listed: BTreeSet<String> = SOURCES
            .iter()
            .flat_map(|s| s.2.iter().map(|k| k.to_string()))
            .collect();
        assert_eq!(
            defined, listed,
            "the kernels defined in kernels/src/cuda/*.cu differ from those listed in nvrtc::SOURCES"
        );
        let listed_files: BTreeSet<String> = SOURCES.iter().map(|s| s.0.to_string()).collect();
        assert_eq!(
            files, listed_files,
            "the .cu files differ from nvrtc::SOURCES"
        );
        for (file, text, kernels) in SOURCES {
            let on_disk = &srcs.iter().find(|s| s.0 == *file).unwrap().1;
            assert_eq!(text, on_disk, "{file}: SOURCES holds different text");
            let here: BTreeSet<String> = kernel_names(text).into_iter().collect();
            let said: BTreeSet<String> = kernels.iter().map(|k| k.to_string()).collect();
            assert_eq!(
                here, said,
                "{file}: SOURCES lists other kernels than it defines"
            );
        }
    }

    let backend = std::fs::read_to_string(format!("{CUDA_DIR}/mod.rs")).unwrap();
    let tests = include_str!("emulated.rs");
    for k in &defined {
        assert!(
            backend.contains(&format!("self.f(\"{k}\")"))
                || backend.contains(&format!("self.inplace_with(\"{k}\"")),
            "kernel {k} is never launched by name in kernels/src/cuda/mod.rs"
        );
        assert!(
            tests.contains(&format!("fn emu_{k}()"))
                && tests.contains(&format!("\"{k}\"")),
            "kernel {k} has no emulated test case: add `#[test] fn emu_{k}()` to kernels/tests/emulated.rs, launching Launch::new(\"{k}\", <the configuration mod.rs uses>) on edge-case shapes and comparing with its CPU twin"
        );
    }
    let layer = srcs.iter().find(|s| s.0 == "layer.cu").unwrap();
    assert!(
        layer
            .1
            .contains(&format!("#define TILE {}\n", launch::TILE)),
        "layer.cu's TILE differs from kvreplay_kernels::launch::TILE"
    );
}
