//! `check_tokenizers` on tiny word-level tokenizer directories: the same tokenizer passes;
//! a different token text, vocabulary size, special flag, added token or EOS token is
//! refused with an error naming both models.
use models::tokenizer::Tokenizer;
use serde_json::json;
use spec::Error;
use spec::two_model::check_tokenizers;

struct Spec {
    words: Vec<&'static str>,
    added: Vec<(&'static str, bool)>,
    eos: &'static str,
}

impl Default for Spec {
    fn default() -> Self {
        Spec { words: vec!["<unk>", "a", "b", "c"], added: vec![("</s>", true), ("<|im_end|>", true)], eos: "</s>" }
    }
}

/// Writes a word-level tokenizer directory and loads it.
fn tokenizer(dir: &tempfile::TempDir, name: &str, spec: &Spec) -> Tokenizer {
    let path = dir.path().join(name);
    std::fs::create_dir_all(&path).unwrap();
    let mut vocab = serde_json::Map::new();
    for (i, w) in spec.words.iter().enumerate() {
        vocab.insert(w.to_string(), json!(i));
    }
    let added: Vec<_> = spec
        .added
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            let id = spec.words.len() + i;
            vocab.insert(content.to_string(), json!(id));
            json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": special})
        })
        .collect();
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(path.join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(path.join("tokenizer_config.json"), json!({"eos_token": spec.eos}).to_string()).unwrap();
    Tokenizer::from_dir(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn refused(draft: &Tokenizer, target: &Tokenizer, needle: &str) {
    let err = check_tokenizers(draft, target, "draft-dir", "target-dir").unwrap_err();
    assert!(matches!(err, Error::Incompatible { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("draft-dir") && msg.contains("target-dir"), "{msg}");
    assert!(msg.contains(needle), "`{needle}` not in: {msg}");
}

#[test]
fn identical_tokenizers_pass() {
    let dir = tempfile::tempdir().unwrap();
    let a = tokenizer(&dir, "a", &Spec::default());
    let b = tokenizer(&dir, "b", &Spec::default());
    check_tokenizers(&a, &b, "a", "b").unwrap();
}

#[test]
fn differences_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = tokenizer(&dir, "target", &Spec::default());
    let text = tokenizer(&dir, "text", &Spec { words: vec!["<unk>", "a", "x", "c"], ..Spec::default() });
    refused(&text, &target, "token 2");
    let bigger = tokenizer(&dir, "bigger", &Spec { words: vec!["<unk>", "a", "b", "c", "d"], ..Spec::default() });
    refused(&bigger, &target, "vocabulary sizes differ");
    let flag = tokenizer(&dir, "flag", &Spec { added: vec![("</s>", true), ("<|im_end|>", false)], ..Spec::default() });
    refused(&flag, &target, "special tokens differ");
    let eos = tokenizer(&dir, "eos", &Spec { eos: "<|im_end|>", ..Spec::default() });
    refused(&eos, &target, "EOS token");
}
