//! The CUDA backend: NVRTC-compiled kernels (sources beside this file) and
//! cuBLAS for dense products, launched through cudarc with dynamic loading.
//!
//! Each operation mirrors a CPU twin in [`crate::cpu`] (named in the kernel
//! sources) and is checked against the same independent reference by the
//! parity tests in `kernels/tests/parity.rs`.
//!
//! Operations are serialised by a lock: capture and replay call them from
//! rayon workers, and one stream with blocking copies keeps them simple and
//! ordered.

pub mod nvrtc;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{sys::cublasOperation_t as Op, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::cpu::{AttentionStats, BlockType, RopeParams, RopeStyle};
use crate::{launch, KernelError, Weight, BLOCK};

pub struct Cuda {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Option<CudaBlas>,
    funcs: HashMap<&'static str, CudaFunction>,
    name: String,
    lock: Mutex<()>,
}

// SAFETY: cudarc's handles are used only under `lock`; the cuBLAS handle is
// bound to `stream`, which is itself thread-safe in cudarc.
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
        let (maj, min) = ctx.compute_capability().map_err(cu("compute capability"))?;
        let arch: &'static str = Box::leak(format!("sm_{maj}{min}").into_boxed_str());
        let mut funcs = HashMap::new();
        for (file, src, kernels) in nvrtc::SOURCES {
            let cubin = nvrtc::compile(file, src, nvrtc::Target::Cubin(arch))?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(cu("load module"))?;
            for k in *kernels {
                funcs.insert(*k, module.load_function(k).map_err(cu("load function"))?);
            }
        }
        let stream = ctx.default_stream();
        // SAFETY: only probes whether libcublas can be dlopen'ed.
        let blas = if unsafe { cudarc::cublas::sys::is_culib_present() } {
            CudaBlas::new(stream.clone()).ok()
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
            lock: Mutex::new(()),
        })
    }

    pub fn describe(&self) -> String {
        self.name.clone()
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn up<T: cudarc::driver::DeviceRepr>(&self, x: &[T]) -> Result<CudaSlice<T>, KernelError> {
        self.stream.clone_htod(x).map_err(cu("copy to device"))
    }

    fn down<T: cudarc::driver::DeviceRepr>(
        &self,
        d: &CudaSlice<T>,
        out: &mut [T],
    ) -> Result<(), KernelError> {
        self.stream.memcpy_dtoh(d, out).map_err(cu("copy to host"))
    }

    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(cu("alloc"))
    }

    fn resident<'w>(&self, w: &'w Weight) -> Result<&'w CudaSlice<f32>, KernelError> {
        if w.dev.get().is_none() {
            let d = self.up(w)?;
            let _ = w.dev.set(d);
        }
        Ok(w.dev.get().expect("set above"))
    }

    pub fn dequantize(
        &self,
        ty: BlockType,
        src: &[u8],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        if !out.len().is_multiple_of(be) || src.len() != out.len() / be * bb {
            return Err(KernelError::Shape {
                op: "dequantize",
                msg: format!("{ty:?}: {} bytes for {} elements", src.len(), out.len()),
            });
        }
        let name = match ty {
            BlockType::F32 => "dequant_f32",
            BlockType::F16 => "dequant_f16",
            BlockType::BF16 => "dequant_bf16",
            BlockType::Q8_0 => "dequant_q8_0",
            BlockType::Q4_0 => "dequant_q4_0",
            BlockType::Q4_1 => "dequant_q4_1",
            BlockType::Q4_K => "dequant_q4_k",
            BlockType::Q5_K => "dequant_q5_k",
            BlockType::Q6_K => "dequant_q6_k",
        };
        let s = self.up(src)?;
        let mut o = self.zeros::<f32>(out.len())?;
        let n = out.len() as i64;
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(&s).arg(&mut o).arg(&n);
        // SAFETY: arguments match the kernel's (const u8*, float*, i64) and
        // every index the kernel touches is below n (checked above).
        unsafe { b.launch(grid_1d(out.len())) }.map_err(cu("dequantize"))?;
        self.down(&o, out)
    }

    pub fn embedding(
        &self,
        table: &Weight,
        dim: usize,
        ids: &[u32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let t = self.resident(table)?;
        let d_ids = self.up(ids)?;
        let mut o = self.zeros::<f32>(out.len())?;
        let (dim_i, n) = (dim as i32, out.len() as i64);
        let mut b = self.stream.launch_builder(self.f("embedding"));
        b.arg(t).arg(&d_ids).arg(&mut o).arg(&dim_i).arg(&n);
        // SAFETY: ids were checked against the table by the caller.
        unsafe { b.launch(grid_1d(out.len())) }.map_err(cu("embedding"))?;
        self.down(&o, out)
    }

    pub fn linear(
        &self,
        x: &[f32],
        w: &Weight,
        out: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let wd = self.resident(w)?;
        let xd = self.up(x)?;
        let mut od = self.zeros::<f32>(m * n)?;
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
                // SAFETY: buffers hold n·k, m·k and m·n elements (checked by the caller).
                unsafe { blas.gemm(cfg, wd, &xd, &mut od) }.map_err(cu("cublas sgemm"))?;
            }
            None => {
                let (mi, ki, ni) = (m as i32, k as i32, n as i32);
                let mut b = self.stream.launch_builder(self.f("linear_tiled"));
                b.arg(&xd).arg(wd).arg(&mut od).arg(&mi).arg(&ki).arg(&ni);
                // SAFETY: as above.
                unsafe { b.launch(cfg(launch::tiles(m, n))) }.map_err(cu("linear"))?;
            }
        }
        self.down(&od, out)
    }

    pub fn rms_norm(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let mut xd = self.up(x)?;
        let wd = self.up(w)?;
        let dim = w.len() as i32;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(&mut xd).arg(&wd).arg(&dim).arg(&eps);
        // SAFETY: one block per row of a (rows, dim) buffer.
        unsafe { b.launch(rows(x.len() / w.len(), BLOCK)) }.map_err(cu("rms_norm"))?;
        self.down(&xd, x)
    }

    pub fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let mut gd = self.up(gate)?;
        let ud = self.up(up)?;
        let n = gate.len() as i64;
        let mut b = self.stream.launch_builder(self.f("silu_mul"));
        b.arg(&mut gd).arg(&ud).arg(&n);
        // SAFETY: both buffers hold n elements.
        unsafe { b.launch(grid_1d(gate.len())) }.map_err(cu("silu_mul"))?;
        self.down(&gd, gate)
    }

    pub fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
        table: &[f32],
    ) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let r = x.len() / (n_heads * head_dim);
        let half = p.rotated_dims / 2;
        if half == 0 || r == 0 {
            return Ok(());
        }
        let mut xd = self.up(x)?;
        let td = self.up(table)?;
        let (ri, hi, di, hf) = (r as i32, n_heads as i32, head_dim as i32, half as i32);
        let inter = (p.style == RopeStyle::Interleaved) as i32;
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(&mut xd)
            .arg(&td)
            .arg(&ri)
            .arg(&hi)
            .arg(&di)
            .arg(&hf)
            .arg(&inter);
        // SAFETY: one thread per (row, head, pair), all inside x and table.
        unsafe { b.launch(grid_1d(r * n_heads * half)) }.map_err(cu("rope"))?;
        self.down(&xd, x)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn causal_attention_head(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        d: usize,
        pos0: usize,
        scale: f32,
        out: &mut [f32],
        mut stats: AttentionStats<'_>,
    ) -> Result<(), KernelError> {
        let _g = self.lock.lock().unwrap();
        let c = q.len() / d;
        let n = pos0 + c;
        let (qd, kd, vd) = (self.up(q)?, self.up(k)?, self.up(v)?);
        let mut pd = self.zeros::<f32>(c * n)?;
        let mut od = self.zeros::<f32>(c * d)?;
        let (ni, di, p0) = (n as i32, d as i32, pos0 as i32);
        let mut b = self.stream.launch_builder(self.f("causal_softmax"));
        b.arg(&qd)
            .arg(&kd)
            .arg(&mut pd)
            .arg(&ni)
            .arg(&di)
            .arg(&p0)
            .arg(&scale);
        // SAFETY: one block per query row; q (c,d), k (n,d), p (c,n).
        unsafe { b.launch(rows(c, BLOCK)) }.map_err(cu("causal_softmax"))?;
        let mut b = self.stream.launch_builder(self.f("probs_times_v"));
        b.arg(&pd).arg(&vd).arg(&mut od).arg(&ni).arg(&di);
        // SAFETY: p (c,n), v (n,d), out (c,d).
        unsafe { b.launch(rows(c, launch::PV_THREADS)) }.map_err(cu("probs_times_v"))?;
        if let Some(colsum) = stats.colsum.as_deref_mut() {
            let m = colsum.len().min(n);
            let mut cd = self.up(&colsum[..m])?;
            let (ci, mi) = (c as i32, m as i32);
            let mut b = self.stream.launch_builder(self.f("column_sums"));
            b.arg(&pd).arg(&mut cd).arg(&ci).arg(&ni).arg(&mi);
            // SAFETY: one thread per tracked column j < m <= n.
            unsafe { b.launch(grid_1d(m)) }.map_err(cu("column_sums"))?;
            self.down(&cd, &mut colsum[..m])?;
        }
        if let Some(probs) = stats.probs.as_deref_mut() {
            self.down(&pd, probs)?;
        }
        self.down(&od, out)
    }

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
        let _g = self.lock.lock().unwrap();
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
        let _g = self.lock.lock().unwrap();
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
