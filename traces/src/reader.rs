//! Zero-copy reading of a trace through memory maps.

use half::{bf16, f16};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::writer::layer_tensors;
use crate::{Dtype, Manifest, TraceError, TraceLayout};

/// An open trace: the manifest plus one memory map per layer file.
pub struct Trace {
    dir: PathBuf,
    pub manifest: Manifest,
    layers: Vec<LayerFile>,
    /// sha256 of `manifest.json`'s bytes: names this capture's content (the
    /// manifest holds every layer file's sha256).
    content_id: String,
    verified: bool,
}

/// Whether [`Trace::open_with`] checks what it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// Every layer file's sha256 must equal the manifest's, and q/k/v/o and
    /// the statistics must be finite (about a second per GB).
    Verified,
    /// Sizes, headers and shapes only (`--no-verify`).
    Unverified,
}

/// A layer file's tensors: name -> (dtype, shape, absolute byte range in the file).
pub type TensorIndex = BTreeMap<String, (Dtype, Vec<usize>, std::ops::Range<usize>)>;

struct LayerFile {
    path: PathBuf,
    mmap: Mmap,
    tensors: TensorIndex,
}

impl LayerFile {
    fn release(&self) {
        #[cfg(unix)]
        // SAFETY: the map is a read-only shared mapping of a file that is never
        // modified in place (see `open_with`), so MADV_DONTNEED only drops
        // resident pages: the next read faults the same bytes back in from the
        // page cache or the file. Failure only leaves the pages resident.
        unsafe {
            let _ = self
                .mmap
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed);
        }
    }
}

impl Trace {
    /// Open a trace with verified reads: parse the manifest, map every layer
    /// file, check that sizes, headers and shapes agree with it, that each
    /// file's sha256 is the manifest's and that every stored value is finite.
    pub fn open(dir: impl AsRef<Path>) -> Result<Trace, TraceError> {
        Trace::open_with(dir, Reads::Verified)
    }

    /// [`Trace::open`] without the checksum and finiteness checks.
    pub fn open_unverified(dir: impl AsRef<Path>) -> Result<Trace, TraceError> {
        Trace::open_with(dir, Reads::Unverified)
    }

    pub fn open_with(dir: impl AsRef<Path>, reads: Reads) -> Result<Trace, TraceError> {
        let dir = dir.as_ref().to_path_buf();
        let (manifest, content_id) = Manifest::read_with_id(&dir)?;
        let layout = manifest.layout();
        let mut layers = Vec::with_capacity(manifest.files.len());
        for entry in &manifest.files {
            let path = dir.join(&entry.file);
            let meta = match std::fs::metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(TraceError::MissingLayer {
                        path,
                        layer: entry.layer,
                    })
                }
                Err(e) => return Err(TraceError::io(&path, e)),
            };
            // a FIFO or device would block or never end: only plain files
            if !meta.is_file() {
                return Err(TraceError::NotAFile { path });
            }
            let file = std::fs::File::open(&path).map_err(|e| TraceError::io(&path, e))?;
            let actual = meta.len();
            if actual != entry.size {
                return Err(TraceError::Size {
                    path,
                    expected: entry.size,
                    actual,
                });
            }
            // SAFETY: trace files are written once and never modified in place;
            // a concurrent rewrite replaces the directory by rename.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| TraceError::io(&path, e))?;
            let tensors = parse_layer_header(&path, &mmap, &layout)?;
            let layer = LayerFile {
                path,
                mmap,
                tensors,
            };
            layers.push(layer);
        }
        if reads == Reads::Verified {
            use rayon::prelude::*;
            // one task per layer file; the first failure in layer order is reported
            let checked: Vec<Result<(), TraceError>> = layers
                .par_iter()
                .zip(&manifest.files)
                .map(|(layer, entry)| {
                    let r = verify_layer(layer, entry);
                    // reading every byte made the file resident: let it go, so
                    // opening a trace larger than memory does not hold it all
                    layer.release();
                    r
                })
                .collect();
            checked.into_iter().collect::<Result<(), TraceError>>()?;
        }
        Ok(Trace {
            dir,
            manifest,
            layers,
            content_id,
            verified: reads == Reads::Verified,
        })
    }

    /// sha256 of the manifest: two traces with the same id hold the same
    /// capture (the manifest records every layer file's sha256).
    pub fn content_id(&self) -> &str {
        &self.content_id
    }

    /// Whether the files were checked against the manifest when opened.
    pub fn verified(&self) -> bool {
        self.verified
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Drop layer `l`'s pages from this process's resident memory once it has
    /// been read (they stay in the OS page cache and fault back in on the next
    /// access): what lets a replay stream a trace larger than memory with a
    /// bounded resident set.
    pub fn release_layer(&self, l: usize) {
        self.layers[l].release();
    }

    pub fn layer(&self, l: usize) -> LayerView<'_> {
        LayerView {
            file: &self.layers[l],
            layout: self.manifest.layout(),
        }
    }
}

impl Manifest {
    /// The tensor shapes this manifest implies.
    pub fn layout(&self) -> TraceLayout {
        TraceLayout {
            n_layers: self.model.n_layers,
            n_heads: self.model.n_heads,
            n_kv_heads: self.model.n_kv_heads,
            head_dim: self.model.head_dim,
            total_len: self.total_len(),
            prompt_len: self.prompt_len(),
            dtype: self.capture.dtype,
            attn_probs: self.capture.attn_probs,
            query_start: self.query_start(),
        }
    }
}

/// Read the safetensors header of a layer file's bytes and check that it
/// holds every tensor `layout` implies, with its dtype and shape, inside the
/// file; `path` names the file in errors. What `Trace::open` does per file.
pub fn parse_layer_header(
    path: &Path,
    bytes: &[u8],
    layout: &TraceLayout,
) -> Result<TensorIndex, TraceError> {
    let bad = |tensor: &str, msg: String| TraceError::Tensor {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        msg,
    };
    let (header_len, _) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| bad("(header)", format!("not a valid safetensors file: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| bad("(header)", format!("not a valid safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    let base = bytes.as_ptr() as usize;
    let mut out = BTreeMap::new();
    for (name, dtype, shape) in layer_tensors(layout) {
        let tv = st.tensor(name).map_err(|_| {
            let how = if name == "attn_probs" {
                "the manifest says it was captured: recapture with `kvreplay capture --attn-probs` (T <= 1024)"
            } else {
                "the trace is incomplete: recapture it with `kvreplay capture`"
            };
            bad(name, format!("missing from the layer file; {how}"))
        })?;
        let found = Dtype::from_safetensors(tv.dtype());
        if found != Some(dtype) || tv.shape() != shape.as_slice() {
            return Err(bad(
                name,
                format!(
                    "is {:?} {:?}, the manifest implies {} {:?}",
                    tv.dtype(),
                    tv.shape(),
                    dtype.name(),
                    shape
                ),
            ));
        }
        let start = tv.data().as_ptr() as usize - base;
        debug_assert!(start >= data_start);
        if !start.is_multiple_of(dtype.size()) {
            return Err(bad(name, "data is not aligned to its dtype".into()));
        }
        out.insert(
            name.to_string(),
            (dtype, shape, start..start + tv.data().len()),
        );
    }
    Ok(out)
}

/// Check a layer file against its manifest entry: sha256 (which also catches
/// a layer file swapped for or linked to another) and finite values.
fn verify_layer(layer: &LayerFile, entry: &crate::FileEntry) -> Result<(), TraceError> {
    use sha2::{Digest, Sha256};
    let path = &layer.path;
    let sha = crate::hex(&Sha256::digest(&layer.mmap[..]));
    if sha != entry.sha256 {
        return Err(TraceError::Checksum {
            path: path.clone(),
            expected: entry.sha256.clone(),
            actual: sha,
        });
    }
    check_finite(layer, entry.layer)
}

/// The first non-finite stored value of a layer, named by tensor, head and position.
fn check_finite(layer: &LayerFile, l: usize) -> Result<(), TraceError> {
    for (name, (dtype, shape, range)) in &layer.tensors {
        let bytes = &layer.mmap[range.clone()];
        let found = match dtype {
            Dtype::F32 => first_bad::<4>(bytes, 0x7f80_0000),
            Dtype::F16 => first_bad::<2>(bytes, 0x7c00),
            Dtype::Bf16 => first_bad::<2>(bytes, 0x7f80),
        };
        if let Some(i) = found {
            let sz = dtype.size();
            // shapes are (heads, rows[, cols])
            let per_head: usize = shape[1..].iter().product();
            let cols: usize = shape[2..].iter().product();
            let (head, position) = (i / per_head, (i % per_head) / cols.max(1));
            let mut v = [0u8; 4];
            v[..sz].copy_from_slice(&bytes[i * sz..(i + 1) * sz]);
            let value = match dtype {
                Dtype::F32 => f32::from_le_bytes(v),
                Dtype::F16 => half::f16::from_le_bytes([v[0], v[1]]).to_f32(),
                Dtype::Bf16 => half::bf16::from_le_bytes([v[0], v[1]]).to_f32(),
            };
            return Err(TraceError::NonFinite {
                path: layer.path.clone(),
                tensor: name.clone(),
                layer: l,
                head,
                position,
                value: value.to_string(),
            });
        }
    }
    Ok(())
}

/// Index of the first little-endian `N`-byte element whose exponent bits
/// (`mask`) are all ones (inf or NaN). Scans blocks without early exit, so
/// the common all-finite case vectorises; only a bad block is searched.
fn first_bad<const N: usize>(bytes: &[u8], mask: u32) -> Option<usize> {
    let word = |c: &[u8]| {
        let mut w = [0u8; 4];
        w[..N].copy_from_slice(&c[..N]);
        u32::from_le_bytes(w)
    };
    const BLOCK: usize = 4096;
    for (b, block) in bytes.chunks(BLOCK * N).enumerate() {
        let any = block
            .chunks_exact(N)
            .fold(false, |acc, c| acc | (word(c) & mask == mask));
        if any {
            let i = block
                .chunks_exact(N)
                .position(|c| word(c) & mask == mask)
                .expect("the block holds one");
            return Some(b * BLOCK + i);
        }
    }
    None
}

/// One layer of a trace.
#[derive(Clone, Copy)]
pub struct LayerView<'a> {
    file: &'a LayerFile,
    layout: TraceLayout,
}

impl<'a> LayerView<'a> {
    pub fn path(&self) -> &'a Path {
        &self.file.path
    }

    /// A whole tensor of the layer file, as stored: dtype, shape and bytes
    /// inside the memory map (for zero-copy views such as the Python
    /// binding's NumPy arrays); None when the file lacks it.
    pub fn tensor_bytes(&self, name: &str) -> Option<(Dtype, &'a [usize], &'a [u8])> {
        self.file
            .tensors
            .contains_key(name)
            .then(|| self.tensor(name))
    }

    fn tensor(&self, name: &str) -> (Dtype, &'a [usize], &'a [u8]) {
        let (dtype, shape, range) = &self.file.tensors[name];
        (*dtype, shape, &self.file.mmap[range.clone()])
    }

    fn head_of(&self, name: &str, head: usize, first: usize) -> HeadView<'a> {
        let (dtype, shape, bytes) = self.tensor(name);
        let (rows, cols) = (shape[1], shape[2]);
        assert!(head < shape[0], "{name}: head {head} >= {}", shape[0]);
        let n = rows * cols * dtype.size();
        HeadView {
            dtype,
            rows,
            cols,
            first,
            bytes: &bytes[head * n..(head + 1) * n],
        }
    }

    /// First position whose q and o are stored (0 unless the trace is lean).
    pub fn query_start(&self) -> usize {
        self.layout.query_start
    }

    /// Query head `head`: (T − query_start, head_dim), positions query_start..T.
    pub fn q(&self, head: usize) -> HeadView<'a> {
        self.head_of("q", head, self.layout.query_start)
    }
    /// Key head `kv_head`: (T, head_dim).
    pub fn k(&self, kv_head: usize) -> HeadView<'a> {
        self.head_of("k", kv_head, 0)
    }
    /// Value head `kv_head`: (T, head_dim).
    pub fn v(&self, kv_head: usize) -> HeadView<'a> {
        self.head_of("v", kv_head, 0)
    }
    /// Attention output of query head `head`: (T − query_start, head_dim).
    pub fn o(&self, head: usize) -> HeadView<'a> {
        self.head_of("o", head, self.layout.query_start)
    }

    /// `attn_colsum[head, :]`: (prompt_len,), the attention each prompt key
    /// received, summed over all prompt queries.
    pub fn attn_colsum(&self, head: usize) -> &'a [f32] {
        let (_, shape, bytes) = self.tensor("attn_colsum");
        let all: &[f32] = bytemuck::cast_slice(bytes);
        &all[head * shape[1]..(head + 1) * shape[1]]
    }

    /// `attn_probs[head]`: (T, T) row-major, when captured with `--attn-probs`.
    pub fn attn_probs(&self, head: usize) -> Option<HeadView<'a>> {
        self.layout
            .attn_probs
            .then(|| self.head_of("attn_probs", head, 0))
    }
}

/// A (rows, cols) matrix of one head, in the trace's storage dtype: the
/// rows of positions `first..first + rows`.
#[derive(Clone, Copy)]
pub struct HeadView<'a> {
    pub dtype: Dtype,
    pub rows: usize,
    pub cols: usize,
    /// Position of the first stored row (q and o of a lean trace start late).
    pub first: usize,
    bytes: &'a [u8],
}

impl<'a> HeadView<'a> {
    /// Raw storage bytes (rows * cols * dtype size).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Positions whose rows are stored.
    pub fn positions(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.rows
    }

    /// The row of position `r` converted to f32 into `out` (cols).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.rows_into(r, r + 1, out)
    }

    /// The rows of positions `a..b` converted to f32 into `out` ((b - a) * cols).
    pub fn rows_into(&self, a: usize, b: usize, out: &mut [f32]) {
        assert!(
            a >= self.first,
            "position {a} is not stored: this lean trace keeps positions {}..{} only",
            self.first,
            self.first + self.rows
        );
        let (a, b) = (a - self.first, b - self.first);
        assert!(a <= b && b <= self.rows);
        let (s, e) = (a * self.cols, b * self.cols);
        assert_eq!(out.len(), e - s);
        let sz = self.dtype.size();
        let raw = &self.bytes[s * sz..e * sz];
        convert_to_f32(self.dtype, raw, out);
    }

    /// All stored rows as f32: (rows * cols).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        self.rows_into(self.first, self.first + self.rows, &mut out);
        out
    }
}

/// Convert raw little-endian storage to f32. Uses `from_le_bytes` per element
/// so it works whatever the alignment of `raw`.
fn convert_to_f32(dtype: Dtype, raw: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::F32 => match bytemuck::try_cast_slice::<u8, f32>(raw) {
            Ok(s) => out.copy_from_slice(s),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        },
        Dtype::F16 => match bytemuck::try_cast_slice::<u8, f16>(raw) {
            Ok(s) => {
                use half::slice::HalfFloatSliceExt;
                s.convert_to_f32_slice(out)
            }
            Err(_) => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        },
        Dtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
    }
}
