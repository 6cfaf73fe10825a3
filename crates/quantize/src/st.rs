//! Streaming safetensors: read a file's header without its data, read one tensor's bytes at
//! a time, and write a file whose header is planned up front and whose tensors are written
//! into place one by one. The header JSON is parsed and produced by the `safetensors`
//! crate's [`TensorInfo`] / [`Metadata`] types; only the byte-level framing (the 8-byte
//! length prefix, reading and writing ranges) is done here, because that crate reads and
//! writes whole buffers.
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use mlx_core::Dtype;
use mlx_core::io::st_header::{self, PREFIX};
use safetensors::Dtype as StDtype;
use safetensors::tensor::{Metadata, TensorInfo};

use crate::{Error, Result};

/// Chunk size of pass-through copies.
const COPY_CHUNK: u64 = 16 << 20;

/// One tensor of a source file: where its bytes lie, not the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    /// Index of its file in [`SourceFiles::paths`].
    pub file: usize,
    /// The tensor name.
    pub name: String,
    /// Element type as the header gives it.
    pub dtype: StDtype,
    /// Shape as the header gives it.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub start: u64,
    /// Data length in bytes.
    pub len: u64,
}

/// The MLX dtype of a safetensors dtype, `None` for the ones MLX has no type for (FP8,
/// FP6, FP4).
pub fn mlx_dtype(d: StDtype) -> Option<Dtype> {
    Some(match d {
        StDtype::BOOL => Dtype::Bool,
        StDtype::U8 => Dtype::Uint8,
        StDtype::I8 => Dtype::Int8,
        StDtype::U16 => Dtype::Uint16,
        StDtype::I16 => Dtype::Int16,
        StDtype::F16 => Dtype::Float16,
        StDtype::BF16 => Dtype::Bfloat16,
        StDtype::U32 => Dtype::Uint32,
        StDtype::I32 => Dtype::Int32,
        StDtype::F32 => Dtype::Float32,
        StDtype::U64 => Dtype::Uint64,
        StDtype::I64 => Dtype::Int64,
        StDtype::F64 => Dtype::Float64,
        StDtype::C64 => Dtype::Complex64,
        _ => return None,
    })
}

/// The safetensors dtype of an MLX dtype.
pub fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::Bool => StDtype::BOOL,
        Dtype::Uint8 => StDtype::U8,
        Dtype::Int8 => StDtype::I8,
        Dtype::Uint16 => StDtype::U16,
        Dtype::Int16 => StDtype::I16,
        Dtype::Float16 => StDtype::F16,
        Dtype::Bfloat16 => StDtype::BF16,
        Dtype::Uint32 => StDtype::U32,
        Dtype::Int32 => StDtype::I32,
        Dtype::Float32 => StDtype::F32,
        Dtype::Uint64 => StDtype::U64,
        Dtype::Int64 => StDtype::I64,
        Dtype::Float64 => StDtype::F64,
        Dtype::Complex64 => StDtype::C64,
    }
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::Safetensors { path: path.into(), message: message.into() }
}

/// The open weight files of a model directory and the tensors their headers list.
#[derive(Debug)]
pub struct SourceFiles {
    /// The files, in the order given.
    pub paths: Vec<PathBuf>,
    files: Vec<File>,
    /// Every tensor of every file, by name.
    pub tensors: BTreeMap<String, TensorRef>,
}

impl SourceFiles {
    /// Opens `paths` and reads their headers (not their data).
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable file; [`Error::Safetensors`] naming the file (and the
    /// tensor) for a file shorter than its header, a header that is not safetensors JSON, a
    /// tensor whose byte range does not match its shape and dtype, overlaps another, or ends
    /// past the end of the file; the same tensor name in two files.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut out = SourceFiles { paths: paths.to_vec(), files: Vec::new(), tensors: BTreeMap::new() };
        for (i, path) in paths.iter().enumerate() {
            let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
            for t in read_header(path, &mut f, i)? {
                if let Some(prev) = out.tensors.get(&t.name) {
                    return Err(bad(path, format!("tensor `{}` is also in {}", t.name, paths[prev.file].display())));
                }
                out.tensors.insert(t.name.clone(), t);
            }
            out.files.push(f);
        }
        Ok(out)
    }

    /// Reads the bytes of `t`.
    ///
    /// # Errors
    /// [`Error::Safetensors`] naming the file and tensor when the read fails (e.g. the file
    /// shrank since its header was read).
    pub fn read(&mut self, t: &TensorRef) -> Result<Vec<u8>> {
        let path = &self.paths[t.file];
        let f = &mut self.files[t.file];
        let mut buf = Vec::with_capacity(t.len as usize);
        let read = f.seek(SeekFrom::Start(t.start)).and_then(|_| Read::by_ref(f).take(t.len).read_to_end(&mut buf));
        match read {
            Ok(n) if n as u64 == t.len => Ok(buf),
            Ok(n) => Err(bad(
                path,
                format!(
                    "tensor `{}`: read {n} of {} bytes at {}: the file is shorter than its header says",
                    t.name, t.len, t.start
                ),
            )),
            Err(e) => Err(bad(path, format!("tensor `{}`: cannot read {} bytes at {}: {e}", t.name, t.len, t.start))),
        }
    }

    /// Copies the bytes of `t` into `out` at data offset `offset`, in chunks of 16 MiB.
    ///
    /// # Errors
    /// As [`SourceFiles::read`]; [`Error::Io`] naming the output file when writing fails.
    pub fn copy_to(&mut self, t: &TensorRef, out: &mut ShardFile, offset: u64) -> Result<()> {
        let path = self.paths[t.file].clone();
        let f = &mut self.files[t.file];
        let mut buf = vec![0u8; t.len.min(COPY_CHUNK) as usize];
        let mut done = 0u64;
        f.seek(SeekFrom::Start(t.start)).map_err(|e| Error::io(&path, e))?;
        while done < t.len {
            let n = (t.len - done).min(COPY_CHUNK) as usize;
            f.read_exact(&mut buf[..n]).map_err(|e| {
                bad(&path, format!("tensor `{}`: cannot read {} bytes at {}: {e}", t.name, n, t.start + done))
            })?;
            out.write_at(offset + done, &buf[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

/// The header of one open file as tensor references, read and checked by
/// [`mlx_core::io::st_header::read_header`] (every byte range against the shape, dtype,
/// file size and the other tensors).
fn read_header(path: &Path, f: &mut File, file: usize) -> Result<Vec<TensorRef>> {
    let entries = st_header::read_header(path, f).map_err(|e| match e {
        mlx_core::Error::File { path, message } => Error::Safetensors { path, message },
        e => bad(path, e.to_string()),
    })?;
    Ok(entries
        .into_iter()
        .map(|t| TensorRef { file, name: t.name, dtype: t.dtype, shape: t.shape, start: t.start, len: t.len })
        .collect())
}

/// One tensor planned for an output file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// The tensor name.
    pub name: String,
    /// Its dtype.
    pub dtype: StDtype,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl Planned {
    /// Bytes of data.
    pub fn nbytes(&self) -> u64 {
        (self.shape.iter().map(|&d| d as u64).product::<u64>() * self.dtype.bitsize() as u64).div_ceil(8)
    }
}

/// An output safetensors file whose header is written first (from the full plan) and whose
/// tensors are then written into their places, in any order.
#[derive(Debug)]
pub struct ShardFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    /// Name -> (data offset, length, written yet).
    slots: HashMap<String, (u64, u64, bool)>,
}

impl ShardFile {
    /// Creates `path` holding `tensors` (in this order) and the string `metadata`: writes the
    /// header (JSON by the `safetensors` crate, padded with spaces to a multiple of 8 bytes as
    /// that crate does) and sizes the file.
    ///
    /// # Errors
    /// [`Error::Io`] naming `path` when it cannot be created or written.
    pub fn create(path: &Path, tensors: &[Planned], metadata: &[(&str, &str)]) -> Result<Self> {
        let mut offset = 0usize;
        let mut infos = Vec::with_capacity(tensors.len());
        let mut slots = HashMap::with_capacity(tensors.len());
        for t in tensors {
            let n = t.nbytes() as usize;
            infos.push((
                t.name.clone(),
                TensorInfo { dtype: t.dtype, shape: t.shape.clone(), data_offsets: (offset, offset + n) },
            ));
            slots.insert(t.name.clone(), (offset as u64, n as u64, false));
            offset += n;
        }
        let meta: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let header =
            Metadata::new(Some(meta), infos).map_err(|e| bad(path, format!("cannot lay out the header: {e}")))?;
        let mut json = serde_json::to_vec(&header).map_err(|e| bad(path, format!("cannot write the header: {e}")))?;
        let pad = (8 - (json.len() + PREFIX as usize) % 8) % 8;
        json.extend(std::iter::repeat_n(b' ', pad));
        let data_start = PREFIX + json.len() as u64;
        let mut file = File::create(path).map_err(|e| Error::io(path, e))?;
        file.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|_| file.write_all(&json))
            .and_then(|_| file.set_len(data_start + offset as u64))
            .map_err(|e| Error::io(path, e))?;
        Ok(ShardFile { path: path.into(), file, data_start, slots })
    }

    /// The data offset of tensor `name` in this file.
    pub fn offset_of(&self, name: &str) -> Option<u64> {
        self.slots.get(name).map(|s| s.0)
    }

    /// Writes the whole data of `name`.
    ///
    /// # Errors
    /// [`Error::Tensor`] when `name` is not planned here or `data` has another length (a
    /// bug, reported rather than written); [`Error::Io`] when writing fails.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let Some(&(offset, len, _)) = self.slots.get(name) else {
            return Err(Error::Tensor {
                path: self.path.clone(),
                tensor: name.into(),
                message: "not planned for this file".into(),
            });
        };
        if data.len() as u64 != len {
            return Err(Error::Tensor {
                path: self.path.clone(),
                tensor: name.into(),
                message: format!("planned {len} bytes, produced {}", data.len()),
            });
        }
        self.write_at(offset, data)?;
        self.mark(name);
        Ok(())
    }

    /// Marks `name` as fully written (after [`SourceFiles::copy_to`]).
    pub fn mark(&mut self, name: &str) {
        if let Some(s) = self.slots.get_mut(name) {
            s.2 = true;
        }
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.file
            .seek(SeekFrom::Start(self.data_start + offset))
            .and_then(|_| self.file.write_all(data))
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Checks that every planned tensor was written and closes the file. (Like mlx-lm, it
    /// does not `fsync`: the rename into place protects against a failed or interrupted run,
    /// not against a power loss right after it.)
    ///
    /// # Errors
    /// [`Error::Tensor`] naming a tensor never written; [`Error::Io`] when flushing fails.
    pub fn finish(mut self) -> Result<()> {
        if let Some((name, _)) = self.slots.iter().find(|(_, s)| !s.2) {
            return Err(Error::Tensor {
                path: self.path.clone(),
                tensor: name.clone(),
                message: "planned but never written".into(),
            });
        }
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }
}
