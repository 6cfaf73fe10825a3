//! Target language models on MLX for speculative decoding: configuration, weight loading
//! in the mlx-lm directory layout (dense or affine-quantized), KV caches with exact
//! rollback (sliding-window caches included), the llama / qwen2 / qwen3 / gemma3 / gemma4 forward passes with hidden-state taps, the
//! tokenizer and chat template, and the import of GGUF files into that layout.

pub mod blocks;
pub mod cache;
pub mod config;
pub mod default_model;
mod error;
pub mod fetch;
pub mod gemma;
pub mod generate;
pub mod gguf_import;
pub mod layers;
pub mod loader;
mod model;
pub mod sampling;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use cache::{KvCache, LayerCache, ModelCache, RotatingKvCache};
pub use config::{ModelConfig, QuantizationConfig};
pub use error::{Error, Result};
pub use generate::{GenerateParams, GenerationStats, PrefillProgress, generate, generate_with_progress};
pub use model::{LoadOptions, load_model};
pub use sampling::Sampler;
pub use transformer::{BatchPart, Family, ForwardOutput, Transformer};
