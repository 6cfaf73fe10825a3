//! Tokenizer and chat template.
//!
//! - [`Tokenizer`]: a model directory's `tokenizer.json` (HF `tokenizers`), its special tokens,
//!   end-of-sequence ids and chat template (rendered with minijinja the way transformers renders
//!   it with jinja2), with a [`StreamDecoder`] for generation.
//! - [`tokenizer_files_from_gguf`]: `tokenizer.json` + `tokenizer_config.json` built from a GGUF
//!   file's `tokenizer.ggml.*` metadata (byte-level BPE: SmolLM2, Qwen2.5, Llama 3).
//!
//! Token ids are `u32` everywhere; text is UTF-8 `String`s.
use std::path::{Path, PathBuf};

use crate::{Error, Result};

mod chat;
mod gguf;

pub use chat::RENDER_FUEL;
pub use gguf::{SUPPORTED_PRE, tokenizer_files_from_gguf};

/// A [`Error::Tokenizer`] naming `path`.
pub(crate) fn tok_err(path: impl Into<PathBuf>, message: impl Into<String>) -> Error {
    Error::Tokenizer { path: path.into(), message: message.into() }
}

/// Reads a JSON file; `Ok(None)` when it does not exist.
pub(crate) fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(tok_err(path, format!("cannot read: {e}"))),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| tok_err(path, format!("malformed JSON: {e}")))
}

/// The tokenizer files of a model directory, as text, built from a GGUF file's metadata.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    /// `tokenizer.json` (HF `tokenizers` format).
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (special tokens, chat template, tokenizer class).
    pub tokenizer_config_json: String,
}

impl TokenizerFiles {
    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (which must exist),
    /// replacing files of those names.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file that could not be written.
    pub fn write_to(&self, dir: impl AsRef<Path>) -> Result<()> {
        for (name, text) in
            [("tokenizer.json", &self.tokenizer_json), ("tokenizer_config.json", &self.tokenizer_config_json)]
        {
            let path = dir.as_ref().join(name);
            std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        }
        Ok(())
    }
}

/// One chat message: `role` is `"system"`, `"user"`, `"assistant"` (or whatever the template
/// knows), `content` its text. Templates see it as `{"role": ..., "content": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// How `encode(.., add_special_tokens = true)` adds BOS/EOS, following transformers 5: when
/// `tokenizer_config.json` sets `add_bos_token` or `add_eos_token`, or tokenizer.json has no
/// post-processor, transformers replaces the post-processor with `[bos] $A [eos]` from those
/// flags; otherwise tokenizer.json's own post-processor runs.
#[derive(Debug, Clone, Copy)]
enum Specials {
    /// tokenizer.json's post-processor.
    Native,
    /// Prepend / append these ids.
    Explicit { bos: Option<u32>, eos: Option<u32> },
}

/// A loaded tokenizer: HF `tokenizers` plus the special tokens, EOS ids and chat template of the
/// model directory (or GGUF file) it came from. `Send + Sync`; cheap to share by reference.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    origin: PathBuf,
    eos_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    specials: Specials,
    adds_bos: bool,
    vocab_size: usize,
    chat: Option<chat::ChatTemplate>,
}

/// A special-token field of tokenizer_config.json: a string or an AddedToken `{"content": ..}`.
fn token_field(config: Option<&serde_json::Value>, name: &str) -> Option<String> {
    match config?.get(name)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

/// `eos_token_id` of config.json / generation_config.json: absent, null, an int or a list of ints.
fn eos_field(path: &Path, v: Option<&serde_json::Value>) -> Result<Vec<u32>> {
    let bad = || tok_err(path, "field `eos_token_id`: expected an integer token id or a list of them");
    let id = |v: &serde_json::Value| v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad);
    match v {
        None | Some(serde_json::Value::Null) => Ok(vec![]),
        Some(serde_json::Value::Array(list)) => list.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

impl Tokenizer {
    /// Loads the tokenizer of a model directory (the HF / mlx-lm layout):
    ///
    /// - `tokenizer.json` (required), via `tokenizers::Tokenizer::from_file`;
    /// - `tokenizer_config.json` (optional): `bos_token`, `eos_token`, `pad_token`, `unk_token`
    ///   (strings or `{"content": ..}`), `add_bos_token` / `add_eos_token` (see [`Self::encode`])
    ///   and `chat_template`;
    /// - the chat template: `chat_template.jinja` if present, else tokenizer_config's
    ///   `chat_template` (a string, or a list of `{name, template}` of which `default` is used),
    ///   else `chat_template.json`; none is fine until [`Self::apply_chat_template`] is called;
    /// - EOS ids: the union, in this order without repeats, of `generation_config.json`
    ///   `eos_token_id`, `config.json` `eos_token_id` (each an int or a list, both files optional)
    ///   and the id of tokenizer_config's `eos_token`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file: `tokenizer.json` missing or not a valid tokenizer
    /// (with `tokenizers`' message), a JSON file unreadable or malformed, `eos_token_id` not an
    /// id or list of ids, a named special token (`bos_token`, `eos_token`) not in the vocabulary,
    /// a `chat_template` list without `default`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tj = dir.join("tokenizer.json");
        if !tj.is_file() {
            return Err(tok_err(&tj, "missing: a model directory needs tokenizer.json"));
        }
        let inner = tokenizers::Tokenizer::from_file(&tj)
            .map_err(|e| tok_err(&tj, format!("not a valid tokenizer.json: {e}")))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?;
        let template = chat::find_template(dir, config.as_ref(), &config_path)?;
        let mut eos_ids = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            let path = dir.join(name);
            if let Some(v) = read_json(&path)? {
                eos_ids.extend(eos_field(&path, v.get("eos_token_id"))?);
            }
        }
        Self::assemble(inner, dir.to_path_buf(), config.as_ref(), &config_path, template, eos_ids)
    }

    /// Builds the tokenizer of a GGUF file directly from its metadata (no files written), as
    /// [`tokenizer_files_from_gguf`] describes. EOS ids: `tokenizer.ggml.eos_token_id`, plus
    /// `tokenizer.ggml.eot_token_id` and `tokenizer.ggml.eom_token_id` when present (llama.cpp
    /// stops on those too).
    ///
    /// # Errors
    /// As [`tokenizer_files_from_gguf`]; [`Error::Tokenizer`] naming the GGUF file if the built
    /// JSON does not load back.
    pub fn from_gguf(gguf: &mlx_core::io::Gguf) -> Result<Self> {
        let files = tokenizer_files_from_gguf(gguf)?;
        let inner: tokenizers::Tokenizer = files
            .tokenizer_json
            .parse()
            .map_err(|e| tok_err(&gguf.path, format!("built tokenizer.json does not load: {e}")))?;
        let config: serde_json::Value = serde_json::from_str(&files.tokenizer_config_json)
            .map_err(|e| tok_err(&gguf.path, format!("built tokenizer_config.json: {e}")))?;
        let template = config.get("chat_template").and_then(|t| t.as_str()).map(|t| (t.to_string(), gguf.path.clone()));
        let mut eos_ids = Vec::new();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if gguf.metadata.contains_key(key) {
                let id = gguf.number(key).map_err(|e| tok_err(&gguf.path, format!("`{key}`: {e}")))?;
                eos_ids.push(id as u32);
            }
        }
        Self::assemble(inner, gguf.path.clone(), Some(&config), &gguf.path, template, eos_ids)
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        origin: PathBuf,
        config: Option<&serde_json::Value>,
        config_path: &Path,
        template: Option<(String, PathBuf)>,
        extra_eos: Vec<u32>,
    ) -> Result<Self> {
        let bos_token = token_field(config, "bos_token");
        let eos_token = token_field(config, "eos_token");
        let lookup = |name: &str, token: &Option<String>| -> Result<Option<u32>> {
            match token {
                None => Ok(None),
                Some(t) => inner
                    .token_to_id(t)
                    .map(Some)
                    .ok_or_else(|| tok_err(config_path, format!("`{name}` {t:?} is not in the vocabulary"))),
            }
        };
        let bos_id = lookup("bos_token", &bos_token)?;
        let eos_id = lookup("eos_token", &eos_token)?;
        let mut eos_ids: Vec<u32> = Vec::new();
        for id in extra_eos.into_iter().chain(eos_id) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let flag = |name: &str| config.and_then(|c| c.get(name)).map(|v| v.as_bool().unwrap_or(false));
        let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
        let specials = if add_bos.is_some() || add_eos.is_some() || inner.get_post_processor().is_none() {
            Specials::Explicit {
                bos: bos_id.filter(|_| add_bos == Some(true)),
                eos: eos_id.filter(|_| add_eos == Some(true)),
            }
        } else {
            Specials::Native
        };
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&m| m as usize + 1);
        let mut tok = Self {
            inner,
            origin,
            eos_ids,
            bos_token,
            eos_token,
            pad_token: token_field(config, "pad_token"),
            unk_token: token_field(config, "unk_token"),
            specials,
            adds_bos: false,
            vocab_size,
            chat: template.map(|(source, origin)| chat::ChatTemplate::new(source, origin, chat::RENDER_FUEL)),
        };
        tok.adds_bos = match (tok.specials, bos_id) {
            (Specials::Explicit { bos, .. }, _) => bos.is_some(),
            (Specials::Native, Some(b)) => tok.encode("", true)?.first() == Some(&b),
            (Specials::Native, None) => false,
        };
        Ok(tok)
    }

    /// The ids of `text`. With `add_special_tokens`, BOS/EOS are added as transformers 5 adds them:
    /// by `add_bos_token` / `add_eos_token` of tokenizer_config.json when it sets either (or when
    /// tokenizer.json has no post-processor), else by tokenizer.json's post-processor. Chat prompts
    /// rendered by [`Self::apply_chat_template`] already hold their special tokens: encode them with
    /// `add_special_tokens = false`, as transformers does.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the tokenizer's origin if `tokenizers` fails.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let native = add_special_tokens && matches!(self.specials, Specials::Native);
        let enc = self.inner.encode_fast(text, native).map_err(|e| tok_err(&self.origin, format!("encode: {e}")))?;
        let ids = enc.get_ids();
        match self.specials {
            Specials::Explicit { bos, eos } if add_special_tokens => {
                Ok(bos.into_iter().chain(ids.iter().copied()).chain(eos).collect())
            }
            _ => Ok(ids.to_vec()),
        }
    }

    /// The text of `ids`; with `skip_special_tokens` special tokens (control tokens, BOS/EOS)
    /// are left out. Invalid UTF-8 (a multi-byte character cut off) becomes U+FFFD.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if `tokenizers` fails.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| tok_err(&self.origin, format!("decode: {e}")))
    }

    /// A streaming decoder for generated ids (see [`StreamDecoder`]).
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder { tokenizer: self, skip_special_tokens, ids: Vec::new(), prefix: String::new(), prefix_index: 0 }
    }

    /// The ids that end generation (see [`Self::from_dir`]); may be empty.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` is one of [`Self::eos_ids`].
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// One past the largest token id (model vocabulary and added tokens); every id a model with
    /// this tokenizer can produce is below it, though ids in holes of the vocabulary map to no
    /// token.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token string of `id` (byte-level BPE spells a space `Ġ`), `None` if no token has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string (vocabulary or added token), `None` if unknown.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The BOS token string of tokenizer_config.json, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The id of [`Self::bos_token`].
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.inner.token_to_id(t))
    }

    /// The EOS token string of tokenizer_config.json, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Whether `encode(text, true)` starts with BOS (see [`Self::encode`]).
    pub fn adds_bos(&self) -> bool {
        self.adds_bos
    }

    /// The chat template source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat.as_ref().map(|c| c.source.as_str())
    }

    /// This tokenizer with `source` as its chat template instead of the model directory's
    /// (mlx_lm.server's `--chat-template`); `origin` names it in error messages (the file it
    /// came from, or a label such as `--chat-template`). A template that does not compile is
    /// kept and reported when applied, as one from the model directory is.
    pub fn with_chat_template(mut self, source: String, origin: impl Into<PathBuf>) -> Self {
        let fuel = self.chat.as_ref().map_or(chat::RENDER_FUEL, |c| c.fuel());
        self.chat = Some(chat::ChatTemplate::new(source, origin.into(), fuel));
        self
    }

    /// Why the chat template does not compile (minijinja's message, with the line), if it
    /// does not; `None` when it compiles or there is none. [`Self::apply_chat_template`]
    /// reports the same error; a server can refuse a bad `--chat-template` at start with this.
    pub fn chat_template_error(&self) -> Option<&str> {
        self.chat.as_ref().and_then(|c| c.compile_error())
    }

    /// This tokenizer with a work limit of `fuel` minijinja instructions per chat-template
    /// rendering instead of [`RENDER_FUEL`] (about one unit per template instruction;
    /// a rendering that runs out fails with [`Error::Tokenizer`] saying so). A server that
    /// renders many templates per second, or a fuzz test, may want a tighter limit.
    pub fn with_render_fuel(mut self, fuel: u64) -> Self {
        if let Some(c) = self.chat.take() {
            self.chat = Some(chat::ChatTemplate::new(c.source, c.origin, fuel));
        }
        self
    }

    /// The model directory (or GGUF file) this tokenizer came from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// The underlying HF `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Renders the chat template for `messages`, as transformers' `apply_chat_template(messages,
    /// tokenize=False, add_generation_prompt=..)`: jinja2 semantics with `trim_blocks` and
    /// `lstrip_blocks`, Python string methods (`.strip()`, `.startswith()`, `.split()`, ..),
    /// `raise_exception(msg)`, `strftime_now(fmt)` (UTC), HF's `tojson`, and `bos_token`,
    /// `eos_token`, `pad_token`, `unk_token` in the context (those the tokenizer has).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the template's file: no chat template, a template that does
    /// not compile, or a rendering error (including the message of `raise_exception`).
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`Self::apply_chat_template`] with extra context variables (for example
    /// `{"enable_thinking": false}` for Qwen3 templates); they do not override `messages`,
    /// `add_generation_prompt`, and a special token given here wins over the tokenizer's.
    ///
    /// # Errors
    /// As [`Self::apply_chat_template`].
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| {
            tok_err(&self.origin, "no chat template (chat_template.jinja or tokenizer_config.json `chat_template`)")
        })?;
        let specials = [
            ("bos_token", self.bos_token.as_deref()),
            ("eos_token", self.eos_token.as_deref()),
            ("pad_token", self.pad_token.as_deref()),
            ("unk_token", self.unk_token.as_deref()),
        ];
        chat.render(messages, add_generation_prompt, &specials, extra)
    }
}

/// Turns generated ids into text one id at a time, never splitting a multi-byte UTF-8 character:
/// a token that ends inside a character (byte-level BPE cuts emoji and CJK characters into
/// byte tokens) yields nothing until the token that completes it. Like mlx-lm's streaming
/// detokenizer and `tokenizers`' `DecodeStream`: the ids since the last emitted chunk are decoded
/// together with the chunk before them, and the new text is what lies past that earlier chunk.
/// Concatenating every [`Self::push`] and the final [`Self::finish`] gives
/// `decode(all ids)` whenever that text is valid UTF-8.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// The ids of the last emitted chunk, then those not yet emitted.
    ids: Vec<u32>,
    /// The decoded text of `ids[..prefix_index]`.
    prefix: String,
    prefix_index: usize,
}

impl StreamDecoder<'_> {
    /// Adds one id; returns the text it completes (often empty: a partial character, or a
    /// skipped special token).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if `tokenizers` fails to decode.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = match text.strip_prefix(self.prefix.as_str()) {
            Some(new) => new.to_string(),
            // The decoder rewrote the earlier chunk (a context-dependent decoder); emit what lies
            // past its length, on a character boundary.
            None => {
                let mut cut = self.prefix.len();
                while !text.is_char_boundary(cut) {
                    cut += 1;
                }
                text[cut..].to_string()
            }
        };
        let next_prefix_index = self.ids.len() - self.prefix_index;
        self.ids.drain(..self.prefix_index);
        self.prefix = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        self.prefix_index = next_prefix_index;
        Ok(new)
    }

    /// The text still held back (an incomplete character at the end of generation comes out as
    /// U+FFFD); the decoder is empty afterwards and can be reused.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if `tokenizers` fails to decode.
    pub fn finish(&mut self) -> Result<String> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let rest = text.strip_prefix(self.prefix.as_str()).map(str::to_string).unwrap_or_else(|| {
            let mut cut = self.prefix.len().min(text.len());
            while !text.is_char_boundary(cut) {
                cut += 1;
            }
            text[cut..].to_string()
        });
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::chat::strftime;

    #[test]
    fn strftime_matches_known_dates() {
        assert_eq!(strftime(0, "%Y-%m-%d %H:%M:%S %a %A %b %B %j"), "1970-01-01 00:00:00 Thu Thursday Jan January 001");
        // 2024-02-29T13:05:09Z, a leap day (Thursday).
        assert_eq!(strftime(1_709_211_909, "%d %b %Y %I:%M %p %y %j %e %%"), "29 Feb 2024 01:05 PM 24 060 29 %");
        assert_eq!(strftime(951_782_400, "%Y-%m-%d %A"), "2000-02-29 Tuesday");
    }
}
