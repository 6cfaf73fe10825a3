//! The error type of the `train` crate.
use std::path::PathBuf;

/// Everything that can go wrong in training: every variant names the parameter, file or
/// setting and what was expected versus found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An MLX operation failed (mlx-core's error, with MLX's message).
    #[error(transparent)]
    Mlx(#[from] mlx_core::Error),
    /// The target failed to load or run.
    #[error(transparent)]
    Model(#[from] models::Error),
    /// Speculative generation of the training data failed (a draft source, a batched round).
    #[error(transparent)]
    Spec(#[from] spec::Error),
    /// The drafter failed to build or run (a bad checkpoint, a malformed training sequence).
    #[error(transparent)]
    Drafter(#[from] drafter::Error),
    /// A hyper-parameter is out of range (`lr`, betas, `total_steps`, ...).
    #[error("{setting}: {message}")]
    Config {
        /// The setting.
        setting: &'static str,
        /// What was expected and found.
        message: String,
    },
    /// Gradients or parameters that do not match the optimizer's parameters (count, name,
    /// shape or dtype).
    #[error("parameter `{name}`: {message}")]
    Parameter {
        /// The parameter's name (or its index, when the count is wrong).
        name: String,
        /// What was expected and found.
        message: String,
    },
    /// An optimizer-state file that is missing a tensor, has a bad metadata field, or belongs
    /// to other parameters.
    #[error("{path}: {message}")]
    State {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
