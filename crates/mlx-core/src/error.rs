//! The error type of this crate.
use std::path::{Path, PathBuf};

use crate::Dtype;

/// Everything that can go wrong in `mlx-core`. Every variant names the operation (or file)
/// and what was expected versus found; none of them is raised by a panic or an abort.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX rejected an operation (C++ exception caught at the FFI boundary). `message` is
    /// MLX's own text, which names the shapes involved, e.g. `[matmul] Last dimension of
    /// first input with shape (2,3) must match second to last dimension of second input
    /// with shape (4,2).`
    #[error("{op}: {message}")]
    Mlx {
        /// The `mlx-core` operation that failed (`matmul`, `reshape`, `eval`, ...).
        op: &'static str,
        /// MLX's message.
        message: String,
    },
    /// Host data does not fit the requested shape.
    #[error("{op}: shape {shape:?} holds {expected} elements but {found} were given")]
    Shape {
        /// The operation.
        op: &'static str,
        /// The requested shape.
        shape: Vec<i32>,
        /// Elements the shape holds.
        expected: usize,
        /// Elements supplied.
        found: usize,
    },
    /// An array has a different element type than the operation needs.
    #[error("{op}: expected dtype {expected}, found {found}")]
    Dtype {
        /// The operation.
        op: &'static str,
        /// The dtype the operation needs.
        expected: Dtype,
        /// The array's dtype.
        found: Dtype,
    },
    /// An argument is outside what the operation accepts (e.g. `bits = 7`).
    #[error("{op}: {message}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        message: String,
    },
    /// A file could not be read or written (missing, truncated, malformed).
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        message: String,
    },
    /// A tensor or metadata key is absent from a loaded file.
    #[error("{path}: no {what} named `{name}`")]
    Missing {
        /// The file it was looked up in.
        path: PathBuf,
        /// `tensor` or `metadata key`.
        what: &'static str,
        /// The name looked up.
        name: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn mlx(op: &'static str, e: cxx::Exception) -> Self {
        Error::Mlx { op, message: e.what().to_string() }
    }

    /// The same error with every path it names passed through `f` (e.g.
    /// [`crate::io::model_dir::StagedDir::shown`], which names the destination instead of its staging
    /// directory).
    pub fn with_paths(self, f: &dyn Fn(&Path) -> PathBuf) -> Self {
        match self {
            Error::File { path, message } => Error::File { path: f(&path), message },
            Error::Missing { path, what, name } => Error::Missing { path: f(&path), what, name },
            other => other,
        }
    }
}
