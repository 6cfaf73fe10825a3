//! GGUF files (llama.cpp's format, versions 2 and 3), read in Rust: no C parser is involved,
//! so a corrupt or hostile file is an [`Error`], never a crash.
//!
//! - [`Gguf::load`] reads a whole file into MLX arrays, in the conventions of MLX's own
//!   `mlx.core.load` for GGUF (affine triples for Q4_0/Q4_1/Q8_0) but with every block type
//!   of [`GgmlType::SUPPORTED`] decoded exactly as gguf-py does.
//! - [`GgufFile`] ([`reader`]) parses and validates the header of one file or of a file
//!   split byte-wise into parts, and reads tensor bytes on demand; [`dequantize`] and
//!   [`to_affine`] ([`blocks`]) decode GGML blocks. Importers that need control over memory
//!   or layout (e.g. the `models` crate's GGUF import) use these directly.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::f16;

use crate::{Array, Dtype, Error, Result};

pub mod blocks;
pub mod reader;

pub use blocks::{Affine, GgmlType, affine_compatible, dequantize, to_affine};
pub use reader::{DEFAULT_ALIGNMENT, GgufFile, MAGIC, MetaValue, TensorInfo, ValueType};

/// One GGUF metadata value in the form MLX's GGUF loader gives it.
#[derive(Debug, Clone)]
pub enum GgufValue {
    /// A value this form has no place for: an array of arrays.
    None,
    /// Numbers and booleans: a 0-d array for a scalar, a 1-D array for an array of numbers,
    /// of the stored type (`uint8` ... `int64`, `float32`, `float64`, `bool`; see
    /// [`ValueType::dtype`]).
    Array(Array),
    /// A string (e.g. `general.architecture`, `tokenizer.chat_template`); invalid UTF-8 is
    /// replaced with U+FFFD.
    String(String),
    /// An array of strings (e.g. `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    Strings(Vec<String>),
}

/// Tensors and metadata of one GGUF file.
#[derive(Debug, Clone)]
pub struct Gguf {
    /// The file they were read from.
    pub path: PathBuf,
    /// Tensors by name, evaluated, with row-major shapes (GGUF's dimensions reversed: a
    /// GGUF `[ne0 = K, ne1 = N]` matrix is `[N, K]`):
    /// - F32, F16 and BF16 tensors as `float32`, `float16`, `bfloat16`;
    /// - Q4_0, Q4_1 and Q8_0 tensors as three entries, MLX's affine layout with group size
    ///   32, exactly as MLX's loader produced them: `X.weight` (`uint32`, the last
    ///   dimension `K * bits / 32`, bits 4/4/8), `X.scales` and `X.biases` (`float16`, the
    ///   last dimension `K / 32`); `w = scales * q + biases`. For a name `X` without the
    ///   `.weight` suffix the entries are `X`, `X.scales`, `X.biases`;
    /// - every other type of [`GgmlType::SUPPORTED`] (F64, Q5_0, Q5_1, Q2_K ... Q6_K)
    ///   dequantized to `float32`, bit for bit as gguf-py's `gguf.quants.dequantize`.
    pub tensors: BTreeMap<String, Array>,
    /// Metadata by key (`general.architecture`, `llama.block_count`, ...).
    pub metadata: BTreeMap<String, GgufValue>,
}

impl Gguf {
    /// Reads a GGUF file (format versions 2 and 3, little-endian): every tensor, converted
    /// as described at [`Gguf::tensors`], and every metadata value ([`MetaValue::to_mlx`]).
    ///
    /// # Errors
    /// [`Error::File`] naming `path` when it is missing or not a regular file, not a GGUF
    /// file, truncated or malformed (every check of [`GgufFile::open`]), or holds a tensor
    /// of a type outside [`GgmlType::SUPPORTED`] (IQ*, TQ*, I8 ... I64, ...), a dimension
    /// over `i32::MAX`, or two tensors that map to the same name; [`Error::Mlx`] when MLX
    /// cannot build an array.
    pub fn load(path: impl AsRef<Path>) -> Result<Gguf> {
        let g = GgufFile::open(&[path.as_ref().to_path_buf()])?;
        Gguf::from_file(&g)
    }

    /// Reads every tensor and metadata value of an opened [`GgufFile`] (also a split one),
    /// as [`Gguf::load`] does. `path` is the first part.
    ///
    /// # Errors
    /// As [`Gguf::load`].
    pub fn from_file(g: &GgufFile) -> Result<Gguf> {
        let mut gguf = g.to_mlx()?;
        for t in &g.tensors {
            for (name, a) in tensor_arrays(g, t)? {
                if gguf.tensors.contains_key(&name) {
                    return Err(tensor_err(g, t, format!("a second tensor is named `{name}`")));
                }
                gguf.tensors.insert(name, a);
            }
        }
        Ok(gguf)
    }

    /// The tensor `name`.
    ///
    /// # Errors
    /// [`Error::Missing`] naming the file and the tensor.
    pub fn tensor(&self, name: &str) -> Result<&Array> {
        self.tensors.get(name).ok_or_else(|| Error::Missing {
            path: self.path.clone(),
            what: "tensor",
            name: name.into(),
        })
    }

    fn meta(&self, key: &str) -> Result<&GgufValue> {
        self.metadata.get(key).ok_or_else(|| Error::Missing {
            path: self.path.clone(),
            what: "metadata key",
            name: key.into(),
        })
    }

    fn wrong_kind(&self, key: &str, want: &str) -> Error {
        Error::File { path: self.path.clone(), message: format!("metadata `{key}` is not {want}") }
    }

    /// A string metadata value.
    ///
    /// # Errors
    /// [`Error::Missing`] when absent; [`Error::File`] when it is not a string.
    pub fn string(&self, key: &str) -> Result<&str> {
        match self.meta(key)? {
            GgufValue::String(s) => Ok(s),
            _ => Err(self.wrong_kind(key, "a string")),
        }
    }

    /// A string-array metadata value.
    ///
    /// # Errors
    /// [`Error::Missing`] when absent; [`Error::File`] when it is not a string array.
    pub fn strings(&self, key: &str) -> Result<&[String]> {
        match self.meta(key)? {
            GgufValue::Strings(s) => Ok(s),
            _ => Err(self.wrong_kind(key, "a string array")),
        }
    }

    /// A numeric scalar metadata value (any integer, float or bool type), as f64.
    ///
    /// # Errors
    /// [`Error::Missing`] when absent; [`Error::File`] when it is not a single number.
    pub fn number(&self, key: &str) -> Result<f64> {
        match self.meta(key)? {
            GgufValue::Array(a) if a.size() == 1 => a.item(),
            _ => Err(self.wrong_kind(key, "a number")),
        }
    }
}

fn tensor_err(g: &GgufFile, t: &TensorInfo, message: String) -> Error {
    Error::File {
        path: g.path_at(t.offset).into(),
        message: format!("tensor `{}` ({}, shape {:?}): {message}", t.name, t.ty, t.shape),
    }
}

/// The `(name, array)` entries of one tensor (three for an affine triple).
fn tensor_arrays(g: &GgufFile, t: &TensorInfo) -> Result<Vec<(String, Array)>> {
    let err = |m: String| tensor_err(g, t, m);
    if !t.ty.is_supported() {
        let supported: Vec<String> = GgmlType::SUPPORTED.iter().map(|t| t.name()).collect();
        return Err(err(format!("tensor type {} is not supported (supported: {})", t.ty, supported.join(", "))));
    }
    let shape = t
        .shape
        .iter()
        .map(|&d| i32::try_from(d))
        .collect::<std::result::Result<Vec<i32>, _>>()
        .map_err(|_| err("a dimension is larger than i32::MAX".into()))?;
    let raw = g.read(t)?;
    let name = t.name.clone();
    let array = match t.ty {
        GgmlType::F32 => Array::from_bytes(&raw, &shape, Dtype::Float32)?,
        GgmlType::F16 => Array::from_bytes(&raw, &shape, Dtype::Float16)?,
        GgmlType::BF16 => Array::from_bytes(&raw, &shape, Dtype::Bfloat16)?,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
            let (lead, cols) = shape.split_at(shape.len().saturating_sub(1));
            let cols = cols.first().copied().unwrap_or(1) as usize;
            let rows = lead
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d as usize))
                .ok_or_else(|| err("too many elements".into()))?;
            let a = to_affine(t.ty, &raw, rows, cols).map_err(|e| err(e.to_string()))?.expect("affine-compatible");
            drop(raw);
            let dims = |last: usize| {
                let mut s = shape.clone();
                if let Some(l) = s.last_mut() {
                    *l = last as i32;
                }
                s
            };
            let gshape = dims(cols / a.group_size as usize);
            let half = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<f16>>();
            let base = name.strip_suffix(".weight").unwrap_or(&name);
            return Ok(vec![
                (format!("{base}.biases"), Array::from_slice(&half(&a.biases), &gshape)?),
                (format!("{base}.scales"), Array::from_slice(&half(&a.scales), &gshape)?),
                (name.clone(), Array::from_slice(&a.weight, &dims(cols * a.bits as usize / 32))?),
            ]);
        }
        ty => {
            let v = dequantize(ty, &raw).map_err(|e| err(e.to_string()))?;
            drop(raw);
            Array::from_slice(&v, &shape)?
        }
    };
    Ok(vec![(name, array)])
}
