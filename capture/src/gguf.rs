//! A GGUF (v2/v3) reader over a memory map: metadata, tensor index, and
//! dequantised tensors. Format, little-endian:
//! magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv entries
//! (string key, u32 type, value); n_tensors infos (string name, u32 n_dims,
//! u64 dims[n_dims] innermost first, u32 ggml type, u64 offset); then tensor
//! data from align_up(end of infos, general.alignment or 32).
//!
//! Everything a file claims is checked before it is used: lengths against
//! the bytes that remain (so no count in the file can make us allocate more
//! than the file's size), keys and tensor names unique, every tensor of a
//! type we know inside the data section, aligned, not overlapping the next
//! one and exactly as large as its type and shape say (llama.cpp's layout:
//! each tensor starts at the previous one's end rounded up to the alignment).
//! Metadata arrays keep their element type (`MetaArray`): one allocation per
//! array, so a file's metadata takes about its own size in memory.

use kvreplay_kernels::cpu::{dequantize, BlockType};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::CaptureError;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(MetaArray),
}

/// A metadata array, stored with its element type.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    Str(StrArray),
}

/// An array of strings in one buffer: the texts back to back and where each ends.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StrArray {
    text: String,
    ends: Vec<usize>,
}

impl StrArray {
    pub fn new() -> StrArray {
        StrArray::default()
    }
    pub fn len(&self) -> usize {
        self.ends.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }
    /// Element `i`, or None past the end.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.text.get(start..end)
    }
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }
    /// Heap bytes held (see [`heap_bytes`]).
    pub fn heap_bytes(&self) -> usize {
        heap_bytes(self.text.capacity()) + heap_bytes(self.ends.capacity() * size_of::<usize>())
    }
}

impl<S: AsRef<str>> FromIterator<S> for StrArray {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut a = StrArray::new();
        for s in iter {
            a.push(s.as_ref());
        }
        a
    }
}

/// Bytes the allocator hands out for a request of `n` bytes: glibc malloc
/// rounds each allocation plus an 8-byte header up to 16 bytes, 32 at
/// least. Used to count what metadata costs by construction (no RSS sampling).
pub fn heap_bytes(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (n.saturating_add(8).div_ceil(16) * 16).max(32)
    }
}

impl MetaArray {
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::Str(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element `i` when it is a non-negative integer.
    pub fn u64_at(&self, i: usize) -> Option<u64> {
        let signed = |x: i64| u64::try_from(x).ok();
        match self {
            MetaArray::U8(v) => v.get(i).map(|&x| x as u64),
            MetaArray::U16(v) => v.get(i).map(|&x| x as u64),
            MetaArray::U32(v) => v.get(i).map(|&x| x as u64),
            MetaArray::U64(v) => v.get(i).copied(),
            MetaArray::I8(v) => v.get(i).and_then(|&x| signed(x as i64)),
            MetaArray::I16(v) => v.get(i).and_then(|&x| signed(x as i64)),
            MetaArray::I32(v) => v.get(i).and_then(|&x| signed(x as i64)),
            MetaArray::I64(v) => v.get(i).and_then(|&x| signed(x)),
            _ => None,
        }
    }
    /// The elements, when this is an array of strings.
    pub fn strings(&self) -> Option<&StrArray> {
        match self {
            MetaArray::Str(s) => Some(s),
            _ => None,
        }
    }
    /// Heap bytes held (see [`heap_bytes`]).
    pub fn heap_bytes(&self) -> usize {
        fn v<T>(x: &Vec<T>) -> usize {
            heap_bytes(x.capacity() * size_of::<T>())
        }
        match self {
            MetaArray::U8(x) => v(x),
            MetaArray::I8(x) => v(x),
            MetaArray::U16(x) => v(x),
            MetaArray::I16(x) => v(x),
            MetaArray::U32(x) => v(x),
            MetaArray::I32(x) => v(x),
            MetaArray::U64(x) => v(x),
            MetaArray::I64(x) => v(x),
            MetaArray::F32(x) => v(x),
            MetaArray::F64(x) => v(x),
            MetaArray::Bool(x) => v(x),
            MetaArray::Str(x) => x.heap_bytes(),
        }
    }
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            MetaValue::Uint(v) => Some(*v),
            MetaValue::Int(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            MetaValue::Float(v) => Some(*v),
            MetaValue::Uint(v) => Some(*v as f64),
            MetaValue::Int(v) => Some(*v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
    /// Heap bytes held beyond the value itself (see [`heap_bytes`]).
    pub fn heap_bytes(&self) -> usize {
        match self {
            MetaValue::Str(s) => heap_bytes(s.capacity()),
            MetaValue::Array(a) => a.heap_bytes(),
            _ => 0,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost first (ne0 = row length).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Byte offset from the data start.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements; None when the product of the dimensions overflows
    /// (such a tensor is refused when the file is opened).
    pub fn n_elements(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
    }
}

/// The bytes a GGUF file was read from.
enum Data {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Mapped(m) => m,
            Data::Owned(v) => v,
        }
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    data: Data,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    /// Per tensor, its absolute byte range when its type is one we can size.
    extents: Vec<Option<std::ops::Range<usize>>>,
}

/// Default of `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "unexpected end of file at byte {} (wanted {n} more bytes, {} remain); the file is truncated",
                    self.pos,
                    self.remaining()
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A length or count, refused when it exceeds what the file could hold.
    fn len(&mut self, what: &str, min_bytes_each: usize) -> Result<usize, String> {
        let at = self.pos;
        let n = self.u64()?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|n| n.saturating_mul(min_bytes_each) <= self.remaining());
        fits.ok_or_else(|| {
            format!(
                "{what} at byte {at} claims {n} elements of at least {min_bytes_each} bytes each, but only {} bytes remain; the file is truncated or corrupt",
                self.remaining()
            )
        })
    }
    fn str_bytes(&mut self) -> Result<&'a str, String> {
        let n = self.len("string length", 1)?;
        let at = self.pos;
        let b = self.take(n)?;
        std::str::from_utf8(b).map_err(|_| format!("the string at byte {at} is not UTF-8"))
    }
    fn string(&mut self) -> Result<String, String> {
        self.str_bytes().map(String::from)
    }
    fn fixed<T, const N: usize>(
        &mut self,
        n: usize,
        f: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>, String> {
        let bytes = self.take(n * N)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect())
    }
    fn value(&mut self, ty: u32) -> Result<MetaValue, String> {
        Ok(match ty {
            0 => MetaValue::Uint(self.u8()? as u64),
            1 => MetaValue::Int(self.u8()? as i8 as i64),
            2 => MetaValue::Uint(self.u16()? as u64),
            3 => MetaValue::Int(self.u16()? as i16 as i64),
            4 => MetaValue::Uint(self.u32()? as u64),
            5 => MetaValue::Int(self.u32()? as i32 as i64),
            6 => MetaValue::Float(f32::from_bits(self.u32()?) as f64),
            7 => MetaValue::Bool(self.u8()? != 0),
            8 => MetaValue::Str(self.string()?),
            9 => MetaValue::Array(self.array_value()?),
            10 => MetaValue::Uint(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64()?)),
            _ => return Err(format!("has unknown value type {ty} (known: 0 to 12)")),
        })
    }
    fn array_value(&mut self) -> Result<MetaArray, String> {
        let ety = self.u32()?;
        let width = match ety {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8, // a string takes at least its 8-byte length
            9 => return Err("is an array of arrays, which this reader does not support".into()),
            _ => {
                return Err(format!(
                    "is an array of unknown value type {ety} (known: 0 to 12)"
                ))
            }
        };
        let n = self.len("array", width)?;
        Ok(match ety {
            0 => MetaArray::U8(self.take(n)?.to_vec()),
            1 => MetaArray::I8(self.fixed(n, i8::from_le_bytes)?),
            2 => MetaArray::U16(self.fixed(n, u16::from_le_bytes)?),
            3 => MetaArray::I16(self.fixed(n, i16::from_le_bytes)?),
            4 => MetaArray::U32(self.fixed(n, u32::from_le_bytes)?),
            5 => MetaArray::I32(self.fixed(n, i32::from_le_bytes)?),
            6 => MetaArray::F32(self.fixed(n, f32::from_le_bytes)?),
            7 => MetaArray::Bool(self.fixed(n, |b: [u8; 1]| b[0] != 0)?),
            10 => MetaArray::U64(self.fixed(n, u64::from_le_bytes)?),
            11 => MetaArray::I64(self.fixed(n, i64::from_le_bytes)?),
            12 => MetaArray::F64(self.fixed(n, f64::from_le_bytes)?),
            _ => {
                let mut a = StrArray {
                    text: String::new(),
                    ends: Vec::with_capacity(n),
                };
                for i in 0..n {
                    let s = self.str_bytes().map_err(|e| format!("element {i}: {e}"))?;
                    a.push(s);
                }
                a.text.shrink_to_fit();
                MetaArray::Str(a)
            }
        })
    }
}

/// (elements per block, bytes per block) of the ggml types this reader can
/// size; other types are accepted in the table and refused when loaded.
fn block_layout(ggml_type: u32) -> Option<(u64, u64)> {
    BlockType::from_ggml(ggml_type).map(|t| (t.block_elems() as u64, t.block_bytes() as u64))
}

impl GgufFile {
    /// Open and check a GGUF file through a read-only memory map.
    pub fn open(path: &Path) -> Result<GgufFile, CaptureError> {
        // Checked before opening: opening a FIFO blocks until a writer comes.
        if let Some(kind) = crate::files::non_regular(path)? {
            return Err(CaptureError::NotGguf {
                path: path.into(),
                why: format!("it is {kind}, not a regular file"),
            });
        }
        let file = std::fs::File::open(path).map_err(|e| CaptureError::io(path, e))?;
        // SAFETY: model files are read-only inputs; we never write through the map.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| CaptureError::io(path, e))?;
        GgufFile::from_data(path, Data::Mapped(mmap))
    }

    /// Parse and check GGUF bytes held in memory; `path` names them in errors.
    pub fn parse(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile, CaptureError> {
        GgufFile::from_data(&path.into(), Data::Owned(bytes))
    }

    fn from_data(path: &Path, data: Data) -> Result<GgufFile, CaptureError> {
        if data.len() < 24 || &data[..4] != b"GGUF" {
            return Err(CaptureError::NotGguf {
                path: path.into(),
                why: "it does not start with the GGUF magic".into(),
            });
        }
        let corrupt = |msg: String| CaptureError::GgufCorrupt {
            path: path.into(),
            msg,
        };
        let mut c = Cursor { buf: &data, pos: 4 };
        let version = c.u32().map_err(corrupt)?;
        if !(2..=3).contains(&version) {
            return Err(CaptureError::GgufVersion {
                path: path.into(),
                version,
            });
        }
        // A tensor info takes at least 8 + 4 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
        let n_tensors = c.len("tensor count", 24).map_err(corrupt)?;
        let n_kv = c.len("metadata count", 13).map_err(corrupt)?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c
                .string()
                .map_err(|e| corrupt(format!("metadata entry {i}: key: {e}")))?;
            let ty = c
                .u32()
                .map_err(|e| corrupt(format!("metadata `{key}`: {e}")))?;
            let v = c
                .value(ty)
                .map_err(|e| corrupt(format!("metadata `{key}`: {e}")))?;
            if metadata.contains_key(&key) {
                return Err(corrupt(format!(
                    "metadata key `{key}` appears twice; the file is corrupt"
                )));
            }
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut index = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = c
                .string()
                .map_err(|e| corrupt(format!("tensor {i}: name: {e}")))?;
            let tensor_err = |e: String| CaptureError::Tensor {
                path: path.into(),
                tensor: name.clone(),
                msg: format!("{e}; the file is corrupt"),
            };
            let n_dims = c.u32().map_err(tensor_err)? as usize;
            if n_dims > 8 {
                return Err(tensor_err(format!("has {n_dims} dimensions (at most 8)")));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64())
                .collect::<Result<Vec<_>, _>>()
                .map_err(tensor_err)?;
            let ggml_type = c.u32().map_err(tensor_err)?;
            let offset = c.u64().map_err(tensor_err)?;
            if index.insert(name.clone(), i).is_some() {
                return Err(tensor_err("appears twice in the tensor table".into()));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= 1 << 30)
                .ok_or_else(|| CaptureError::Metadata {
                    path: path.into(),
                    key: "general.alignment".into(),
                    problem: format!("{v:?}, not a power of two up to 2^30; the file is corrupt"),
                })?,
        };
        let data_start = (c.pos as u64).div_ceil(align) * align;
        let extents = tensor_extents(path, &tensors, data_start, align, data.len() as u64)?;
        Ok(GgufFile {
            path: path.into(),
            data,
            version,
            metadata,
            tensors,
            index,
            extents,
        })
    }

    /// Heap bytes the metadata holds (keys and values, see [`heap_bytes`]).
    pub fn metadata_heap_bytes(&self) -> usize {
        self.metadata
            .iter()
            .map(|(k, v)| heap_bytes(k.capacity()) + v.heap_bytes())
            .sum()
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn meta_err(&self, key: &str, problem: &str) -> CaptureError {
        CaptureError::Metadata {
            path: self.path.clone(),
            key: key.into(),
            problem: problem.into(),
        }
    }

    /// A required unsigned integer metadata value.
    pub fn get_u64(&self, key: &str) -> Result<u64, CaptureError> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.meta_err(key, "not an unsigned integer")),
        }
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, CaptureError> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v.as_f64().ok_or_else(|| self.meta_err(key, "not a number")),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, CaptureError> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v.as_str().ok_or_else(|| self.meta_err(key, "not a string")),
        }
    }

    /// An optional unsigned integer: None when absent, an error when of another type.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, CaptureError> {
        self.get(key).map(|_| self.get_u64(key)).transpose()
    }

    /// An optional string: None when absent, an error when of another type.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, CaptureError> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }

    /// A required count: an integer of at least 1 that fits in memory sizes.
    pub fn count(&self, key: &str) -> Result<usize, CaptureError> {
        let v = self.get_u64(key)?;
        usize::try_from(v)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| self.meta_err(key, &format!("{v}; it must be at least 1")))
    }

    /// An optional count (see [`GgufFile::count`]), `default` when absent.
    pub fn count_or(&self, key: &str, default: usize) -> Result<usize, CaptureError> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.count(key),
        }
    }

    /// A finite number greater than zero; `default` when absent (required
    /// when `default` is None).
    pub fn positive_f64(&self, key: &str, default: Option<f64>) -> Result<f64, CaptureError> {
        let v = match (self.get(key), default) {
            (None, Some(d)) => return Ok(d),
            _ => self.get_f64(key)?,
        };
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(self.meta_err(
                key,
                &format!(
                    "{v}; it must be a finite number greater than 0: fix or re-convert the model"
                ),
            ))
        }
    }

    /// As [`GgufFile::positive_f64`], also finite and positive once rounded to f32.
    pub fn positive_f32(&self, key: &str, default: Option<f32>) -> Result<f32, CaptureError> {
        let v = self.positive_f64(key, default.map(f64::from))?;
        let x = v as f32;
        if x.is_finite() && x > 0.0 {
            Ok(x)
        } else {
            Err(self.meta_err(
                key,
                &format!("{v}, which is 0 or infinite as an f32; it must be a finite number greater than 0"),
            ))
        }
    }

    /// A required array of strings.
    pub fn get_strings(&self, key: &str) -> Result<&StrArray, CaptureError> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "missing"))?
            .as_array()
            .ok_or_else(|| self.meta_err(key, "not an array"))?
            .strings()
            .ok_or_else(|| self.meta_err(key, "not an array of strings"))
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Dequantise tensor `name` to f32, checking its shape (innermost first).
    pub fn tensor_f32(&self, name: &str, dims: &[u64]) -> Result<Vec<f32>, CaptureError> {
        let (ty, data, n) = self.tensor_raw(name, dims)?;
        let mut out = vec![0f32; n];
        dequantize(ty, data, &mut out).map_err(|e| CaptureError::Tensor {
            path: self.path.clone(),
            tensor: name.into(),
            msg: e.to_string(),
        })?;
        Ok(out)
    }

    /// Tensor `name` as stored: its block type, its bytes and its element
    /// count, with its shape (innermost first) checked.
    pub fn tensor_raw(
        &self,
        name: &str,
        dims: &[u64],
    ) -> Result<(BlockType, &[u8], usize), CaptureError> {
        let bad = |msg: String| CaptureError::Tensor {
            path: self.path.clone(),
            tensor: name.into(),
            msg,
        };
        let i = *self.index.get(name).ok_or_else(|| {
            bad("missing from the file; is it a complete llama-family model?".into())
        })?;
        let info = &self.tensors[i];
        if info.dims != dims {
            return Err(bad(format!(
                "has shape {:?}, the metadata implies {:?}",
                info.dims, dims
            )));
        }
        let ty = BlockType::from_ggml(info.ggml_type).ok_or_else(|| {
            CaptureError::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: name.into(),
                type_name: format!(
                    "{} (ggml type {})",
                    BlockType::ggml_name(info.ggml_type),
                    info.ggml_type
                ),
            }
        })?;
        // Every tensor of a supported type was sized and bounded at open.
        let range = self.extents[i].clone().ok_or_else(|| {
            bad(format!(
                "{ty:?} tensor was not sized when the file was opened (a bug; please report it)"
            ))
        })?;
        let n = info
            .n_elements()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| bad("has more elements than this machine can address".into()))?;
        let data = self.data.get(range.clone()).ok_or_else(|| {
            bad(format!(
                "data {range:?} lies past the end of the file ({} bytes); the file is truncated",
                self.data.len()
            ))
        })?;
        if ty.bytes_for(n) != Some(data.len()) {
            return Err(bad(format!("{} bytes for {n} {ty:?} elements", data.len())));
        }
        Ok((ty, data, n))
    }

    /// The raw file bytes (for checksumming).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

/// Check the tensor table against the data section `[data_start, file_len)`
/// and return each tensor's absolute byte range (None for types we cannot size).
fn tensor_extents(
    path: &Path,
    tensors: &[TensorInfo],
    data_start: u64,
    align: u64,
    file_len: u64,
) -> Result<Vec<Option<std::ops::Range<usize>>>, CaptureError> {
    let bad = |t: &TensorInfo, msg: String| CaptureError::Tensor {
        path: path.into(),
        tensor: t.name.clone(),
        msg,
    };
    if !tensors.is_empty() && data_start > file_len {
        return Err(CaptureError::GgufCorrupt {
            path: path.into(),
            msg: format!(
                "the file ends at byte {file_len}, before its tensor data starts at byte {data_start}; the file is truncated"
            ),
        });
    }
    let data_len = file_len.saturating_sub(data_start);
    // (offset, size) relative to the data start, per tensor.
    let mut sized: Vec<Option<(u64, u64)>> = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t.n_elements().ok_or_else(|| {
            bad(
                t,
                format!(
                    "dimensions {:?} overflow a 64-bit element count; the file is corrupt",
                    t.dims
                ),
            )
        })?;
        if t.offset % align != 0 {
            return Err(bad(
                t,
                format!("data offset {} is not a multiple of the alignment {align}; the file is corrupt", t.offset),
            ));
        }
        if t.offset > data_len {
            return Err(bad(
                t,
                format!(
                    "data offset {} lies past the end of the data section ({data_len} bytes from byte {data_start}); the file is truncated or corrupt",
                    t.offset
                ),
            ));
        }
        let Some((be, bb)) = block_layout(t.ggml_type) else {
            sized.push(None);
            continue;
        };
        let row = t.dims.first().copied().unwrap_or(1);
        if row % be != 0 {
            return Err(bad(
                t,
                format!(
                    "rows of {row} elements are not a multiple of the {} block size {be}; the file is corrupt",
                    BlockType::ggml_name(t.ggml_type)
                ),
            ));
        }
        let size = (n / be).checked_mul(bb).ok_or_else(|| {
            bad(
                t,
                format!("{n} elements overflow a 64-bit byte size; the file is corrupt"),
            )
        })?;
        if size > data_len - t.offset {
            return Err(bad(
                t,
                format!(
                    "{} data [{}, {}) of shape {:?} lies past the end of the file ({file_len} bytes); the file is truncated or the tensor's type or shape is wrong",
                    BlockType::ggml_name(t.ggml_type),
                    data_start + t.offset,
                    data_start as u128 + t.offset as u128 + size as u128,
                    t.dims
                ),
            ));
        }
        sized.push(Some((t.offset, size)));
    }
    // In offset order, each sized tensor must end where the next begins
    // (after padding to the alignment): a gap or an overlap means a type or
    // shape that does not match the bytes stored.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        let Some((off, size)) = sized[w[0]] else {
            continue;
        };
        // off + size <= data_len, so neither sum overflows.
        let end = off + size;
        let padded = end.div_ceil(align) * align;
        if b.offset != padded {
            let how = if b.offset < end {
                "overlaps"
            } else {
                "leaves a gap before"
            };
            return Err(bad(
                a,
                format!(
                    "{} of shape {:?} takes {size} bytes from offset {off}, so its data ends at {end} and {how} tensor `{}` at offset {}; its type or shape does not match the bytes stored: the file is corrupt",
                    BlockType::ggml_name(a.ggml_type),
                    a.dims,
                    b.name,
                    b.offset
                ),
            ));
        }
    }
    Ok(sized
        .into_iter()
        .map(|s| {
            s.map(|(off, size)| (data_start + off) as usize..(data_start + off + size) as usize)
        })
        .collect())
}

/// A minimal GGUF writer for tests: builds files from metadata and f32/f16
/// tensors so unit tests can run tiny models without downloads.
pub mod write {
    use super::{MetaArray, MetaValue};

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn put_array(out: &mut Vec<u8>, a: &MetaArray) {
        fn all<T, const N: usize>(out: &mut Vec<u8>, ty: u32, v: &[T], f: impl Fn(&T) -> [u8; N]) {
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            v.iter().for_each(|x| out.extend_from_slice(&f(x)));
        }
        match a {
            MetaArray::U8(v) => all(out, 0, v, |x| x.to_le_bytes()),
            MetaArray::I8(v) => all(out, 1, v, |x| x.to_le_bytes()),
            MetaArray::U16(v) => all(out, 2, v, |x| x.to_le_bytes()),
            MetaArray::I16(v) => all(out, 3, v, |x| x.to_le_bytes()),
            MetaArray::U32(v) => all(out, 4, v, |x| x.to_le_bytes()),
            MetaArray::I32(v) => all(out, 5, v, |x| x.to_le_bytes()),
            MetaArray::F32(v) => all(out, 6, v, |x| x.to_le_bytes()),
            MetaArray::Bool(v) => all(out, 7, v, |x| [*x as u8]),
            MetaArray::U64(v) => all(out, 10, v, |x| x.to_le_bytes()),
            MetaArray::I64(v) => all(out, 11, v, |x| x.to_le_bytes()),
            MetaArray::F64(v) => all(out, 12, v, |x| x.to_le_bytes()),
            MetaArray::Str(v) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| put_str(out, s));
            }
        }
    }

    fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
        match v {
            MetaValue::Uint(x) => {
                out.extend_from_slice(&10u32.to_le_bytes());
                out.extend_from_slice(&x.to_le_bytes());
            }
            MetaValue::Int(x) => {
                out.extend_from_slice(&11u32.to_le_bytes());
                out.extend_from_slice(&x.to_le_bytes());
            }
            MetaValue::Float(x) => {
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&(*x as f32).to_le_bytes());
            }
            MetaValue::Bool(b) => {
                out.extend_from_slice(&7u32.to_le_bytes());
                out.push(*b as u8);
            }
            MetaValue::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                put_str(out, s);
            }
            MetaValue::Array(a) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                put_array(out, a);
            }
        }
    }

    /// A tensor to write: name, dims (innermost first), ggml type id, raw bytes.
    pub struct RawTensor {
        pub name: String,
        pub dims: Vec<u64>,
        pub ggml_type: u32,
        pub data: Vec<u8>,
    }

    /// The header and metadata of a GGUF file announcing `n_tensors` tensors,
    /// without tensor infos or padding.
    pub fn gguf_header(meta: &[(&str, MetaValue)], n_tensors: usize) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(n_tensors as u64).to_le_bytes());
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        for (k, v) in meta {
            put_str(&mut out, k);
            put_value(&mut out, v);
        }
        out
    }

    pub fn gguf_bytes(meta: &[(&str, MetaValue)], tensors: &[RawTensor]) -> Vec<u8> {
        let mut out = gguf_header(meta, tensors.len());
        let mut off = 0u64;
        let mut offsets = Vec::new();
        for t in tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
            offsets.push(off);
            off += (t.data.len() as u64).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        let start = out.len();
        for (t, o) in tensors.iter().zip(offsets) {
            out.resize(start + o as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::write::{gguf_bytes, gguf_header};
    use super::*;

    /// A GGUF with the given tensor table (offsets as given) and `data_len`
    /// zero bytes of tensor data.
    fn raw(
        meta: &[(&str, MetaValue)],
        infos: &[(&str, &[u64], u32, u64)],
        data_len: usize,
    ) -> Vec<u8> {
        let mut b = gguf_header(meta, infos.len());
        for (name, dims, ty, off) in infos {
            b.extend_from_slice(&(name.len() as u64).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            dims.iter()
                .for_each(|d| b.extend_from_slice(&d.to_le_bytes()));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
        }
        b.resize(b.len().div_ceil(32) * 32 + data_len, 0);
        b
    }

    fn err(bytes: Vec<u8>) -> String {
        match GgufFile::parse("bad.gguf", bytes) {
            Ok(_) => panic!("a corrupt file was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_million_short_strings_take_less_than_four_times_their_file_size() {
        let tokens: StrArray = (0..1_000_000u32).map(|i| format!("{}", i % 100)).collect();
        let bytes = gguf_bytes(
            &[(
                "tokenizer.ggml.tokens",
                MetaValue::Array(MetaArray::Str(tokens)),
            )],
            &[],
        );
        let len = bytes.len();
        let g = GgufFile::parse("m.gguf", bytes).unwrap();
        let held = g.metadata_heap_bytes();
        assert!(
            held < 4 * len,
            "metadata holds {held} heap bytes for a {len} byte file"
        );
        let t = g.get_strings("tokenizer.ggml.tokens").unwrap();
        assert_eq!(
            (t.len(), t.get(0), t.get(123_456), t.get(1_000_000)),
            (1_000_000, Some("0"), Some("56"), None)
        );
    }

    #[test]
    fn numeric_arrays_keep_their_element_width() {
        let bytes = gguf_bytes(
            &[
                ("a.u8", MetaValue::Array(MetaArray::U8(vec![7; 100_000]))),
                ("a.i32", MetaValue::Array(MetaArray::I32(vec![-1, 5]))),
                ("a.f32", MetaValue::Array(MetaArray::F32(vec![0.5, 2.0]))),
            ],
            &[],
        );
        let g = GgufFile::parse("m.gguf", bytes).unwrap();
        let a = |k: &str| g.get(k).unwrap().as_array().unwrap().clone();
        assert_eq!(a("a.u8").heap_bytes(), heap_bytes(100_000));
        assert_eq!(a("a.i32"), MetaArray::I32(vec![-1, 5]));
        assert_eq!(
            (a("a.i32").u64_at(0), a("a.i32").u64_at(1)),
            (None, Some(5))
        );
        assert_eq!(a("a.f32"), MetaArray::F32(vec![0.5, 2.0]));
    }

    #[test]
    fn an_array_length_of_two_to_the_sixtieth_is_refused_before_allocating() {
        let mut b = gguf_header(&[("a", MetaValue::Array(MetaArray::U64(vec![1, 2])))], 0);
        // the array's length follows its element type, 8 bytes before the two elements
        let at = b.len() - 16 - 8;
        b[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
        let e = err(b);
        assert!(
            e.contains("bad.gguf")
                && e.contains("metadata `a`")
                && e.contains("1152921504606846976 elements"),
            "{e}"
        );
        let mut b = gguf_header(
            &[(
                "s",
                MetaValue::Array(MetaArray::Str(["x"].iter().collect())),
            )],
            0,
        );
        let at = b.len() - 9 - 8;
        b[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(err(b).contains("metadata `s`"));
    }

    #[test]
    fn a_tensor_offset_near_two_to_the_sixty_fourth_is_refused_naming_the_tensor() {
        for off in [u64::MAX - 1000, u64::MAX - 1023] {
            let e = err(raw(&[], &[("w", &[8], 0, off)], 32));
            assert!(
                e.contains("bad.gguf") && e.contains("tensor `w`") && e.contains(&off.to_string()),
                "{e}"
            );
        }
        // in bounds but running past the end
        let e = err(raw(&[], &[("w", &[16], 0, 0)], 32));
        assert!(
            e.contains("tensor `w`") && e.contains("past the end") && e.contains("truncated"),
            "{e}"
        );
    }

    #[test]
    fn a_file_that_ends_before_its_tensor_data_starts_is_refused() {
        // found by cargo-fuzz: an empty tensor at offset 0 of a file cut
        // inside the padding before the data section was sliced past the end
        let mut b = raw(&[], &[("empty", &[0], 0, 0)], 0);
        b.truncate(b.len() - 1);
        let e = err(b.clone());
        assert!(
            e.contains("bad.gguf")
                && e.contains("before its tensor data starts")
                && e.contains("truncated"),
            "{e}"
        );
        b.push(0);
        let g = GgufFile::parse("ok.gguf", b).unwrap();
        assert_eq!(g.tensor_f32("empty", &[0]).unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn a_tensor_whose_type_does_not_match_its_bytes_is_refused() {
        // 8 f32 values take 32 bytes: the next tensor follows at 32.
        let ok = raw(&[], &[("a", &[8], 0, 0), ("b", &[8], 0, 32)], 64);
        assert!(GgufFile::parse("ok.gguf", ok).is_ok());
        // `a` declared F16 (16 bytes) over 32 bytes of data: a gap before `b`
        let e = err(raw(&[], &[("a", &[16], 1, 0), ("b", &[8], 0, 64)], 96));
        assert!(
            e.contains("tensor `a`") && e.contains("F16") && e.contains("gap before tensor `b`"),
            "{e}"
        );
        // `a` declared F32 [16] (64 bytes) where `b` starts at 32: overlap
        let e = err(raw(&[], &[("a", &[16], 0, 0), ("b", &[8], 0, 32)], 64));
        assert!(
            e.contains("tensor `a`") && e.contains("overlaps tensor `b`"),
            "{e}"
        );
        // a Q8_0 row that is not whole blocks
        let e = err(raw(&[], &[("q", &[16, 2], 8, 0)], 64));
        assert!(
            e.contains("tensor `q`") && e.contains("block size 32"),
            "{e}"
        );
        // a dimension product that overflows
        let e = err(raw(&[], &[("big", &[1 << 40, 1 << 40], 0, 0)], 32));
        assert!(e.contains("tensor `big`") && e.contains("overflow"), "{e}");
    }

    #[test]
    fn duplicate_keys_and_tensor_names_and_bad_alignments_are_refused() {
        let e = err(gguf_bytes(
            &[("k", MetaValue::Uint(1)), ("k", MetaValue::Uint(2))],
            &[],
        ));
        assert!(e.contains("`k` appears twice"), "{e}");
        let e = err(raw(&[], &[("a", &[8], 0, 0), ("a", &[8], 0, 32)], 64));
        assert!(
            e.contains("tensor `a`") && e.contains("appears twice"),
            "{e}"
        );
        for a in [0u64, 3, 1 << 40] {
            let e = err(gguf_bytes(
                &[("general.alignment", MetaValue::Uint(a))],
                &[],
            ));
            assert!(
                e.contains("general.alignment") && e.contains("power of two"),
                "{a}: {e}"
            );
        }
    }

    #[test]
    fn metadata_numbers_are_checked_where_they_are_read() {
        let g = GgufFile::parse(
            "m.gguf",
            gguf_bytes(
                &[
                    ("zero", MetaValue::Uint(0)),
                    ("neg", MetaValue::Float(-1.0)),
                    ("nan", MetaValue::Float(f64::NAN)),
                    ("tiny", MetaValue::Array(MetaArray::F64(vec![]))),
                    ("small", MetaValue::Float(1e-5)),
                ],
                &[],
            ),
        )
        .unwrap();
        let e = g.count("zero").unwrap_err().to_string();
        assert!(
            e.contains("m.gguf") && e.contains("`zero` is 0; it must be at least 1"),
            "{e}"
        );
        for k in ["neg", "nan"] {
            let e = g.positive_f64(k, Some(1.0)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{k}`")) && e.contains("finite number greater than 0"),
                "{e}"
            );
        }
        assert!(g
            .positive_f64("tiny", None)
            .unwrap_err()
            .to_string()
            .contains("not a number"));
        assert_eq!(g.positive_f64("absent", Some(10000.0)).unwrap(), 10000.0);
        assert_eq!(g.positive_f32("small", None).unwrap(), 1e-5);
        assert!(g
            .positive_f64("absent", None)
            .unwrap_err()
            .to_string()
            .contains("missing"));
    }
}
