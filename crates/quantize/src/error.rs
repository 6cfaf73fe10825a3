//! The error type of the `quantize` crate.
use std::path::{Path, PathBuf};

/// Everything that can go wrong while quantizing a model directory. Every variant names the
/// file (and the tensor or field, where there is one) and says what was expected versus
/// found. When [`crate::quantize_model_dir`] returns one of these, nothing has been left at
/// the destination.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An MLX operation failed (quantize, dequantize, a cast, evaluation).
    #[error("{path}: tensor `{tensor}`: {source}")]
    Mlx {
        /// The source file the tensor came from.
        path: PathBuf,
        /// The tensor (or module) being converted.
        tensor: String,
        /// mlx-core's error, with MLX's own message.
        source: mlx_core::Error,
    },
    /// A file or directory could not be read, created, written or renamed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` or `model.safetensors.index.json` is missing, not JSON, or has a field
    /// of the wrong form.
    #[error("{path}: {message}")]
    Config {
        /// The JSON file (or the directory, when it is missing).
        path: PathBuf,
        /// What was wrong (the field is named).
        message: String,
    },
    /// A safetensors file is malformed: truncated, a header that is not valid safetensors
    /// JSON, offsets that overlap or point past the end of the file.
    #[error("{path}: {message}")]
    Safetensors {
        /// The weight file.
        path: PathBuf,
        /// What was wrong (the tensor is named when one is at fault).
        message: String,
    },
    /// A tensor cannot be converted: an unsupported dtype, a quantized module without its
    /// scales/biases or config entry, shapes that disagree with the config.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        /// The weight file holding it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Expected versus found.
        message: String,
    },
    /// The options are not usable: bits / group size / mode MLX's affine quantization
    /// refuses, a source already quantized when the caller does not allow that.
    #[error("{0}")]
    Options(String),
    /// The destination exists (and `force` is off) or cannot be written.
    #[error("{path}: {message}")]
    Destination {
        /// The destination directory.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    /// The same error with every path it names passed through `f` (the quantizer names the
    /// destination, not its staging directory: [`mlx_core::io::model_dir::StagedDir::shown`]).
    pub fn with_paths(self, f: &dyn Fn(&Path) -> PathBuf) -> Self {
        match self {
            Error::Mlx { path, tensor, source } => Error::Mlx { path: f(&path), tensor, source: source.with_paths(f) },
            Error::Io { path, source } => Error::Io { path: f(&path), source },
            Error::Config { path, message } => Error::Config { path: f(&path), message },
            Error::Safetensors { path, message } => Error::Safetensors { path: f(&path), message },
            Error::Tensor { path, tensor, message } => Error::Tensor { path: f(&path), tensor, message },
            Error::Destination { path, message } => Error::Destination { path: f(&path), message },
            Error::Options(message) => Error::Options(message),
        }
    }

    /// A file failure of `mlx_core::io` ([`mlx_core::Error::File`]) as an [`Error::Io`]
    /// naming the file.
    pub(crate) fn file(e: mlx_core::Error) -> Self {
        match e {
            mlx_core::Error::File { path, message } => Error::io(path, std::io::Error::other(message)),
            other => Error::io(PathBuf::new(), std::io::Error::other(other.to_string())),
        }
    }
}
