//! Backend selection and the operations capture and replay run through it.
//!
//! Every operation takes and returns host slices with the shapes of its CPU
//! twin in [`crate::cpu`]; the CUDA backend copies inputs to the device, runs
//! the kernel and copies the result back (weights stay resident, see
//! [`Weight`]). Results of one backend do not depend on the thread count.

use std::str::FromStr;

use crate::cpu::{self, AttentionStats, RopeParams};
use crate::{Device, KernelError, Weight};

/// What `--device` asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    Cpu,
    Cuda,
    /// CUDA when a usable GPU is present, else the CPU (and say why).
    #[default]
    Auto,
}

impl FromStr for DeviceRequest {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda),
            "auto" => Ok(DeviceRequest::Auto),
            _ => Err(format!("unknown device {s:?}: use cpu, cuda or auto")),
        }
    }
}

/// An open backend. Cheap to clone (the CUDA state is shared).
#[derive(Clone, Default)]
pub enum Backend {
    #[default]
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<crate::cuda::Cuda>),
}

/// The result of [`Backend::open`]: the backend, and a note when `auto` fell
/// back to the CPU (callers print it).
pub struct Opened {
    pub backend: Backend,
    pub note: Option<String>,
}

impl Backend {
    /// Open the backend `req` asks for. `Cuda` fails with a clear reason when
    /// no usable GPU, driver or NVRTC is present; `Auto` then uses the CPU.
    pub fn open(req: DeviceRequest) -> Result<Opened, KernelError> {
        let done = |backend| Opened {
            backend,
            note: None,
        };
        match req {
            DeviceRequest::Cpu => Ok(done(Backend::Cpu)),
            DeviceRequest::Cuda => open_cuda().map(done),
            DeviceRequest::Auto => Ok(match open_cuda() {
                Ok(b) => done(b),
                Err(e) => Opened {
                    backend: Backend::Cpu,
                    note: Some(format!("--device auto: running on the CPU ({e})")),
                },
            }),
        }
    }

    pub fn device(&self) -> Device {
        match self {
            Backend::Cpu => Device::Cpu,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Device::Cuda,
        }
    }

    /// One line for logs and provenance, e.g. "cpu" or "cuda: NVIDIA H100 (sm_90), cuBLAS".
    pub fn describe(&self) -> String {
        match self {
            Backend::Cpu => "cpu".into(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => format!("cuda: {}", c.describe()),
        }
    }

    /// `out` (ids.len(), dim) = rows `ids` of `table` (vocab, dim); the
    /// host-slice form of [`Backend::embed`].
    pub fn embedding(
        &self,
        table: &Weight,
        dim: usize,
        ids: &[u32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check(out.len() == ids.len() * dim, "embedding", || {
            "out is not (ids, dim)".into()
        })?;
        let b = self.embed(table, dim, ids)?;
        out.copy_from_slice(&self.download(&b)?);
        Ok(())
    }

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`; the host-slice form of [`Backend::matmul`].
    pub fn linear(
        &self,
        x: &[f32],
        w: &Weight,
        out: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        check(out.len() == m * n, "linear", || {
            format!("out {} for m={m} n={n}", out.len())
        })?;
        let b = self.matmul(&self.upload(x)?, w, m, k, n)?;
        out.copy_from_slice(&self.download(&b)?);
        Ok(())
    }

    /// RMSNorm of each row of `x` (rows, w.len()) in place; the host-slice
    /// form of [`Backend::norm`].
    pub fn rms_norm(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), KernelError> {
        let b = self.norm(&self.upload(x)?, &Weight::new(w.to_vec()), eps)?;
        x.copy_from_slice(&self.download(&b)?);
        Ok(())
    }

    /// gate = silu(gate) · up; the host-slice form of [`Backend::swiglu`].
    pub fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
        let mut g = self.upload(gate)?;
        self.swiglu(&mut g, &self.upload(up)?)?;
        gate.copy_from_slice(&self.download(&g)?);
        Ok(())
    }

    /// Rotate `x` (rows, n_heads, head_dim), row r at position pos0 + r, by
    /// `sign` times the RoPE angles (1.0 applies, -1.0 undoes); the host-slice
    /// form of [`Backend::rotate`].
    pub fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        p: &RopeParams,
        sign: f64,
    ) -> Result<(), KernelError> {
        let row = n_heads * head_dim;
        check(row > 0 && x.len().is_multiple_of(row), "rope", || {
            format!("x {} is not (rows, {n_heads}, {head_dim})", x.len())
        })?;
        let table = self.rope_table(x.len() / row, pos0, p, sign)?;
        let mut b = self.upload(x)?;
        self.rotate(&mut b, n_heads, head_dim, p, &table)?;
        x.copy_from_slice(&self.download(&b)?);
        Ok(())
    }

    /// Causal attention of one head with optional column sums and
    /// probabilities; see [`cpu::causal_attention_head`] for the shapes.
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
        stats: AttentionStats<'_>,
    ) -> Result<(), KernelError> {
        check(d > 0, "attention", || "head_dim is 0".into())?;
        let c = q.len() / d;
        let n = pos0 + c;
        check(
            q.len() == c * d && k.len() >= n * d && v.len() >= n * d && out.len() == c * d,
            "attention",
            || {
                format!(
                    "q {} k {} v {} out {} for c={c} d={d} pos0={pos0}",
                    q.len(),
                    k.len(),
                    v.len(),
                    out.len()
                )
            },
        )?;
        if let Some(p) = &stats.probs {
            check(p.len() == c * n, "attention", || {
                "probs is not (c, pos0 + c)".into()
            })?;
        }
        match self {
            Backend::Cpu => {
                cpu::causal_attention_head(q, k, v, d, pos0, scale, out, stats);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => {
                // One head over a plain (n, d) key block: heads = 1, cap = n.
                let shape = crate::AttnShape {
                    n_heads: 1,
                    n_kv_heads: 1,
                    c,
                    pos0,
                    cap: n,
                    head_dim: d,
                    scale,
                };
                let mut stats = stats;
                let mut cs = match stats.colsum.as_deref() {
                    Some(cs) => Some(self.upload(cs)?),
                    None => None,
                };
                let mut pr = match stats.probs.as_deref() {
                    Some(p) => Some(self.zeros(p.len())?),
                    None => None,
                };
                let o = self.attention(
                    &self.upload(q)?,
                    &self.upload(&k[..n * d])?,
                    &self.upload(&v[..n * d])?,
                    shape,
                    cs.as_mut(),
                    pr.as_mut(),
                )?;
                out.copy_from_slice(&self.download(&o)?);
                if let (Some(dst), Some(src)) = (stats.colsum.as_deref_mut(), &cs) {
                    dst.copy_from_slice(&self.download(src)?);
                }
                if let (Some(dst), Some(src)) = (stats.probs.as_deref_mut(), &pr) {
                    dst.copy_from_slice(&self.download(src)?);
                }
                Ok(())
            }
        }
    }

    /// Decode queries `q` (nq, d) over a cache `keys`/`values` (n, d) with
    /// logit `bias` (n,): `w` (nq, n) = exp(logit - max) in f64, `z` (nq,) their
    /// sums, `out` (nq, d) the outputs. See [`cpu::attend_biased`].
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
        attend_shapes("attend_biased", q, keys, values, bias, w, z, out, &[])?;
        match self {
            Backend::Cpu => {
                cpu::attend_biased_multi(q, keys, values, bias, scale, w, z, out);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.attend_biased(q, keys, values, bias, scale, w, z, out),
        }
    }

    /// [`Backend::attend_biased`] that also returns, per query and entry, the
    /// shifted logit `x` (f32; w = exp(x as f64)) and the probability `p` =
    /// (w / z) as f32: `x`, `p` (nq, n). See [`cpu::attend_biased_probs`].
    /// On CUDA, `p` and `x` are derived on the host from the device's
    /// weights (x = ln w rounded to f32, which is x itself where w is normal).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_biased_probs(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        bias: &[f32],
        scale: f32,
        w: &mut [f64],
        z: &mut [f64],
        out: &mut [f32],
        x: &mut [f32],
        p: &mut [f32],
    ) -> Result<(), KernelError> {
        attend_shapes(
            "attend_biased_probs",
            q,
            keys,
            values,
            bias,
            w,
            z,
            out,
            &[x, p],
        )?;
        match self {
            Backend::Cpu => {
                cpu::attend_biased_probs(q, keys, values, bias, scale, w, z, out, x, p);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                c.attend_biased(q, keys, values, bias, scale, w, z, out)?;
                let n = bias.len();
                for (j, zj) in z.iter().enumerate() {
                    for e in j * n..(j + 1) * n {
                        p[e] = (w[e] / zj) as f32;
                        x[e] = w[e].ln() as f32;
                    }
                }
                Ok(())
            }
        }
    }

    /// Scoring rows; see [`cpu::attention_rows`].
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
        check(d > 0, "attention_rows", || "head_dim is 0".into())?;
        let (r, n) = (lens.len(), keys.len() / d);
        check(
            q.len() == r * d
                && gains.len() == r
                && out.len() == r * n
                && lens.iter().all(|&l| l <= n),
            "attention_rows",
            || format!("shapes do not match (r={r}, n={n}, d={d})"),
        )?;
        match self {
            Backend::Cpu => {
                cpu::attention_rows(q, keys, d, lens, gains, scale, out);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.attention_rows(q, keys, d, lens, gains, scale, out),
        }
    }
}

/// The shapes of an attention of `nq = z.len()` queries over `n = bias.len()`
/// entries: q, out (nq, d); keys, values (n, d); w and each of `per_entry`
/// (nq, n).
#[allow(clippy::too_many_arguments)]
fn attend_shapes(
    op: &'static str,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    bias: &[f32],
    w: &[f64],
    z: &[f64],
    out: &[f32],
    per_entry: &[&[f32]],
) -> Result<(), KernelError> {
    let (nq, n) = (z.len(), bias.len());
    let d = q.len() / nq.max(1);
    check(
        q.len() == nq * d
            && keys.len() == n * d
            && values.len() == n * d
            && w.len() == nq * n
            && out.len() == nq * d
            && per_entry.iter().all(|a| a.len() == nq * n),
        op,
        || format!("shapes do not match (nq={nq}, n={n}, d={d})"),
    )
}

pub(crate) fn check(
    ok: bool,
    op: &'static str,
    msg: impl FnOnce() -> String,
) -> Result<(), KernelError> {
    if ok {
        Ok(())
    } else {
        Err(KernelError::Shape { op, msg: msg() })
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Backend, KernelError> {
    crate::cuda::Cuda::open().map(|c| Backend::Cuda(std::sync::Arc::new(c)))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Backend, KernelError> {
    Err(KernelError::Unavailable(
        "this kvreplay was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`".into(),
    ))
}
