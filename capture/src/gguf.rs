//! A GGUF (v2/v3) reader over a memory map: metadata, tensor index, and
//! dequantised tensors. Format, little-endian:
//! magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv entries
//! (string key, u32 type, value); n_tensors infos (string name, u32 n_dims,
//! u64 dims[n_dims] innermost first, u32 ggml type, u64 offset); then tensor
//! data from align_up(end of infos, general.alignment or 32).

use kvreplay_kernels::cpu::{dequantize, BlockType};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::CaptureError;

#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
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
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
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
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    mmap: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    data_start: usize,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "unexpected end of file at byte {} (wanted {n} more bytes); the file is truncated",
                    self.pos
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| format!("string at byte {} is not UTF-8", self.pos - n))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue, String> {
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
            9 if depth == 0 => {
                let ety = self.u32()?;
                let n = self.u64()? as usize;
                if n > self.buf.len() {
                    return Err(format!("array of {n} elements is longer than the file"));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::Uint(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64()?)),
            _ => return Err(format!("unknown metadata value type {ty}")),
        })
    }
}

impl GgufFile {
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
        if mmap.len() < 24 || &mmap[..4] != b"GGUF" {
            return Err(CaptureError::NotGguf {
                path: path.into(),
                why: "it does not start with the GGUF magic".into(),
            });
        }
        let corrupt = |msg: String| CaptureError::GgufCorrupt {
            path: path.into(),
            msg,
        };
        let mut c = Cursor { buf: &mmap, pos: 4 };
        let version = c.u32().map_err(corrupt)?;
        if !(2..=3).contains(&version) {
            return Err(CaptureError::GgufVersion {
                path: path.into(),
                version,
            });
        }
        let n_tensors = c.u64().map_err(corrupt)? as usize;
        let n_kv = c.u64().map_err(corrupt)? as usize;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string().map_err(corrupt)?;
            let ty = c.u32().map_err(corrupt)?;
            let v = c
                .value(ty, 0)
                .map_err(|e| corrupt(format!("metadata `{key}`: {e}")))?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = c.string().map_err(corrupt)?;
            let n_dims = c.u32().map_err(corrupt)? as usize;
            if n_dims > 8 {
                return Err(corrupt(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64())
                .collect::<Result<Vec<_>, _>>()
                .map_err(corrupt)?;
            let ggml_type = c.u32().map_err(corrupt)?;
            let offset = c.u64().map_err(corrupt)?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(|v| v.as_u64())
            .unwrap_or(32) as usize;
        let data_start = c.pos.div_ceil(align.max(1)) * align.max(1);
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.into(),
            mmap,
            version,
            metadata,
            tensors,
            index,
            data_start,
        })
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

    /// A required array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, CaptureError> {
        let arr = self
            .get(key)
            .ok_or_else(|| self.meta_err(key, "missing"))?
            .as_array()
            .ok_or_else(|| self.meta_err(key, "not an array"))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.meta_err(key, "not an array of strings"))
            })
            .collect()
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Dequantise tensor `name` to f32, checking its shape (innermost first).
    pub fn tensor_f32(&self, name: &str, dims: &[u64]) -> Result<Vec<f32>, CaptureError> {
        let info = self.tensor_info(name).ok_or_else(|| CaptureError::Tensor {
            path: self.path.clone(),
            tensor: name.into(),
            msg: "missing from the file; is it a complete llama-family model?".into(),
        })?;
        let bad = |msg: String| CaptureError::Tensor {
            path: self.path.clone(),
            tensor: name.into(),
            msg,
        };
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
        let n = info.n_elements() as usize;
        let nbytes = ty.bytes_for(n).ok_or_else(|| {
            bad(format!(
                "{n} elements is not a multiple of the {ty:?} block size {}",
                ty.block_elems()
            ))
        })?;
        let start = self.data_start + info.offset as usize;
        let data = self.mmap.get(start..start + nbytes).ok_or_else(|| {
            bad(format!(
                "data [{start}, {}) lies past the end of the file ({} bytes); the file is truncated",
                start + nbytes,
                self.mmap.len()
            ))
        })?;
        let mut out = vec![0f32; n];
        dequantize(ty, data, &mut out).map_err(|e| bad(e.to_string()))?;
        Ok(out)
    }

    /// The raw file bytes (for checksumming).
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }
}

/// A minimal GGUF writer for tests: builds files from metadata and f32/f16
/// tensors so unit tests can run tiny models without downloads.
pub mod write {
    use super::MetaValue;

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
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
                let (ety, body): (u32, Vec<u8>) = match a.first() {
                    Some(MetaValue::Str(_)) | None => {
                        let mut b = Vec::new();
                        for e in a {
                            put_str(&mut b, e.as_str().expect("homogeneous string array"));
                        }
                        (8, b)
                    }
                    Some(_) => {
                        let mut b = Vec::new();
                        for e in a {
                            b.extend_from_slice(
                                &(e.as_u64().expect("int array") as i32).to_le_bytes(),
                            );
                        }
                        (5, b)
                    }
                };
                out.extend_from_slice(&ety.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                out.extend_from_slice(&body);
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

    pub fn gguf_bytes(meta: &[(&str, MetaValue)], tensors: &[RawTensor]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        for (k, v) in meta {
            put_str(&mut out, k);
            put_value(&mut out, v);
        }
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
