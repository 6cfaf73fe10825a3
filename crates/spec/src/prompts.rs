//! Prompt sets for equality tests, benchmarks and acceptance A/B runs: JSON lines
//! `{"kind": "grounded" | "free", "source": "...", "prompt": "..."}`, as written by
//! `fixtures/prompts/make_prompts.py` (32 prompts from DeepSpec's eval sets: 16
//! input-grounded, whose answers copy from the prompt, and 16 free-form).
use std::path::Path;

use models::tokenizer::{ChatMessage, Tokenizer};

use crate::error::Context;
use crate::{Error, Result};

/// Whether a prompt's answer copies from the prompt (where n-gram lookup shines) or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptKind {
    /// Edit this code, rename a variable, repeat or correct this text.
    Grounded,
    /// Open-ended writing, reasoning, math.
    Free,
}

/// One prompt of a set.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Prompt {
    /// Grounded or free-form.
    pub kind: PromptKind,
    /// Where it came from (`"humaneval:4"`: data set and 0-based line).
    pub source: String,
    /// The user message.
    pub prompt: String,
}

impl Prompt {
    /// The token ids of this prompt as a single user turn through `tok`'s chat template
    /// (with the generation prompt), or the raw text with BOS when the tokenizer has no
    /// template.
    ///
    /// # Errors
    /// [`Error::Model`] when the template or the tokenizer fails.
    pub fn ids(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        let what = || format!("encoding prompt {}", self.source);
        if tok.chat_template().is_none() {
            return tok.encode(&self.prompt, true).context(what);
        }
        let text = tok.apply_chat_template(&[ChatMessage::user(self.prompt.clone())], true).context(what)?;
        tok.encode(&text, false).context(what)
    }
}

/// The domain of a prompt `source`: the data set before `:` (`"gsm8k:17"` -> `"gsm8k"`; a
/// source without `:` is its own domain). Tau per domain is reported over these.
pub fn domain(source: &str) -> &str {
    source.split(':').next().unwrap_or(source)
}

/// Reads a prompt set (JSON lines; blank lines skipped).
///
/// # Errors
/// [`Error::Invalid`] naming the file (and line) when it cannot be read or a line is not a
/// [`Prompt`].
pub fn load_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::Invalid(format!("{} line {}: {e}", path.display(), i + 1)))
        })
        .collect()
}
