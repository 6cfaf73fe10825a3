//! Tokenizer and chat template (in progress).
use crate::Result;

/// The tokenizer files of a model directory, as text, built from a GGUF file's metadata.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    /// `tokenizer.json` (HF `tokenizers` format).
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (special tokens, chat template, tokenizer class).
    pub tokenizer_config_json: String,
}

/// Builds `tokenizer.json` and `tokenizer_config.json` from a GGUF file's `tokenizer.ggml.*`
/// metadata.
///
/// # Errors
/// [`crate::Error::Unsupported`] until implemented.
pub fn tokenizer_files_from_gguf(gguf: &mlx_core::io::Gguf) -> Result<TokenizerFiles> {
    Err(crate::Error::Unsupported(format!("tokenizer from GGUF ({})", gguf.path.display())))
}
