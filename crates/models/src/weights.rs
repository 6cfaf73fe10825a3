//! Loading the tensors of a model directory: the shards listed in
//! `model.safetensors.index.json`, else the `model*.safetensors` files (mlx-lm's rule).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_core::{Array, io::load_safetensors};

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
    /// [`Error::Mlx`] naming the index or `dir` as [`weight_files`] does, or a corrupt
    /// safetensors file.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_files(dir, &weight_files(dir)?)
    }

    /// Reads the given safetensors `files` (of the model directory `dir`, which error
    /// messages name).
    ///
    /// # Errors
    /// [`Error::Mlx`] for a missing or corrupt file (the message names it);
    /// [`Error::Weight`] naming a tensor that two files both hold.
    pub fn load_files(dir: &Path, files: &[PathBuf]) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        for file in files {
            for (name, t) in load_safetensors(file)?.tensors {
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(Error::Weight {
                        path: dir.into(),
                        name,
                        message: format!("stored twice: again in {}", file.display()),
                    });
                }
            }
        }
        Ok(Weights { dir: dir.into(), tensors })
    }

    /// Tensors already in memory (e.g. a model's parameters traced by
    /// [`mlx_core::autograd`]), with `dir` the directory error messages name.
    pub fn from_tensors(dir: &Path, tensors: BTreeMap<String, Array>) -> Self {
        Weights { dir: dir.into(), tensors }
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, if present (not taken).
    pub fn get(&self, name: &str) -> Option<&Array> {
        self.tensors.get(name)
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
                message: format!("expected shape {shape:?} (from config.json's sizes), found {:?}", a.shape()),
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

/// The weight files of `dir`, following mlx-lm ([`mlx_core::io::model_dir::weight_files`]):
/// the index's shard list when `model.safetensors.index.json` exists, else the
/// `model*.safetensors` files (other `*.safetensors` files beside the model are not read).
///
/// # Errors
/// [`Error::Mlx`] ([`mlx_core::Error::File`]) naming the index when it is unreadable,
/// malformed or lists a missing file, or naming `dir` when it holds no weight file.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(mlx_core::io::model_dir::weight_files(dir)?)
}
