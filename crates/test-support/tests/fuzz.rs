//! The parser fuzz suite: every reader of an untrusted file gets valid inputs damaged by
//! proptest strategies ([`test_support::fuzz`]) and must answer with a result or an error
//! that names the file, never a panic, an abort or a hang. Covered: safetensors (the header
//! reader and MLX behind it), GGUF, a target's `config.json` (loaded with the tiny fixture's
//! weights), a DSpark drafter's `config.json`, `tokenizer.json`, chat templates, and the
//! affine quantization of a block of weights.
//!
//! The case count is proptest's: `PROPTEST_CASES` (default 256, with a fixed seed, in the
//! test suite; `cargo xtask fuzz` runs a million per parser in release mode with a fresh
//! seed it prints). A panic fails the case and proptest shrinks it to a
//! minimal input; an abort kills the test binary, which fails the run.
use std::path::{Path, PathBuf};

use mlx_core::io::{Gguf, load_safetensors, save_safetensors};
use mlx_core::quant::{QuantSpec, dequantize, quantize};
use mlx_core::{Array, Dtype};
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{LoadOptions, load_model};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use serde_json::{Map, Value, json};
use test_support::fuzz::{apply_byte_edits, apply_edits, byte_edits, json_edits, json_value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn object(path: &Path) -> Map<String, Value> {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// proptest's configuration (its `PROPTEST_CASES`, `PROPTEST_RNG_SEED` and other
/// variables apply), without persistence files in the source tree; without
/// `PROPTEST_RNG_SEED` the seed is fixed, so the bounded run of the test suite checks the
/// same inputs every time.
fn config() -> Config {
    let default = Config::default();
    let rng_seed = match std::env::var_os("PROPTEST_RNG_SEED") {
        Some(_) => default.rng_seed,
        None => RngSeed::Fixed(20_261_202),
    };
    Config { failure_persistence: None, rng_seed, ..default }
}

/// An error message must name the file (or the directory holding it).
fn names(message: &str, file: &Path) -> bool {
    let dir = file.parent().map(|d| d.display().to_string()).unwrap_or_default();
    message.contains(&file.display().to_string()) || (!dir.is_empty() && message.contains(&dir))
}

/// A small valid safetensors file: several dtypes, shapes and a metadata entry.
fn safetensors_bytes(dir: &Path) -> Vec<u8> {
    let path = dir.join("base.safetensors");
    let a = Array::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0], &[2, 3]).unwrap();
    let b = Array::from_slice(&[7u32, 8, 9], &[3]).unwrap();
    let c = Array::from_slice(&[1u8, 2], &[1, 2]).unwrap();
    save_safetensors(&path, [("a", &a), ("b.weight", &b), ("c", &c)], [("format", "mlx")]).unwrap();
    std::fs::read(path).unwrap()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn damaged_safetensors_files_load_or_name_the_file(edits in byte_edits()) {
        let dir = tempfile::tempdir().unwrap();
        let bytes = apply_byte_edits(&safetensors_bytes(dir.path()), &edits);
        let path = dir.path().join("fuzz.safetensors");
        std::fs::write(&path, bytes).unwrap();
        if let Err(e) = load_safetensors(&path) {
            prop_assert!(names(&e.to_string(), &path), "{e}");
        }
    }

    #[test]
    fn safetensors_headers_with_any_entry_values_load_or_name_the_file(
        edits in json_edits(),
        data in 0usize..64,
    ) {
        let base: Map<String, Value> = serde_json::from_value(json!({
            "__metadata__": {"format": "mlx"},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "U8", "shape": [8], "data_offsets": [24, 32]},
        })).unwrap();
        let header = Value::Object(apply_edits(&base, &edits)).to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.into_bytes());
        bytes.extend(std::iter::repeat_n(0u8, data));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fuzz.safetensors");
        std::fs::write(&path, bytes).unwrap();
        if let Err(e) = load_safetensors(&path) {
            prop_assert!(names(&e.to_string(), &path), "{e}");
        }
    }

    #[test]
    fn damaged_gguf_files_load_or_name_the_file(edits in byte_edits()) {
        let base = std::fs::read(fixtures().join("gguf/tiny.gguf")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fuzz.gguf");
        std::fs::write(&path, apply_byte_edits(&base, &edits)).unwrap();
        if let Err(e) = Gguf::load(&path) {
            prop_assert!(names(&e.to_string(), &path), "{e}");
        }
    }

    #[test]
    fn target_configs_load_or_name_the_config(fixture in 0usize..4, edits in json_edits()) {
        let name = ["llama", "qwen2", "qwen3", "llama_q4"][fixture];
        let src = fixtures().join("parity").join(name);
        let dir = tempfile::tempdir().unwrap();
        for f in ["model.safetensors", "model.safetensors.index.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        let config = apply_edits(&object(&src.join("config.json")), &edits);
        std::fs::write(dir.path().join("config.json"), Value::Object(config).to_string()).unwrap();
        if let Err(e) = load_model(dir.path(), &LoadOptions::default()) {
            prop_assert!(names(&e.to_string(), &dir.path().join("config.json")), "{e}");
        }
    }

    #[test]
    fn drafter_configs_load_or_name_the_config(fixture in 0usize..2, edits in json_edits()) {
        let src = fixtures().join("deepspec").join(["qwen3", "gemma4/k_eq_v"][fixture]);
        let dir = tempfile::tempdir().unwrap();
        let config = apply_edits(&object(&src.join("config.json")), &edits);
        let path = dir.path().join("config.json");
        std::fs::write(&path, Value::Object(config).to_string()).unwrap();
        if let Err(e) = drafter::DrafterConfig::from_dir(dir.path()) {
            prop_assert!(names(&e.to_string(), &path), "{e}");
        }
    }

    #[test]
    fn tokenizer_json_files_load_or_name_the_file(edits in json_edits(), text in "[ab <>/]{0,16}") {
        let base: Map<String, Value> = serde_json::from_value(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [{"id": 3, "content": "</s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2, "</s>": 3}, "unk_token": "[UNK]"},
        })).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, Value::Object(apply_edits(&base, &edits)).to_string()).unwrap();
        match Tokenizer::from_dir(dir.path()) {
            Ok(tok) => {
                // Whatever loaded must encode and decode without panicking.
                if let Ok(ids) = tok.encode(&text, true) {
                    let _ = tok.decode(&ids, false);
                }
            }
            Err(e) => prop_assert!(names(&e.to_string(), &path), "{e}"),
        }
    }

    #[test]
    fn chat_templates_render_or_fail_within_the_work_limit(
        parts in prop::collection::vec(template_part(), 0..12),
        extra in prop::collection::btree_map("[a-z]{1,6}", json_value(), 0..3),
    ) {
        let template: String = parts.concat();
        let dir = tempfile::tempdir().unwrap();
        let vocab = json!({"a": 0, "[UNK]": 1});
        let tokenizer = json!({"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}});
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let config = json!({"chat_template": template, "eos_token": "[UNK]"});
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        // A tight work limit: a runaway template stops after 100,000 instructions, as it
        // stops after `RENDER_FUEL` in use (the same error path, a thousandth of the time).
        let tok = Tokenizer::from_dir(dir.path()).unwrap().with_render_fuel(100_000);
        let msgs = [ChatMessage::system("be brief"), ChatMessage::user("hi"), ChatMessage::assistant("ok")];
        let extra: Map<String, Value> = extra.into_iter().collect();
        if let Err(e) = tok.apply_chat_template_with(&msgs, true, &extra) {
            prop_assert!(names(&e.to_string(), &path), "{e}");
        }
    }

    #[test]
    fn quantizing_any_block_of_weights_is_a_result_or_an_error(
        values in prop::collection::vec(
            prop_oneof![8 => -4.0f32..4.0, 1 => Just(f32::NAN), 1 => Just(f32::INFINITY), 1 => Just(-1e38f32), 1 => Just(0.0)],
            64..=256,
        ),
        spec in (0usize..3, 0usize..3),
    ) {
        let group = [32, 64, 128][spec.0];
        let bits = [4, 8, 2][spec.1];
        let cols = group * (values.len() / group).max(1);
        let mut v = values.clone();
        v.resize(cols, 0.5);
        let w = Array::from_slice(&v, &[1, cols as i32]).unwrap();
        let spec = QuantSpec::new(group as i32, bits).unwrap();
        if let Ok(q) = quantize(&w, spec) {
            let back = dequantize(&q.weight, &q.scales, &q.biases, spec).and_then(|d| d.astype(Dtype::Float32));
            if let Ok(back) = back {
                let back: Vec<f32> = back.to_vec().unwrap();
                prop_assert_eq!(back.len(), cols);
                // Where the whole group is finite, so is its reconstruction.
                for (g, chunk) in v.chunks(group).enumerate() {
                    if chunk.iter().all(|x| x.is_finite() && x.abs() < 1e30) {
                        prop_assert!(back[g * group..(g + 1) * group].iter().all(|x| x.is_finite()), "group {}", g);
                    }
                }
            }
        }
    }
}

/// Fragments of Jinja that, concatenated in any order, make templates that are valid,
/// invalid, deeply looping or erroring.
fn template_part() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("{% for m in messages %}".to_string()),
        Just("{% endfor %}".to_string()),
        Just("{{ m.role }}: {{ m.content }}\n".to_string()),
        Just("{% if add_generation_prompt %}assistant:{% endif %}".to_string()),
        Just("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".to_string()),
        Just("{{ messages | tojson }}".to_string()),
        Just("{% set x = messages[0].content.strip().split(' ') %}{{ x }}".to_string()),
        Just("{{ raise_exception('no') }}".to_string()),
        Just("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}".to_string()),
        Just("{{ bos_token ~ eos_token }}".to_string()),
        Just("{%".to_string()),
        Just("}}".to_string()),
        "[a-z {}%]{0,8}",
    ]
}
