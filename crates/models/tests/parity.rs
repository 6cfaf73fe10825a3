//! Parity with mlx-lm on tiny random models made by mlx-lm's own classes
//! (`fixtures/parity/make_goldens.py`): logits of a full-prompt forward, logits of a
//! chunked (cached) forward, and 16 greedy tokens.
use std::path::PathBuf;

use mlx_core::{Array, Dtype, io::load_safetensors};
use models::generate::{generate, ids};
use models::{GenerateParams, LoadOptions, Sampler, load_model};

fn case_dir(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name)
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Runs one case. Our graph issues the same MLX ops as mlx-lm, so the tolerance is tight:
/// `tol` absolute on logits whose scale is ~1.
fn check(name: &str, tol: f32) {
    let dir = case_dir(name);
    let model = load_model(&dir, &LoadOptions::default()).unwrap();
    let g = load_safetensors(dir.join("goldens.safetensors")).unwrap();
    for i in 0..2 {
        let prompt: Vec<u32> =
            g.get(&format!("prompt_{i}")).unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
        let mut cache = model.make_cache();
        let logits = model.forward(&ids(&prompt).unwrap(), &mut cache).unwrap();
        let d = max_diff(&logits, g.get(&format!("logits_{i}")).unwrap());
        assert!(d <= tol, "{name} prompt {i}: full-forward logits differ by {d}");
        assert_eq!(cache.offset(), prompt.len());

        let n = prompt.len();
        let mut cache = model.make_cache();
        model.forward(&ids(&prompt[..n - 3]).unwrap(), &mut cache).unwrap();
        let chunked = model.forward(&ids(&prompt[n - 3..]).unwrap(), &mut cache).unwrap();
        let d = max_diff(&chunked, g.get(&format!("chunked_{i}")).unwrap());
        assert!(d <= tol, "{name} prompt {i}: cached-forward logits differ by {d}");

        let want: Vec<u32> =
            g.get(&format!("greedy_{i}")).unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
        let params = GenerateParams { max_tokens: 16, sampler: Sampler::default(), eos: vec![] };
        let mut got = Vec::new();
        generate(&model, &prompt, &params, |t| {
            got.push(t);
            true
        })
        .unwrap();
        assert_eq!(got, want, "{name} prompt {i}: greedy tokens differ");
    }
}

#[test]
fn llama_tied() {
    check("llama", 1e-5);
}

#[test]
fn llama_untied_with_biases_and_llama3_rope() {
    check("llama_untied_bias", 1e-5);
}

#[test]
fn qwen2() {
    check("qwen2", 1e-5);
}

#[test]
fn qwen3_with_head_norms() {
    check("qwen3", 1e-5);
}

#[test]
fn llama_quantized_with_overrides() {
    check("llama_q4", 1e-5);
}

#[test]
fn qwen2_bf16() {
    check("qwen2_bf16", 1e-2);
}

#[test]
fn taps_do_not_change_logits() {
    let dir = case_dir("qwen3");
    let model = load_model(&dir, &LoadOptions::default()).unwrap();
    let prompt = ids(&[1, 2, 3, 4, 5]).unwrap();
    let plain = model.forward(&prompt, &mut model.make_cache()).unwrap();
    let out = model.forward_with_taps(&prompt, &mut model.make_cache(), &[1, 0, 1]).unwrap();
    assert_eq!(plain.to_vec::<f32>().unwrap(), out.logits.to_vec::<f32>().unwrap());
    assert_eq!(out.taps.len(), 3);
    for t in &out.taps {
        assert_eq!(t.shape(), vec![1, 5, 64]);
    }
    assert_eq!(out.taps[0].to_vec::<f32>().unwrap(), out.taps[2].to_vec::<f32>().unwrap());
    assert_ne!(out.taps[0].to_vec::<f32>().unwrap(), out.taps[1].to_vec::<f32>().unwrap());
    assert!(model.forward_with_taps(&prompt, &mut model.make_cache(), &[2]).is_err());
}
