//! `tokenizer.json` and `tokenizer_config.json` from a GGUF file's `tokenizer.*` metadata.
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use mlx_core::io::{Gguf, GgufValue};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::{TokenizerFiles, tok_err};
use crate::Result;

/// GGUF `tokenizer.ggml.token_type` of a control token (`<|im_start|>`): a special added token.
const TOKEN_CONTROL: i32 = 3;
/// GGUF `tokenizer.ggml.token_type` of a user-defined token (`<tool_call>`): a plain added token.
const TOKEN_USER_DEFINED: i32 = 4;

/// The split regex of Qwen2's `tokenizer.json` (and transformers' `Qwen2Tokenizer`).
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The split regex of Llama 3's `tokenizer.json`.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values [`tokenizer_files_from_gguf`] understands.
pub const SUPPORTED_PRE: &[&str] = &["default", "gpt2", "gpt-2", "smollm", "qwen2", "llama-bpe", "llama3", "llama-v3"];

/// The HF pipeline a `tokenizer.ggml.pre` value stands for.
struct PrePipeline {
    nfc: bool,
    pre: PreTokenizerWrapper,
    ignore_merges: bool,
}

fn pre_pipeline(pre: &str, path: &Path) -> Result<PrePipeline> {
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| tok_err(path, format!("split regex of `{pre}`: {e}")))?;
        Ok(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()]).into())
    };
    Ok(match pre {
        // GPT-2: ByteLevel with its own regex.
        "default" | "gpt2" | "gpt-2" => {
            PrePipeline { nfc: false, pre: ByteLevel::new(false, true, true).into(), ignore_merges: false }
        }
        // SmolLM / SmolLM2's tokenizer.json; llama.cpp's `smollm` is `\p{N}` then the GPT-2 regex.
        "smollm" => PrePipeline {
            nfc: false,
            pre: Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into(),
            ignore_merges: false,
        },
        // Qwen2 / Qwen2.5 / Qwen2.5-Coder (and Qwen3): NFC, the Qwen2 split, ByteLevel without regex.
        "qwen2" => PrePipeline { nfc: true, pre: split(QWEN2_SPLIT)?, ignore_merges: false },
        // Llama 3.x.
        "llama-bpe" | "llama3" | "llama-v3" => {
            PrePipeline { nfc: false, pre: split(LLAMA3_SPLIT)?, ignore_merges: true }
        }
        other => {
            return Err(tok_err(
                path,
                format!("tokenizer.ggml.pre = {other:?} is not supported (supported: {})", SUPPORTED_PRE.join(", ")),
            ));
        }
    })
}

fn optional_number(gguf: &Gguf, key: &str) -> Result<Option<f64>> {
    match gguf.metadata.get(key) {
        None => Ok(None),
        Some(_) => Ok(Some(gguf.number(key).map_err(|e| tok_err(&gguf.path, format!("`{key}`: {e}")))?)),
    }
}

fn optional_bool(gguf: &Gguf, key: &str) -> Result<Option<bool>> {
    Ok(optional_number(gguf, key)?.map(|v| v != 0.0))
}

fn strings<'a>(gguf: &'a Gguf, key: &str) -> Result<&'a [String]> {
    gguf.strings(key).map_err(|e| tok_err(&gguf.path, format!("`{key}`: {e}")))
}

fn token_types(gguf: &Gguf, n: usize) -> Result<Vec<i32>> {
    let key = "tokenizer.ggml.token_type";
    let types = match gguf.metadata.get(key) {
        None => return Ok(vec![1; n]),
        Some(GgufValue::Array(a)) => a.astype(mlx_core::Dtype::Int32)?.to_vec::<i32>()?,
        Some(_) => return Err(tok_err(&gguf.path, format!("`{key}` is not a numeric array"))),
    };
    if types.len() != n {
        return Err(tok_err(
            &gguf.path,
            format!("`{key}` has {} entries but `tokenizer.ggml.tokens` has {n}", types.len()),
        ));
    }
    Ok(types)
}

/// Builds `tokenizer.json` and `tokenizer_config.json` from a GGUF file's `tokenizer.*` metadata,
/// with the `tokenizers` crate's own types (so the JSON is exactly what `tokenizers` loads back).
///
/// Supported: `tokenizer.ggml.model = "llama"` (SentencePiece) for the Gemma architectures
/// ([`GEMMA_ARCHITECTURES`], see `gemma_files` below: BPE with byte fallback and merges recovered
/// from the vocabulary, as transformers builds it), and `tokenizer.ggml.model = "gpt2"`
/// (byte-level BPE), with `tokenizer.ggml.pre` one of [`SUPPORTED_PRE`] (absent means `default`):
///
/// | `pre` | tokenizer.json pipeline (as in the model's own HF tokenizer.json) |
/// |---|---|
/// | `default`, `gpt2`, `gpt-2` | ByteLevel(add_prefix_space=false, use_regex=true) |
/// | `smollm` (SmolLM2) | Digits(individual) + ByteLevel(add_prefix_space=false, use_regex=true) |
/// | `qwen2` (Qwen2.5, Qwen2.5-Coder) | NFC normalizer; Split(Qwen2 regex, isolated) + ByteLevel(use_regex=false) |
/// | `llama-bpe`, `llama3`, `llama-v3` | Split(Llama 3 regex) + ByteLevel(use_regex=false); BPE ignore_merges |
///
/// The model is BPE over `tokenizer.ggml.tokens` (token id = position) and `tokenizer.ggml.merges`
/// (each `"left right"`, split at the first space), no unknown token, with a ByteLevel decoder and
/// no post-processor. Control tokens (`token_type` 3) become special added tokens and user-defined
/// tokens (4) plain (non-special) added tokens, as in the HF files these GGUFs were converted from,
/// both matched on the raw text and keeping their ids. `tokenizer_config.json` has `tokenizer_class`
/// `PreTrainedTokenizerFast` (transformers 5 then keeps tokenizer.json as written), `bos_token`,
/// `eos_token`, `pad_token` and `unk_token` (the token strings of `tokenizer.ggml.{bos,eos,padding,
/// unknown}_token_id`, each only when present), `add_bos_token` / `add_eos_token` (when present),
/// `chat_template` (`tokenizer.chat_template`, when present) and `clean_up_tokenization_spaces`
/// false.
///
/// # Errors
/// [`crate::Error::Tokenizer`] naming the GGUF file: `tokenizer.ggml.model` missing or not `gpt2`
/// (SentencePiece `llama`, Gemma's and the rest are not supported yet), an unknown
/// `tokenizer.ggml.pre` (the message names it and lists the supported ones), tokens, token types
/// or merges missing or inconsistent (a merge without a space, or naming a token not in the
/// vocabulary), a special token id out of range. [`crate::Error::Mlx`] when a numeric metadata
/// array cannot be read.
pub fn tokenizer_files_from_gguf(gguf: &Gguf) -> Result<TokenizerFiles> {
    let path = gguf.path.as_path();
    let model = match gguf.metadata.get("tokenizer.ggml.model") {
        Some(GgufValue::String(s)) => s.as_str(),
        Some(_) => return Err(tok_err(path, "`tokenizer.ggml.model` is not a string")),
        None => return Err(tok_err(path, "no `tokenizer.ggml.model`: the file has no tokenizer")),
    };
    let arch = match gguf.metadata.get("general.architecture") {
        Some(GgufValue::String(s)) => s.as_str(),
        _ => "",
    };
    if model == "llama" && GEMMA_ARCHITECTURES.contains(&arch) {
        return gemma_files(gguf);
    }
    if model != "gpt2" {
        let what = match model {
            "llama" => " (SentencePiece)",
            "gemma4" => " (Gemma 4)",
            "bert" => " (WordPiece)",
            "t5" => " (Unigram)",
            _ => "",
        };
        return Err(tok_err(
            path,
            format!(
                "tokenizer.ggml.model = {model:?}{what} is not supported yet (supported: \"gpt2\", byte-level BPE; \"llama\" SentencePiece for the Gemma architectures {GEMMA_ARCHITECTURES:?})"
            ),
        ));
    }
    let pre_name = match gguf.metadata.get("tokenizer.ggml.pre") {
        Some(GgufValue::String(s)) => s.as_str(),
        Some(_) => return Err(tok_err(path, "`tokenizer.ggml.pre` is not a string")),
        None => "default",
    };
    let pipeline = pre_pipeline(pre_name, path)?;

    let tokens = strings(gguf, "tokenizer.ggml.tokens")?;
    let types = token_types(gguf, tokens.len())?;
    let merges = strings(gguf, "tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tok_err(path, format!("`tokenizer.ggml.merges`[{i}] = {m:?} has no space")))
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pipeline.ignore_merges)
        .build()
        .map_err(|e| tok_err(path, format!("BPE from `tokenizer.ggml.tokens`/`merges`: {e}")))?;

    let mut tk = tokenizers::Tokenizer::new(bpe);
    if pipeline.nfc {
        tk.with_normalizer(Some(NFC));
    }
    tk.with_pre_tokenizer(Some(pipeline.pre));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    let added = |kind: i32| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&types)
            .filter(|&(_, &t)| t == kind)
            .map(|(tok, _)| AddedToken::from(tok.clone(), kind == TOKEN_CONTROL).normalized(false))
            .collect()
    };
    tk.add_special_tokens(&added(TOKEN_CONTROL));
    tk.add_tokens(&added(TOKEN_USER_DEFINED));
    let tokenizer_json = tk.to_string(false).map_err(|e| tok_err(path, format!("serializing tokenizer.json: {e}")))?;
    Ok(TokenizerFiles { tokenizer_json, tokenizer_config_json: tokenizer_config(gguf, tokens)? })
}

/// `tokenizer_config.json` (see [`tokenizer_files_from_gguf`]).
fn tokenizer_config(gguf: &Gguf, tokens: &[String]) -> Result<String> {
    let path = gguf.path.as_path();
    let mut config = BTreeMap::<&str, serde_json::Value>::new();
    config.insert("tokenizer_class", "PreTrainedTokenizerFast".into());
    config.insert("clean_up_tokenization_spaces", false.into());
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(id) = optional_number(gguf, key)? {
            let token =
                (id >= 0.0 && id.fract() == 0.0).then(|| tokens.get(id as usize)).flatten().ok_or_else(|| {
                    tok_err(path, format!("`{key}` = {id} is not a token id (vocabulary of {})", tokens.len()))
                })?;
            config.insert(name, token.clone().into());
        }
    }
    for (name, key) in
        [("add_bos_token", "tokenizer.ggml.add_bos_token"), ("add_eos_token", "tokenizer.ggml.add_eos_token")]
    {
        if let Some(b) = optional_bool(gguf, key)? {
            config.insert(name, b.into());
        }
    }
    match gguf.metadata.get("tokenizer.chat_template") {
        Some(GgufValue::String(t)) => {
            config.insert("chat_template", t.clone().into());
        }
        Some(_) => return Err(tok_err(path, "`tokenizer.chat_template` is not a string")),
        None => {}
    }
    serde_json::to_string_pretty(&config).map_err(|e| tok_err(path, format!("serializing tokenizer_config.json: {e}")))
}

/// `general.architecture` values whose `tokenizer.ggml.model = "llama"` vocabulary is built
/// as Gemma's SentencePiece BPE.
pub const GEMMA_ARCHITECTURES: &[&str] = &["gemma", "gemma2", "gemma3"];

/// Python's `str.isspace` for one character (Rust's `char::is_whitespace` plus the
/// information separators U+001C..U+001F).
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// BPE merges recovered from a vocabulary without merges, as transformers'
/// `generate_merges(vocab, vocab_scores)` does: for each token in order of first appearance,
/// every split into two vocabulary tokens (by characters), sorted by the ids of the halves;
/// then all of them sorted, stably, by (score, length of the left half, length of the right
/// half), highest first.
fn merges_from_vocab(tokens: &[String], scores: &HashMap<&str, i64>) -> Vec<(String, String)> {
    let vocab: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut seen = std::collections::HashSet::new();
    let mut merges: Vec<(&str, &str, i64)> = Vec::new();
    for t in tokens {
        if !seen.insert(t.as_str()) {
            continue;
        }
        let score = scores[t.as_str()];
        let mut local: Vec<(&str, &str, i64)> = t
            .char_indices()
            .skip(1)
            .map(|(at, _)| t.split_at(at))
            .filter(|(l, r)| vocab.contains_key(l) && vocab.contains_key(r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|&(l, r, _)| (vocab[l], vocab[r]));
        merges.extend(local);
    }
    merges.sort_by(|a, b| {
        let key = |m: &(&str, &str, i64)| (m.2, m.0.chars().count(), m.1.chars().count());
        key(b).cmp(&key(a))
    });
    merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect()
}

/// Gemma's tokenizer from a GGUF SentencePiece vocabulary, built as transformers builds it
/// from the same file (`integrations/gguf/gguf_tokenizer_mapping.py`, `gemma_tokenizer`, then
/// `GemmaTokenizer`): tokens made only of whitespace that contain a space are respelled with
/// `▁` (llama.cpp stores `"  "`, the model's pieces are `"▁▁"`); the file has no merges, so
/// they are recovered from the vocabulary ranked by token position ([`merges_from_vocab`]);
/// the model is BPE with byte fallback, `<unk>` fused; the normalizer replaces `" "` with
/// `"▁"`; the pre-tokenizer splits on `" "` (merged with the previous piece); the decoder
/// is `Replace("▁", " ")`, `ByteFallback`, `Fuse`. Control tokens (`token_type` 3) are special
/// added tokens and user-defined ones (4, such as `"\n\n"`) plain added tokens, matched on
/// the raw text. The post-processor prepends BOS (`<bos> $A`) unless
/// `tokenizer.ggml.add_bos_token` is false, as Gemma's own tokenizer.json does.
fn gemma_files(gguf: &Gguf) -> Result<TokenizerFiles> {
    let path = gguf.path.as_path();
    let raw = strings(gguf, "tokenizer.ggml.tokens")?;
    let types = token_types(gguf, raw.len())?;
    let tokens: Vec<String> = raw
        .iter()
        .map(|t| if t.contains(' ') && t.chars().all(py_space) { "▁".repeat(t.chars().count()) } else { t.clone() })
        .collect();
    let mut scores: HashMap<&str, i64> = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        scores.insert(t.as_str(), -(i as i64));
    }
    let merges = merges_from_vocab(&tokens, &scores);
    let unk = tokens.get(3).cloned().unwrap_or_else(|| "<unk>".into());
    let unk = optional_number(gguf, "tokenizer.ggml.unknown_token_id")?
        .and_then(|id| tokens.get(id as usize).cloned())
        .unwrap_or(unk);
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true)
        .unk_token(unk)
        .build()
        .map_err(|e| tok_err(path, format!("BPE from `tokenizer.ggml.tokens`: {e}")))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let space = |to: &str| Replace::new(" ", to).map_err(|e| tok_err(path, format!("replace normalizer: {e}")));
    tk.with_normalizer(Some(space("▁")?));
    let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false)
        .map_err(|e| tok_err(path, format!("split pre-tokenizer: {e}")))?;
    tk.with_pre_tokenizer(Some(split));
    let unspace = Replace::new("▁", " ").map_err(|e| tok_err(path, format!("replace decoder: {e}")))?;
    tk.with_decoder(Some(DecoderSequence::new(vec![
        DecoderWrapper::Replace(unspace),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));
    let in_vocab: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
    let added = |kind: i32| -> Vec<AddedToken> {
        raw.iter()
            .zip(&types)
            .filter(|&(tok, &t)| t == kind && (kind == TOKEN_CONTROL || in_vocab.contains(tok.as_str())))
            .map(|(tok, _)| AddedToken::from(tok.clone(), kind == TOKEN_CONTROL).normalized(false))
            .collect()
    };
    tk.add_special_tokens(&added(TOKEN_CONTROL));
    tk.add_tokens(&added(TOKEN_USER_DEFINED));
    // BOS as Gemma's own tokenizer.json adds it (transformers 5 keeps a tokenizer.json's
    // post-processor, so mlx-lm adds it too); llama.cpp adds BOS to SentencePiece vocabularies
    // unless `add_bos_token` says otherwise.
    if optional_bool(gguf, "tokenizer.ggml.add_bos_token")?.unwrap_or(true)
        && let Some(id) = optional_number(gguf, "tokenizer.ggml.bos_token_id")?
    {
        let bos = tokens
            .get(id as usize)
            .ok_or_else(|| tok_err(path, format!("`tokenizer.ggml.bos_token_id` = {id} is not a token id")))?;
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos}:1 $B:1")))
            .map_err(|e| tok_err(path, format!("BOS template: {e}")))?
            .special_tokens(vec![(bos.clone(), id as u32)])
            .build()
            .map_err(|e| tok_err(path, format!("BOS template: {e}")))?;
        tk.with_post_processor(Some(template));
    }
    let tokenizer_json = tk.to_string(false).map_err(|e| tok_err(path, format!("serializing tokenizer.json: {e}")))?;
    Ok(TokenizerFiles { tokenizer_json, tokenizer_config_json: tokenizer_config(gguf, &tokens)? })
}
