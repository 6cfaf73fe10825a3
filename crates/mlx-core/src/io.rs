//! Reading and writing tensor files: safetensors (read and write, with string metadata) and
//! GGUF (read: tensors and typed metadata). Quantized GGUF tensors (Q4_0, Q4_1, Q8_0) load
//! as MLX affine triples `name`, `name.scales`, `name.biases` with group size 32.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_sys::ffi;

use crate::{Array, Error, Result};

/// Tensors and metadata of one safetensors file.
#[derive(Debug, Clone)]
pub struct Safetensors {
    /// The file they were read from (for error messages).
    pub path: PathBuf,
    /// Tensors by name, already evaluated (a corrupt payload fails at load, not later).
    pub tensors: BTreeMap<String, Array>,
    /// The `__metadata__` string map (e.g. `{"format": "mlx"}`).
    pub metadata: BTreeMap<String, String>,
}

impl Safetensors {
    /// The tensor `name`.
    ///
    /// # Errors
    /// [`Error::Missing`] naming the file and the tensor.
    pub fn get(&self, name: &str) -> Result<&Array> {
        self.tensors.get(name).ok_or_else(|| Error::Missing {
            path: self.path.clone(),
            what: "tensor",
            name: name.into(),
        })
    }
}

fn check_file(path: &Path) -> Result<String> {
    if !path.is_file() {
        let message = if path.exists() { "not a regular file" } else { "no such file" };
        return Err(Error::File { path: path.into(), message: message.into() });
    }
    path.to_str()
        .map(str::to_owned)
        .ok_or_else(|| Error::File { path: path.into(), message: "path is not valid UTF-8".into() })
}

fn file_err(path: &Path, e: cxx::Exception) -> Error {
    Error::File { path: path.into(), message: e.what().to_string() }
}

/// Reads a safetensors file into evaluated arrays.
///
/// # Errors
/// [`Error::File`] naming `path` when it is missing, truncated, or its header is not valid
/// safetensors (MLX's reason is kept in the message).
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Safetensors> {
    let path = path.as_ref();
    let p = check_file(path)?;
    let m = ffi::load_safetensors(&p).map_err(|e| file_err(path, e))?;
    let mut tensors = BTreeMap::new();
    for k in ffi::map_keys(&m) {
        let a = crate::array::wrap("load_safetensors", ffi::map_get(&m, &k))?;
        tensors.insert(k, a);
    }
    let mut metadata = BTreeMap::new();
    for k in ffi::map_metadata_keys(&m) {
        let v = ffi::map_metadata_get(&m, &k).map_err(|e| file_err(path, e))?;
        metadata.insert(k, v);
    }
    Ok(Safetensors { path: path.into(), tensors, metadata })
}

/// Writes `tensors` (evaluating them) and `metadata` to `path` as safetensors. The file is
/// written beside `path` under a temporary name and renamed into place when complete, so
/// `path` is never left half written.
///
/// # Errors
/// [`Error::File`] when the directory is not writable; [`Error::Mlx`] when a tensor fails
/// to evaluate.
pub fn save_safetensors<'a>(
    path: impl AsRef<Path>,
    tensors: impl IntoIterator<Item = (&'a str, &'a Array)>,
    metadata: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<()> {
    let path = path.as_ref();
    let mut m = ffi::map_new();
    for (k, a) in tensors {
        ffi::map_insert(m.pin_mut(), k, a.raw());
    }
    for (k, v) in metadata {
        ffi::map_set_metadata(m.pin_mut(), k, v);
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("tensors");
    // MLX appends `.safetensors` to names without it, so the temporary name keeps the suffix.
    let tmp = path.with_file_name(format!(".{name}.tmp-{}.safetensors", std::process::id()));
    let tmp_str =
        tmp.to_str().ok_or_else(|| Error::File { path: path.into(), message: "path is not valid UTF-8".into() })?;
    if let Err(e) = ffi::save_safetensors(tmp_str, &m) {
        let _ = std::fs::remove_file(&tmp);
        return Err(file_err(path, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::File { path: path.into(), message: format!("cannot rename {} into place: {e}", tmp.display()) }
    })
}

/// One GGUF metadata value as MLX decodes it.
#[derive(Debug, Clone)]
pub enum GgufValue {
    /// A value type MLX does not decode.
    None,
    /// Numbers and booleans (a 0-d array for a scalar, 1-D for an array of numbers).
    Array(Array),
    /// A string (e.g. `general.architecture`, `tokenizer.chat_template`).
    String(String),
    /// An array of strings (e.g. `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    Strings(Vec<String>),
}

/// Tensors and metadata of one GGUF file.
#[derive(Debug, Clone)]
pub struct Gguf {
    /// The file they were read from.
    pub path: PathBuf,
    /// Tensors by name (evaluated). Q4_0/Q4_1/Q8_0 tensors appear as three entries:
    /// `X.weight` (uint32 packed), `X.scales`, `X.biases` (f16), affine, group size 32.
    pub tensors: BTreeMap<String, Array>,
    /// Metadata by key (`general.architecture`, `llama.block_count`, ...).
    pub metadata: BTreeMap<String, GgufValue>,
}

impl Gguf {
    /// Reads a GGUF file (format versions 1-3, via MLX's gguflib).
    ///
    /// # Errors
    /// [`Error::File`] naming `path` when it is missing or not a GGUF file, or holds a tensor
    /// type MLX cannot load (e.g. Q5_0).
    pub fn load(path: impl AsRef<Path>) -> Result<Gguf> {
        let path = path.as_ref();
        let p = check_file(path)?;
        let g = ffi::load_gguf(&p).map_err(|e| file_err(path, e))?;
        let mut tensors = BTreeMap::new();
        for k in ffi::gguf_tensor_names(&g) {
            tensors.insert(k.clone(), crate::array::wrap("load_gguf", ffi::gguf_tensor(&g, &k))?);
        }
        let mut metadata = BTreeMap::new();
        for k in ffi::gguf_metadata_keys(&g) {
            let kind = ffi::gguf_metadata_kind(&g, &k).map_err(|e| file_err(path, e))?;
            let v = match kind {
                1 => GgufValue::Array(crate::array::wrap("load_gguf", ffi::gguf_metadata_array(&g, &k))?),
                2 => GgufValue::String(ffi::gguf_metadata_string(&g, &k).map_err(|e| file_err(path, e))?),
                3 => GgufValue::Strings(ffi::gguf_metadata_strings(&g, &k).map_err(|e| file_err(path, e))?),
                _ => GgufValue::None,
            };
            metadata.insert(k, v);
        }
        Ok(Gguf { path: path.into(), tensors, metadata })
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

    /// A numeric scalar metadata value, as f64.
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
