//! The CUDA backend: NVRTC-compiled kernels (sources beside this file) and
//! cuBLAS for dense products, launched through cudarc with dynamic loading.
//!
//! Each operation mirrors a CPU twin in [`crate::cpu`] (named in the kernel
//! sources) and is checked against the same independent reference by the
//! parity tests in `kernels/tests/parity.rs`.
//!
//! Capture's forward pass runs on [`Buf`]s that stay on the device
//! (`crate::resident`); replay's host-slice operations copy in and out. All
//! work goes to one stream, so its order is the program order; nothing is
//! serialised by a lock except the cuBLAS handle.

pub mod nvrtc;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::{sys::cublasOperation_t as Op, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::buf::{AttnShape, Buf};
use crate::cpu::{RopeParams, RopeStyle};
use crate::{launch, KernelError, Weight, BLOCK};

pub struct Cuda {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handles are not safe to drive from two threads at once; this
    /// lock covers the handle only (kernels and copies are not serialised).
    blas: Option<Mutex<CudaBlas>>,
    /// Every kernel by name, with its index in `names`.
    funcs: HashMap<&'static str, (usize, CudaFunction)>,
    name: String,
    /// The kernel launched last (an index into `funcs`' names), named in the
    /// error of a later failing copy: kernel faults surface asynchronously.
    last: AtomicUsize,
    names: Vec<&'static str>,
}

// SAFETY: cudarc's context and stream are thread-safe (every call binds the
// context to the calling thread and enqueues on the one stream, whose order
// CUDA keeps); the cuBLAS handle is only used under its lock.
unsafe impl Send for Cuda {}
unsafe impl Sync for Cuda {}

fn cu<E: std::fmt::Display>(op: &'static str) -> impl Fn(E) -> KernelError {
    move |e| KernelError::Cuda(format!("{op}: {e}"))
}

/// A shared launch configuration ([`crate::launch`]) as cudarc's.
fn cfg(l: launch::Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: l.grid,
        block_dim: l.block,
        shared_mem_bytes: l.shared_bytes,
    }
}

fn grid_1d(n: usize) -> LaunchConfig {
    cfg(launch::grid_1d(n))
}

fn rows(r: usize, threads: u32) -> LaunchConfig {
    cfg(launch::rows(r, threads))
}

/// Whether a CUDA driver library is present (no device needed to ask).
pub fn driver_present() -> bool {
    // SAFETY: only probes whether libcuda can be dlopen'ed.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn dev(b: &Buf) -> Result<&CudaSlice<f32>, KernelError> {
    match b {
        Buf::Dev(s, _) => Ok(s),
        Buf::Host(_) => Err(KernelError::Shape {
            op: "cuda",
            msg: "a host buffer was given to the CUDA backend".into(),
        }),
    }
}

fn dev_mut(b: &mut Buf) -> Result<&mut CudaSlice<f32>, KernelError> {
    match b {
        Buf::Dev(s, _) => Ok(s),
        Buf::Host(_) => Err(KernelError::Shape {
            op: "cuda",
            msg: "a host buffer was given to the CUDA backend".into(),
        }),
    }
}

impl Cuda {
    /// Open device 0, compile every kernel for its architecture (CUBIN, so
    /// the driver's PTX version does not matter) and load cuBLAS if present.
    pub fn open() -> Result<Cuda, KernelError> {
        if !driver_present() {
            return Err(KernelError::Unavailable(
                "no CUDA driver found (libcuda.so.1 is not loadable): run on a machine with an NVIDIA GPU and driver, or use --device cpu".into(),
            ));
        }
        nvrtc::nvrtc_available().map_err(KernelError::Unavailable)?;
        let ctx = CudaContext::new(0).map_err(|e| {
            KernelError::Unavailable(format!("CUDA device 0 could not be opened: {e}"))
        })?;
        // One stream, so stream order is the only order: cudarc's per-buffer
        // events (two per allocation) buy nothing here.
        // SAFETY: every buffer is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let (maj, min) = ctx.compute_capability().map_err(cu("compute capability"))?;
        let arch: &'static str = Box::leak(format!("sm_{maj}{min}").into_boxed_str());
        let mut funcs = HashMap::new();
        let mut names = Vec::new();
        for (file, src, kernels) in nvrtc::SOURCES {
            let cubin = nvrtc::compile(file, src, nvrtc::Target::Cubin(arch))?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(cu("load module"))?;
            for k in *kernels {
                let f = module.load_function(k).map_err(cu("load function"))?;
                funcs.insert(*k, (names.len(), f));
                names.push(*k);
            }
        }
        let stream = ctx.default_stream();
        // SAFETY: only probes whether libcublas can be dlopen'ed.
        let blas = if unsafe { cudarc::cublas::sys::is_culib_present() } {
            CudaBlas::new(stream.clone()).ok().map(Mutex::new)
        } else {
            None
        };
        let dev = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let name = format!(
            "{dev} ({arch}), {}",
            if blas.is_some() {
                "cuBLAS"
            } else {
                "no cuBLAS: tiled NVRTC products"
            }
        );
        Ok(Cuda {
            _ctx: ctx,
            stream,
            blas,
            funcs,
            name,
            last: AtomicUsize::new(usize::MAX),
            names,
        })
    }

    pub fn describe(&self) -> String {
        self.name.clone()
    }

    fn f(&self, name: &'static str) -> &CudaFunction {
        let (i, f) = &self.funcs[name];
        self.last.store(*i, Ordering::Relaxed);
        f
    }

    /// An error from a synchronising call: kernel faults are reported by the
    /// next call that waits for the stream, so name the last kernel launched.
    fn sync_err<E: std::fmt::Display>(&self, op: &'static str) -> impl Fn(E) -> KernelError + '_ {
        move |e| {
            let last = self
                .names
                .get(self.last.load(Ordering::Relaxed))
                .copied()
                .unwrap_or("none");
            KernelError::Cuda(format!(
                "{op}: {e} (CUDA reports kernel faults at the next synchronising call; the last kernel launched was `{last}`; rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the faulting launch)"
            ))
        }
    }

    fn up<T: cudarc::driver::DeviceRepr>(&self, x: &[T]) -> Result<CudaSlice<T>, KernelError> {
        if x.is_empty() {
            return self.raw::<T>(0);
        }
        self.stream
            .clone_htod(x)
            .map_err(self.sync_err("copy to device"))
    }

    fn down<T: cudarc::driver::DeviceRepr>(
        &self,
        d: &CudaSlice<T>,
        out: &mut [T],
    ) -> Result<(), KernelError> {
        if out.is_empty() {
            return Ok(());
        }
        let src = d.slice(..out.len());
        self.stream
            .memcpy_dtoh(&src, out)
            .map_err(self.sync_err("copy to host"))
    }

    /// A zeroed device buffer; at least one element, since CUDA refuses
    /// 0-byte allocations (the logical length is kept beside it in `Buf`).
    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(cu("alloc"))
    }

    /// An uninitialised device buffer (every element is written before it is read).
    fn raw<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>, KernelError> {
        // SAFETY: callers write every element before reading it.
        unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(cu("alloc"))
    }

    fn resident<'w>(&self, w: &'w Weight) -> Result<&'w CudaSlice<f32>, KernelError> {
        if w.dev.get().is_none() {
            // A quantised weight is dequantised for the upload only (no host
            // f32 copy is kept).
            let d = self.up(&w.to_f32())?;
            let _ = w.dev.set(d);
        }
        Ok(w.dev.get().expect("set above"))
    }

    // ---- resident operations (kernels/src/resident.rs) ----

    pub fn zeros_buf(&self, n: usize) -> Result<Buf, KernelError> {
        Ok(Buf::Dev(self.zeros(n)?, n))
    }

    pub fn upload(&self, x: &[f32]) -> Result<Buf, KernelError> {
        Ok(Buf::Dev(self.up(x)?, x.len()))
    }

    pub fn download(&self, b: &Buf) -> Result<Vec<f32>, KernelError> {
        let mut out = vec![0f32; b.len()];
        self.down(dev(b)?, &mut out)?;
        Ok(out)
    }

    pub fn embed(&self, table: &Weight, dim: usize, ids: &[u32]) -> Result<Buf, KernelError> {
        let t = self.resident(table)?;
        let n = ids.len() * dim;
        let mut o = self.raw::<f32>(n)?;
        if n > 0 {
            let d_ids = self.up(ids)?;
            let (dim_i, n_i) = (dim as i32, n as i64);
            let mut b = self.stream.launch_builder(self.f("embedding"));
            b.arg(t).arg(&d_ids).arg(&mut o).arg(&dim_i).arg(&n_i);
            // SAFETY: ids were checked against the table by the caller.
            unsafe { b.launch(grid_1d(n)) }.map_err(cu("embedding"))?;
        }
        Ok(Buf::Dev(o, n))
    }

    pub fn matmul(
        &self,
        x: &Buf,
        w: &Weight,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Buf, KernelError> {
        let wd = self.resident(w)?;
        let xd = dev(x)?;
        if m * n == 0 || k == 0 {
            return self.zeros_buf(m * n);
        }
        let mut od = self.raw::<f32>(m * n)?;
        match &self.blas {
            Some(blas) => {
                // Row-major out[m,n] = x[m,k]·w[n,k]ᵀ is column-major
                // outᵀ[n,m] = op_T(w as k×n)·(x as k×m).
                let cfg = GemmConfig {
                    transa: Op::CUBLAS_OP_T,
                    transb: Op::CUBLAS_OP_N,
                    m: n as i32,
                    n: m as i32,
                    k: k as i32,
                    alpha: 1.0f32,
                    lda: k as i32,
                    ldb: k as i32,
                    beta: 0.0f32,
                    ldc: n as i32,
                };
                let blas = blas.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: buffers hold n·k, m·k and m·n elements (checked by the caller).
                unsafe { blas.gemm(cfg, wd, xd, &mut od) }.map_err(cu("cublas sgemm"))?;
            }
            None => {
                let (mi, ki, ni) = (m as i32, k as i32, n as i32);
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
                    block_dim: (16, 16, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.stream.launch_builder(self.f("linear_tiled"));
                b.arg(xd).arg(wd).arg(&mut od).arg(&mi).arg(&ki).arg(&ni);
                // SAFETY: as above.
                unsafe { b.launch(cfg) }.map_err(cu("linear"))?;
            }
        }
        Ok(Buf::Dev(od, m * n))
    }

    pub fn norm(&self, x: &Buf, w: &Weight, eps: f32) -> Result<Buf, KernelError> {
        let wd = self.resident(w)?;
        let n = x.len();
        let mut od = self.raw::<f32>(n)?;
        if n == 0 {
            return Ok(Buf::Dev(od, 0));
        }
        self.stream
            .memcpy_dtod(&dev(x)?.slice(..n), &mut od)
            .map_err(cu("copy on device"))?;
        let dim = w.len() as i32;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(&mut od).arg(wd).arg(&dim).arg(&eps);
        // SAFETY: one block per row of a (rows, dim) buffer.
        unsafe { b.launch(rows(n / w.len(), BLOCK)) }.map_err(cu("rms_norm"))?;
        Ok(Buf::Dev(od, n))
    }

    /// `kernel(x, y, n)`: an element-wise kernel updating x (n elements) in
    /// place from y (n elements), one thread per element.
    fn inplace_with(&self, kernel: &'static str, x: &mut Buf, y: &Buf) -> Result<(), KernelError> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n_i = n as i64;
        let yd = dev(y)?;
        let xd = dev_mut(x)?;
        let mut b = self.stream.launch_builder(self.f(kernel));
        b.arg(xd).arg(yd).arg(&n_i);
        // SAFETY: both buffers hold n elements (checked by the caller).
        unsafe { b.launch(grid_1d(n)) }.map_err(cu(kernel))?;
        Ok(())
    }

    pub fn add_assign(&self, x: &mut Buf, y: &Buf) -> Result<(), KernelError> {
        self.inplace_with("add_inplace", x, y)
    }

    pub fn swiglu(&self, gate: &mut Buf, up: &Buf) -> Result<(), KernelError> {
        self.inplace_with("silu_mul", gate, up)
    }

    pub fn gelu_tanh_mul(&self, gate: &mut Buf, up: &Buf) -> Result<(), KernelError> {
        self.inplace_with("gelu_tanh_mul", gate, up)
    }

    pub fn scale(&self, x: &mut Buf, s: f32) -> Result<(), KernelError> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n_i = n as i64;
        let xd = dev_mut(x)?;
        let mut b = self.stream.launch_builder(self.f("scale_inplace"));
        b.arg(xd).arg(&s).arg(&n_i);
        // SAFETY: x holds n elements.
        unsafe { b.launch(grid_1d(n)) }.map_err(cu("scale_inplace"))?;
        Ok(())
    }

    pub fn rotate(
        &self,
        x: &mut Buf,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
        table: &Buf,
    ) -> Result<(), KernelError> {
        let r = x.len() / (n_heads * head_dim);
        let half = p.rotated_dims / 2;
        if half == 0 || r == 0 {
            return Ok(());
        }
        let td = dev(table)?;
        let xd = dev_mut(x)?;
        let (ri, hi, di, hf) = (r as i32, n_heads as i32, head_dim as i32, half as i32);
        let inter = (p.style == RopeStyle::Interleaved) as i32;
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(xd)
            .arg(td)
            .arg(&ri)
            .arg(&hi)
            .arg(&di)
            .arg(&hf)
            .arg(&inter);
        // SAFETY: one thread per (row, head, pair), all inside x and table
        // (rotated_dims <= head_dim and the table's length checked by the caller).
        unsafe { b.launch(grid_1d(r * n_heads * half)) }.map_err(cu("rope"))?;
        Ok(())
    }

    pub fn transpose_heads(
        &self,
        x: &Buf,
        c: usize,
        heads: usize,
        d: usize,
        to_heads: bool,
    ) -> Result<Buf, KernelError> {
        let n = c * heads * d;
        let mut od = self.raw::<f32>(n)?;
        if n > 0 {
            let (ci, hi, di, ti) = (c as i32, heads as i32, d as i32, to_heads as i32);
            let mut b = self.stream.launch_builder(self.f("transpose_heads"));
            b.arg(dev(x)?)
                .arg(&mut od)
                .arg(&ci)
                .arg(&hi)
                .arg(&di)
                .arg(&ti);
            // SAFETY: one thread per element of two (c, heads, d) buffers.
            unsafe { b.launch(grid_1d(n)) }.map_err(cu("transpose_heads"))?;
        }
        Ok(Buf::Dev(od, n))
    }

    pub fn copy_within(
        &self,
        src: &Buf,
        src_at: usize,
        dst: &mut Buf,
        dst_at: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        if len == 0 {
            return Ok(());
        }
        let s = dev(src)?.slice(src_at..src_at + len);
        let mut d = dev_mut(dst)?.slice_mut(dst_at..dst_at + len);
        self.stream
            .memcpy_dtod(&s, &mut d)
            .map_err(cu("copy on device"))
    }

    /// See [`crate::Backend::attention`]; shapes were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        s: AttnShape,
        window: Option<usize>,
        colsum: Option<&mut Buf>,
        probs: Option<&mut Buf>,
    ) -> Result<Buf, KernelError> {
        let (nh, c, d) = (s.n_heads, s.c, s.head_dim);
        // 0: no window (a window covering every key masks nothing either)
        let wi = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let n = s.pos0 + c;
        let group = (nh / s.n_kv_heads) as i32;
        let (ci, ni, di, p0, capi) = (c as i32, n as i32, d as i32, s.pos0 as i32, s.cap as i32);
        let mut scratch;
        let pd: &mut CudaSlice<f32> = match probs {
            Some(p) => dev_mut(p)?,
            None => {
                scratch = self.raw::<f32>(nh * c * n)?;
                &mut scratch
            }
        };
        let mut b = self.stream.launch_builder(self.f("causal_softmax"));
        b.arg(dev(q)?)
            .arg(dev(k)?)
            .arg(&mut *pd)
            .arg(&ci)
            .arg(&ni)
            .arg(&di)
            .arg(&p0)
            .arg(&capi)
            .arg(&group)
            .arg(&s.scale)
            .arg(&wi);
        // SAFETY: one block per (query row, head); q (nh,c,d), k (nkv,cap,d)
        // with n <= cap, p (nh,c,n).
        unsafe { b.launch(cfg(launch::rows_heads(c, nh, BLOCK))) }.map_err(cu("causal_softmax"))?;
        let pv = launch::probs_times_v(c, nh, n, d);
        let splits = pv.grid.2 as usize;
        let mut part = self.raw::<f32>(nh * c * splits * d)?;
        let mut b = self.stream.launch_builder(self.f("probs_times_v"));
        b.arg(&*pd)
            .arg(dev(v)?)
            .arg(&mut part)
            .arg(&ci)
            .arg(&ni)
            .arg(&di)
            .arg(&capi)
            .arg(&group);
        // SAFETY: p (nh,c,n), v (nkv,cap,d), part (nh,c,splits,d); every key
        // index is below n <= cap.
        unsafe { b.launch(cfg(pv)) }.map_err(cu("probs_times_v"))?;
        let mut od = self.raw::<f32>(nh * c * d)?;
        let (ri, si) = ((nh * c) as i32, splits as i32);
        let mut b = self.stream.launch_builder(self.f("sum_splits"));
        b.arg(&part).arg(&mut od).arg(&ri).arg(&si).arg(&di);
        // SAFETY: one thread per element of out (nh·c, d).
        unsafe { b.launch(grid_1d(nh * c * d)) }.map_err(cu("sum_splits"))?;
        if let Some(cs) = colsum {
            let tracked = cs.len() / nh;
            let m = tracked.min(n);
            if m > 0 {
                let (mi, ti) = (m as i32, tracked as i32);
                let mut b = self.stream.launch_builder(self.f("column_sums"));
                b.arg(&*pd)
                    .arg(dev_mut(cs)?)
                    .arg(&ci)
                    .arg(&ni)
                    .arg(&mi)
                    .arg(&ti);
                // SAFETY: one thread per (tracked column j < m <= n, head).
                unsafe { b.launch(cfg(launch::column_sums(m, nh))) }.map_err(cu("column_sums"))?;
            }
        }
        Ok(Buf::Dev(od, nh * c * d))
    }

    // ---- host-slice operations (replay) ----

    #[allow(clippy::too_many_arguments)]
    pub fn attend_biased(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        bias: &[f32],
        scale: f32,
        w: &mut [f64],
        z: &mut [f64],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let (nq, n) = (z.len(), bias.len());
        if nq == 0 {
            return Ok(());
        }
        let d = q.len() / nq;
        let (qd, kd, vd, bd) = (
            self.up(q)?,
            self.up(keys)?,
            self.up(values)?,
            self.up(bias)?,
        );
        let mut wd = self.zeros::<f64>(nq * n)?;
        let mut zd = self.zeros::<f64>(nq)?;
        let mut od = self.zeros::<f32>(nq * d)?;
        let (ni, di) = (n as i32, d as i32);
        let mut b = self.stream.launch_builder(self.f("attend_biased"));
        b.arg(&qd)
            .arg(&kd)
            .arg(&vd)
            .arg(&bd)
            .arg(&mut wd)
            .arg(&mut zd)
            .arg(&mut od)
            .arg(&ni)
            .arg(&di)
            .arg(&scale);
        // SAFETY: one block per query; shapes checked by the caller.
        unsafe { b.launch(rows(nq, BLOCK)) }.map_err(cu("attend_biased"))?;
        if n > 0 {
            self.down(&wd, w)?;
        }
        self.down(&zd, z)?;
        self.down(&od, out)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention_rows(
        &self,
        q: &[f32],
        keys: &[f32],
        d: usize,
        lens: &[usize],
        gains: &[f32],
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let (r, n) = (lens.len(), keys.len() / d);
        if r == 0 || n == 0 {
            return Ok(());
        }
        let lens_i: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let (qd, kd, ld, gd) = (
            self.up(q)?,
            self.up(keys)?,
            self.up(&lens_i)?,
            self.up(gains)?,
        );
        let mut od = self.zeros::<f32>(r * n)?;
        let (ni, di) = (n as i32, d as i32);
        let mut b = self.stream.launch_builder(self.f("attention_rows"));
        b.arg(&qd)
            .arg(&kd)
            .arg(&ld)
            .arg(&gd)
            .arg(&mut od)
            .arg(&ni)
            .arg(&di)
            .arg(&scale);
        // SAFETY: one block per row; lens <= n checked by the caller.
        unsafe { b.launch(rows(r, BLOCK)) }.map_err(cu("attention_rows"))?;
        self.down(&od, out)
    }
}
