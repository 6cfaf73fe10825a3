//! The error type of the `spec` crate.

/// Everything that can go wrong in speculative decoding. Model and MLX failures carry the
/// step that failed (`"target forward over the verify window"`, ...) as context.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `models` call failed (forward pass, prefill, sampling, tokenizer).
    #[error("{context}: {source}")]
    Model {
        /// What the executor or source was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: models::Error,
    },
    /// An MLX array operation failed.
    #[error("{context}: {source}")]
    Mlx {
        /// What the executor or source was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: mlx_core::Error,
    },
    /// A DSpark drafter call failed (forward pass, malformed taps).
    #[error("{context}: {source}")]
    Drafter {
        /// What the source was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: drafter::Error,
    },
    /// A draft model cannot draft for a target (different vocabulary or special tokens).
    #[error("draft model `{draft}` cannot draft for target model `{target}`: {message}")]
    Incompatible {
        /// The draft model's name (usually its directory).
        draft: String,
        /// The target model's name.
        target: String,
        /// What differs, with both values.
        message: String,
    },
    /// A draft source broke the [`crate::DraftSource`] contract (more than `n` drafts, an
    /// empty feed, commit counts that do not match the last draft) or its own bookkeeping
    /// invariant (its history no longer equals prompt + emitted tokens). Always a bug.
    #[error("draft source `{source_name}`: {message}")]
    Contract {
        /// [`crate::DraftSource::name`].
        source_name: String,
        /// What was violated, with the numbers.
        message: String,
    },
    /// A batched target forward failed; every request in it fails with its message
    /// ([`crate::batch::Batch::step`]).
    #[error("the batched target forward failed: {0}")]
    Batch(String),
    /// An argument is out of range (empty prompt, `ngram_min > ngram_max`, a non-empty cache).
    #[error("invalid argument: {0}")]
    Invalid(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches context to `models` and `mlx-core` results.
pub(crate) trait Context<T> {
    /// Wraps the error with `what()` as its context.
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, models::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Model { context: what(), source })
    }
}

impl<T> Context<T> for std::result::Result<T, mlx_core::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Mlx { context: what(), source })
    }
}

impl<T> Context<T> for std::result::Result<T, drafter::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Drafter { context: what(), source })
    }
}
