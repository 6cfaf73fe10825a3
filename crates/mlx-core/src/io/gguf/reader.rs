//! A GGUF container reader (format versions 2 and 3, little-endian) over one file or a file
//! split byte-wise into parts, without reading tensor data until asked.
//!
//! Layout (all integers little-endian): magic `GGUF`, `u32` version, `u64` tensor count,
//! `u64` metadata count; metadata as `(string key, u32 value type, value)`; tensor infos as
//! `(string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 ggml type, u64 offset)`;
//! padding to `general.alignment` (default 32); then the tensor data, each tensor at its
//! offset from the start of the data section. Strings are a `u64` length and UTF-8 bytes.
//!
//! Everything the header claims is checked against the bytes present before any tensor is
//! read: tensor types, sizes, alignment, overlaps and the total length. For a split file
//! the parts are also checked for order (see [`GgufFile::open`]). No claim of the header
//! can make the reader allocate more than a small multiple of the file's size, read out of
//! bounds, overflow or panic: a corrupt file is an [`Error::File`] naming it.
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::blocks::GgmlType;
use super::{Gguf, GgufValue};
use crate::{Array, Dtype, Error, Result};

/// The GGUF magic, the first four bytes of every GGUF file.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// The default data alignment in bytes (`general.alignment` overrides it).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML's maximum number of tensor dimensions.
const MAX_DIMS: u32 = 4;

/// A GGUF metadata value type id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    /// 0
    U8,
    /// 1
    I8,
    /// 2
    U16,
    /// 3
    I16,
    /// 4
    U32,
    /// 5
    I32,
    /// 6
    F32,
    /// 7 (one byte, 0 or 1)
    Bool,
    /// 8
    String,
    /// 9
    Array,
    /// 10
    U64,
    /// 11
    I64,
    /// 12
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The MLX dtype MLX's own loader gives a number of this type (`None` for strings and
    /// arrays). F64 maps to `float64` (MLX 0.32's loader itself aborts on F64 values).
    pub fn dtype(self) -> Option<Dtype> {
        use ValueType::*;
        Some(match self {
            U8 => Dtype::Uint8,
            I8 => Dtype::Int8,
            U16 => Dtype::Uint16,
            I16 => Dtype::Int16,
            U32 => Dtype::Uint32,
            I32 => Dtype::Int32,
            F32 => Dtype::Float32,
            Bool => Dtype::Bool,
            U64 => Dtype::Uint64,
            I64 => Dtype::Int64,
            F64 => Dtype::Float64,
            String | Array => return None,
        })
    }
}

/// One metadata value, exactly as stored.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `u8`
    U8(u8),
    /// `i8`
    I8(i8),
    /// `u16`
    U16(u16),
    /// `i16`
    I16(i16),
    /// `u32`
    U32(u32),
    /// `i32`
    I32(i32),
    /// `f32`
    F32(f32),
    /// `bool`
    Bool(bool),
    /// A UTF-8 string (invalid UTF-8 is replaced with U+FFFD).
    String(String),
    /// `u64`
    U64(u64),
    /// `i64`
    I64(i64),
    /// `f64`
    F64(f64),
    /// An array of values of one element type.
    Array {
        /// The element type (kept for empty arrays).
        elem: ValueType,
        /// The elements.
        items: Vec<MetaValue>,
    },
}

impl MetaValue {
    /// An integer value (any integer type, or a bool as 0/1), `None` for other kinds or a
    /// negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            MetaValue::Bool(v) => Some(v.into()),
            _ => None,
        }
    }

    /// A number as f64. An f32 is converted through its shortest decimal form, so the
    /// f32 `1e-5` (stored as 9.99999975e-06) reads back as exactly `1e-5`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => format!("{v}").parse().ok(),
            MetaValue::F64(v) => Some(v),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as MLX's GGUF loader would return it: numbers and bools as 0-d arrays
    /// of the matching dtype, numeric arrays as 1-D arrays, strings and string arrays as
    /// strings, nested arrays as [`GgufValue::None`].
    ///
    /// # Errors
    /// [`Error::Mlx`] if MLX cannot build the array.
    pub fn to_mlx(&self) -> Result<GgufValue> {
        Ok(match self {
            MetaValue::String(s) => GgufValue::String(s.clone()),
            MetaValue::Array { elem: ValueType::String, items } => {
                GgufValue::Strings(items.iter().map(|v| v.as_str().unwrap_or_default().to_string()).collect())
            }
            MetaValue::Array { elem: ValueType::Array, .. } => GgufValue::None,
            MetaValue::Array { elem, items } => {
                let dtype = elem.dtype().expect("numeric element type");
                let mut bytes = Vec::with_capacity(items.len() * dtype.size());
                items.iter().for_each(|v| v.push_le(&mut bytes));
                GgufValue::Array(Array::from_bytes(&bytes, &[items.len() as i32], dtype)?)
            }
            scalar => {
                let mut bytes = Vec::with_capacity(8);
                scalar.push_le(&mut bytes);
                GgufValue::Array(Array::from_bytes(&bytes, &[], scalar.value_type().dtype().expect("numeric"))?)
            }
        })
    }

    /// The stored type of this value.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::String(_) => ValueType::String,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
            MetaValue::Array { .. } => ValueType::Array,
        }
    }

    fn push_le(&self, out: &mut Vec<u8>) {
        match *self {
            MetaValue::U8(v) => out.push(v),
            MetaValue::I8(v) => out.extend(v.to_le_bytes()),
            MetaValue::U16(v) => out.extend(v.to_le_bytes()),
            MetaValue::I16(v) => out.extend(v.to_le_bytes()),
            MetaValue::U32(v) => out.extend(v.to_le_bytes()),
            MetaValue::I32(v) => out.extend(v.to_le_bytes()),
            MetaValue::F32(v) => out.extend(v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(v.into()),
            MetaValue::U64(v) => out.extend(v.to_le_bytes()),
            MetaValue::I64(v) => out.extend(v.to_le_bytes()),
            MetaValue::F64(v) => out.extend(v.to_le_bytes()),
            MetaValue::String(_) | MetaValue::Array { .. } => {}
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The GGUF tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Row-major shape, outermost first (GGUF stores it innermost first): a GGUF
    /// `[ne0=K, ne1=N]` matrix is `[N, K]` here, `N` rows of `K` elements.
    pub shape: Vec<u64>,
    /// The element type.
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the (concatenated) file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub nbytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

struct Part {
    path: PathBuf,
    start: u64,
    len: u64,
    file: RefCell<File>,
}

/// A parsed GGUF header with access to the tensor data.
pub struct GgufFile {
    parts: Vec<Part>,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key, in key order.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Data alignment in bytes.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// Total length in bytes (all parts together).
    pub len: u64,
    /// What is odd but readable, e.g. bytes after the last tensor of a single file.
    pub warnings: Vec<String>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("parts", &self.parts.iter().map(|p| &p.path).collect::<Vec<_>>())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn gguf_err(path: &Path, message: impl Into<String>) -> Error {
    Error::File { path: path.into(), message: message.into() }
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    let message = match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        _ => format!("cannot {what}: {e}"),
    };
    Error::File { path: path.into(), message }
}

/// At most this many entries are reserved ahead of parsing them; more grow as they are read.
const RESERVE: u64 = 1 << 16;

fn names(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The part numbers in the file names when every name differs from the others only by a
/// run of digits at the same place (`x.part1`, `x.part2`, ..., `x.part10`), else `None`.
fn part_numbers(paths: &[PathBuf]) -> Option<Vec<u64>> {
    let s: Vec<Vec<char>> = paths.iter().map(|p| p.to_string_lossy().chars().collect()).collect();
    let first = &s[0];
    let mut pre = s.iter().map(|x| first.iter().zip(x).take_while(|(a, b)| a == b).count()).min()?;
    let mut suf = s.iter().map(|x| first.iter().rev().zip(x.iter().rev()).take_while(|(a, b)| a == b).count()).min()?;
    while pre > 0 && first[pre - 1].is_ascii_digit() {
        pre -= 1;
    }
    while suf > 0 && first[first.len() - suf].is_ascii_digit() {
        suf -= 1;
    }
    s.iter()
        .map(|x| {
            let mid: String = x.get(pre..x.len().checked_sub(suf)?)?.iter().collect();
            if mid.is_empty() || !mid.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            mid.parse().ok()
        })
        .collect()
}

impl GgufFile {
    /// Opens a GGUF file given as one path, or as parts that concatenate byte-wise into one
    /// file (in the order given), and parses its header. Tensor data is read only by
    /// [`GgufFile::read`] / [`GgufFile::read_at`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty list; [`Error::File`] naming the file when a part is
    /// missing (`no such file`) or cannot be opened or read, and when:
    /// - the (first) file does not start with the GGUF magic (with a hint when another
    ///   part does, i.e. the parts are out of order), or a later part starts with it (the
    ///   parts are separate GGUF files, e.g. llama.cpp `gguf-split` shards);
    /// - the part names are numbered (`...part1`, `...part2`) and not listed in increasing
    ///   order, or a part is listed twice;
    /// - the version is not 2 or 3 (a big-endian file shows up here too);
    /// - the header is truncated or malformed (unknown value type, a string or array longer
    ///   than the file, more than 4 dimensions, a metadata key or tensor name given twice);
    /// - a tensor has an unknown GGML type id, a row length that is not a whole number of
    ///   blocks, a misaligned offset, data overlapping another tensor, or data past the end
    ///   of the file (truncated: the message names the tensor and the missing bytes);
    /// - a split file has bytes after the last tensor beyond the alignment padding (an
    ///   extra or foreign part). For a single file that is only a warning
    ///   ([`GgufFile::warnings`]).
    pub fn open(paths: &[PathBuf]) -> Result<GgufFile> {
        if paths.is_empty() {
            return Err(Error::Invalid {
                op: "GgufFile::open",
                message: "no files given (an empty list of parts)".into(),
            });
        }
        for (i, p) in paths.iter().enumerate() {
            if paths[..i].contains(p) {
                return Err(gguf_err(p, format!("listed twice among the parts ({})", names(paths))));
            }
        }
        let mut parts = Vec::with_capacity(paths.len());
        let mut start = 0u64;
        for p in paths {
            let file = File::open(p).map_err(|e| io_err(p, "open", e))?;
            let meta = file.metadata().map_err(|e| io_err(p, "read the size", e))?;
            if !meta.is_file() {
                return Err(gguf_err(p, "not a regular file"));
            }
            parts.push(Part { path: p.clone(), start, len: meta.len(), file: RefCell::new(file) });
            start += meta.len();
        }
        let mut g = GgufFile {
            parts,
            version: 0,
            metadata: BTreeMap::new(),
            tensors: Vec::new(),
            alignment: DEFAULT_ALIGNMENT,
            data_offset: 0,
            len: start,
            warnings: Vec::new(),
        };
        g.check_parts(paths)?;
        g.parse_header()?;
        g.check_layout()?;
        Ok(g)
    }

    fn starts_with_magic(&self, i: usize) -> Result<bool> {
        let p = &self.parts[i];
        if p.len < 4 {
            return Ok(false);
        }
        let mut m = [0u8; 4];
        let mut f = p.file.borrow_mut();
        f.seek(SeekFrom::Start(0)).and_then(|_| f.read_exact(&mut m)).map_err(|e| io_err(&p.path, "read", e))?;
        Ok(&m == MAGIC)
    }

    fn check_parts(&self, paths: &[PathBuf]) -> Result<()> {
        let split = paths.len() > 1;
        if !self.starts_with_magic(0)? {
            let others: Vec<usize> = (1..paths.len()).filter(|&i| self.starts_with_magic(i).unwrap_or(false)).collect();
            let mut msg = "not a GGUF file (it does not start with the magic `GGUF`)".to_string();
            if let Some(&i) = others.first() {
                msg = format!(
                    "the first part does not start with the magic `GGUF`, but part {} ({}) does: the parts \
                     are out of order (given: {})",
                    i + 1,
                    paths[i].display(),
                    names(paths)
                );
            } else if split {
                msg = format!("{msg}; none of the parts does ({})", names(paths));
            }
            return Err(gguf_err(&paths[0], msg));
        }
        for i in 1..paths.len() {
            if self.starts_with_magic(i)? {
                return Err(gguf_err(
                    &paths[i],
                    format!(
                        "part {} starts with the GGUF magic itself: the files are separate GGUF files \
                         (llama.cpp gguf-split shards?), not byte-wise parts of one file ({})",
                        i + 1,
                        names(paths)
                    ),
                ));
            }
        }
        if split
            && let Some(nums) = part_numbers(paths)
            && let Some(i) = (1..nums.len()).find(|&i| nums[i] <= nums[i - 1])
        {
            return Err(gguf_err(
                &paths[i],
                format!(
                    "parts are not in order: part {} is numbered {} after {} ({}); list them as \
                         numbered",
                    i + 1,
                    nums[i],
                    nums[i - 1],
                    names(paths)
                ),
            ));
        }
        Ok(())
    }

    /// The first file (the GGUF file itself when not split).
    pub fn path(&self) -> &Path {
        &self.parts[0].path
    }

    /// The files, in order.
    pub fn part_paths(&self) -> Vec<PathBuf> {
        self.parts.iter().map(|p| p.path.clone()).collect()
    }

    /// The file that holds absolute offset `off` (the last part for an offset past the end).
    pub fn path_at(&self, off: u64) -> &Path {
        let i = self.parts.iter().rposition(|p| p.start <= off).unwrap_or(0);
        &self.parts[i].path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The tensor info for `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Reads `buf.len()` bytes at absolute offset `off`, across part boundaries.
    ///
    /// # Errors
    /// [`Error::File`] naming the part when it cannot be read, or the last part when the
    /// range passes the end.
    pub fn read_at(&self, mut off: u64, mut buf: &mut [u8]) -> Result<()> {
        if off.checked_add(buf.len() as u64).is_none_or(|end| end > self.len) {
            return Err(gguf_err(
                self.path_at(self.len),
                format!("file ends at byte {}, reading {} bytes at {off}", self.len, buf.len()),
            ));
        }
        while !buf.is_empty() {
            let p = &self.parts[self.parts.iter().rposition(|p| p.start <= off && p.len > 0).expect("in range")];
            let local = off - p.start;
            let n = ((p.len - local) as usize).min(buf.len());
            let mut f = p.file.borrow_mut();
            f.seek(SeekFrom::Start(local))
                .and_then(|_| f.read_exact(&mut buf[..n]))
                .map_err(|e| io_err(&p.path, "read", e))?;
            buf = &mut buf[n..];
            off += n as u64;
        }
        Ok(())
    }

    /// The raw bytes of a tensor (`info.nbytes` of them).
    ///
    /// # Errors
    /// As [`GgufFile::read_at`] (checked before anything is allocated).
    pub fn read(&self, info: &TensorInfo) -> Result<Vec<u8>> {
        if info.offset.checked_add(info.nbytes).is_none_or(|end| end > self.len) {
            return Err(gguf_err(
                self.path_at(self.len),
                format!(
                    "tensor `{}`: file ends at byte {}, reading {} bytes at {}",
                    info.name, self.len, info.nbytes, info.offset
                ),
            ));
        }
        let mut buf = vec![0u8; info.nbytes as usize];
        self.read_at(info.offset, &mut buf)?;
        Ok(buf)
    }

    /// A [`Gguf`] with this file's metadata, each value as MLX's loader would return it
    /// ([`MetaValue::to_mlx`]), and no tensors (what a tokenizer builder reads). `path` is
    /// the first part.
    ///
    /// # Errors
    /// [`Error::Mlx`] if an array cannot be built.
    pub fn to_mlx(&self) -> Result<Gguf> {
        let mut metadata = BTreeMap::new();
        for (k, v) in &self.metadata {
            metadata.insert(k.clone(), v.to_mlx()?);
        }
        Ok(Gguf { path: self.path().into(), tensors: BTreeMap::new(), metadata })
    }

    fn parse_header(&mut self) -> Result<()> {
        let mut c = Cursor { g: self, pos: 0, buf: Vec::new(), buf_start: 0 };
        c.bytes(4, "the magic")?;
        let version = c.u32("the version")?;
        match version {
            2 | 3 => {}
            1 => return Err(c.err("GGUF version 1 is not supported (versions 2 and 3 are)")),
            v if v.swap_bytes() <= 3 => return Err(c.err("big-endian GGUF files are not supported")),
            v => return Err(c.err(format!("unknown GGUF version {v} (versions 2 and 3 are supported)"))),
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        c.check_count(n_kv, 12, "metadata entries")?;
        c.check_count(n_tensors, 28, "tensor infos")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let ty = c.u32("a metadata value type")?;
            let v = c.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(c.err(format!("metadata key `{key}` appears twice")));
            }
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(RESERVE) as usize);
        let mut seen = BTreeSet::new();
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            if !seen.insert(name.clone()) {
                return Err(c.err(format!("tensor `{name}` appears twice")));
            }
            let n_dims = c.u32("a tensor's dimension count")?;
            if n_dims > MAX_DIMS {
                return Err(c.err(format!("tensor `{name}` has {n_dims} dimensions (at most {MAX_DIMS})")));
            }
            let mut shape = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                shape.push(c.u64("a tensor dimension")?);
            }
            shape.reverse();
            let ty = GgmlType(c.u32("a tensor type")?);
            let offset = c.u64("a tensor offset")?;
            tensors.push(TensorInfo { name, shape, ty, offset, nbytes: 0 });
        }
        let pos = c.pos;
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return Err(gguf_err(self.path(), format!("`general.alignment` is {v:?}, not a power of two"))),
            },
        };
        self.version = version;
        self.metadata = metadata;
        self.alignment = alignment;
        self.data_offset = pos.div_ceil(alignment).saturating_mul(alignment);
        for t in &mut tensors {
            t.offset = t.offset.saturating_add(self.data_offset);
        }
        self.tensors = tensors;
        Ok(())
    }

    fn check_layout(&mut self) -> Result<()> {
        let path = self.path().to_path_buf();
        for t in &mut self.tensors {
            let Some((bs, _)) = t.ty.block() else {
                return Err(gguf_err(&path, format!("tensor `{}` has unknown tensor type id {}", t.name, t.ty.0)));
            };
            let inner = t.shape.last().copied().unwrap_or(1);
            if inner % bs as u64 != 0 {
                return Err(gguf_err(
                    &path,
                    format!(
                        "tensor `{}` ({}, shape {:?}): row length {inner} is not a multiple of the block size {bs}",
                        t.name, t.ty, t.shape
                    ),
                ));
            }
            let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            t.nbytes = numel
                .and_then(|n| t.ty.bytes_for(n))
                .ok_or_else(|| gguf_err(&path, format!("tensor `{}` has an impossible shape {:?}", t.name, t.shape)))?;
            if !(t.offset - self.data_offset).is_multiple_of(self.alignment) {
                return Err(gguf_err(
                    &path,
                    format!(
                        "tensor `{}`: offset {} is not a multiple of the alignment {}",
                        t.name,
                        t.offset - self.data_offset,
                        self.alignment
                    ),
                ));
            }
        }
        let mut order: Vec<&TensorInfo> = self.tensors.iter().collect();
        order.sort_by_key(|t| t.offset);
        for w in order.windows(2) {
            if w[0].offset.saturating_add(w[0].nbytes) > w[1].offset {
                return Err(gguf_err(&path, format!("tensors `{}` and `{}` overlap", w[0].name, w[1].name)));
            }
        }
        let end = order.iter().map(|t| t.offset.saturating_add(t.nbytes)).max().unwrap_or(self.data_offset);
        if let Some(t) = order.iter().find(|t| t.offset.saturating_add(t.nbytes) > self.len) {
            let last = &self.parts.last().expect("one part").path;
            let what = if self.parts.len() > 1 {
                format!("the {} parts together are {} bytes", self.parts.len(), self.len)
            } else {
                format!("the file is {} bytes", self.len)
            };
            return Err(gguf_err(
                last,
                format!(
                    "truncated: tensor `{}` needs bytes {}..{} but {what}; all tensors need {end} bytes \
                     ({} missing){}",
                    t.name,
                    t.offset,
                    t.offset.saturating_add(t.nbytes),
                    end.saturating_sub(self.len),
                    if self.parts.len() > 1 {
                        format!(" (parts: {})", names(&self.part_paths()))
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        let trailing = self.len.saturating_sub(end);
        if trailing >= self.alignment {
            let msg = format!("{trailing} bytes after the end of the last tensor (at byte {end})");
            if self.parts.len() > 1 {
                return Err(gguf_err(
                    self.path_at(end),
                    format!(
                        "{msg}: an extra or foreign part, or parts out of order? (parts: {})",
                        names(&self.part_paths())
                    ),
                ));
            }
            self.warnings.push(msg);
        }
        Ok(())
    }
}

/// A forward reader over the header with a buffer.
struct Cursor<'a> {
    g: &'a GgufFile,
    pos: u64,
    buf: Vec<u8>,
    buf_start: u64,
}

const CHUNK: u64 = 1 << 20;

impl Cursor<'_> {
    fn err(&self, message: impl Into<String>) -> Error {
        gguf_err(self.g.path(), message)
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<&[u8]> {
        if self.pos.checked_add(n).is_none_or(|end| end > self.g.len) {
            let last = &self.g.parts.last().expect("one part").path;
            return Err(gguf_err(
                last,
                format!(
                    "truncated: the header ends at byte {} while reading {what} ({n} bytes at byte {})",
                    self.g.len, self.pos
                ),
            ));
        }
        let end = self.buf_start + self.buf.len() as u64;
        if self.pos < self.buf_start || self.pos + n > end {
            let len = n.max(CHUNK).min(self.g.len - self.pos);
            self.buf = vec![0u8; len as usize];
            self.buf_start = self.pos;
            self.g.read_at(self.pos, &mut self.buf)?;
        }
        let s = (self.pos - self.buf_start) as usize;
        self.pos += n;
        Ok(&self.buf[s..s + n as usize])
    }

    fn check_count(&self, n: u64, min_size: u64, what: &str) -> Result<()> {
        if n.saturating_mul(min_size) > self.g.len.saturating_sub(self.pos) {
            return Err(self.err(format!(
                "truncated or corrupt header: it claims {n} {what} at byte {}, more than the file holds ({} bytes)",
                self.pos, self.g.len
            )));
        }
        Ok(())
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4, what)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8, what)?.try_into().expect("8 bytes")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        self.check_count(n, 1, &format!("bytes of {what}"))?;
        Ok(String::from_utf8_lossy(self.bytes(n, what)?).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue> {
        let what = format!("metadata `{key}`");
        let Some(vt) = ValueType::from_id(ty) else {
            return Err(self.err(format!("metadata `{key}` has unknown value type {ty}")));
        };
        let mut le = |n: u64| -> Result<[u8; 8]> {
            let mut a = [0u8; 8];
            a[..n as usize].copy_from_slice(self.bytes(n, &what)?);
            Ok(a)
        };
        Ok(match vt {
            ValueType::U8 => MetaValue::U8(le(1)?[0]),
            ValueType::I8 => MetaValue::I8(le(1)?[0] as i8),
            ValueType::Bool => MetaValue::Bool(le(1)?[0] != 0),
            ValueType::U16 => MetaValue::U16(u16::from_le_bytes(le(2)?[..2].try_into().expect("2"))),
            ValueType::I16 => MetaValue::I16(i16::from_le_bytes(le(2)?[..2].try_into().expect("2"))),
            ValueType::U32 => MetaValue::U32(u32::from_le_bytes(le(4)?[..4].try_into().expect("4"))),
            ValueType::I32 => MetaValue::I32(i32::from_le_bytes(le(4)?[..4].try_into().expect("4"))),
            ValueType::F32 => MetaValue::F32(f32::from_le_bytes(le(4)?[..4].try_into().expect("4"))),
            ValueType::U64 => MetaValue::U64(u64::from_le_bytes(le(8)?)),
            ValueType::I64 => MetaValue::I64(i64::from_le_bytes(le(8)?)),
            ValueType::F64 => MetaValue::F64(f64::from_le_bytes(le(8)?)),
            ValueType::String => MetaValue::String(self.string(&what)?),
            ValueType::Array => {
                if depth > 4 {
                    return Err(self.err(format!("metadata `{key}`: arrays nested too deeply")));
                }
                let et = self.u32(&what)?;
                let n = self.u64(&what)?;
                let elem = ValueType::from_id(et)
                    .ok_or_else(|| self.err(format!("metadata `{key}` has unknown element type {et}")))?;
                // The smallest encoding of one element: a string is at least its u64 length,
                // an array its u32 type and u64 count.
                let min_size = match elem {
                    ValueType::String => 8,
                    ValueType::Array => 12,
                    t => t.dtype().map_or(1, |d| d.size() as u64),
                };
                self.check_count(n, min_size, &format!("elements of {what}"))?;
                let mut items = Vec::with_capacity(n.min(RESERVE) as usize);
                for _ in 0..n {
                    items.push(self.value(et, key, depth + 1)?);
                }
                MetaValue::Array { elem, items }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: &[&str]) -> Vec<PathBuf> {
        v.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn part_numbers_from_names() {
        assert_eq!(part_numbers(&p(&["m.part1", "m.part2", "m.part10"])), Some(vec![1, 2, 10]));
        assert_eq!(part_numbers(&p(&["a/p9/x.gguf", "a/p10/x.gguf"])), Some(vec![9, 10]));
        assert_eq!(part_numbers(&p(&["m-00002-of-00003", "m-00001-of-00003"])), Some(vec![2, 1]));
        assert_eq!(part_numbers(&p(&["a.bin", "b.bin"])), None);
        assert_eq!(part_numbers(&p(&["x1", "x1a"])), None);
    }

    #[test]
    fn f32_metadata_reads_as_its_shortest_decimal() {
        assert_eq!(MetaValue::F32(1e-5).as_f64(), Some(1e-5));
        assert_eq!(MetaValue::F32(100000.0).as_f64(), Some(100000.0));
        assert_eq!(MetaValue::I32(-3).as_u64(), None);
    }
}
