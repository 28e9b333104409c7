//! Writing a trace without holding it in memory.
//!
//! Each layer file is preallocated with its final safetensors header and
//! filled in place through a writable memory map, so capture memory stays
//! bounded whatever the trace size. Everything is written into
//! `OUT.partial/`; only `finish` (after checksums and the manifest) renames it
//! to `OUT`, so an interrupted capture never leaves a trace that looks complete.
//!
//! The blocks of every layer file are reserved on disk (`fallocate`, or
//! zeros written where the filesystem has no `fallocate`) before the file is
//! mapped: a store into an unbacked page of a memory-mapped file on a full
//! disk is a SIGBUS that kills the process, while a failed reservation is a
//! [`TraceError::NoSpace`] naming the bytes needed and free.

use half::slice::HalfFloatSliceExt;
use memmap2::MmapMut;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use crate::{layer_file_name, Dtype, FileEntry, Manifest, TraceError};

/// Shapes of a trace to be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceLayout {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// T: prompt plus generated tokens.
    pub total_len: usize,
    pub prompt_len: usize,
    pub dtype: Dtype,
    /// Also store full attention probabilities `attn_probs` (n_heads, T, T), f32.
    pub attn_probs: bool,
    /// First position whose `q` and `o` are stored: 0 in a full trace; in a
    /// lean one (`--keep lean`) P − N for the last N prompt positions, so
    /// `q` and `o` are (n_heads, T − query_start, head_dim). `k` and `v`
    /// always hold every position.
    pub query_start: usize,
}

impl TraceLayout {
    /// Format version a trace of this layout needs: 1 when every position's
    /// q and o are stored (readable by every release), 2 for a lean trace.
    pub fn format_version(&self) -> u32 {
        if self.query_start > 0 {
            2
        } else {
            1
        }
    }
    /// Bytes of each tensor of one layer file: (name, bytes), in file order.
    pub fn tensor_bytes(&self) -> Vec<(&'static str, u64)> {
        layer_tensors(self)
            .into_iter()
            .map(|(name, dtype, shape)| {
                (
                    name,
                    (shape.iter().product::<usize>() * dtype.size()) as u64,
                )
            })
            .collect()
    }

    /// Bytes of every layer file, headers included: what a capture of this
    /// layout writes (the manifest, a few KB, aside).
    pub fn trace_bytes(&self) -> u64 {
        (0..self.n_layers).map(|l| layer_file_len(self, l)).sum()
    }
}

/// The per-position tensors of a layer file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TensorKind {
    /// (n_heads, T, head_dim), post-RoPE queries.
    Q,
    /// (n_kv_heads, T, head_dim), post-RoPE keys.
    K,
    /// (n_kv_heads, T, head_dim), values.
    V,
    /// (n_heads, T, head_dim), per-head attention output before the output projection.
    O,
}

impl TensorKind {
    pub const ALL: [TensorKind; 4] = [TensorKind::Q, TensorKind::K, TensorKind::V, TensorKind::O];
    pub fn name(self) -> &'static str {
        match self {
            TensorKind::Q => "q",
            TensorKind::K => "k",
            TensorKind::V => "v",
            TensorKind::O => "o",
        }
    }
}

/// (name, dtype, shape) of every tensor of a layer file, in data order:
/// f32 statistics first (keeps every tensor naturally aligned), then q, k, v, o.
pub(crate) fn layer_tensors(layout: &TraceLayout) -> Vec<(&'static str, Dtype, Vec<usize>)> {
    let (h, kv, t, d, p) = (
        layout.n_heads,
        layout.n_kv_heads,
        layout.total_len,
        layout.head_dim,
        layout.prompt_len,
    );
    let tq = t - layout.query_start;
    let mut v = vec![("attn_colsum", Dtype::F32, vec![h, p])];
    if layout.attn_probs {
        v.push(("attn_probs", Dtype::F32, vec![h, t, t]));
    }
    for (kind, heads, rows) in [
        (TensorKind::Q, h, tq),
        (TensorKind::K, kv, t),
        (TensorKind::V, kv, t),
        (TensorKind::O, h, tq),
    ] {
        v.push((kind.name(), layout.dtype, vec![heads, rows, d]));
    }
    v
}

/// The safetensors header (length prefix + JSON padded to 8 bytes) and the
/// byte range of each tensor relative to the data start.
fn layer_header(
    layout: &TraceLayout,
    layer: usize,
) -> (Vec<u8>, BTreeMap<&'static str, (usize, usize)>) {
    use serde_json::{json, Map, Value};
    let mut map = Map::new();
    let mut meta = Map::new();
    meta.insert("format".into(), Value::from(crate::FORMAT_NAME));
    meta.insert(
        "format_version".into(),
        Value::from(layout.format_version().to_string()),
    );
    meta.insert("layer".into(), Value::from(layer.to_string()));
    map.insert("__metadata__".into(), Value::Object(meta));
    let mut ranges = BTreeMap::new();
    let mut off = 0usize;
    for (name, dtype, shape) in layer_tensors(layout) {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let st = dtype.safetensors().to_string();
        map.insert(
            name.into(),
            json!({"dtype": st, "shape": shape, "data_offsets": [off, off + bytes]}),
        );
        ranges.insert(name, (off, off + bytes));
        off += bytes;
    }
    let mut text = serde_json::to_vec(&Value::Object(map)).expect("header serialises");
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut header = (text.len() as u64).to_le_bytes().to_vec();
    header.extend_from_slice(&text);
    (header, ranges)
}

/// One layer file being filled through a writable memory map.
pub struct LayerWriter {
    path: PathBuf,
    layout: TraceLayout,
    mmap: MmapMut,
    data_start: usize,
    ranges: BTreeMap<&'static str, (usize, usize)>,
}

/// Bytes of a layer file: header plus data.
fn layer_file_len(layout: &TraceLayout, layer: usize) -> u64 {
    let (header, ranges) = layer_header(layout, layer);
    (header.len() + ranges.values().map(|r| r.1).max().unwrap_or(0)) as u64
}

/// Bytes an unprivileged process may still write on the filesystem holding
/// `path` (statvfs: available blocks times fragment size), when known.
fn free_bytes(path: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        rustix::fs::statvfs(path)
            .ok()
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// The error for a failed write of `needed` bytes to `path`: a disk that is
/// full becomes [`TraceError::NoSpace`] with the bytes free.
fn write_error(path: &Path, needed: u64, err: std::io::Error) -> TraceError {
    if err.kind() == std::io::ErrorKind::StorageFull {
        TraceError::NoSpace {
            path: path.into(),
            needed,
            free: free_bytes(path.parent().unwrap_or(path)).unwrap_or(0),
        }
    } else {
        TraceError::io(path, err)
    }
}

/// Give the new, empty `file` `len` bytes of allocated disk blocks (not a
/// sparse hole), so that writing through its memory map cannot run out of
/// space. `fallocate` where the filesystem has it, else zeros written.
fn reserve(file: &File, path: &Path, len: u64) -> Result<(), TraceError> {
    #[cfg(unix)]
    {
        use rustix::fs::{fallocate, FallocateFlags};
        use rustix::io::Errno;
        match fallocate(file, FallocateFlags::empty(), 0, len) {
            Ok(()) => return Ok(()),
            // no fallocate on this filesystem: write the zeros ourselves
            Err(Errno::OPNOTSUPP | Errno::NOSYS) => {}
            Err(e) => return Err(write_error(path, len, e.into())),
        }
    }
    write_zeros(file, len).map_err(|e| write_error(path, len, e))
}

fn write_zeros(mut file: &File, len: u64) -> std::io::Result<()> {
    use std::io::Write;
    let zeros = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    file.sync_data()
}

impl LayerWriter {
    fn create(path: PathBuf, layout: TraceLayout, layer: usize) -> Result<Self, TraceError> {
        let (header, ranges) = layer_header(&layout, layer);
        let data_len = ranges.values().map(|r| r.1).max().unwrap_or(0);
        let total = header.len() + data_len;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| TraceError::io(&path, e))?;
        reserve(&file, &path, total as u64)?;
        // SAFETY: the file was just created by us (create_new) inside our own
        // partial directory; nothing else maps or truncates it while we hold
        // it, and its blocks are allocated (`reserve`), so stores into the
        // map cannot fault for want of disk space.
        let mut mmap = unsafe { MmapMut::map_mut(&file) }.map_err(|e| TraceError::io(&path, e))?;
        mmap[..header.len()].copy_from_slice(&header);
        Ok(LayerWriter {
            path,
            layout,
            mmap,
            data_start: header.len(),
            ranges,
        })
    }

    fn bytes_mut(&mut self, name: &str) -> &mut [u8] {
        let (a, b) = self.ranges[name];
        &mut self.mmap[self.data_start + a..self.data_start + b]
    }

    /// Write `rows` (n, head_dim) of `kind` for `head` at positions
    /// `pos..pos+n`. In a lean layout, q and o rows before `query_start` are
    /// not stored and are skipped.
    pub fn write_rows(&mut self, kind: TensorKind, head: usize, pos: usize, rows: &[f32]) {
        let TraceLayout {
            head_dim: d,
            total_len: t,
            dtype,
            ..
        } = self.layout;
        let (heads, first) = match kind {
            TensorKind::Q | TensorKind::O => (self.layout.n_heads, self.layout.query_start),
            TensorKind::K | TensorKind::V => (self.layout.n_kv_heads, 0),
        };
        assert!(head < heads, "{}: head {head} >= {heads}", kind.name());
        assert_eq!(rows.len() % d, 0, "rows must be whole head_dim rows");
        let n = rows.len() / d;
        assert!(pos + n <= t, "positions {pos}..{} exceed T={t}", pos + n);
        // rows before the first stored position are dropped
        let skip = first.saturating_sub(pos).min(n);
        let (pos, rows) = (pos + skip, &rows[skip * d..]);
        if rows.is_empty() {
            return;
        }
        let start = (head * (t - first) + pos - first) * d;
        let bytes = self.bytes_mut(kind.name());
        write_converted(bytes, dtype, start, rows);
    }

    /// Set `attn_colsum[head, :]` (prompt_len values).
    pub fn write_colsum(&mut self, head: usize, values: &[f32]) {
        let p = self.layout.prompt_len;
        assert_eq!(values.len(), p);
        let bytes = self.bytes_mut("attn_colsum");
        write_converted(bytes, Dtype::F32, head * p, values);
    }

    /// Set `attn_probs[head, pos, ..row.len()]` (later columns stay zero).
    pub fn write_probs_row(&mut self, head: usize, pos: usize, row: &[f32]) {
        let t = self.layout.total_len;
        assert!(self.layout.attn_probs && row.len() <= t && pos < t);
        let bytes = self.bytes_mut("attn_probs");
        write_converted(bytes, Dtype::F32, (head * t + pos) * t, row);
    }

    fn finish(self) -> Result<FileEntry, TraceError> {
        self.mmap
            .flush()
            .map_err(|e| TraceError::io(&self.path, e))?;
        drop(self.mmap);
        let size = std::fs::metadata(&self.path)
            .map_err(|e| TraceError::io(&self.path, e))?
            .len();
        let sha256 = crate::sha256_file(&self.path).map_err(|e| TraceError::io(&self.path, e))?;
        let file = self
            .path
            .file_name()
            .expect("layer file has a name")
            .to_string_lossy()
            .into_owned();
        let layer = file[6..9].parse().expect("layer-NNN name");
        Ok(FileEntry {
            layer,
            file,
            size,
            sha256,
        })
    }
}

/// Convert `src` into `dtype` elements at element offset `start` of `dst`.
fn write_converted(dst: &mut [u8], dtype: Dtype, start: usize, src: &[f32]) {
    let n = src.len();
    match dtype {
        Dtype::F32 => {
            let out: &mut [f32] = bytemuck::cast_slice_mut(dst);
            out[start..start + n].copy_from_slice(src);
        }
        Dtype::F16 => {
            let out: &mut [half::f16] = bytemuck::cast_slice_mut(dst);
            out[start..start + n].convert_from_f32_slice(src);
        }
        Dtype::Bf16 => {
            let out: &mut [half::bf16] = bytemuck::cast_slice_mut(dst);
            out[start..start + n].convert_from_f32_slice(src);
        }
    }
}

/// A trace being written into `OUT.partial/`.
pub struct TraceWriter {
    out: PathBuf,
    partial: PathBuf,
    force: bool,
    layers: Vec<LayerWriter>,
    finished: bool,
}

impl TraceWriter {
    /// Prepare `out` (which must not exist unless `force`). A stale
    /// `OUT.partial/` from an interrupted run is removed.
    pub fn create(out: &Path, layout: TraceLayout, force: bool) -> Result<Self, TraceError> {
        if out.exists() && !force {
            return Err(TraceError::Output {
                path: out.to_path_buf(),
                msg: "already exists; pass --force to overwrite it or choose another --out".into(),
            });
        }
        if out.exists() && !out.join("manifest.json").exists() {
            return Err(TraceError::Output {
                path: out.to_path_buf(),
                msg: "exists and is not a trace; refusing to overwrite it even with --force".into(),
            });
        }
        let name = out.file_name().ok_or_else(|| TraceError::Output {
            path: out.to_path_buf(),
            msg: "output path has no directory name".into(),
        })?;
        let mut pname = name.to_os_string();
        pname.push(".partial");
        let partial = out.with_file_name(pname);
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| TraceError::io(parent, e))?;
        }
        if partial.exists() {
            std::fs::remove_dir_all(&partial).map_err(|e| TraceError::io(&partial, e))?;
        }
        std::fs::create_dir(&partial).map_err(|e| TraceError::io(&partial, e))?;
        // Refuse at once a trace the disk cannot hold (a previous trace at
        // `out` stays until the new one is complete, so it does not count).
        let needed: u64 = (0..layout.n_layers)
            .map(|l| layer_file_len(&layout, l))
            .sum();
        if let Some(free) = free_bytes(&partial).filter(|&free| free < needed) {
            let _ = std::fs::remove_dir(&partial);
            return Err(TraceError::NoSpace {
                path: partial,
                needed,
                free,
            });
        }
        let mut w = TraceWriter {
            out: out.to_path_buf(),
            partial,
            force,
            layers: Vec::with_capacity(layout.n_layers),
            finished: false,
        };
        for l in 0..layout.n_layers {
            let path = w.partial.join(layer_file_name(l));
            w.layers.push(LayerWriter::create(path, layout, l)?);
        }
        Ok(w)
    }

    pub fn layer(&mut self, l: usize) -> &mut LayerWriter {
        &mut self.layers[l]
    }

    /// All layer writers, e.g. to fill layers in parallel.
    pub fn layers_mut(&mut self) -> &mut [LayerWriter] {
        &mut self.layers
    }

    /// Flush, checksum, write the manifest (its `files` are filled in here)
    /// and move the finished trace into place.
    pub fn finish(mut self, mut manifest: Manifest) -> Result<PathBuf, TraceError> {
        manifest.format_version = manifest.needed_version();
        let layers = std::mem::take(&mut self.layers);
        manifest.files = layers
            .into_iter()
            .map(LayerWriter::finish)
            .collect::<Result<_, _>>()?;
        manifest.check().map_err(|msg| TraceError::Manifest {
            path: self.partial.join("manifest.json"),
            msg,
        })?;
        let mpath = self.partial.join("manifest.json");
        let text = serde_json::to_string_pretty(&manifest).expect("manifest serialises") + "\n";
        // Inside OUT.partial/, so it appears at OUT only with the whole trace.
        std::fs::write(&mpath, &text).map_err(|e| write_error(&mpath, text.len() as u64, e))?;
        if self.out.exists() {
            if !self.force {
                return Err(TraceError::Output {
                    path: self.out.clone(),
                    msg: "appeared while the trace was captured; the new trace was not moved there: pass --force to overwrite it or choose another --out".into(),
                });
            }
            replace(&self.partial, &self.out)?;
        } else {
            std::fs::rename(&self.partial, &self.out).map_err(|e| TraceError::io(&self.out, e))?;
        }
        self.finished = true;
        Ok(self.out.clone())
    }
}

/// Put the finished trace `partial` at `out`, which holds the previous one,
/// so that `out` is at every moment the old or the new complete trace: on
/// Linux both folders swap in one step (renameat2 RENAME_EXCHANGE) and the
/// old trace, now at `partial`, is removed; elsewhere (or on a filesystem
/// that cannot swap) the old trace is moved aside to `OUT.replaced`, put
/// back if the new one cannot take its place, and removed after.
fn replace(partial: &Path, out: &Path) -> Result<(), TraceError> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        use rustix::io::Errno;
        match renameat_with(CWD, partial, CWD, out, RenameFlags::EXCHANGE) {
            Ok(()) => {
                // the old trace; a leftover is removed by the next capture
                let _ = std::fs::remove_dir_all(partial);
                return Ok(());
            }
            Err(Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => {}
            Err(e) => return Err(TraceError::io(out, e.into())),
        }
    }
    let mut aside = out.as_os_str().to_os_string();
    aside.push(".replaced");
    let aside = PathBuf::from(aside);
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(|e| TraceError::io(&aside, e))?;
    }
    std::fs::rename(out, &aside).map_err(|e| TraceError::io(out, e))?;
    if let Err(e) = std::fs::rename(partial, out) {
        let _ = std::fs::rename(&aside, out);
        return Err(TraceError::io(out, e));
    }
    let _ = std::fs::remove_dir_all(&aside);
    Ok(())
}

impl Drop for TraceWriter {
    /// A writer dropped without `finish` (an error or a panic) removes its
    /// partial directory: nothing half-written is left behind.
    fn drop(&mut self) {
        if !self.finished {
            self.layers.clear();
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}
