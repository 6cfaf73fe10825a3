//! `Tokenizer::from_dir` on a tiny hand-made byte-level BPE model directory: special tokens,
//! EOS ids, BOS handling, streaming decode of characters cut across tokens, chat template
//! sources, and the errors.
use std::path::Path;

use models::Error;
use models::tokenizer::{ChatMessage, Tokenizer};
use serde_json::json;

/// GPT-2's byte -> character table (byte-level BPE spells byte `b` as `table[b]`).
fn byte_chars() -> Vec<char> {
    let mut bytes: Vec<u32> = (0x21..=0x7e).chain(0xa1..=0xac).chain(0xae..=0xff).collect();
    let mut chars = bytes.clone();
    let mut n = 0;
    for b in 0..256 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bytes.iter().zip(chars) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

const HE: u32 = 256;
const HEL: u32 = 257;
/// The merge of byte 0xA9 (the end of "é") and byte 0xF0 (the start of a 4-byte character).
const CROSS: u32 = 258;
const BOS: u32 = 259;
const EOS: u32 = 260;
const IM_END: u32 = 261;

/// tokenizer.json: ids 0..=255 are the bytes, then `he`, `hel`, a token spanning two characters,
/// and the added special tokens `<s>`, `</s>`, `<|im_end|>`; ByteLevel without regex, so merges
/// apply across character boundaries. `post_processor` is inserted as given.
fn tokenizer_json(post_processor: serde_json::Value) -> String {
    let t = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (b, c) in t.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let cross = format!("{}{}", t[0xa9], t[0xf0]);
    vocab.insert("he".into(), json!(HE));
    vocab.insert("hel".into(), json!(HEL));
    vocab.insert(cross.clone(), json!(CROSS));
    let added = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added(BOS, "<s>"), added(EOS, "</s>"), added(IM_END, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": [["h", "e"], ["he", "l"], [t[0xa9].to_string(), t[0xf0].to_string()]]
        }
    })
    .to_string()
}

fn bos_post_processor() -> serde_json::Value {
    json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}}
    })
}

/// A model directory with these files.
fn model_dir(files: &[(&str, String)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn basic_dir(config: serde_json::Value) -> tempfile::TempDir {
    model_dir(&[("tokenizer.json", tokenizer_json(json!(null))), ("tokenizer_config.json", config.to_string())])
}

fn load(dir: &tempfile::TempDir) -> Tokenizer {
    Tokenizer::from_dir(dir.path()).unwrap()
}

/// The file and message of an [`Error::Tokenizer`].
fn tok_error<T: std::fmt::Debug>(r: models::Result<T>) -> (std::path::PathBuf, String) {
    match r {
        Err(Error::Tokenizer { path, message }) => (path, message),
        other => panic!("expected Error::Tokenizer, got {other:?}"),
    }
}

fn file_name(p: &Path) -> &str {
    p.file_name().unwrap().to_str().unwrap()
}

#[test]
fn encodes_decodes_and_looks_up() {
    let dir = basic_dir(json!({"bos_token": "<s>", "eos_token": "</s>"}));
    let tok = load(&dir);
    assert_eq!(tok.encode("hello", false).unwrap(), [HEL, b'l' as u32, b'o' as u32]);
    assert_eq!(tok.encode("hello</s>", false).unwrap(), [HEL, b'l' as u32, b'o' as u32, EOS]);
    assert_eq!(tok.decode(&[BOS, HEL, b'l' as u32, b'o' as u32, EOS], false).unwrap(), "<s>hello</s>");
    assert_eq!(tok.decode(&[BOS, HEL, b'l' as u32, b'o' as u32, EOS], true).unwrap(), "hello");
    assert_eq!(tok.vocab_size(), 262);
    assert_eq!(tok.id_to_token(HEL).as_deref(), Some("hel"));
    assert_eq!(tok.id_to_token(IM_END).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.id_to_token(999), None);
    assert_eq!(tok.token_to_id("<s>"), Some(BOS));
    assert_eq!(tok.token_to_id("nope"), None);
    assert_eq!(tok.bos_id(), Some(BOS));
    assert_eq!(tok.eos_ids(), &[EOS]);
    assert!(tok.is_eos(EOS) && !tok.is_eos(BOS));
    assert!(tok.chat_template().is_none());
    // No post-processor and no add_bos_token: nothing is added.
    assert!(!tok.adds_bos());
    assert_eq!(tok.encode("hello", true).unwrap(), tok.encode("hello", false).unwrap());
    // " é😀": every byte round-trips.
    let text = "h é😀 中\n\t";
    assert_eq!(tok.decode(&tok.encode(text, false).unwrap(), false).unwrap(), text);
}

#[test]
fn eos_ids_are_the_union_of_three_files() {
    let dir = model_dir(&[
        ("tokenizer.json", tokenizer_json(json!(null))),
        ("tokenizer_config.json", json!({"eos_token": {"__type": "AddedToken", "content": "</s>"}}).to_string()),
        ("generation_config.json", json!({"eos_token_id": [IM_END, 7], "bos_token_id": 1}).to_string()),
        ("config.json", json!({"eos_token_id": 7}).to_string()),
    ]);
    let tok = load(&dir);
    assert_eq!(tok.eos_ids(), &[IM_END, 7, EOS]);
    assert_eq!(tok.eos_token(), Some("</s>"));

    // Only config.json, holding a list; no tokenizer_config.json at all.
    let dir = model_dir(&[
        ("tokenizer.json", tokenizer_json(json!(null))),
        ("config.json", json!({"eos_token_id": [EOS, IM_END]}).to_string()),
    ]);
    assert_eq!(load(&dir).eos_ids(), &[EOS, IM_END]);

    // null is no id.
    let dir = model_dir(&[
        ("tokenizer.json", tokenizer_json(json!(null))),
        ("config.json", json!({"eos_token_id": null}).to_string()),
    ]);
    assert!(load(&dir).eos_ids().is_empty());
}

#[test]
fn bos_and_eos_follow_transformers_5() {
    // add_bos_token in tokenizer_config.json.
    let tok = load(&basic_dir(json!({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true})));
    assert!(tok.adds_bos());
    assert_eq!(tok.encode("he", true).unwrap(), [BOS, HE]);
    assert_eq!(tok.encode("he", false).unwrap(), [HE]);
    let tok = load(&basic_dir(json!({"bos_token": "<s>", "eos_token": "</s>", "add_eos_token": true})));
    assert!(!tok.adds_bos());
    assert_eq!(tok.encode("he", true).unwrap(), [HE, EOS]);

    // tokenizer.json's own post-processor runs when tokenizer_config.json says nothing.
    let with_pp = |config: serde_json::Value| {
        model_dir(&[
            ("tokenizer.json", tokenizer_json(bos_post_processor())),
            ("tokenizer_config.json", config.to_string()),
        ])
    };
    let tok = load(&with_pp(json!({"bos_token": "<s>"})));
    assert!(tok.adds_bos());
    assert_eq!(tok.encode("he", true).unwrap(), [BOS, HE]);
    assert_eq!(tok.encode("he", false).unwrap(), [HE]);
    // ... and an explicit add_bos_token = false replaces it.
    let tok = load(&with_pp(json!({"bos_token": "<s>", "add_bos_token": false})));
    assert!(!tok.adds_bos());
    assert_eq!(tok.encode("he", true).unwrap(), [HE]);
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let tok = load(&basic_dir(json!({})));
    // "é" is C3 A9, "😀" is F0 9F 98 80; the merge A9+F0 makes a token that ends inside "😀".
    let ids = tok.encode("hé", false).unwrap();
    assert_eq!(ids, [b'h' as u32, 0xc3, 0xa9]);
    let mut stream = tok.stream_decoder(false);
    let chunks: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
    assert_eq!(chunks, ["h", "", "é"]);
    let ids = tok.encode("hé😀", false).unwrap();
    assert_eq!(ids, [b'h' as u32, 0xc3, CROSS, 0x9f, 0x98, 0x80]);
    let mut stream = tok.stream_decoder(false);
    let chunks: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
    // "é" is complete at CROSS, but the text then ends inside "😀": both come out together once
    // "😀" is complete, as with mlx-lm's BPE detokenizer and tokenizers' DecodeStream.
    assert_eq!(chunks, ["h", "", "", "", "", "é😀"]);
    assert_eq!(stream.finish().unwrap(), "");
    // The same chunks as tokenizers' own DecodeStream.
    let mut hf = tok.inner().decode_stream(false);
    let hf_chunks: Vec<String> = ids.iter().map(|&id| hf.step(id).unwrap().unwrap_or_default()).collect();
    assert_eq!(chunks, hf_chunks);

    // Generation that stops inside a character: finish() gives a replacement character.
    let mut stream = tok.stream_decoder(false);
    for &id in &ids[..4] {
        stream.push(id).unwrap();
    }
    assert_eq!(stream.finish().unwrap(), "é\u{FFFD}");
    // ... and the decoder starts over.
    assert_eq!(stream.push(b'o' as u32).unwrap(), "o");

    // Special tokens skipped or kept.
    let ids = [BOS, HEL, b'l' as u32, 0xe4, 0xb8, 0xad, IM_END];
    for (skip, want) in [(true, "hell中"), (false, "<s>hell中<|im_end|>")] {
        let mut stream = tok.stream_decoder(skip);
        let mut text: String = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
        text.push_str(&stream.finish().unwrap());
        assert_eq!(text, want);
    }

    // Many strings: the chunks are whole characters and add up to decode().
    for text in ["中文 and emoji 👨‍👩‍👧‍👦🇫🇷", "é😀é😀é😀", "a\u{0301}\u{0308}", "\u{10ffff}x", "hello hello"]
    {
        let ids = tok.encode(text, false).unwrap();
        let mut stream = tok.stream_decoder(false);
        let mut out = String::new();
        for &id in &ids {
            let chunk = stream.push(id).unwrap();
            assert!(!chunk.contains('\u{FFFD}'), "{text:?}: {chunk:?}");
            out.push_str(&chunk);
        }
        out.push_str(&stream.finish().unwrap());
        assert_eq!(out, text);
    }
}

#[test]
fn chat_template_sources() {
    let t_config = "config:{{ messages[0].content }}";
    let t_jinja = "jinja:{{ messages[0].content }}";
    let msgs = [ChatMessage::user("hi")];
    let tj = || ("tokenizer.json", tokenizer_json(json!(null)));

    // A string in tokenizer_config.json.
    let dir = model_dir(&[tj(), ("tokenizer_config.json", json!({"chat_template": t_config}).to_string())]);
    assert_eq!(load(&dir).apply_chat_template(&msgs, false).unwrap(), "config:hi");
    // chat_template.jinja wins.
    let dir = model_dir(&[
        tj(),
        ("tokenizer_config.json", json!({"chat_template": t_config}).to_string()),
        ("chat_template.jinja", t_jinja.into()),
    ]);
    let tok = load(&dir);
    assert_eq!(tok.chat_template(), Some(t_jinja));
    assert_eq!(tok.apply_chat_template(&msgs, false).unwrap(), "jinja:hi");
    // A list of named templates: "default".
    let list = json!({"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default:{{ messages|length }}"}
    ]});
    let dir = model_dir(&[tj(), ("tokenizer_config.json", list.to_string())]);
    assert_eq!(load(&dir).apply_chat_template(&msgs, false).unwrap(), "default:1");
    // chat_template.json (older processor layout).
    let dir = model_dir(&[
        tj(),
        ("chat_template.json", json!({"chat_template": "json:{{ add_generation_prompt }}"}).to_string()),
    ]);
    assert_eq!(load(&dir).apply_chat_template(&msgs, true).unwrap(), "json:True");
}

#[test]
fn chat_template_context_and_python_features() {
    let template = "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
                    {{ m.role }}={{ m.content.strip().upper() }};{% endfor %}{{ eos_token }}\
                    {% if enable_thinking is defined and enable_thinking is false %}no-think{% endif %}\
                    |{{ strftime_now('%Y')|length }}|{{ 'a,b'.split(',') }}|{{ none }}";
    let dir = basic_dir(json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}));
    let tok = load(&dir);
    let msgs =
        [ChatMessage::system(" sys "), ChatMessage::user("hi\n"), ChatMessage::assistant("never rendered: break")];
    assert_eq!(tok.apply_chat_template(&msgs, true).unwrap(), "<s>system=SYS;user=HI;</s>|4|['a', 'b']|None");
    let mut extra = serde_json::Map::new();
    extra.insert("enable_thinking".into(), false.into());
    extra.insert("bos_token".into(), "[B]".into());
    assert_eq!(
        tok.apply_chat_template_with(&msgs, true, &extra).unwrap(),
        "[B]system=SYS;user=HI;</s>no-think|4|['a', 'b']|None"
    );
}

#[test]
fn chat_template_errors_name_the_file() {
    // No template at all.
    let dir = basic_dir(json!({}));
    let (path, msg) = tok_error(load(&dir).apply_chat_template(&[ChatMessage::user("x")], true));
    assert_eq!(path, dir.path());
    assert!(msg.contains("no chat template"), "{msg}");
    // A template that does not compile loads, and fails when applied.
    let dir = basic_dir(json!({"chat_template": "{% for m in messages %}{{ m.content }"}));
    let tok = load(&dir);
    assert!(tok.encode("he", false).is_ok());
    let (path, msg) = tok_error(tok.apply_chat_template(&[ChatMessage::user("x")], true));
    assert_eq!(file_name(&path), "tokenizer_config.json");
    assert!(msg.contains("does not compile"), "{msg}");
    // raise_exception's message comes through.
    let dir = model_dir(&[
        ("tokenizer.json", tokenizer_json(json!(null))),
        ("chat_template.jinja", "{{ raise_exception('System role not supported') }}".into()),
    ]);
    let (path, msg) = tok_error(load(&dir).apply_chat_template(&[ChatMessage::system("x")], true));
    assert_eq!(file_name(&path), "chat_template.jinja");
    assert!(msg.contains("System role not supported"), "{msg}");
    // A list of templates without "default".
    let dir = basic_dir(json!({"chat_template": [{"name": "tool_use", "template": "x"}]}));
    let (path, msg) = tok_error(Tokenizer::from_dir(dir.path()));
    assert_eq!(file_name(&path), "tokenizer_config.json");
    assert!(msg.contains("default") && msg.contains("tool_use"), "{msg}");
}

#[test]
fn loading_errors_name_the_file() {
    // No tokenizer.json.
    let dir = model_dir(&[("tokenizer_config.json", "{}".into())]);
    let (path, msg) = tok_error(Tokenizer::from_dir(dir.path()));
    assert_eq!(path, dir.path().join("tokenizer.json"));
    assert!(msg.contains("missing"), "{msg}");
    // A directory that does not exist.
    let (path, _) = tok_error(Tokenizer::from_dir("/nonexistent/model"));
    assert_eq!(path, Path::new("/nonexistent/model/tokenizer.json"));
    // Malformed tokenizer.json: not JSON, and JSON that is not a tokenizer.
    for bad in ["{not json", "{}", "[1, 2]", ""] {
        let dir = model_dir(&[("tokenizer.json", bad.into())]);
        let (path, msg) = tok_error(Tokenizer::from_dir(dir.path()));
        assert_eq!(file_name(&path), "tokenizer.json", "{bad:?}");
        assert!(msg.contains("not a valid tokenizer.json"), "{msg}");
    }
    // Malformed JSON in the other files.
    for name in ["tokenizer_config.json", "config.json", "generation_config.json"] {
        let dir = model_dir(&[("tokenizer.json", tokenizer_json(json!(null))), (name, "{\"eos_token_id\": ".into())]);
        let (path, msg) = tok_error(Tokenizer::from_dir(dir.path()));
        assert_eq!(file_name(&path), name);
        assert!(msg.contains("malformed JSON"), "{msg}");
    }
    // eos_token_id of the wrong type.
    for bad in [json!("</s>"), json!([1, "x"]), json!(-1), json!(1.5)] {
        let dir = model_dir(&[
            ("tokenizer.json", tokenizer_json(json!(null))),
            ("generation_config.json", json!({"eos_token_id": bad}).to_string()),
        ]);
        let (path, msg) = tok_error(Tokenizer::from_dir(dir.path()));
        assert_eq!(file_name(&path), "generation_config.json");
        assert!(msg.contains("eos_token_id"), "{msg}");
    }
    // A special token that is not in the vocabulary.
    let dir = basic_dir(json!({"eos_token": "<|eot|>"}));
    let (path, msg) = tok_error(Tokenizer::from_dir(dir.path()));
    assert_eq!(file_name(&path), "tokenizer_config.json");
    assert!(msg.contains("<|eot|>"), "{msg}");
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<models::tokenizer::TokenizerFiles>();
}

#[test]
fn a_chat_template_that_never_finishes_stops_at_its_work_limit() {
    // Nested loops over a large range: years of work without a limit.
    let template = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}\
                    x{% endfor %}{% endfor %}{% endfor %}";
    let tok = load(&basic_dir(json!({"chat_template": template})));
    let start = std::time::Instant::now();
    let err = tok.apply_chat_template(&[ChatMessage::user("hi")], true).unwrap_err().to_string();
    assert!(err.contains("work limit") && err.contains("tokenizer_config.json"), "{err}");
    // Ordinary templates stay far inside the limit, even for a long conversation.
    let chat = "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}\n{% endfor %}";
    let tok = load(&basic_dir(json!({"chat_template": chat})));
    let msgs: Vec<ChatMessage> = (0..2000).map(|i| ChatMessage::user(format!("message {i}"))).collect();
    assert!(tok.apply_chat_template(&msgs, true).unwrap().contains("message 1999"));
    eprintln!("out of fuel after {:?}", start.elapsed());
}

#[test]
fn a_tighter_work_limit_is_kept_across_a_replaced_template() {
    let loop_1000 = "{% for a in range(1000) %}x{% endfor %}";
    let tok = load(&basic_dir(json!({"chat_template": loop_1000})));
    let msgs = [ChatMessage::user("hi")];
    assert_eq!(tok.apply_chat_template(&msgs, false).unwrap().len(), 1000);
    let tight = tok.with_render_fuel(100);
    let err = tight.apply_chat_template(&msgs, false).unwrap_err().to_string();
    assert!(err.contains("work limit of 100 instructions"), "{err}");
    // `--chat-template` replaces the template, not the limit.
    let replaced = tight.with_chat_template(loop_1000.to_string(), "--chat-template");
    let err = replaced.apply_chat_template(&msgs, false).unwrap_err().to_string();
    assert!(err.contains("work limit of 100") && err.contains("--chat-template"), "{err}");
}
