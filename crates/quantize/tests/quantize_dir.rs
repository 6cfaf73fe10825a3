//! The quantizer on small synthetic directories: every eligibility case, the predicate hook,
//! outputs against mlx-core's `quantize` (itself bit-identical to Python MLX, see
//! fixtures/quantize), sharding, requantizing a quantized source, `--force`, progress events,
//! and loading the output with the `models` crate.
mod common;

use std::path::Path;

use common::{entries, load_all, write_model};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype};
use quantize::{Action, Eligibility, Progress, QuantizeOptions, eligibility, quantize_model_dir};
use serde_json::json;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn arr(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    let n = shape.iter().product::<i32>() as usize;
    let a = Array::from_slice(&values(n, seed), shape).unwrap();
    if dtype == Dtype::Float32 { a } else { a.astype(dtype).unwrap() }
}

fn bytes(a: &Array) -> Vec<u8> {
    a.to_bytes().unwrap()
}

#[test]
fn eligibility_rule() {
    assert_eq!(eligibility("m.weight", &[8, 128], 64), Eligibility::Eligible);
    assert_eq!(eligibility("model.embed_tokens.weight", &[49152, 576], 64), Eligibility::Eligible);
    assert_eq!(eligibility("m.weight", &[8, 96], 64), Eligibility::NotDivisible { last: 96, group_size: 64 });
    assert_eq!(eligibility("norm.weight", &[128], 64), Eligibility::NotMatrix { ndim: 1 });
    assert_eq!(eligibility("experts.weight", &[2, 8, 128], 64), Eligibility::NotMatrix { ndim: 3 });
    assert_eq!(eligibility("m.table", &[8, 128], 64), Eligibility::NotWeight);
    assert_eq!(eligibility("m.bias", &[8, 128], 64), Eligibility::NotWeight);
    assert_eq!(eligibility(".weight", &[8, 128], 64), Eligibility::NotWeight);
    // the first dimension is never checked
    assert_eq!(eligibility("m.weight", &[3, 64], 64), Eligibility::Eligible);
}

/// A directory holding one tensor of every eligibility case.
fn mixed_source(dir: &Path) -> Vec<(&'static str, Array)> {
    let tensors = vec![
        ("a.weight", arr(&[8, 128], Dtype::Float32, 1)),          // eligible, f32
        ("f.weight", arr(&[16, 256], Dtype::Float16, 2)),         // eligible, f16
        ("g.weight", arr(&[4, 64], Dtype::Bfloat16, 3)),          // eligible, bf16
        ("e.weight", arr(&[8, 128], Dtype::Bfloat16, 4)),         // eligible, predicate false
        ("b.weight", arr(&[8, 96], Dtype::Float32, 5)),           // 2-D, 96 % 64 != 0
        ("norm.weight", arr(&[128], Dtype::Float32, 6)),          // 1-D
        ("experts.weight", arr(&[2, 8, 128], Dtype::Float32, 7)), // 3-D
        ("a.bias", arr(&[8], Dtype::Float32, 8)),                 // no .weight suffix
        ("d.table", arr(&[8, 128], Dtype::Float32, 9)),           // 2-D divisible, no .weight suffix
        ("steps", Array::from_slice(&[1i32, 2, 3], &[3]).unwrap()), // integer buffer
    ];
    write_model(dir, &json!({"model_type": "synthetic", "hidden_size": 128}), &tensors);
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages }}").unwrap();
    std::fs::write(dir.join("generation_config.json"), "{}").unwrap();
    std::fs::write(dir.join("README.md"), "not copied").unwrap();
    tensors
}

#[test]
fn every_eligibility_case_and_the_predicate() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("out"));
    let tensors = mixed_source(&src);
    let options = QuantizeOptions {
        bits: 4,
        group_size: 64,
        predicate: Some(Box::new(|base: &str, shape: &[usize]| {
            assert_eq!(shape.len(), 2, "the predicate sees only eligible modules ({base} {shape:?})");
            base != "e"
        })),
        ..QuantizeOptions::default()
    };
    let mut events = Vec::new();
    let r = quantize_model_dir(&src, &dst, &options, &mut |p| events.push(p)).unwrap();
    let spec = QuantSpec::new(64, 4).unwrap();

    let out = load_all(&dst);
    let src_of = |n: &str| tensors.iter().find(|(k, _)| *k == n).unwrap().1.clone();
    for base in ["a", "f", "g"] {
        let q = quant::quantize(&src_of(&format!("{base}.weight")), spec).unwrap();
        assert_eq!(bytes(&out[&format!("{base}.weight")]), bytes(&q.weight), "{base}.weight");
        assert_eq!(out[&format!("{base}.weight")].dtype(), Dtype::Uint32);
        assert_eq!(bytes(&out[&format!("{base}.scales")]), bytes(&q.scales), "{base}.scales");
        assert_eq!(bytes(&out[&format!("{base}.biases")]), bytes(&q.biases), "{base}.biases");
        assert_eq!(out[&format!("{base}.scales")].dtype(), src_of(&format!("{base}.weight")).dtype());
    }
    for name in ["e.weight", "b.weight", "norm.weight", "experts.weight", "a.bias", "d.table", "steps"] {
        let s = src_of(name);
        assert_eq!(out[name].dtype(), s.dtype(), "{name} keeps its dtype");
        assert_eq!(out[name].shape(), s.shape(), "{name} keeps its shape");
        assert_eq!(bytes(&out[name]), bytes(&s), "{name} passes through unchanged");
    }
    for absent in ["e.scales", "b.scales", "norm.scales", "experts.scales", "d.scales"] {
        assert!(!out.contains_key(absent), "{absent} must not be written");
    }
    assert_eq!(out.len(), 3 * 3 + 7);

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "synthetic");
    assert_eq!(cfg["hidden_size"], 128);
    let q = &cfg["quantization"];
    assert_eq!(q, &cfg["quantization_config"]);
    assert_eq!((q["group_size"].as_i64(), q["bits"].as_i64(), q["mode"].as_str()), (Some(64), Some(4), Some("affine")));
    for base in ["a", "f", "g"] {
        assert_eq!(q[base], json!({"group_size": 64, "bits": 4, "mode": "affine"}), "entry of {base}");
    }
    assert_eq!(q["e"], json!(false));
    let keys: Vec<&String> = q.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 3 + 3 + 1, "only quantized and predicate-excluded modules get entries: {keys:?}");

    assert_eq!(r.quantized_modules, ["a", "f", "g"]);
    assert_eq!(r.full_precision_modules, ["e"]);
    assert_eq!(r.passed_through, 6);
    assert_eq!(r.weight_files, ["model.safetensors"]);
    let st = mlx_core::io::load_safetensors(dst.join("model.safetensors")).unwrap();
    assert_eq!(st.metadata.get("format").map(String::as_str), Some("mlx"));
    // 4 bits + (scale + bias) per 64 weights: 4.5 with 16-bit scales, 5.0 with f32 ones
    let want = (8.0 * 128.0 * 5.0 + 16.0 * 256.0 * 4.5 + 4.0 * 64.0 * 4.5) / (8.0 * 128.0 + 16.0 * 256.0 + 4.0 * 64.0);
    assert!((r.quantized_bits_per_weight - want).abs() < 1e-9, "{} vs {want}", r.quantized_bits_per_weight);
    let params: u64 = tensors.iter().map(|(_, a)| a.size() as u64).sum();
    assert_eq!(r.total_parameters, params);
    assert!((r.bits_per_weight - r.weight_bytes as f64 * 8.0 / params as f64).abs() < 1e-12);

    assert_eq!(
        r.copied_files,
        ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    );
    assert!(!dst.join("README.md").exists());
    assert_eq!(entries(tmp.path()), ["out", "src"], "no temporary directory is left");

    // progress: loading, one event per item in order, writing, done
    assert!(matches!(events[0], Progress::Loading { files: 1, tensors: 10, .. }), "{:?}", events[0]);
    let steps: Vec<(usize, usize, Action)> = events
        .iter()
        .filter_map(|e| match e {
            Progress::Quantizing { index, total, action, .. } => Some((*index, *total, *action)),
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 10);
    assert!(steps.iter().enumerate().all(|(i, s)| s.0 == i + 1 && s.1 == 10));
    assert_eq!(steps.iter().filter(|s| s.2 == Action::Quantize).count(), 3);
    assert_eq!(steps.iter().filter(|s| s.2 == Action::FullPrecision).count(), 1);
    assert!(events.iter().any(|e| matches!(e, Progress::Writing { file } if file == "model.safetensors")));
    assert!(matches!(events.last(), Some(Progress::Done { .. })));
}

#[test]
fn shards_index_and_force() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, one, many) = (tmp.path().join("src"), tmp.path().join("one"), tmp.path().join("many"));
    mixed_source(&src);
    quantize_model_dir(&src, &one, &QuantizeOptions::default(), &mut |_| {}).unwrap();
    let options = QuantizeOptions { max_shard_bytes: 3000, ..QuantizeOptions::default() };
    let r = quantize_model_dir(&src, &many, &options, &mut |_| {}).unwrap();
    assert!(r.weight_files.len() > 2, "{:?}", r.weight_files);
    assert_eq!(r.weight_files[0], format!("model-00001-of-{:05}.safetensors", r.weight_files.len()));
    assert!(!one.join("model.safetensors.index.json").exists(), "one shard: no index");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(many.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let (a, b) = (load_all(&one), load_all(&many));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    assert_eq!(map.len(), a.len());
    for (k, v) in &a {
        assert_eq!(bytes(v), bytes(&b[k]), "{k} is the same sharded or not");
        let shard = map[k].as_str().unwrap();
        assert!(mlx_core::io::load_safetensors(many.join(shard)).unwrap().tensors.contains_key(k));
    }
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(r.weight_bytes));

    // an existing destination is refused, and replaced with force
    let err = quantize_model_dir(&src, &one, &QuantizeOptions::default(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("already exists") && err.to_string().contains("one"), "{err}");
    let options = QuantizeOptions { bits: 8, force: true, ..QuantizeOptions::default() };
    quantize_model_dir(&src, &one, &options, &mut |_| {}).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(one.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization"]["bits"], 8);
    assert_eq!(entries(tmp.path()), ["many", "one", "src"]);
}

#[test]
fn requantizes_a_quantized_source() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, q4, q8) = (tmp.path().join("src"), tmp.path().join("q4"), tmp.path().join("q8"));
    let tensors = mixed_source(&src);
    let options = QuantizeOptions {
        predicate: Some(Box::new(|base: &str, _: &[usize]| base != "e")),
        ..QuantizeOptions::default()
    };
    quantize_model_dir(&src, &q4, &options, &mut |_| {}).unwrap();
    // g is [4, 64]: eligible at group 64, not at 128, so it comes out dense (dequantized)
    let options = QuantizeOptions { bits: 8, group_size: 128, ..QuantizeOptions::default() };
    let r = quantize_model_dir(&q4, &q8, &options, &mut |_| {}).unwrap();
    assert_eq!(r.requantized_modules, 3);
    assert_eq!(r.quantized_modules, ["a", "e", "f"]);
    let (a, b) = (load_all(&q4), load_all(&q8));
    let s4 = QuantSpec::new(64, 4).unwrap();
    let s8 = QuantSpec::new(128, 8).unwrap();
    for base in ["a", "f"] {
        let dq = quant::dequantize(
            &a[&format!("{base}.weight")],
            &a[&format!("{base}.scales")],
            &a[&format!("{base}.biases")],
            s4,
        )
        .unwrap();
        let want = quant::quantize(&dq, s8).unwrap();
        assert_eq!(bytes(&b[&format!("{base}.weight")]), bytes(&want.weight), "{base}");
        assert_eq!(bytes(&b[&format!("{base}.scales")]), bytes(&want.scales), "{base}");
        assert_eq!(bytes(&b[&format!("{base}.biases")]), bytes(&want.biases), "{base}");
    }
    let dq = quant::dequantize(&a["g.weight"], &a["g.scales"], &a["g.biases"], s4).unwrap();
    assert_eq!(b["g.weight"].dtype(), Dtype::Bfloat16);
    assert_eq!(bytes(&b["g.weight"]), bytes(&dq), "ineligible after requantizing: written dequantized");
    assert!(!b.contains_key("g.scales"));
    // e was kept dense by the first run, so it is an ordinary dense eligible weight now
    let e = tensors.iter().find(|(k, _)| *k == "e.weight").unwrap().1.clone();
    assert_eq!(bytes(&b["e.scales"]), bytes(&quant::quantize(&e, s8).unwrap().scales));

    // the drafter policy refuses a quantized source, leaving nothing behind
    let refused = tmp.path().join("refused");
    let options = QuantizeOptions { allow_quantized_source: false, ..QuantizeOptions::default() };
    let err = quantize_model_dir(&q4, &refused, &options, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("already quantized"), "{err}");
    assert!(!refused.exists());
}

/// The output of a tiny mlx-lm llama loads in `models` with `false` entries and with only a
/// `quantization_config` block, and `models` reads that block (a wrong entry is refused).
#[test]
fn models_loads_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let src = common::fixtures().join("parity/llama_untied_bias");
    let dst = tmp.path().join("q");
    let options = QuantizeOptions {
        bits: 8,
        group_size: 32,
        predicate: Some(Box::new(|base: &str, _: &[usize]| !base.ends_with("mlp.down_proj") && base != "lm_head")),
        ..QuantizeOptions::default()
    };
    let r = quantize_model_dir(&src, &dst, &options, &mut |_| {}).unwrap();
    assert_eq!(r.full_precision_modules.len(), 3);
    let opts = models::LoadOptions { dtype: Some(Dtype::Float32), ..models::LoadOptions::default() };
    let dense = models::load_model(&src, &opts).unwrap();
    let quant = models::load_model(&dst, &opts).unwrap();
    let ids = Array::from_slice(&[1i32, 17, 33, 200, 5], &[1, 5]).unwrap();
    let a = dense.forward(&ids, &mut dense.make_cache()).unwrap().to_vec::<f32>().unwrap();
    let b = quant.forward(&ids, &mut quant.make_cache()).unwrap().to_vec::<f32>().unwrap();
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    // 8-bit weights: the logits move by a small fraction of their range
    assert!(err < 0.05 * scale, "8-bit logits differ by {err} (scale {scale})");

    // only quantization_config (the HF name), as some converters write it
    let cfg_path = dst.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let again = models::load_model(&dst, &opts).unwrap();
    let c = again.forward(&ids, &mut again.make_cache()).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(b, c);
    // ... and it is read: an entry contradicting the tensors is refused
    cfg["quantization_config"]["model.layers.0.self_attn.q_proj"] = json!({"group_size": 64, "bits": 4});
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = match models::load_model(&dst, &opts) {
        Ok(_) => panic!("a quantization_config entry contradicting the tensors was not noticed"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("q_proj"), "{err}");
}

/// Only the model's own weight files are read (mlx-lm: the index's shards, else
/// `model*.safetensors`): an unrelated `eval_outputs.safetensors` beside them is neither
/// quantized nor copied.
#[test]
fn unrelated_safetensors_beside_the_model_are_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("out"));
    let tensors = mixed_source(&src);
    let stranger = arr(&[4, 128], Dtype::Float32, 10);
    mlx_core::io::save_safetensors(src.join("eval_outputs.safetensors"), [("logits.weight", &stranger)], []).unwrap();
    let r = quantize_model_dir(&src, &dst, &QuantizeOptions::default(), &mut |_| {}).unwrap();
    let out = load_all(&dst);
    assert!(!out.keys().any(|k| k.starts_with("logits")), "{:?}", out.keys());
    for name in out.keys() {
        let base = name.rsplit_once('.').map_or(name.as_str(), |(b, _)| b);
        assert!(tensors.iter().any(|(k, _)| k.starts_with(base)), "{name} is not the model's");
    }
    assert_eq!(r.weight_files, ["model.safetensors"]);
    assert!(!entries(&dst).iter().any(|f| f.contains("eval_outputs")));
}
