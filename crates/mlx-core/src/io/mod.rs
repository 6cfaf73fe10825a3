//! Reading and writing tensor files: safetensors (read and write, with string metadata,
//! through MLX) and GGUF (read: tensors and typed metadata, by the Rust reader of [`gguf`]).
//! Quantized GGUF tensors Q4_0, Q4_1 and Q8_0 load as MLX affine triples `name`,
//! `name.scales`, `name.biases` with group size 32; the other GGUF block types are
//! dequantized to f32 (see [`Gguf::tensors`]).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_sys::ffi;

use crate::{Array, Error, Result};

pub mod gguf;
pub mod model_dir;
pub mod st_header;

pub use gguf::{Gguf, GgufValue};

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

/// Reads a safetensors file into evaluated arrays, after checking its header with
/// [`st_header::read_header`] (MLX's own reader trusts the header's offsets and truncates
/// dimensions to 32 bits).
///
/// # Errors
/// [`Error::File`] naming `path` when it is missing, shorter than the 8-byte header length
/// (the message gives its size), truncated, or its header is not valid safetensors (the
/// checks of [`st_header::read_header`], or MLX's reason kept in the message).
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Safetensors> {
    let path = path.as_ref();
    let p = check_file(path)?;
    let mut file = std::fs::File::open(path)
        .map_err(|e| Error::File { path: path.into(), message: format!("cannot open: {e}") })?;
    st_header::read_header(path, &mut file)?;
    drop(file);
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
/// [`Error::File`] naming `path` when its directory does not exist or is not a directory
/// (with the OS reason), when MLX cannot write the file (MLX's reason is kept, e.g. a
/// tensor that fails to evaluate), or when it cannot be renamed into place.
pub fn save_safetensors<'a>(
    path: impl AsRef<Path>,
    tensors: impl IntoIterator<Item = (&'a str, &'a Array)>,
    metadata: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<()> {
    let path = path.as_ref();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            let message = format!("cannot write it: {} is not a directory", dir.display());
            return Err(Error::File { path: path.into(), message });
        }
        Err(e) => {
            let message = format!("cannot write it into {}: {e}", dir.display());
            return Err(Error::File { path: path.into(), message });
        }
    }
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
    crate::settings::apply_process();
    if let Err(e) = ffi::save_safetensors(tmp_str, &m) {
        let _ = std::fs::remove_file(&tmp);
        // MLX's writer reports a short write without the OS's reason.
        let message = format!(
            "cannot write it: {} (a short write: the file system is full, a file-size limit was reached, or \
             the device failed)",
            e.what()
        );
        return Err(Error::File { path: path.into(), message });
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::File { path: path.into(), message: format!("cannot rename {} into place: {e}", tmp.display()) }
    })
}
