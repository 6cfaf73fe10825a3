//! Loading the tensors of a model directory: `model.safetensors`, or the shards listed in
//! `model.safetensors.index.json`, or every `model*.safetensors` file (mlx-lm's rule).
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use mlx_core::{Array, io::load_safetensors};
use serde_json::Value;

use crate::{Error, Result};

/// All tensors of a model directory by name. Tensors are taken out as the model is built,
/// so [`Weights::unused`] can report leftovers.
#[derive(Debug)]
pub struct Weights {
    dir: PathBuf,
    tensors: BTreeMap<String, Array>,
}

impl Weights {
    /// Reads every weight file of `dir`.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Json`] for an unreadable index; [`Error::Weight`] when the
    /// index names a missing shard or no weight file exists; [`Error::Mlx`] for a corrupt
    /// safetensors file (the message names it).
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_files(dir, &weight_files(dir)?)
    }

    /// Reads the given safetensors `files` (of the model directory `dir`, which error
    /// messages name); a later file's tensor replaces an earlier one of the same name.
    ///
    /// # Errors
    /// [`Error::Mlx`] for a missing or corrupt file (the message names it).
    pub fn load_files(dir: &Path, files: &[PathBuf]) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        for file in files {
            let st = load_safetensors(file)?;
            tensors.extend(st.tensors);
        }
        Ok(Weights { dir: dir.into(), tensors })
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes and returns `name`.
    ///
    /// # Errors
    /// [`Error::Weight`] naming the directory and the tensor when it is absent.
    pub fn take(&mut self, name: &str) -> Result<Array> {
        self.tensors.remove(name).ok_or_else(|| Error::Weight {
            path: self.dir.clone(),
            name: name.into(),
            message: "missing from the weight files".into(),
        })
    }

    /// Removes and returns `name` if present.
    pub fn take_opt(&mut self, name: &str) -> Option<Array> {
        self.tensors.remove(name)
    }

    /// Removes and returns `name`, checking its shape.
    ///
    /// # Errors
    /// [`Error::Weight`] when absent or when the shape differs (both shapes named).
    pub fn take_shaped(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let a = self.take(name)?;
        self.check_shape(name, &a, shape)?;
        Ok(a)
    }

    /// Checks that `a` (the tensor `name`) has `shape`.
    ///
    /// # Errors
    /// [`Error::Weight`] naming both shapes.
    pub fn check_shape(&self, name: &str, a: &Array, shape: &[i32]) -> Result<()> {
        if a.shape() != shape {
            return Err(Error::Weight {
                path: self.dir.clone(),
                name: name.into(),
                message: format!("expected shape {shape:?}, found {:?}", a.shape()),
            });
        }
        Ok(())
    }

    /// The directory the weights came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Names not taken by the model (e.g. unused rotary buffers).
    pub fn unused(&self) -> Vec<&str> {
        self.tensors.keys().map(String::as_str).collect()
    }
}

/// The weight files of `dir`, following mlx-lm: the index's shard list when
/// `model.safetensors.index.json` exists, else every `model*.safetensors` file (mlx-lm
/// `load_model`'s glob, so other files beside the weights, e.g. goldens, are not read).
///
/// # Errors
/// [`Error::Io`] when the directory has no weight file; [`Error::Json`] naming the index when
/// it is malformed or lists a missing file.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| Error::Json { path: index.clone(), message: e.to_string() })?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::Json { path: index.clone(), message: "no `weight_map` object".into() })?;
        let shards: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        let files: Vec<PathBuf> = shards.into_iter().map(|s| dir.join(s)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(Error::Json {
                path: index,
                message: format!("the weight file {} listed in `weight_map` does not exist", missing.display()),
            });
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model*.safetensors weight files in the model directory",
            ),
        ));
    }
    Ok(files)
}
