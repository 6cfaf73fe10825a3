//! The error type of the `drafter` crate.
use std::path::{Path, PathBuf};

/// Everything that can go wrong while loading or running a DSpark drafter. Every variant
/// names the file, tensor, field or model involved and what was expected versus found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading weights or a layer failed (a missing or misshapen tensor, an unreadable file,
    /// an inconsistent quantization entry; see [`models::Error`]).
    #[error(transparent)]
    Model(#[from] models::Error),
    /// An MLX operation failed.
    #[error(transparent)]
    Mlx(#[from] mlx_core::Error),
    /// A `config.json` field is missing, malformed or out of range.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What was expected and found.
        message: String,
    },
    /// The checkpoint uses something this crate does not implement (an unknown
    /// architecture, a gated/RNN Markov head, an MoE block, an activation).
    #[error("{path}: unsupported: {message}")]
    Unsupported {
        /// The drafter directory or config file.
        path: PathBuf,
        /// What is unsupported, and what is.
        message: String,
    },
    /// Tensors in the weight files that the architecture does not use (usually a layout
    /// mismatch: a key prefix, a different head type).
    #[error("{path}: tensors not used by the drafter: {names:?}")]
    Unused {
        /// The drafter directory.
        path: PathBuf,
        /// The leftover tensor names.
        names: Vec<String>,
    },
    /// The drafter was trained for another target: tap layers, hidden size or vocabulary
    /// do not fit.
    #[error("drafter `{drafter}` does not fit target `{target}`: {message}")]
    Incompatible {
        /// The drafter (its directory).
        drafter: String,
        /// The target (its name or directory).
        target: String,
        /// The mismatching field with the drafter's and the target's values.
        message: String,
    },
    /// A call was made with arguments that do not fit the drafter (feature width, empty
    /// input).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The generic quantizer failed (see [`crate::quant::quantize_drafter_dir`]).
    #[error(transparent)]
    Quantize(Box<quantize::Error>),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The same error with every path it names passed through `f` (`quantize-drafter` names
    /// the destination, not its staging directory:
    /// [`mlx_core::io::model_dir::StagedDir::shown`]).
    pub fn with_paths(self, f: &dyn Fn(&Path) -> PathBuf) -> Self {
        match self {
            Error::Model(e) => Error::Model(e.with_paths(f)),
            Error::Mlx(e) => Error::Mlx(e.with_paths(f)),
            Error::Config { path, field, message } => Error::Config { path: f(&path), field, message },
            Error::Unsupported { path, message } => Error::Unsupported { path: f(&path), message },
            Error::Unused { path, names } => Error::Unused { path: f(&path), names },
            Error::Quantize(e) => Error::Quantize(Box::new(e.with_paths(f))),
            other @ (Error::Incompatible { .. } | Error::Invalid(_)) => other,
        }
    }
}

impl From<quantize::Error> for Error {
    fn from(e: quantize::Error) -> Self {
        Error::Quantize(Box::new(e))
    }
}
