//! Lossless speculative decoding for the `models` transformers: a draft source guesses the
//! next tokens cheaply, the target model scores `[pending] ++ drafts` in one forward pass,
//! and a sequential accept walk with the request's own sampler keeps exactly the tokens
//! plain decoding ([`models::generate::generate`]) would emit, rolling the KV cache back
//! over the rest.
//!
//! - [`DraftProvider`] / [`DraftSource`]: the seam between decoding and drafting
//!   ([`source`] documents the per-round protocol and the re-feed rule).
//! - [`speculative_generate`]: the executor, with [`SpecStats`] and [`SpecOptions`]
//!   (exact-match acceptance, or the Leviathan/Chen rule of [`rejection`] for sampling);
//!   [`run`] is the same executor for a server's requests ([`Request`]: a prompt-cache
//!   prefix and the drafter's [`DraftSnapshot`], cancellation, logprobs, prefill progress;
//!   [`Outcome`]: the trimmed cache to keep).
//! - [`providers`]: the one drafter factory, [`providers::DrafterSpec`] (none, n-gram,
//!   draft model, DSpark) parsed from flags or a word, defaults in one place, built into a
//!   [`DraftProvider`].
//! - [`suffix::SuffixProvider`]: suffix-automaton drafting over the request (and earlier
//!   requests), the default drafter, its length chosen by the cost-aware [`policy`].
//! - [`ngram::NgramProvider`]: prompt lookup (no weights).
//! - [`ab`]: the acceptance A/B of two drafters on one target.
//! - [`prompts`]: the prompt sets of the equality tests and benchmarks.
//! - [`two_model::TwoModelProvider`]: a small model with the same tokenizer drafts;
//!   [`two_model::check_tokenizers`] refuses a mismatched pair.
//! - [`dspark::DSparkProvider`]: a DeepSpec DSpark / DFlash drafter (`drafter` crate) that
//!   drafts a block per round from the target's tapped hidden states.
//!
//! ```no_run
//! use models::{GenerateParams, LoadOptions, Sampler, load_model};
//! use spec::{DraftProvider, ngram::NgramProvider, speculative_generate};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let target = load_model("model-dir".as_ref(), &LoadOptions::default())?;
//! let params = GenerateParams { max_tokens: 64, sampler: Sampler::default(), eos: vec![2] };
//! let provider = NgramProvider::default();
//! let mut source = provider.open(&target, &params.sampler)?;
//! let prompt = [1, 15, 27, 15, 27];
//! let stats = speculative_generate(&target, source.as_mut(), &prompt, &params, 10, |t| {
//!     print!("{t} ");
//!     true
//! })?;
//! eprintln!("tau {:.2}, {} target forwards", stats.tau, stats.target_forwards);
//! # Ok(())
//! # }
//! ```

pub mod ab;
pub mod batch;
pub mod dspark;
mod error;
mod executor;
pub mod ngram;
pub mod policy;
pub mod prompts;
pub mod providers;
pub mod rejection;
pub mod source;
mod stats;
pub mod suffix;
pub mod two_model;

pub use error::{Error, Result};
pub use executor::{
    Closing, Emitted, Finish, Outcome, Request, SpecOptions, TokenLogprobs, WalkEnd, WalkOutcome, accept_walk, run,
    speculative_generate, speculative_generate_with_cache,
};
pub use rejection::Acceptance;
pub use source::{DraftProvider, DraftSnapshot, DraftSource, NoDrafts};
pub use stats::{RoundProfile, SpecStats};
