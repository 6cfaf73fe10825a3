//! Target language models on MLX for speculative decoding: configuration, weight loading
//! in the mlx-lm directory layout (dense or affine-quantized), KV caches with exact
//! rollback, the llama / qwen2 / qwen3 forward passes with hidden-state taps, the
//! tokenizer and chat template, and the import of GGUF files into that layout.

mod error;
pub mod gguf_import;
pub mod tokenizer;

pub use error::{Error, Result};
