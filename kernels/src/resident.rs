//! Buffers that live where the backend computes, and the forward-pass
//! operations on them.
//!
//! A [`Buf`] is host memory on the CPU backend and device memory on CUDA.
//! Capture's forward pass keeps its activations, KV cache and column sums in
//! `Buf`s, so data crosses the host-device bus only where the caller asks for
//! it: [`Backend::upload`], [`Backend::download`], the token ids of
//! [`Backend::embed`] and the RoPE table of [`Backend::rope_table`]. Those four
//! are counted per thread ([`transfers`]) on every backend, so a CPU test can
//! check how often a forward pass would cross the bus on a GPU.
//!
//! Shapes are row-major and written beside each operation. The CPU versions
//! call the same `cpu::` kernels in the same order as the host-slice API, so a
//! CPU forward pass is bit-identical either way.

use std::borrow::Cow;

use crate::backend::check;
use crate::buf::{transfers, AttnShape, Buf};
use crate::cpu::{self, RopeParams};
use crate::{Backend, KernelError, Weight};

impl Backend {
    /// A zeroed buffer of `n` elements.
    pub fn zeros(&self, n: usize) -> Result<Buf, KernelError> {
        match self {
            Backend::Cpu => Ok(Buf::Host(vec![0f32; n])),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.zeros_buf(n),
        }
    }

    /// Copy `x` to the device (counted).
    pub fn upload(&self, x: &[f32]) -> Result<Buf, KernelError> {
        transfers::to_device();
        match self {
            Backend::Cpu => Ok(Buf::Host(x.to_vec())),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.upload(x),
        }
    }

    /// The contents of `b` on the host (counted; borrowed on the CPU).
    pub fn download<'b>(&self, b: &'b Buf) -> Result<Cow<'b, [f32]>, KernelError> {
        transfers::to_host();
        match b {
            Buf::Host(v) => Ok(Cow::Borrowed(v)),
            #[cfg(feature = "cuda")]
            Buf::Dev(..) => match self {
                Backend::Cuda(c) => c.download(b).map(Cow::Owned),
                Backend::Cpu => Err(not_here("download")),
            },
        }
    }

    /// (ids.len(), dim) = rows `ids` of `table` (vocab, dim); the ids travel
    /// to the device (counted).
    pub fn embed(&self, table: &Weight, dim: usize, ids: &[u32]) -> Result<Buf, KernelError> {
        check(
            ids.iter().all(|&i| (i as usize + 1) * dim <= table.len()),
            "embedding",
            || {
                format!(
                    "an id is outside the table of {} rows",
                    table.len() / dim.max(1)
                )
            },
        )?;
        transfers::to_device();
        match self {
            Backend::Cpu => {
                let mut out = vec![0f32; ids.len() * dim];
                match table.quant() {
                    Some(q) if q.cols() == dim => cpu::embedding_quant(q, ids, &mut out),
                    _ => cpu::embedding(table, dim, ids, &mut out),
                }
                Ok(Buf::Host(out))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.embed(table, dim, ids),
        }
    }

    /// (m, n) = x (m, k) · w (n, k)ᵀ.
    pub fn matmul(
        &self,
        x: &Buf,
        w: &Weight,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Buf, KernelError> {
        match self {
            Backend::Cpu => Ok(self.matmul_many(x, &[(w, n)], m, k)?.remove(0)),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                check(x.len() == m * k && w.len() == n * k, "linear", || {
                    format!("x {} w {:?} for m={m} k={k} n={n}", x.len(), w)
                })?;
                c.matmul(x, w, m, k, n)
            }
        }
    }

    /// [`Backend::matmul`] of one input by several weights (n_i, k): q, k
    /// and v, or gate and up. On the CPU their tiles share one parallel
    /// region; results are those of separate calls.
    pub fn matmul_many(
        &self,
        x: &Buf,
        ws: &[(&Weight, usize)],
        m: usize,
        k: usize,
    ) -> Result<Vec<Buf>, KernelError> {
        for (w, n) in ws {
            let n = *n;
            check(
                x.len() == m * k
                    && w.len() == n * k
                    && w.quant().is_none_or(|q| q.rows() == n && q.cols() == k),
                "linear",
                || format!("x {} w {:?} for m={m} k={k} n={n}", x.len(), w),
            )?;
        }
        match self {
            Backend::Cpu => {
                let mut outs: Vec<Vec<f32>> = ws.iter().map(|(_, n)| vec![0f32; m * n]).collect();
                let refs: Vec<cpu::WeightRef<'_>> = ws
                    .iter()
                    .map(|(w, _)| match w.quant() {
                        Some(q) => cpu::WeightRef::Quant(q),
                        None => cpu::WeightRef::F32(w),
                    })
                    .collect();
                let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                cpu::linear_many(x.host(), m, k, &refs, &mut slices);
                Ok(outs.into_iter().map(Buf::Host).collect())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => ws
                .iter()
                .map(|(w, n)| self.matmul(x, w, m, k, *n))
                .collect(),
        }
    }

    /// RMSNorm of each row of x (rows, w.len()) into a new buffer.
    pub fn norm(&self, x: &Buf, w: &Weight, eps: f32) -> Result<Buf, KernelError> {
        check(
            !w.is_empty() && x.len().is_multiple_of(w.len()),
            "rms_norm",
            || "x is not (rows, dim)".into(),
        )?;
        match self {
            Backend::Cpu => {
                let mut out = x.host().to_vec();
                cpu::rms_norm(&mut out, w, eps);
                Ok(Buf::Host(out))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.norm(x, w, eps),
        }
    }

    /// x += y, element-wise.
    pub fn add_assign(&self, x: &mut Buf, y: &Buf) -> Result<(), KernelError> {
        check(x.len() == y.len(), "add", || {
            "x and y differ in length".into()
        })?;
        match self {
            Backend::Cpu => {
                x.host_mut()
                    .iter_mut()
                    .zip(y.host())
                    .for_each(|(a, b)| *a += b);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.add_assign(x, y),
        }
    }

    /// gate = silu(gate) · up.
    pub fn swiglu(&self, gate: &mut Buf, up: &Buf) -> Result<(), KernelError> {
        check(gate.len() == up.len(), "silu_mul", || {
            "gate and up differ in length".into()
        })?;
        match self {
            Backend::Cpu => {
                cpu::silu_mul(gate.host_mut(), up.host());
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.swiglu(gate, up),
        }
    }

    /// gate = gelu_tanh(gate) · up (Gemma's GeGLU).
    pub fn gelu_tanh_mul(&self, gate: &mut Buf, up: &Buf) -> Result<(), KernelError> {
        check(gate.len() == up.len(), "gelu_mul", || {
            "gate and up differ in length".into()
        })?;
        match self {
            Backend::Cpu => {
                cpu::gelu_tanh_mul(gate.host_mut(), up.host());
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.gelu_tanh_mul(gate, up),
        }
    }

    /// x *= s, element-wise (Gemma's embedding scale).
    pub fn scale(&self, x: &mut Buf, s: f32) -> Result<(), KernelError> {
        match self {
            Backend::Cpu => {
                cpu::scale(x.host_mut(), s);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.scale(x, s),
        }
    }

    /// The (rows, rotated_dims / 2, 2) cos/sin table for positions
    /// pos0 .. pos0 + rows, on the device (counted).
    pub fn rope_table(
        &self,
        rows: usize,
        pos0: usize,
        p: &RopeParams,
        sign: f64,
    ) -> Result<Buf, KernelError> {
        self.upload(&cpu::rope_table(rows, pos0, p, sign))
    }

    /// Rotate x (rows, n_heads, head_dim) in place with a table from
    /// [`Backend::rope_table`] made for the same rows.
    pub fn rotate(
        &self,
        x: &mut Buf,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
        table: &Buf,
    ) -> Result<(), KernelError> {
        let row = n_heads * head_dim;
        check(
            row > 0
                && x.len().is_multiple_of(row)
                && p.rotated_dims <= head_dim
                && p.rotated_dims.is_multiple_of(2)
                && table.len() == x.len() / row * p.rotated_dims,
            "rope",
            || {
                format!(
                    "x {} is not (rows, {n_heads}, {head_dim}) with a table of {} for rotated_dims {}",
                    x.len(),
                    table.len(),
                    p.rotated_dims
                )
            },
        )?;
        match self {
            Backend::Cpu => {
                cpu::rotate_with_table(
                    x.host_mut(),
                    n_heads,
                    head_dim,
                    p.style,
                    p.rotated_dims,
                    table.host(),
                );
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.rotate(x, n_heads, head_dim, p, table),
        }
    }

    /// (c, heads, d) row-major -> (heads, c, d) head-major when `to_heads`,
    /// else the reverse.
    pub fn transpose_heads(
        &self,
        x: &Buf,
        c: usize,
        heads: usize,
        d: usize,
        to_heads: bool,
    ) -> Result<Buf, KernelError> {
        check(x.len() == c * heads * d, "transpose_heads", || {
            format!("{} elements for ({c}, {heads}, {d})", x.len())
        })?;
        match self {
            Backend::Cpu => {
                let x = x.host();
                let mut out = vec![0f32; x.len()];
                for t in 0..c {
                    for h in 0..heads {
                        let (rm, hm) = ((t * heads + h) * d, (h * c + t) * d);
                        let (src, dst) = if to_heads { (rm, hm) } else { (hm, rm) };
                        out[dst..dst + d].copy_from_slice(&x[src..src + d]);
                    }
                }
                Ok(Buf::Host(out))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(cu) => cu.transpose_heads(x, c, heads, d, to_heads),
        }
    }

    /// dst[dst_at .. dst_at + len] = src[src_at .. src_at + len] (on the device).
    pub fn copy_within(
        &self,
        src: &Buf,
        src_at: usize,
        dst: &mut Buf,
        dst_at: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check(
            src_at + len <= src.len() && dst_at + len <= dst.len(),
            "copy",
            || {
                format!(
                    "[{src_at}, +{len}) of {} into [{dst_at}, +{len}) of {}",
                    src.len(),
                    dst.len()
                )
            },
        )?;
        match self {
            Backend::Cpu => {
                dst.host_mut()[dst_at..dst_at + len]
                    .copy_from_slice(&src.host()[src_at..src_at + len]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.copy_within(src, src_at, dst, dst_at, len),
        }
    }

    /// f32 elements one KV head's keys take in this backend's KV cache of
    /// `cap` positions: the CPU keeps keys in panels of eight positions
    /// (`cap` rounded up to 8; [`cpu::store_kv`]), CUDA plain rows.
    pub fn key_cache_len(&self, cap: usize, d: usize) -> usize {
        match self {
            Backend::Cpu => cpu::key_cache_len(cap, d),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => cap * d,
        }
    }

    /// A layer's KV cache of `cap` positions for `n_kv_heads` heads of `d`
    /// dimensions, zeroed, in the layout [`Backend::attention`] reads: the
    /// keys (n_kv_heads × [`Backend::key_cache_len`]) and the values
    /// (n_kv_heads × cap × d). Write it with [`Backend::store_kv`].
    pub fn kv_cache(
        &self,
        n_kv_heads: usize,
        cap: usize,
        d: usize,
    ) -> Result<(Buf, Buf), KernelError> {
        let keys = self.zeros(n_kv_heads * self.key_cache_len(cap, d))?;
        Ok((keys, self.zeros(n_kv_heads * cap * d)?))
    }

    /// A hint, for decode: the single-row quantised products that run next
    /// ask the memory for what a decode step at `pos` will read of the
    /// layer cache `kc`, `vc` (see [`cpu::ahead`]), so that its attention
    /// finds them in cache, until [`Backend::stop_read_ahead`]. Changes no
    /// result; nothing to do on CUDA.
    pub fn read_ahead(
        &self,
        kc: &Buf,
        vc: &Buf,
        (n_kv_heads, cap, d): (usize, usize, usize),
        pos: usize,
        window: Option<usize>,
    ) {
        if let (Backend::Cpu, Buf::Host(kc), Buf::Host(vc)) = (self, kc, vc) {
            let reads = cpu::decode_reads(kc, vc, (n_kv_heads, cap, d), pos, window);
            cpu::ahead::DECODE.set(&reads);
        }
    }

    /// Nothing more to read ahead ([`Backend::read_ahead`]).
    pub fn stop_read_ahead(&self) {
        if let Backend::Cpu = self {
            cpu::ahead::DECODE.clear();
        }
    }

    /// Writes `k`, `v` (n_kv_heads, c, d), head-major, at positions pos0 ..
    /// pos0 + c of a layer's KV cache `kc`, `vc` from
    /// [`Backend::kv_cache`] with the same (n_kv_heads, cap, d): on the CPU
    /// in attention's layout ([`cpu::store_kv`]), on CUDA as plain rows.
    pub fn store_kv(
        &self,
        k: &Buf,
        v: &Buf,
        (n_kv_heads, cap, d): (usize, usize, usize),
        pos0: usize,
        kc: &mut Buf,
        vc: &mut Buf,
    ) -> Result<(), KernelError> {
        let c = k.len() / (n_kv_heads * d).max(1);
        check(
            k.len() == n_kv_heads * c * d && v.len() == k.len(),
            "store_kv",
            || {
                format!(
                    "k and v ({} and {} elements) are not ({n_kv_heads}, c, {d})",
                    k.len(),
                    v.len()
                )
            },
        )?;
        check(pos0 + c <= cap, "store_kv", || {
            format!(
                "positions {pos0} .. {} past the cache's capacity of {cap}",
                pos0 + c
            )
        })?;
        check(
            kc.len() == n_kv_heads * self.key_cache_len(cap, d) && vc.len() == n_kv_heads * cap * d,
            "store_kv",
            || {
                format!(
                    "caches of {} and {} elements are not a KV cache of ({n_kv_heads}, {cap}, {d}) from kv_cache",
                    kc.len(),
                    vc.len()
                )
            },
        )?;
        match self {
            Backend::Cpu => {
                cpu::store_kv(
                    k.host(),
                    v.host(),
                    (n_kv_heads, cap, d),
                    pos0,
                    kc.host_mut(),
                    vc.host_mut(),
                );
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => {
                for g in 0..n_kv_heads {
                    let (src, dst) = (g * c * d, (g * cap + pos0) * d);
                    self.copy_within(k, src, kc, dst, c * d)?;
                    self.copy_within(v, src, vc, dst, c * d)?;
                }
                Ok(())
            }
        }
    }

    /// Causal attention of every head of a layer in one call.
    ///
    /// - `q`: (n_heads, c, d) queries at positions pos0 .. pos0 + c
    /// - `k`, `v`: a layer's KV cache of `cap` positions from
    ///   [`Backend::kv_cache`], holding positions 0 .. pos0 + c (written by
    ///   [`Backend::store_kv`]); query head h reads KV head h / (n_heads /
    ///   n_kv_heads)
    /// - returns o (n_heads, c, d)
    /// - `colsum`: (n_heads, n_tracked): `+= Σ_i P[h, i, j]` for j < min(n_tracked, pos0 + c)
    /// - `probs`: (n_heads, c, pos0 + c) probabilities (zero above the diagonal)
    pub fn attention(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        s: AttnShape,
        colsum: Option<&mut Buf>,
        probs: Option<&mut Buf>,
    ) -> Result<Buf, KernelError> {
        self.attention_windowed(q, k, v, s, None, colsum, probs)
    }

    /// [`Backend::attention`] with an optional sliding window: the query at
    /// position t attends to keys `max(0, t - W + 1) ..= t` (see
    /// [`cpu::windowed_attention_head`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_windowed(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        s: AttnShape,
        window: Option<usize>,
        colsum: Option<&mut Buf>,
        probs: Option<&mut Buf>,
    ) -> Result<Buf, KernelError> {
        check(window != Some(0), "attention", || {
            "a window of 0 keys".into()
        })?;
        let AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            c,
            pos0,
            cap,
            head_dim: d,
            ..
        } = s;
        let n = pos0 + c;
        check(d > 0, "attention", || "head_dim is 0".into())?;
        check(
            nkv > 0
                && nh.is_multiple_of(nkv)
                && n <= cap
                && q.len() == nh * c * d
                && k.len() == nkv * self.key_cache_len(cap, d)
                && v.len() == nkv * cap * d
                && colsum
                    .as_ref()
                    .is_none_or(|cs| cs.len().is_multiple_of(nh.max(1)))
                && probs.as_ref().is_none_or(|p| p.len() == nh * c * n),
            "attention",
            || format!("buffers do not match {s:?}"),
        )?;
        if nh == 0 || c == 0 {
            return self.zeros(nh * c * d);
        }
        match self {
            Backend::Cpu => {
                let mut o = vec![0f32; nh * c * d];
                cpu::attention_heads(
                    q.host(),
                    k.host(),
                    v.host(),
                    (nh, nkv, cap, d),
                    pos0,
                    window,
                    s.scale,
                    &mut o,
                    colsum.map(|cs| cs.host_mut()),
                    probs.map(|p| p.host_mut()),
                );
                Ok(Buf::Host(o))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(cu) => cu.attention(q, k, v, s, window, colsum, probs),
        }
    }
}

#[cfg(feature = "cuda")]
fn not_here(op: &'static str) -> KernelError {
    KernelError::Shape {
        op,
        msg: "a device buffer was given to the CPU backend".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_dim_zero_is_an_error_not_a_division_by_zero() {
        let be = Backend::Cpu;
        let e = be
            .causal_attention_head(
                &[],
                &[],
                &[],
                0,
                0,
                1.0,
                &mut [],
                cpu::AttentionStats::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("head_dim is 0"), "{e}");
        let e = be
            .attention_rows(&[], &[], 0, &[], &[], 1.0, &mut [])
            .unwrap_err();
        assert!(e.to_string().contains("head_dim is 0"), "{e}");
        let s = AttnShape {
            n_heads: 1,
            n_kv_heads: 1,
            c: 0,
            pos0: 0,
            cap: 0,
            head_dim: 0,
            scale: 1.0,
        };
        let z = be.zeros(0).unwrap();
        let e = be.attention(&z, &z, &z, s, None, None).unwrap_err();
        assert!(e.to_string().contains("head_dim is 0"), "{e}");
    }

    #[test]
    fn store_kv_refuses_what_does_not_fit_the_cache() {
        let be = Backend::Cpu;
        let (nkv, cap, d) = (2, 5, 4);
        let (mut kc, mut vc) = be.kv_cache(nkv, cap, d).unwrap();
        let kv = be.zeros(nkv * 2 * d).unwrap(); // two positions
        let odd = be.zeros(7).unwrap();
        let mut plain = be.zeros(nkv * cap * d).unwrap();
        let refused = |k: &Buf, pos0: usize, keys: &mut Buf, values: &mut Buf, want: &str| {
            let e = be
                .store_kv(k, k, (nkv, cap, d), pos0, keys, values)
                .unwrap_err()
                .to_string();
            assert!(e.contains("store_kv") && e.contains(want), "{e}");
        };
        refused(&kv, 4, &mut kc, &mut vc, "capacity of 5");
        // a plain (heads, cap, d) buffer is not the CPU's key cache
        refused(&kv, 0, &mut plain, &mut vc, "from kv_cache");
        refused(&odd, 0, &mut kc, &mut vc, "are not (2, c, 4)");
        // and the same shapes fit
        be.store_kv(&kv, &kv, (nkv, cap, d), 3, &mut kc, &mut vc)
            .unwrap();
    }

    #[test]
    fn rope_refuses_rotated_dims_beyond_the_head() {
        let be = Backend::Cpu;
        let p = RopeParams {
            theta: 10000.0,
            style: crate::cpu::RopeStyle::Neox,
            rotated_dims: 6,
            linear_factor: 1.0,
            llama3: None,
        };
        let mut x = vec![1.0f32; 8]; // (2 rows, 1 head, head_dim 4)
        let e = be.rope(&mut x, 1, 4, 0, &p, 1.0).unwrap_err();
        assert!(e.to_string().contains("rotated_dims 6"), "{e}");
        let mut b = be.upload(&x).unwrap();
        let t = be.zeros(2 * 6).unwrap();
        assert!(be.rotate(&mut b, 1, 4, &p, &t).is_err());
    }
}
