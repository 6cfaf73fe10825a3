//! The error type of the `models` crate.
use std::path::{Path, PathBuf};

/// Everything that can go wrong while loading, importing or running a model. Every variant
/// names the file, tensor or field involved and what was expected versus found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An MLX operation or tensor file failed (see [`mlx_core::Error`]).
    #[error(transparent)]
    Mlx(#[from] mlx_core::Error),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file is malformed or a field has the wrong type.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// serde's message (it names the field and line).
        message: String,
    },
    /// A configuration value is missing or out of range.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What was expected and found.
        message: String,
    },
    /// A weight is missing or has the wrong shape or dtype.
    #[error("{path}: tensor `{name}`: {message}")]
    Weight {
        /// The model directory or file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What was expected and found.
        message: String,
    },
    /// Tensors in the weight files that no module of the architecture took and that are not
    /// on the family's ignore list (usually a layout mismatch: a key prefix, another model
    /// type); see [`crate::loader::Loader::finish`].
    #[error("{path}: tensors not used by the model: {names:?}")]
    Unused {
        /// The model directory.
        path: PathBuf,
        /// The leftover tensor names.
        names: Vec<String>,
    },
    /// The tokenizer or chat template could not be loaded, built or applied.
    #[error("{path}: {message}")]
    Tokenizer {
        /// The tokenizer file, template file or model directory.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// A GGUF file cannot be imported.
    #[error("{path}: {message}")]
    Gguf {
        /// The GGUF file (or the first part of a split file).
        path: PathBuf,
        /// What was wrong (tensor name, type, offset, ...).
        message: String,
    },
    /// Something this crate does not implement (architecture, tensor type, option).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    /// The same error with every path it names passed through `f` (an import names the
    /// destination, not its staging directory: [`mlx_core::io::model_dir::StagedDir::shown`]).
    pub fn with_paths(self, f: &dyn Fn(&Path) -> PathBuf) -> Self {
        match self {
            Error::Mlx(e) => Error::Mlx(e.with_paths(f)),
            Error::Io { path, source } => Error::Io { path: f(&path), source },
            Error::Json { path, message } => Error::Json { path: f(&path), message },
            Error::Config { path, field, message } => Error::Config { path: f(&path), field, message },
            Error::Weight { path, name, message } => Error::Weight { path: f(&path), name, message },
            Error::Unused { path, names } => Error::Unused { path: f(&path), names },
            Error::Tokenizer { path, message } => Error::Tokenizer { path: f(&path), message },
            Error::Gguf { path, message } => Error::Gguf { path: f(&path), message },
            Error::Unsupported(message) => Error::Unsupported(message),
        }
    }
}
